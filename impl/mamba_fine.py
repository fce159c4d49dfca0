"""The fast Mamba "align" manager whose hits may end inside a block (kvpool.model.mamba_fine).

A Mamba "align" block of several hash blocks: hits are searched hash block by
hash block; a chunk ending on the prompt's partial boundary keys its block
there (a partial key) and the request's next allocation copies that state to
a fresh block that takes the keys over (a producer); a request whose hit ends
inside a block gets a private copy where it ends (a consumer). Copies are
(source, destination) pairs the manager queues for the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mypy_extensions import mypyc_attr

from kvpool.impl.block import KVCacheBlock
from kvpool.impl.mamba_align import MambaAlignManager
from kvpool.impl.single_type import SingleTypeKVCacheManager, num_prompt_tokens
from kvpool.model.errors import InvalidManagerConfig, InvalidTokenCount
from kvpool.model.mamba_align import AlignTable, Offload
from kvpool.model.single_type import AttentionType, GroupTable, KVCacheSpec


def fine_hits_on(specs: Sequence[KVCacheSpec], hash_block_size: int, enable_caching: bool) -> bool:
    """Whether hits may end inside a Mamba "align" block (vLLM 0.33.0's
    ``partial_hash_hits_enabled``): caching on and an "align" block longer than a hash block."""
    return enable_caching and any(s.mamba_align and s.block_size > hash_block_size for s in specs)


def check_fine_config(
    specs: Sequence[KVCacheSpec],
    hash_block_size: int,
    use_eagle: bool,
    retention_interval: int | None,
    dcp_world_size: int,
) -> None:
    """InvalidManagerConfig, by name, for what kvpool does not model beside hits inside a
    Mamba "align" block (as ``kvpool.model.mamba_fine_config.verify``)."""
    where = f'Mamba "align" with hits inside a block (hash blocks of {hash_block_size} tokens)'
    # Verify that another group runs beside it (vLLM's one-group coordinator refuses it)
    if len(specs) == 1:
        raise InvalidManagerConfig(f"{where} as the only group is not a vLLM configuration")
    for spec in specs:
        # Verify that every other group is full attention
        if not spec.mamba_align and spec.attention is not AttentionType.FULL:
            raise InvalidManagerConfig(
                f'Mamba "align" with hits inside a block beside a {spec.attention.value} group '
                "is not modelled (only full attention)"
            )
    # Verify that neither EAGLE, sparse retention nor context parallelism is on
    if use_eagle:
        raise InvalidManagerConfig(f"{where} with EAGLE is not modelled")
    if retention_interval is not None:
        raise InvalidManagerConfig(f"{where} with sparse retention is not modelled")
    if dcp_world_size != 1:
        raise InvalidManagerConfig(f"{where} with dcp_world_size={dcp_world_size} is not modelled")


def partial_boundary(num_prompt: int, hash_block_size: int, lookahead: int) -> int:
    """The prompt's last hash-block boundary a resend can hit (``max(1, lookahead)`` tokens
    after it)."""
    boundary = (num_prompt - max(1, lookahead)) // hash_block_size * hash_block_size
    return boundary if boundary > 0 else 0


@mypyc_attr(allow_interpreted_subclasses=True)
class MambaFineManager(MambaAlignManager):
    """Mamba "align" with blocks of several hash blocks, hits inside a block, and the state
    copies they need (vLLM 0.33.0's ``MambaManager``, partial hits on)."""

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: Any, kv_cache_group_id: int):
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self._partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}
        self._producer_partial_tail_reqs: dict[str, tuple[KVCacheBlock, int]] = {}
        self.fine = True
        # kept by kvpool.impl.mamba_fine_reserve's subclass; 0 here
        self.num_speculative_blocks: int = kv_cache_spec.num_speculative_blocks

    def find_fine_hit(
        self, block_hashes: Sequence[bytes], max_length: int, kv_cache_group_ids: Sequence[int]
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The last hash-block boundary within ``max_length`` whose state every group has
        cached: per group nulls then the block holding it, and the hit's tokens."""
        # Verify that the length is not negative
        if max_length < 0:
            raise InvalidTokenCount(f"max_length={max_length} is negative")
        pool = self.block_pool
        hbs = pool.hash_block_size
        scale = self.block_size // hbs
        stop = min(max_length // hbs, len(block_hashes))
        ids = list(kv_cache_group_ids)
        for fine in range(stop - 1, -1, -1):
            found = pool.get_cached_block(block_hashes[fine], ids)
            if found is not None:
                null = pool.null_block
                index = fine // scale
                return tuple([null] * index + [block] for block in found), (fine + 1) * hbs
        return tuple([] for _ in kv_cache_group_ids), 0

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """As the "align" manager's; a pending producer copy takes its block and at most one
        more."""
        if request_id not in self._partial_hit_reqs:
            return super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks)
        held = self.req_to_blocks.get(request_id)
        lacking = -(-num_tokens // self.block_size) - len(new_computed_blocks)
        if held is not None:
            lacking -= len(held)
        return (1 if lacking > 0 else 0) + 1

    def allocate_with_copy(
        self, request_id: str, num_tokens: int, hit: tuple[int, KVCacheBlock] | None
    ) -> tuple[list[KVCacheBlock], tuple[KVCacheBlock, KVCacheBlock] | None]:
        """``allocate_new_blocks`` copying the state a consumer's ``hit`` (block index, source)
        ends inside, or the producer's pending one; returns what the worker's table gains
        and the (source, destination) copy, or None."""
        if hit is None:
            hit = self._partial_hit_reqs.get(request_id)
        if hit is None:
            return self.allocate_new_blocks(request_id, num_tokens), None
        blocks = self.req_to_blocks[request_id]
        index, source = hit
        running = request_id in self._allocated_block_reqs
        prev = len(blocks)
        spec = self.num_speculative_blocks
        if running:
            self.last_state_block_idx[request_id] = prev - 1 - spec
        elif prev:
            self.last_state_block_idx[request_id] = prev - 1
        required = -(-num_tokens // self.block_size) + spec
        # a recorded prefill checkpoint keeps its block (kvpool.impl.mamba_fine_reserve)
        stop = required - spec - 1 - self._checkpoint_gap(request_id)
        null = self._null_block
        if prev < stop:
            blocks.extend([null] * (stop - prev))
        if running:
            # the old speculative blocks the chunk moved past go to the end
            for i in range(max(prev - spec, 0), prev):
                if i >= stop:
                    break
                blocks.append(blocks[i])
                blocks[i] = null
        lacking = required - len(blocks)
        fresh = self.block_pool.get_new_blocks((lacking if lacking > 0 else 0) + 1)
        destination = fresh[0]
        returned = blocks[prev:]
        if running:
            # the producer keeps its block: the cache entry moves to the copy
            self.block_pool.move_block_hashes(source, destination)
            self.block_pool.touch([source])
            tail = self._producer_partial_tail_reqs.pop(request_id, None)
            if tail is not None:
                self._pending_boundary_state_offloads.append(
                    (request_id, self.kv_cache_group_id, destination, tail[1])
                )
            key = destination._primary_key()
            if key is not None:
                self.cached_blocks_this_step.add(key)
        else:
            blocks[index] = destination
            self.block_pool.touch([destination])
            returned.insert(0, destination)
        rest = fresh[1:]
        blocks.extend(rest)
        returned.extend(rest)
        self._allocated_block_reqs.add(request_id)
        self._partial_hit_reqs.pop(request_id, None)
        return returned, (source, destination)

    def _checkpoint_gap(self, request_id: str) -> int:
        """1 when the request keeps a prefill checkpoint's block in this allocation (a
        subclass records them), else 0."""
        return 0

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        """Cache the full positions' states; key the state at the prompt's partial boundary
        when caching reaches exactly there (inside a block: the request becomes a producer)."""
        blocks = self._cache_and_offer(request, num_tokens)
        pool = self.block_pool
        hbs = pool.hash_block_size
        boundary = partial_boundary(num_prompt_tokens(request), hbs, pool.num_hash_lookahead_tokens)
        index = -(-num_tokens // self.block_size) - 1
        if num_tokens <= 0 or num_tokens != boundary or index >= len(blocks):
            return
        source = blocks[index]
        if source.is_null or source.block_hash_num_tokens == num_tokens:
            return
        group = self.kv_cache_group_id
        # on a block boundary (a block that lost its key) vLLM keys it the same way; the
        # pool reads the block size only to refuse that in strict mode: a longer one passes
        whole = num_tokens % self.block_size == 0
        size = num_tokens + hbs if whole else self.block_size
        pool.cache_partial_block(request, source, num_tokens, group, size)
        self.cached_blocks_this_step.add((request.block_hashes[num_tokens // hbs - 1], group))
        if whole:
            return
        rid = request.request_id
        self._partial_hit_reqs[rid] = (index, source)
        self.num_cached_block[rid] = index
        self._producer_partial_tail_reqs[rid] = (source, num_tokens)

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._partial_hit_reqs.pop(request_id, None)
        self._producer_partial_tail_reqs.pop(request_id, None)

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> tuple[int, KVCacheBlock, int] | None:
        """The producer's tail, consumed: offered when no later token was computed or is in
        flight."""
        tail = self._producer_partial_tail_reqs.pop(request_id, None)
        if tail is None:
            return None
        source, boundary = tail
        if num_in_flight_tokens != 0 or num_computed_tokens != boundary:
            return None
        return self.kv_cache_group_id, source, boundary

    def table(self) -> GroupTable:
        base = super().table()
        offloads: tuple[Offload, ...] = base.align.offloads
        align = AlignTable(
            last_state=base.align.last_state,
            retired=base.align.retired,
            allocated=base.align.allocated,
            cached_this_step=base.align.cached_this_step,
            offloads=offloads,
            partial_hits={r: (i, b.block_id) for r, (i, b) in self._partial_hit_reqs.items()},
            producer_tails={
                r: (b.block_id, n) for r, (b, n) in self._producer_partial_tail_reqs.items()
            },
        )
        return GroupTable(
            req_to_blocks=base.req_to_blocks, num_cached_block=base.num_cached_block, align=align
        )


def is_fine(manager: SingleTypeKVCacheManager) -> bool:
    """Whether the group's hits may end inside its blocks (a ``MambaFineManager``)."""
    return isinstance(manager, MambaFineManager)
