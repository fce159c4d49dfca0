"""The fast single-type managers: kvpool.model.single_type' semantics on mutable block tables.

One class per attention type, with vLLM 0.33's method names: each manager
owns one KV cache group's block tables (``req_to_blocks``: request id to a
list of ``KVCacheBlock``) and cached counts, and works through the shared
``kvpool.impl.BlockPool``. ``table()`` is the abstraction function into the
model's ``GroupTable``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from mypy_extensions import mypyc_attr

from kvpool.impl.block import KVCacheBlock
from kvpool.impl.geometry import window_mask
from kvpool.impl.pool import BlockPool
from kvpool.impl.retention import boundaries, retention_mask, shared_prefix_boundary
from kvpool.model.errors import (
    HashBlockSizeMismatch,
    HitOnRunningRequest,
    InvalidArgument,
    InvalidTokenCount,
    UnknownGroup,
    UnknownRequest,
)
from kvpool.model.single_type import AttentionType, GroupTable, KVCacheSpec


def num_prompt_tokens(request: Any) -> int:
    """The request's prompt length (vLLM's ``num_prompt_tokens``, or kvpool's prompt ids);
    InvalidArgument if it has neither."""
    count = getattr(request, "num_prompt_tokens", None)
    if count is None:
        prompt = getattr(request, "prompt_token_ids", None)
        if not isinstance(prompt, Sequence):
            raise InvalidArgument("not a request: it has no prompt length")
        count = len(prompt)
    if not isinstance(count, int) or isinstance(count, bool):
        raise InvalidArgument(f"num_prompt_tokens must be an int, got {type(count).__name__}")
    return count


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_hashes_at(block_hashes: Sequence[bytes], hash_block_size: int, block_size: int) -> Any:
    """The request's hashes for blocks of ``block_size`` tokens (the same list if sizes match)."""
    if block_size == hash_block_size:
        return block_hashes
    factor = block_size // hash_block_size
    return block_hashes[factor - 1 :: factor]


