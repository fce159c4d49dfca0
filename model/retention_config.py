"""Which retention intervals a manager takes (``kvpool.model.retention`` says what they do).

Source: vLLM 0.33.0, ``_validate_prefix_cache_retention_interval`` in
``vllm/v1/core/kv_cache_coordinator.py``.
"""

from collections.abc import Sequence

from kvpool.model.errors import InvalidManagerConfig
from kvpool.model.single_type import AttentionType, KVCacheSpec


def verify_retention_interval(
    interval: object, specs: Sequence[KVCacheSpec], scheduler_block_size: int
) -> None:
    """Raise InvalidManagerConfig unless ``interval`` is a retention interval these groups take.

    As vLLM 0.33 checks it: any interval but ``None`` and ``0`` needs a
    sliding-window or Mamba group (nothing else is sparsified); then it must
    be non-negative and a multiple of ``scheduler_block_size``. A Mamba "align"
    group with prefill checkpoint blocks under sparse retention is not modelled
    (vLLM 0.33 reserves its checkpoints by the prefill's end under retention 0 and
    keys them against the retention mask). vLLM's own tests match the
    message's words ("no sliding-window or Mamba", "non-negative", "multiple
    of scheduler_block_size"), so they are kept.

    >>> from kvpool.model.single_type import sliding_window
    >>> verify_retention_interval(64, [sliding_window(16, 16)], 32)
    >>> verify_retention_interval(48, [sliding_window(16, 16)], 32)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    kvpool.model.errors.InvalidManagerConfig: ... a multiple of scheduler_block_size (32)
    """
    if interval is None:
        return
    # Verify that the interval is an int (bool is not)
    if not isinstance(interval, int) or isinstance(interval, bool):
        raise InvalidManagerConfig(
            f"prefix_cache_retention_interval={interval!r} must be None or an int"
        )
    sparse = any(s.attention in (AttentionType.SLIDING_WINDOW, AttentionType.MAMBA) for s in specs)
    # Verify that a nonzero interval has a group to sparsify
    if not sparse:
        if interval == 0:
            return
        raise InvalidManagerConfig(
            f"prefix_cache_retention_interval={interval} has no effect: there is no "
            "sliding-window or Mamba group (set it to 0 or None)"
        )
    # Verify that the interval is non-negative and lands on hit boundaries
    if interval < 0 or interval % scheduler_block_size != 0:
        raise InvalidManagerConfig(
            f"prefix_cache_retention_interval={interval} must be non-negative and a "
            f"multiple of scheduler_block_size ({scheduler_block_size})"
        )
    # Verify that no Mamba "align" group with prefill checkpoints would thin them (not modelled)
    if any(s.mamba_align and s.prefill_checkpoint_alignment for s in specs):
        raise InvalidManagerConfig(
            f"prefix_cache_retention_interval={interval}: sparse retention of Mamba "
            '"align" prefill checkpoints is not modelled'
        )
