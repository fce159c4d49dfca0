"""EAGLE beside a Mamba "align" group: where the prompt's reusable state sits, and what is modelled.

A Mamba layer has no drafter layers, so a Mamba group's hit search never drops
EAGLE's block and never peeks past the candidate (``kvpool.model.eagle.peek``):
its hit is the last cached state within what the attention groups, which do
drop a block, allow. What EAGLE changes in an "align" group is where the
prompt's last *reusable* state is. Without EAGLE a resend of the prompt hits
at most ``num_prompt_tokens - 1`` tokens, so the state worth keying again at
the end of the prompt is at the last hash-block boundary before the prompt's
last token. With EAGLE the attention groups read the whole prompt and drop a
block, so that state is one hash block below the last boundary within the
prompt (vLLM's ``drop_eagle_checkpoint_block``, which vLLM 0.33's coordinator
sets on every Mamba group whenever ``use_eagle`` is on, flagged or not).

Modelled: every "align" geometry kvpool models without hits inside a Mamba
block (``kvpool.model.mamba_align``), speculative blocks
(``kvpool.model.mamba_reserve``), dense and sparse retention
(``kvpool.model.retention``). Refused by name: prefill checkpoint blocks (with
EAGLE vLLM places the checkpoint one hash block below the chunk's last
boundary, which for a chunk ending inside a block is not the checkpoint block's
own boundary); hits inside a Mamba block (``kvpool.model.mamba_fine_config``,
``kvpool.model.align_dcp`` refuse EAGLE themselves).

Source: vLLM 0.33.0, ``get_mamba_prefill_checkpoint_position`` in
``vllm/v1/kv_cache_interface.py``; ``KVCacheCoordinator.__init__``
(``drop_eagle_checkpoint_block``) in ``vllm/v1/core/kv_cache_coordinator.py``;
``MambaManager.find_longest_cache_hit`` and ``_cache_partial_tail_block`` in
``vllm/v1/core/single_type_kv_cache_manager.py``. docs/semantics.md, "EAGLE beside
a Mamba align group".
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.model.errors import InvalidManagerConfig

if TYPE_CHECKING:  # kvpool.model.mamba_align calls prompt_boundary
    from kvpool.model.single_type import KVCacheSpec


def prompt_boundary(num_prompt_tokens: int, hash_block_size: int, drop_eagle: bool) -> int:
    """The prompt's last reusable state position, a multiple of ``hash_block_size`` (0: none).

    Without EAGLE: the last boundary before the prompt's last token. With EAGLE
    (``drop_eagle``): one hash block below the last boundary within the prompt.

    >>> prompt_boundary(128, 32, False), prompt_boundary(128, 32, True)
    (96, 96)
    >>> prompt_boundary(127, 32, False), prompt_boundary(127, 32, True)
    (96, 64)
    >>> prompt_boundary(129, 32, False), prompt_boundary(129, 32, True)
    (128, 96)
    >>> prompt_boundary(31, 32, True)
    0
    """
    if drop_eagle:
        return max(num_prompt_tokens // hash_block_size * hash_block_size - hash_block_size, 0)
    return max((num_prompt_tokens - 1) // hash_block_size * hash_block_size, 0)


def verify(specs: "Sequence[KVCacheSpec]", use_eagle: bool) -> None:
    """Raise InvalidManagerConfig where EAGLE meets a Mamba "align" group kvpool does not model
    beside it: one with prefill checkpoint blocks.

    >>> from kvpool.model.single_type import full_attention, mamba_align, mamba_reserving
    >>> verify([full_attention(4), mamba_reserving(4, 3)], True)
    >>> verify([full_attention(4), mamba_reserving(4, 0, 4)], True)
    Traceback (most recent call last):
    ...
    kvpool.model.errors.InvalidManagerConfig: EAGLE beside a Mamba "align" group with prefill \
checkpoint blocks is not modelled
    """
    if not use_eagle:
        return
    # Verify that no "align" group beside EAGLE reserves prefill checkpoint blocks
    if any(s.mamba_align and s.prefill_checkpoint_alignment for s in specs):
        raise InvalidManagerConfig(
            'EAGLE beside a Mamba "align" group with prefill checkpoint blocks is not modelled'
        )
