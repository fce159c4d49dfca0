"""The fast Mamba "align" manager with prefill checkpoints and speculative blocks.

kvpool.model.mamba_reserve's semantics on mutable tables: a chunk spanning two
blocks or more keeps a real block at its checkpoint (the last block boundary
before its last token) when its spec asks for checkpoint blocks, decided as the
allocation is counted (``plan_checkpoint``); the table reaches
``num_speculative_blocks`` past the block the main model's tokens end in, and a
later allocation moves those blocks to the end rather than taking fresh ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from mypy_extensions import mypyc_attr

from kvpool.impl.block import KVCacheBlock
from kvpool.impl.mamba_align import MambaAlignManager
from kvpool.impl.pool import BlockPool
from kvpool.impl.single_type import SingleTypeKVCacheManager
from kvpool.model.errors import InvalidBlockRange
from kvpool.model.single_type import GroupTable, KVCacheSpec


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _checkpoint(
    query_start: int, query_end: int, size: int, alignment: int, every: int, hbs: int
) -> int:
    """The chunk's checkpoint (the last multiple of ``alignment`` before its last token) if
    it can export it, else 0: the chunk starts on a hash-block boundary, its checkpoint
    column lies past its initial state's, the checkpoint is a hash block or more past the
    start and inside the chunk, ``every`` tokens apart from the start."""
    position = max((query_end - 1) // alignment * alignment, 0)
    if (
        query_start % hbs == 0
        and _cdiv(query_end, size) - 2 > (query_start - 1) // size
        and query_start + hbs <= position
        and query_start < position < query_end
        and (position - query_start) % every == 0
    ):
        return position
    return 0


@mypyc_attr(allow_interpreted_subclasses=True)
class MambaReservingManager(MambaAlignManager):
    """Mamba in "align" mode with checkpoint and speculative blocks, vLLM 0.33.0's names.

    >>> from kvpool.model.single_type import mamba_reserving
    >>> m = MambaReservingManager(mamba_reserving(2, 1), BlockPool(8, True, 2), 0)
    >>> m.save_new_computed_blocks("r", []); [b.block_id for b in m.allocate_new_blocks("r", 7)]
    [0, 0, 0, 1, 2]
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int):
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.num_speculative_blocks = kv_cache_spec.num_speculative_blocks
        self.checkpoint_alignment = kv_cache_spec.prefill_checkpoint_alignment
        self._checkpoints: dict[str, tuple[int, int]] = {}

    def plan_checkpoint(self, request_id: str, query_start: int, query_end: int) -> None:
        """Record (or forget) the request's checkpoint for a chunk ``query_start..query_end``
        (vLLM records it in ``get_num_blocks_to_allocate``; kvpool's manager calls this
        just before)."""
        if not self.checkpoint_alignment:
            return
        size = self.block_size
        alignment = self.cache_hit_alignment_tokens or size
        hbs = self.block_pool.hash_block_size
        every = self.checkpoint_alignment
        position = _checkpoint(query_start, query_end, size, alignment, every, hbs)
        index = _cdiv(query_end, size) - 2
        held = self.req_to_blocks.get(request_id, ())
        if (
            position > 0
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
        """InvalidBlockRange if the request's recorded checkpoint lies past its table (an
        allocation refused after recording it; vLLM asserts when caching then)."""
        verify_recorded_checkpoint(
            self._checkpoints.get(request_id), self.req_to_blocks.get(request_id, [])
        )

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """What the table lacks past the speculative blocks, capped at one block plus the
        checkpoint's (plus the speculative ones on a first allocation), plus the free
        hits; the pool's size plus one when the hit ends on a state cached this step."""
        if new_computed_blocks:
            key = new_computed_blocks[-1]._primary_key()
            if key is not None and key in self.cached_blocks_this_step:
                return self.block_pool.num_gpu_blocks + 1
        held = self.req_to_blocks.get(request_id)
        lacking = _cdiv(num_tokens, self.block_size) + self.num_speculative_blocks
        lacking -= len(new_computed_blocks)
        if held is not None:
            lacking -= len(held)
        if lacking > 0:
            cap = 2 if request_id in self._checkpoints else 1
            if request_id not in self._allocated_block_reqs:
                cap += self.num_speculative_blocks
            if lacking > cap:
                lacking = cap
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                lacking += 1
        return lacking

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Nulls over the skipped positions but the checkpoint's, the old speculative blocks
        moved to the end, fresh blocks for the rest; return everything appended."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return SingleTypeKVCacheManager.allocate_new_blocks(self, request_id, num_tokens)
        spec = self.num_speculative_blocks
        required = _cdiv(num_tokens, self.block_size) + spec
        checkpoint = 1 if request_id in self._checkpoints else 0
        was_allocated = request_id in self._allocated_block_reqs
        self._allocated_block_reqs.add(request_id)
        if required <= len(blocks) and not checkpoint:
            return []
        prev = len(blocks)
        if was_allocated:
            self.last_state_block_idx[request_id] = prev - 1 - spec
        elif prev > 0:
            self.last_state_block_idx[request_id] = prev - 1
        skipped = required - spec - 1
        null = self._null_block
        for _ in range(prev, skipped - checkpoint):
            blocks.append(null)
        if was_allocated:
            for i in range(max(prev - spec, 0), prev):
                if i >= skipped - checkpoint:
                    break
                blocks.append(blocks[i])
                blocks[i] = null
        if required > len(blocks):
            blocks.extend(self.block_pool.get_new_blocks(required - len(blocks)))
        return blocks[prev:]

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        """Cache as a bare "align" group, but with a recorded checkpoint key its block at the
        checkpoint (when it lost the key) in place of the prompt-boundary step."""
        rid = request.request_id
        checkpoint = self._checkpoints.get(rid)
        if checkpoint is None:
            MambaAlignManager.cache_blocks(self, request, num_tokens)
            return
        blocks = self._cache_and_offer(request, num_tokens)
        position, index = checkpoint
        if index >= len(blocks):
            return
        block = blocks[index]
        if block.is_null or block.block_hash_num_tokens == position:
            return
        if block._primary_key() is not None:
            self.block_pool.evict_blocks({block.block_id})
        self.block_pool.cache_full_blocks(
            request, blocks, index, index + 1, self.block_size, self.kv_cache_group_id
        )
        key = block._primary_key()
        if key is not None:
            self.cached_blocks_this_step.add(key)

    def free(self, request_id: str) -> None:
        """Forget the request's checkpoint too."""
        self._checkpoints.pop(request_id, None)
        super().free(request_id)

    def forget(self, request_id: str) -> None:
        """Forget the request's checkpoint too (vLLM 0.33.0's ``pop_blocks_for_free``)."""
        self._checkpoints.pop(request_id, None)
        super().forget(request_id)

    def table(self) -> GroupTable:
        table = super().table()
        return replace(table, align=replace(table.align, checkpoints=dict(self._checkpoints)))


def admission_blocks(
    manager: MambaAlignManager,
    request_id: str,
    num_tokens: int,
    hits: Sequence[KVCacheBlock],
    query_start: int,
) -> int:
    """The blocks a Mamba "align" group counts when the whole sequence must fit: what an
    allocation of ``num_tokens`` main-model tokens from ``query_start`` would count, its
    checkpoint decided but not recorded (vLLM 0.33.0's ``get_num_blocks_to_allocate`` with
    ``apply_admission_cap``). A bare "align" group reserves nothing."""
    if not isinstance(manager, MambaReservingManager):
        return manager.get_num_blocks_to_allocate(request_id, num_tokens, hits)
    saved = manager._checkpoints.get(request_id)
    manager.plan_checkpoint(request_id, query_start, num_tokens)
    try:
        return manager.get_num_blocks_to_allocate(request_id, num_tokens, hits)
    finally:
        if saved is None:
            manager._checkpoints.pop(request_id, None)
        else:
            manager._checkpoints[request_id] = saved


def verify_recorded_checkpoint(
    checkpoint: tuple[int, int] | None, blocks: Sequence[KVCacheBlock]
) -> None:
    """InvalidBlockRange if a recorded checkpoint (position, block index) lies past the
    request's ``blocks`` (an allocation refused after recording it)."""
    if checkpoint is not None and checkpoint[1] >= len(blocks):
        raise InvalidBlockRange(
            f"the checkpoint at block {checkpoint[1]} lies past the request's "
            f"{len(blocks)} blocks (its allocation was refused)"
        )
