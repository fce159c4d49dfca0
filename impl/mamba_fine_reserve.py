"""The fast Mamba "align" manager with prefill checkpoints and hits inside a block.

kvpool.model.mamba_fine_reserve's semantics on mutable tables: a checkpoint on the last
hash-block boundary before the chunk's end (``max(1, num_hash_lookahead_tokens)`` tokens
after it), kept in the block before the one the chunk ends in, counted and allocated
beside a producer's or consumer's state copy; caching re-keys that block at the
checkpoint when the checkpoint is reusable (the prompt's, on a block boundary, or at the
shared-prefix boundary) and drops its keys otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from mypy_extensions import mypyc_attr

from kvpool.impl.block import KVCacheBlock
from kvpool.impl.mamba_fine import MambaFineManager
from kvpool.impl.mamba_reserve import verify_recorded_checkpoint
from kvpool.impl.retention import shared_prefix_boundary
from kvpool.impl.single_type import SingleTypeKVCacheManager, num_prompt_tokens
from kvpool.model.single_type import GroupTable, KVCacheSpec


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _position(num_tokens: int, alignment: int, lookahead: int) -> int:
    """The last multiple of ``alignment`` leaving ``max(1, lookahead)`` tokens after it."""
    position = (num_tokens - max(1, lookahead)) // alignment * alignment
    return position if position > 0 else 0


@mypyc_attr(allow_interpreted_subclasses=True)
class MambaFineReservingManager(MambaFineManager):
    """Mamba "align" with blocks of several hash blocks, prefill checkpoint and speculative
    blocks, vLLM 0.33.0's ``MambaManager`` with partial hits on."""

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: Any, kv_cache_group_id: int):
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.checkpoint_alignment = kv_cache_spec.prefill_checkpoint_alignment
        self._checkpoints: dict[str, tuple[int, int]] = {}

    def _checkpoint_gap(self, request_id: str) -> int:
        return 1 if request_id in self._checkpoints else 0

    def plan_checkpoint(self, request_id: str, query_start: int, query_end: int) -> None:
        """Record (or forget) the request's checkpoint for a chunk ``query_start..query_end``:
        on hash-block boundaries, the pool's look-ahead left after it."""
        size = self.block_size
        pool = self.block_pool
        hbs = pool.hash_block_size
        position = _position(query_end, hbs, pool.num_hash_lookahead_tokens)
        index = _cdiv(query_end, size) - 2
        held = self.req_to_blocks.get(request_id, ())
        if (
            self.checkpoint_alignment > 0
            and query_start % hbs == 0
            and index > (query_start - 1) // size
            and query_start + hbs <= position
            and query_start < position < query_end
            and (position - query_start) % self.checkpoint_alignment == 0
            and index >= 0
            and (
                index >= len(held)
                or held[index].is_null
                or (
                    request_id in self._allocated_block_reqs
                    and index >= len(held) - self.num_speculative_blocks
                )
            )
        ):
            self._checkpoints[request_id] = (position, index)
        else:
            self._checkpoints.pop(request_id, None)

    def verify_checkpoint(self, request_id: str) -> None:
        """InvalidBlockRange if the recorded checkpoint lies past the request's table (an
        allocation refused after recording it; vLLM asserts when caching then)."""
        verify_recorded_checkpoint(
            self._checkpoints.get(request_id), self.req_to_blocks.get(request_id, [])
        )

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """What the table lacks (plus a producer's copy), capped at one block plus the
        copy's and the checkpoint's, plus the free hits; the pool's size plus one when the
        hit ends on a state cached this step."""
        if new_computed_blocks:
            key = new_computed_blocks[-1]._primary_key()
            if key is not None and key in self.cached_blocks_this_step:
                return self.block_pool.num_gpu_blocks + 1
        held = self.req_to_blocks.get(request_id)
        spec = self.num_speculative_blocks
        lacking = _cdiv(num_tokens, self.block_size) + spec - len(new_computed_blocks)
        if held is not None:
            lacking -= len(held)
        producer = 1 if request_id in self._partial_hit_reqs else 0
        if producer:
            lacking = (lacking if lacking > 0 else 0) + 1
        if lacking > 0:
            cap = 1 + producer + self._checkpoint_gap(request_id)
            if request_id not in self._allocated_block_reqs:
                cap += spec
            if lacking > cap:
                lacking = cap
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                lacking += 1
        return lacking

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """As ``kvpool.impl.mamba_reserve.MambaReservingManager``'s: nulls over the skipped
        positions but a recorded checkpoint's, the old speculative blocks the chunk passed
        moved to the end, fresh blocks for the rest."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return super().allocate_new_blocks(request_id, num_tokens)  # raises UnknownRequest
        spec = self.num_speculative_blocks
        required = _cdiv(num_tokens, self.block_size) + spec
        checkpoint = self._checkpoint_gap(request_id)
        was_allocated = request_id in self._allocated_block_reqs
        self._allocated_block_reqs.add(request_id)
        if required <= len(blocks) and not checkpoint:
            return []
        prev = len(blocks)
        if was_allocated:
            self.last_state_block_idx[request_id] = prev - 1 - spec
        elif prev > 0:
            self.last_state_block_idx[request_id] = prev - 1
        stop = required - spec - 1 - checkpoint
        null = self._null_block
        for _ in range(prev, stop):
            blocks.append(null)
        if was_allocated:
            for i in range(max(prev - spec, 0), prev):
                if i >= stop:
                    break
                blocks.append(blocks[i])
                blocks[i] = null
        if required > len(blocks):
            blocks.extend(self.block_pool.get_new_blocks(required - len(blocks)))
        return blocks[prev:]

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        """With a recorded checkpoint: cache the full positions' states, key the checkpoint's
        block there (or drop its keys when the checkpoint is transient), then note and
        offer the newly cached states; without one, as ``MambaFineManager``."""
        rid = request.request_id
        checkpoint = self._checkpoints.get(rid)
        if checkpoint is None:
            super().cache_blocks(request, num_tokens)
            return
        before = self.num_cached_block.get(rid, 0)
        SingleTypeKVCacheManager.cache_blocks(self, request, num_tokens)
        blocks = self.req_to_blocks[rid]
        # before the offers: a transient checkpoint's block loses the key it just took
        self._cache_checkpoint(request, blocks, checkpoint)
        self._offer(rid, blocks, before, self.num_cached_block[rid])

    def _cache_checkpoint(
        self, request: Any, blocks: list[KVCacheBlock], checkpoint: tuple[int, int]
    ) -> None:
        position, index = checkpoint
        block = blocks[index]
        pool = self.block_pool
        hbs = pool.hash_block_size
        size = self.block_size
        prompt = _position(num_prompt_tokens(request), hbs, pool.num_hash_lookahead_tokens)
        if not (
            position == prompt
            or position % size == 0
            or position == shared_prefix_boundary(request)
        ):
            # the worker overwrites this state: neither it nor a key taken this step is reusable
            if not block.is_null and block._primary_key() is not None:
                pool.evict_blocks({block.block_id})
            return
        if block.is_null or block.block_hash_num_tokens == position:
            return
        group = self.kv_cache_group_id
        # the pool reads the block size only to refuse a block boundary in strict mode
        pool.cache_partial_block(
            request,
            block,
            position,
            group,
            size if position % size else position + hbs,
            replace_existing_hashes=True,
        )
        self.cached_blocks_this_step.add((request.block_hashes[position // hbs - 1], group))

    def forget(self, request_id: str) -> None:
        """Forget the request's checkpoint too (vLLM 0.33.0's ``pop_blocks_for_free``)."""
        self._checkpoints.pop(request_id, None)
        super().forget(request_id)

    def table(self) -> GroupTable:
        table = super().table()
        return replace(table, align=replace(table.align, checkpoints=dict(self._checkpoints)))


def admission_blocks(
    manager: MambaFineReservingManager,
    request_id: str,
    num_tokens: int,
    hits: Sequence[KVCacheBlock],
    query_start: int,
) -> int:
    """The blocks the group counts when the whole sequence must fit: an allocation of
    ``num_tokens`` main-model tokens from ``query_start``, its checkpoint decided but not
    recorded (as ``kvpool.impl.mamba_reserve.admission_blocks``)."""
    saved = manager._checkpoints.get(request_id)
    manager.plan_checkpoint(request_id, query_start, num_tokens)
    try:
        return manager.get_num_blocks_to_allocate(request_id, num_tokens, hits)
    finally:
        if saved is None:
            manager._checkpoints.pop(request_id, None)
        else:
            manager._checkpoints[request_id] = saved