@mypyc_attr(allow_interpreted_subclasses=True)
class SingleTypeKVCacheManager:
    """The bookkeeping every attention type shares; subclasses decide hits and skips.

    >>> from kvpool.model.single_type import full_attention
    >>> m = FullAttentionManager(full_attention(2), BlockPool(4, True, 2), 0)
    >>> m.save_new_computed_blocks("r", []); [b.block_id for b in m.allocate_new_blocks("r", 3)]
    [1, 2]
    """

    attention: ClassVar[AttentionType]

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int):
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block
        self.use_eagle = False
        """EAGLE drafts read the whole prompt (the manager sets it, as vLLM's coordinator does)."""
        self.fine_grained_hits = False
        """Hits may end inside a block, so the prompt's tail is cached without rounding (the
        manager sets it, as vLLM's coordinator sets ``cache_hit_alignment_tokens``)."""
        self.cache_hit_alignment_tokens = kv_cache_spec.block_size
        """What hits end on a multiple of: the scheduler block size (the manager sets it)."""
        self.dcp_world_size = 1
        self.pcp_world_size = 1
        """The context-parallel world sizes this group sees (1 unless sharded; set by the
        manager, whose specs already carry the sharded block size)."""
        self.retention_interval: int | None = None
        """vLLM 0.33's ``prefix_cache_retention_interval`` (None: dense; the manager sets it;
        only sliding-window groups act on it: ``kvpool.impl.retention``)."""
        self.replay_eagle: bool | None = None
        """Whether any of the manager's groups drops EAGLE's block (the manager sets it):
        sparse retention's replay boundaries follow it, not this group's flag."""

    # ------------------------------------------------------------------

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free blocks needed for ``num_tokens`` slots: lacking blocks plus free hits."""
        held = self.req_to_blocks.get(request_id)
        lacking = _cdiv(num_tokens, self.block_size) - len(new_computed_blocks)
        if held is not None:
            lacking -= len(held)
        evictable = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                evictable += 1
        return (lacking if lacking > 0 else 0) + evictable

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Start a new request's table with its (already touched) hits."""
        if request_id in self.req_to_blocks:
            # Verify that a request holding blocks gets no new hits
            if new_computed_blocks:
                raise HitOnRunningRequest(f"request {request_id!r} already holds blocks")
            return
        self.req_to_blocks[request_id] = list(new_computed_blocks)
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Append fresh blocks until the request has ``num_tokens`` slots; return them."""
        blocks = self.req_to_blocks.get(request_id)
        # Verify that the request is in the group's tables
        if blocks is None:
            raise UnknownRequest(f"request {request_id!r} holds no blocks in this group")
        lacking = _cdiv(num_tokens, self.block_size) - len(blocks)
        if lacking <= 0:
            return []
        new = self.block_pool.get_new_blocks(lacking)
        blocks.extend(new)
        return new

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        """Cache the blocks full within ``num_tokens`` (and the request's hashes)."""
        rid = request.request_id
        # Verify that the request is in the group's tables
        if rid not in self.req_to_blocks:
            raise UnknownRequest(f"request {rid!r} holds no blocks in this group")
        # Verify that the request is hashed in the pool's hash blocks
        verify_hash_block_size(request, self.block_pool.hash_block_size)
        num_cached = self.num_cached_block[rid]
        num_hashed = len(request.block_hashes) * self.block_pool.hash_block_size
        num_full = (num_tokens if num_tokens < num_hashed else num_hashed) // self.block_size
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[rid],
            num_cached,
            num_full,
            self.block_size,
            self.kv_cache_group_id,
            self._cache_mask(request, num_cached, num_full),
        )
        self.num_cached_block[rid] = num_full

    def _cache_mask(self, request: Any, first: int, stop: int) -> list[bool] | None:
        """Which of the request's blocks ``first..stop`` to cache (None: all)."""
        return None

    def _replay_boundaries(self, request: Any) -> list[int]:
        """The request's replay boundaries, which sparse retention keeps
        (``kvpool.impl.retention.boundaries``)."""
        return boundaries(
            num_prompt_tokens(request),
            self.cache_hit_alignment_tokens,
            self.use_eagle,
            shared_prefix_boundary(request),
            self.block_size,
            self.replay_eagle,
        )

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last first; unknown requests hold nothing."""
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks is None:
            return
        del self.num_cached_block[request_id]
        blocks.reverse()
        self.block_pool.free_blocks(blocks)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Nothing leaves the window by default (full attention, Mamba)."""

    def _release_before(self, request_id: str, first_useful: int) -> None:
        """Replace blocks before ``first_useful`` by the null block, from the edge backwards."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        null = self._null_block
        removed: list[KVCacheBlock] = []
        for i in range(min(first_useful, len(blocks)) - 1, -1, -1):
            block = blocks[i]
            if block is null:
                break
            removed.append(block)
            blocks[i] = null
        if removed:
            self.block_pool.free_blocks(removed)

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """Leading blocks shared by every running request (full attention only)."""
        return 0

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        alignment: int = 0,
    ) -> tuple[list[KVCacheBlock], ...]:
        """The cached blocks a request may reuse, one list per group (no hit by default)."""
        _verify_search(kv_cache_group_ids, max_length, alignment, kv_cache_spec.block_size)
        return tuple([] for _ in kv_cache_group_ids)

    def table(self) -> GroupTable:
        """This group's tables as the model's ``GroupTable`` (the abstraction function)."""
        return GroupTable(
            req_to_blocks={
                r: tuple(b.block_id for b in blocks) for r, blocks in self.req_to_blocks.items()
            },
            num_cached_block=dict(self.num_cached_block),
        )


@mypyc_attr(allow_interpreted_subclasses=True)
class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: the longest run of cached blocks from the start."""

    attention = AttentionType.FULL

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        alignment: int = 0,
    ) -> tuple[list[KVCacheBlock], ...]:
        _verify_search(kv_cache_group_ids, max_length, alignment, kv_cache_spec.block_size)
        hashes = block_hashes_at(block_hashes, block_pool.hash_block_size, kv_cache_spec.block_size)
        stop = min(max_length // kv_cache_spec.block_size, len(hashes))
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        lookup = block_pool.get_cached_block
        if len(kv_cache_group_ids) == 1:
            only = computed[0]
            for i in range(stop):
                found = lookup(hashes[i], kv_cache_group_ids)
                if found is None:
                    break
                only.append(found[0])
        else:
            for i in range(stop):
                found = lookup(hashes[i], kv_cache_group_ids)
                if found is None:
                    break
                for blocks, block in zip(computed, found, strict=True):
                    blocks.append(block)
        if use_eagle and computed[0]:
            for blocks in computed:
                blocks.pop()
        size = kv_cache_spec.block_size
        if alignment and alignment != size:
            # hits of several groups end on multiples of the alignment: cut back to one
            keep = len(computed[0]) * size // alignment * alignment // size
            for blocks in computed:
                del blocks[keep:]
        return computed

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        """The full blocks, then the prompt's partial tail when blocks hold several hash blocks."""
        super().cache_blocks(request, num_tokens)
        hbs = self.block_pool.hash_block_size
        if self.block_size == hbs:
            return
        # The last hash-block boundary a resend of the prompt can hit (docs/semantics.md)
        limit = num_prompt_tokens(request) - (0 if self.use_eagle else 1)
        num_hashes = len(request.block_hashes)
        boundary = (limit // hbs if limit // hbs < num_hashes else num_hashes) * hbs
        # what a hit could match: block-aligned hits round down (not with EAGLE, nor with
        # fine-grained hits)
        size = self.block_size
        aligned = not (self.use_eagle or self.fine_grained_hits)
        cacheable = num_tokens // size * size if aligned else num_tokens
        if boundary == 0 or boundary > cacheable or boundary % size == 0:
            return
        blocks = self.req_to_blocks[request.request_id]
        index = boundary // size
        if index < len(blocks):
            self.block_pool.cache_partial_block(
                request, blocks[index], boundary, self.kv_cache_group_id, self.block_size
            )

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        count = 0
        for block in self.req_to_blocks.get(request_id, ()):
            if block.ref_cnt != num_running_requests:
                break
            count += 1
        return count


@mypyc_attr(allow_interpreted_subclasses=True)
class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window: enough contiguous cached blocks to cover the window, nulls before."""

    attention = AttentionType.SLIDING_WINDOW

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        alignment: int = 0,
    ) -> tuple[list[KVCacheBlock], ...]:
        _verify_search(kv_cache_group_ids, max_length, alignment, kv_cache_spec.block_size)
        size = kv_cache_spec.block_size
        hashes = block_hashes_at(block_hashes, block_pool.hash_block_size, size)
        needed = _cdiv(kv_cache_spec.sliding_window - 1, size) + (1 if use_eagle else 0)
        stop = min(max_length // size, len(hashes))
        null = block_pool.null_block
        computed = tuple([null] * stop for _ in kv_cache_group_ids)
        align = alignment or size
        run = 0
        end: int | None = None
        for i in range(stop - 1, -1, -1):
            found = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
            if found is None:
                run = 0
                continue
            # a run must end where the hit (after EAGLE's drop) lands on the alignment
            if run == 0 and align != size and ((i if use_eagle else i + 1) * size) % align:
                continue
            for blocks, block in zip(computed, found, strict=True):
                blocks[i] = block
            run += 1
            if run >= needed:
                end = i + run
                break
        keep = end if end is not None else run
        if end is None and align != size:
            keep = keep * size // align * align // size
        for blocks in computed:
            del blocks[keep:]
        if use_eagle and computed[0]:
            keep = len(computed[0]) - 1
            if align != size:
                keep = keep * size // align * align // size
            for blocks in computed:
                del blocks[keep:]
        return computed

    def _cache_mask(self, request: Any, first: int, stop: int) -> list[bool] | None:
        alignment = self.cache_hit_alignment_tokens
        interval = self.retention_interval
        if interval is not None:
            return retention_mask(
                first,
                stop,
                alignment,
                self.block_size,
                self.kv_cache_spec.sliding_window,
                self.use_eagle,
                interval,
                self._replay_boundaries(request),
            )
        if alignment == self.block_size:
            return None
        return window_mask(
            first,
            stop,
            alignment,
            self.block_size,
            self.kv_cache_spec.sliding_window,
            self.use_eagle,
        )

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        first_useful_token = num_computed_tokens - self.kv_cache_spec.sliding_window + 1
        if first_useful_token >= self.block_size:
            self._release_before(request_id, first_useful_token // self.block_size)


@mypyc_attr(allow_interpreted_subclasses=True)
class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention: nulls for earlier chunks, then a prefix hit in the current one."""

    attention = AttentionType.CHUNKED_LOCAL

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        alignment: int = 0,
    ) -> tuple[list[KVCacheBlock], ...]:
        _verify_search(kv_cache_group_ids, max_length, alignment, kv_cache_spec.block_size)
        size = kv_cache_spec.block_size
        chunk = kv_cache_spec.attention_chunk_size
        hashes = block_hashes_at(block_hashes, block_pool.hash_block_size, size)
        stop = min(max_length // size, len(hashes))
        first = min(max_length // chunk * chunk // size, stop)
        null = block_pool.null_block
        computed = tuple([null] * first for _ in kv_cache_group_ids)
        for i in range(first, stop):
            found = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
            if found is None:
                break
            for blocks, block in zip(computed, found, strict=True):
                blocks.append(block)
        return computed

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        if request_id not in self.req_to_blocks:
            return
        chunk = self.kv_cache_spec.attention_chunk_size
        # the last cached block of an earlier chunk goes too (docs/semantics.md)
        first_useful = num_computed_tokens // chunk * chunk // self.block_size
        if first_useful > 0:
            self._release_before(request_id, first_useful)


@mypyc_attr(allow_interpreted_subclasses=True)
class MambaManager(SingleTypeKVCacheManager):
    """Mamba: one state block per request, never a hit, never cached."""

    attention = AttentionType.MAMBA

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        rid = request.request_id
        # Verify that the request is in the group's tables
        if rid not in self.req_to_blocks:
            raise UnknownRequest(f"request {rid!r} holds no blocks in this group")
        # Verify that the request is hashed in the pool's hash blocks
        verify_hash_block_size(request, self.block_pool.hash_block_size)


MANAGERS: dict[AttentionType, type[SingleTypeKVCacheManager]] = {
    cls.attention: cls
    for cls in (
        FullAttentionManager,
        SlidingWindowManager,
        ChunkedLocalAttentionManager,
        MambaManager,
    )
}


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
) -> SingleTypeKVCacheManager:
    """The manager class for the spec's attention type, built for one group.

    >>> from kvpool.model.single_type import mamba
    >>> type(get_manager_for_kv_cache_spec(mamba(8), BlockPool(2, True, 1), 0)).__name__
    'MambaManager'
    """
    return MANAGERS[kv_cache_spec.attention](kv_cache_spec, block_pool, kv_cache_group_id)


def _verify_search(
    group_ids: Sequence[int], max_length: int, alignment: int, block_size: int
) -> None:
    # Verify that at least one group is searched and none is negative
    if not group_ids or min(group_ids) < 0:
        raise UnknownGroup(f"cannot search groups {list(group_ids)}")
    # Verify that the length is not negative
    if max_length < 0:
        raise InvalidTokenCount(f"max_length={max_length} is negative")
    # Verify that the alignment, if any, is a whole number of blocks
    if alignment < 0 or alignment % block_size:
        raise InvalidTokenCount(f"alignment={alignment} is not a multiple of {block_size}")


def verify_hash_block_size(request: Any, hash_block_size: int) -> None:
    """Raise HashBlockSizeMismatch if the request says it is hashed in other hash blocks.

    kvpool's requests say it (``hash_block_size``); vLLM's do not (their hasher is
    built with the manager's hash block size), and are taken as hashed in the pool's.
    """
    said = getattr(request, "hash_block_size", hash_block_size)
    if said != hash_block_size:
        raise HashBlockSizeMismatch(
            f"request {request.request_id!r} is hashed in blocks of {said} tokens, "
            f"the pool uses {hash_block_size}"
        )
