"""The fast manager's block geometry: kvpool.model.geometry's rules, written again.

Groups of different block sizes hit at multiples of the scheduler block size;
decode context parallelism multiplies a sharded group's block size. The
model and the impl share no logic (docs/architecture.md), so this module
restates the checks and the sliding-window cache mask on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from math import gcd

from kvpool.model.errors import InvalidManagerConfig
from kvpool.model.single_type import AttentionType, KVCacheSpec


def check_world_sizes(specs: Sequence[KVCacheSpec], dcp: object, pcp: object) -> None:
    """InvalidManagerConfig unless vLLM 0.33 runs these groups with these world sizes."""
    for name, size in (("dcp_world_size", dcp), ("pcp_world_size", pcp)):
        if type(size) is not int or size < 1:
            raise InvalidManagerConfig(f"{name}={size!r} must be a positive int")
    assert isinstance(dcp, int) and isinstance(pcp, int)
    for spec in specs:
        kind = spec.attention
        if kind is AttentionType.FULL:
            continue
        if dcp > 1 and spec.dcp_sharded:
            raise InvalidManagerConfig(
                f"decode context parallelism (dcp_world_size={dcp}) shards only "
                f"full attention, not a sharded {kind.value} group"
            )
        if pcp > 1 and (spec.dcp_sharded or kind is AttentionType.MAMBA):
            raise InvalidManagerConfig(
                f"prefill context parallelism (pcp_world_size={pcp}) runs only "
                f"full attention and replicated attention groups, not {kind.value}"
            )


def sharded(specs: Sequence[KVCacheSpec], dcp: int) -> tuple[KVCacheSpec, ...]:
    """Each spec with the block size its manager uses (times ``dcp`` when sharded)."""
    if dcp == 1:
        return tuple(specs)
    out = []
    for spec in specs:
        out.append(replace(spec, block_size=spec.block_size * dcp) if spec.dcp_sharded else spec)
    return tuple(out)


def common_divisor(specs: Sequence[KVCacheSpec]) -> int:
    """The default hash block size: the gcd of the block sizes."""
    result = 0
    for spec in specs:
        result = gcd(result, spec.block_size)
    return result


def common_multiple(specs: Sequence[KVCacheSpec]) -> int:
    """The default scheduler block size: the lcm of the block sizes."""
    result = 1
    for spec in specs:
        result = result * spec.block_size // gcd(result, spec.block_size)
    return result


def check_scheduler_block_size(
    specs: Sequence[KVCacheSpec], hash_block_size: int, scheduler_block_size: object
) -> None:
    """InvalidManagerConfig unless the scheduler block size is a common multiple of the hash
    block size and every block size, and (several groups) every chunked-local block is it."""
    sizes = [spec.block_size for spec in specs]
    size = scheduler_block_size
    if (
        type(size) is not int
        or size < 1
        or size % hash_block_size != 0
        or any(size % block != 0 for block in sizes)
    ):
        raise InvalidManagerConfig(
            f"scheduler_block_size={size!r} is not a multiple of "
            f"hash_block_size={hash_block_size} and of every group's block size {sizes}"
        )
    if len(specs) < 2:
        return
    for spec in specs:
        if spec.attention is AttentionType.CHUNKED_LOCAL and spec.block_size != size:
            raise InvalidManagerConfig(
                f"a chunked-local group of {spec.block_size}-token blocks cannot hit at "
                f"multiples of scheduler_block_size={size}"
            )


def check_align_geometry(
    specs: Sequence[KVCacheSpec], scheduler: int, hash_block_size: int, dcp: int
) -> None:
    """InvalidManagerConfig where a Mamba "align" group is beside blocks of another size or a
    larger scheduler block, unless every "align" block is one hash block and there is no
    decode context parallelism: vLLM keeps fine-grained hits off there, so hits end on
    scheduler blocks (the model's ``verify_align_geometry``). Not called where
    ``kvpool.impl.align_dcp`` models decode context parallelism (caching on)."""
    if not any(spec.mamba_align for spec in specs):
        return
    sizes = [spec.block_size for spec in specs]
    if all(size == scheduler for size in sizes):
        return
    one_hash_block = all(spec.block_size == hash_block_size for spec in specs if spec.mamba_align)
    if dcp != 1 or not one_hash_block:
        raise InvalidManagerConfig(
            f'Mamba "align" beside blocks of sizes {sizes} with '
            f"scheduler_block_size={scheduler} is not modelled unless every "
            f"align block is one hash block ({hash_block_size} tokens) and "
            f"dcp_world_size=1 (got {dcp})"
        )


def window_mask(
    first: int, stop: int, alignment: int, block_size: int, window: int, eagle: bool
) -> list[bool] | None:
    """Which blocks ``first..stop`` of a sliding-window group can end a hit's window run when
    hits end on multiples of ``alignment`` (None: every block)."""
    if alignment % block_size:
        return None
    per_segment = alignment // block_size
    run = max(1, (window - 1 + block_size - 1) // block_size)  # a one-token window needs one
    if eagle:
        run += 1
    if run >= per_segment:
        return None
    offset = 1 if eagle else 0
    keep_from = per_segment - run
    mask = []
    for i in range(first, stop):
        mask.append(i >= offset and (i - offset) % per_segment >= keep_from)
    return mask
