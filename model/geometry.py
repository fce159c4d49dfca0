"""Block geometry: groups of different block sizes, and context parallelism.

A KV cache manager's groups may have different block sizes (a full-attention
group of 32-token blocks beside a sliding-window group of 16-token blocks,
when their pages hold the same bytes). Requests are hashed in hash blocks of
``hash_block_size`` tokens, a divisor of every group's block size; the
scheduler works in ``scheduler_block_size`` tokens, a common multiple of them
all (their least common multiple by default). With several groups a hit is
only useful if every group can resume there, so every hit length is a
multiple of ``scheduler_block_size`` (``hit_alignment``), and a group caches
only the tokens up to such a boundary.

Decode context parallelism (``dcp_world_size``) shards each block's tokens
across ranks: a group whose spec is ``dcp_sharded`` has blocks of
``block_size * dcp_world_size`` tokens in the manager (``effective_specs``).
Prefill context parallelism (``pcp_world_size``) does not change a block's
tokens. vLLM 0.33 runs either only with full attention and unsharded
(replicated) groups beside it (``verify_context_parallel``).

Sources: vLLM 0.33.0, ``vllm/v1/core/kv_cache_coordinator.py``
(``KVCacheCoordinator.__init__``, ``HybridKVCacheCoordinator``: the
alignment, ``_align_cacheable``, the context-parallel assertions) and
``vllm/v1/core/single_type_kv_cache_manager.py`` (``SingleTypeKVCacheManager.__init__``:
the sharded block size; ``SlidingWindowManager.reachable_block_mask``);
docs/semantics.md, "Block geometry".
"""

import math
from collections.abc import Sequence
from dataclasses import replace

from kvpool.model.errors import InvalidManagerConfig
from kvpool.model.single_type import AttentionType, KVCacheSpec


def effective_specs(specs: Sequence[KVCacheSpec], dcp_world_size: int) -> tuple[KVCacheSpec, ...]:
    """The specs with the block sizes the manager uses: sharded groups' times ``dcp_world_size``.

    >>> from kvpool.model.single_type import full_attention, mamba
    >>> [s.block_size for s in effective_specs([full_attention(4), mamba(64)], 2)]
    [8, 64]
    """
    return tuple(
        replace(s, block_size=s.block_size * dcp_world_size) if s.dcp_sharded else s for s in specs
    )


def verify_context_parallel(
    specs: Sequence[KVCacheSpec], dcp_world_size: int, pcp_world_size: int
) -> None:
    """Raise InvalidManagerConfig unless vLLM 0.33 runs these groups with these world sizes.

    Both sizes are positive ints. With ``dcp_world_size > 1`` a sharded group must
    be full attention (sliding window and chunked local attention assert a world
    size of 1; an unsharded group keeps its blocks). With ``pcp_world_size > 1``
    every group must be full attention or an unsharded attention group (not Mamba).

    >>> from kvpool.model.single_type import full_attention, sliding_window
    >>> verify_context_parallel([full_attention(4)], 4, 1)
    >>> verify_context_parallel([sliding_window(4, 4)], 2, 1)
    Traceback (most recent call last):
    ...
    kvpool.model.errors.InvalidManagerConfig: decode context parallelism (dcp_world_size=2) ...
    """
    for name, size in (("dcp_world_size", dcp_world_size), ("pcp_world_size", pcp_world_size)):
        # Verify that the world sizes are positive ints
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InvalidManagerConfig(f"{name}={size!r} must be a positive int")
    for spec in specs:
        full = spec.attention is AttentionType.FULL
        # Verify that only full attention is sharded across decode ranks
        if dcp_world_size > 1 and spec.dcp_sharded and not full:
            raise InvalidManagerConfig(
                f"decode context parallelism (dcp_world_size={dcp_world_size}) shards only "
                f"full attention, not a sharded {spec.attention.value} group"
            )
        # Verify that prefill context parallelism sees full attention or replicated attention
        if pcp_world_size > 1 and not (
            full or (not spec.dcp_sharded and spec.attention is not AttentionType.MAMBA)
        ):
            raise InvalidManagerConfig(
                f"prefill context parallelism (pcp_world_size={pcp_world_size}) runs only "
                f"full attention and replicated attention groups, not {spec.attention.value}"
            )


def default_hash_block_size(specs: Sequence[KVCacheSpec]) -> int:
    """The hash block size when none is given: the greatest common divisor of the block sizes.

    >>> from kvpool.model.single_type import full_attention, sliding_window
    >>> default_hash_block_size([full_attention(8), sliding_window(12, 4)])
    4
    """
    return math.gcd(*(s.block_size for s in specs))


def default_scheduler_block_size(specs: Sequence[KVCacheSpec]) -> int:
    """The scheduler block size when none is given: the least common multiple of the block sizes.

    >>> from kvpool.model.single_type import full_attention, sliding_window
    >>> default_scheduler_block_size([full_attention(8), sliding_window(12, 4)])
    24
    """
    return math.lcm(*(s.block_size for s in specs))


def verify_scheduler_block_size(
    specs: Sequence[KVCacheSpec], hash_block_size: int, scheduler_block_size: int
) -> None:
    """Raise InvalidManagerConfig unless ``scheduler_block_size`` is a common multiple of the
    hash block size and every group's (effective) block size, and a chunked-local group of
    several groups has blocks of exactly that size (vLLM 0.33's chunked-local search
    asserts its block size is the hit alignment).

    >>> from kvpool.model.single_type import full_attention
    >>> verify_scheduler_block_size([full_attention(8)], 4, 12)
    Traceback (most recent call last):
    ...
    kvpool.model.errors.InvalidManagerConfig: scheduler_block_size=12 is not a multiple of ...
    """
    sizes = [s.block_size for s in specs]
    # Verify that the scheduler block size is a common multiple of every block size
    if (
        not isinstance(scheduler_block_size, int)
        or isinstance(scheduler_block_size, bool)
        or scheduler_block_size < 1
        or scheduler_block_size % hash_block_size
        or any(scheduler_block_size % size for size in sizes)
    ):
        raise InvalidManagerConfig(
            f"scheduler_block_size={scheduler_block_size!r} is not a multiple of "
            f"hash_block_size={hash_block_size} and of every group's block size {sizes}"
        )
    # Verify that a chunked-local group beside others has blocks of the hit alignment
    if len(specs) > 1:
        for spec in specs:
            if spec.attention is AttentionType.CHUNKED_LOCAL and spec.block_size != (
                scheduler_block_size
            ):
                raise InvalidManagerConfig(
                    f"a chunked-local group of {spec.block_size}-token blocks cannot hit at "
                    f"multiples of scheduler_block_size={scheduler_block_size}"
                )


def hit_alignment(specs: Sequence[KVCacheSpec], scheduler_block_size: int) -> int:
    """What every hit length is a multiple of: one group's block size, or with several
    groups the scheduler block size (where every group can resume).

    >>> from kvpool.model.single_type import full_attention, sliding_window
    >>> hit_alignment([full_attention(8)], 16)
    8
    >>> hit_alignment([full_attention(8), sliding_window(4, 4)], 16)
    16
    """
    return specs[0].block_size if len(specs) == 1 else scheduler_block_size
