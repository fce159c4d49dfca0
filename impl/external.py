"""KV-connector loads at admission: external tokens, reserved blocks (``kvpool.model.external``).

``KVCacheManager.allocate_slots`` checks the connector's arguments here, and for
a request holding nothing that comes with external tokens counts its blocks and
takes its hit and the external tokens' blocks here.
"""

from collections.abc import Sequence
from typing import Any

from kvpool.impl.block import KVCacheBlock
from kvpool.impl.single_type import SingleTypeKVCacheManager
from kvpool.model.errors import (
    HitOnRunningRequest,
    InvalidArgument,
    InvalidTokenCount,
    UnknownGroup,
)
from kvpool.model.single_type import AttentionType, KVCacheSpec


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def skipped_tokens(spec: KVCacheSpec, num_computed_tokens: int) -> int:
    """The leading tokens no later token attends to (sliding window, chunked local)."""
    if spec.attention is AttentionType.SLIDING_WINDOW:
        return max(0, num_computed_tokens - spec.sliding_window + 1)
    if spec.attention is AttentionType.CHUNKED_LOCAL:
        return num_computed_tokens // spec.attention_chunk_size * spec.attention_chunk_size
    return 0


def blocks_to_allocate(
    manager: SingleTypeKVCacheManager,
    num_tokens: int,
    hits: Sequence[KVCacheBlock],
    num_total_computed_tokens: int,
    cap: int | None = None,
) -> int:
    """Free blocks a request holding nothing takes in this group: those it lacks beyond its
    hit and its skipped blocks (at most ``cap`` counted), plus its free hits past them."""
    required = _cdiv(num_tokens, manager.block_size)
    if cap is not None and cap < required:
        required = cap
    skipped = skipped_tokens(manager.kv_cache_spec, num_total_computed_tokens)
    skipped //= manager.block_size
    lacking = required - max(skipped, len(hits))
    evictable = 0
    for block in hits[skipped:]:
        if block.ref_cnt == 0 and not block.is_null:
            evictable += 1
    return max(lacking, 0) + evictable


def take_hits(
    managers: Sequence[SingleTypeKVCacheManager],
    rid: str,
    hits: tuple[Sequence[KVCacheBlock], ...],
    num_total_computed_tokens: int,
    enable_caching: bool,
) -> None:
    """Every group takes its hit past its skipped blocks (touched first, all groups), nulls
    in front."""
    kept: list[Sequence[KVCacheBlock]] = []
    skips: list[int] = []
    for manager, group_hits in zip(managers, hits, strict=True):
        skipped = skipped_tokens(manager.kv_cache_spec, num_total_computed_tokens)
        skips.append(skipped // manager.block_size)
        kept.append(group_hits[skips[-1] :])
    if enable_caching:
        for group_kept in kept:
            if group_kept:
                managers[0].block_pool.touch(group_kept)
    for manager, skipped, group_kept in zip(managers, skips, kept, strict=True):
        null = manager.block_pool.null_block
        manager.save_new_computed_blocks(rid, [null] * skipped + list(group_kept))


def allocate_external(
    manager: SingleTypeKVCacheManager, rid: str, num_local: int, num_external: int
) -> list[KVCacheBlock]:
    """The group's blocks for the external tokens it does not skip; returned."""
    total = num_local + num_external
    skipped = skipped_tokens(manager.kv_cache_spec, total)
    if skipped > 0 and total - skipped < num_external:
        num_external = total - skipped
    if num_external <= 0:
        return []
    return manager.allocate_new_blocks(rid, total)


def verify_arguments(
    managers: Sequence[SingleTypeKVCacheManager],
    request: Any,
    num_new_computed_tokens: int,
    num_external_computed_tokens: int,
    reserved_blocks: int,
    skip_zeroing_group_ids: Any,
) -> None:
    """The named error for KV-connector arguments ``allocate_slots`` cannot take
    (``kvpool.model.external.verify_connector_arguments``; types checked already)."""
    ext = num_external_computed_tokens
    # Verify that the reservation is not negative
    if reserved_blocks < 0:
        raise InvalidTokenCount(f"reserved_blocks={reserved_blocks} must be >= 0")
    # Verify that the external tokens are not negative
    if ext < 0:
        raise InvalidTokenCount(f"num_external_computed_tokens={ext} must be >= 0")
    # Verify that the groups not to zero exist
    for g in skip_zeroing_group_ids:
        if type(g) is not int or not 0 <= g < len(managers):
            raise UnknownGroup(f"skip_zeroing_group_ids names {g!r}: no such group")
    if ext == 0:
        return
    computed = request.num_computed_tokens + num_new_computed_tokens
    # Verify that the computed tokens, external ones included, are the request's
    if computed + ext > request.num_tokens:
        raise InvalidTokenCount(
            f"{computed} computed and {ext} external tokens exceed the request's "
            f"{request.num_tokens} tokens"
        )
    # Verify that only a request holding no blocks takes external tokens
    rid = request.request_id
    if any(rid in m.req_to_blocks for m in managers):
        raise HitOnRunningRequest(
            f"request {rid!r} already holds blocks: external tokens come only with its "
            "first allocation"
        )
    # Verify that no Mamba group takes external tokens (not modelled)
    if any(m.kv_cache_spec.attention is AttentionType.MAMBA for m in managers):
        raise InvalidArgument("external tokens beside a Mamba group: not modelled")
