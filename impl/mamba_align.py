"""The fast Mamba "align" manager: kvpool.model.mamba_align's semantics on mutable tables.

A Mamba group in vLLM's "align" cache mode keeps one state block per block of
tokens, positionally: a chunk gets at most one new block (where it ends),
nulls over the positions it skipped; the previous step's block is released
once passed; blocks whose position is full are cached as boundary states,
and a hit is the last cached boundary (searched from the right). A hit on a
state cached this step waits for the next step. Only the subset the model
describes: no speculative or checkpoint blocks, hash block = block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mypy_extensions import mypyc_attr

from kvpool.impl.block import KVCacheBlock
from kvpool.impl.pool import BlockPool
from kvpool.impl.retention import align_retention_mask
from kvpool.impl.single_type import (
    MambaManager,
    SingleTypeKVCacheManager,
    _verify_search,
    block_hashes_at,
    num_prompt_tokens,
)
from kvpool.model.errors import InvalidManagerConfig
from kvpool.model.mamba_align import AlignTable, Offload
from kvpool.model.single_type import AttentionType, GroupTable, KVCacheSpec
from kvpool.model.state import HashKey


@mypyc_attr(allow_interpreted_subclasses=True)
class MambaAlignManager(MambaManager):
    """Mamba in "align" mode, with vLLM 0.33.0's method names.

    >>> from kvpool.model.single_type import mamba_align
    >>> m = MambaAlignManager(mamba_align(2), BlockPool(8, True, 2), 0)
    >>> m.save_new_computed_blocks("r", []); [b.block_id for b in m.allocate_new_blocks("r", 7)]
    [0, 0, 0, 1]
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int):
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.last_state_block_idx: dict[str, int] = {}
        self._num_retired_blocks: dict[str, int] = {}
        self._allocated_block_reqs: set[str] = set()
        self.cached_blocks_this_step: set[HashKey] = set()
        self._pending_boundary_state_offloads: list[tuple[str, int, KVCacheBlock, int]] = []
        self.hybrid = False
        """One of several groups (the manager sets it): caching rounds to whole blocks."""
        self.fine = False
        """Whether hits may end inside a block (``kvpool.impl.mamba_fine.MambaFineManager``)."""
        self.drop_eagle_checkpoint_block = False
        """The manager runs EAGLE (it sets this on every "align" group, flagged or not): the
        prompt's reusable state is one block below its last boundary, not before its last
        token (``kvpool.model.mamba_align_eagle``)."""

    def find_fine_hit(
        self, block_hashes: Sequence[bytes], max_length: int, kv_cache_group_ids: Sequence[int]
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The hit and its tokens where hits may end inside a block: only a
        ``MambaFineManager`` searches so; this one refuses."""
        raise NotImplementedError("hits inside a block need a MambaFineManager")

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
        block_size = kv_cache_spec.block_size
        _verify_search(kv_cache_group_ids, max_length, alignment, block_size)
        hashes = block_hashes_at(block_hashes, block_pool.hash_block_size, block_size)
        stop = min(max_length // block_size, len(hashes))
        ids = list(kv_cache_group_ids)
        for i in range(stop - 1, -1, -1):
            # with several groups only a state on a scheduler-block boundary is a hit
            if alignment and (i + 1) * block_size % alignment:
                continue
            found = block_pool.get_cached_block(hashes[i], ids)
            if found is not None:
                null = block_pool.null_block
                return tuple([null] * i + [block] for block in found)
        return tuple([] for _ in kv_cache_group_ids)

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """At most one new block plus the free hits; the pool's size plus one (so the request
        waits) when the hit ends on a state cached this step. Not clamped at zero."""
        if new_computed_blocks:
            key = new_computed_blocks[-1]._primary_key()
            if key is not None and key in self.cached_blocks_this_step:
                return self.block_pool.num_gpu_blocks + 1
        held = self.req_to_blocks.get(request_id)
        lacking = -(-num_tokens // self.block_size) - len(new_computed_blocks)
        if held is not None:
            lacking -= len(held)
        if lacking > 0:
            lacking = 1
        evictable = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                evictable += 1
        return lacking + evictable

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Nulls up to the block ``num_tokens`` ends in, then one new block; return both."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return super().allocate_new_blocks(request_id, num_tokens)  # raises UnknownRequest
        required = -(-num_tokens // self.block_size)
        if required <= len(blocks):
            self._allocated_block_reqs.add(request_id)
            return []
        if request_id in self._allocated_block_reqs or blocks:
            self.last_state_block_idx[request_id] = len(blocks) - 1
        appended: list[KVCacheBlock] = [self._null_block] * (required - 1 - len(blocks))
        appended.extend(self.block_pool.get_new_blocks(1))
        blocks.extend(appended)
        self._allocated_block_reqs.add(request_id)
        return appended

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release every state before the last computed token's, and the previous step's."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        null = self._null_block
        skipped = min((num_computed_tokens - 1) // self.block_size, len(blocks))
        first = self._num_retired_blocks.get(request_id, 0)
        if num_computed_tokens > 1 and first < skipped:
            freed: list[KVCacheBlock] = []
            for i in range(skipped - 1, first - 1, -1):
                if blocks[i] is not null:
                    freed.append(blocks[i])
                    blocks[i] = null
            if freed:
                self.block_pool.free_blocks(freed)
            self._num_retired_blocks[request_id] = skipped
        last = self.last_state_block_idx.get(request_id)
        if (
            last is not None
            and last < -(-num_computed_tokens // self.block_size) - 1
            and blocks[last] is not null
        ):
            self.block_pool.free_blocks([blocks[last]])
            blocks[last] = null

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        """Cache the full positions' states, key the prompt's boundary again if its block lost
        its key, then note each newly cached position as cached this step and offer it (the
        boundary's block too when it lies among them, as vLLM 0.33.0 offers after both)."""
        rid = request.request_id
        before = self.num_cached_block.get(rid, 0)
        SingleTypeKVCacheManager.cache_blocks(self, request, num_tokens)
        blocks = self.req_to_blocks[rid]
        self._cache_prompt_boundary(request, num_tokens, blocks)
        self._offer(rid, blocks, before, self.num_cached_block[rid])

    def _cache_prompt_boundary(
        self, request: Any, num_tokens: int, blocks: list[KVCacheBlock]
    ) -> None:
        """Key the prompt's last reusable boundary again if its block lost its key."""
        # with several groups (vLLM's hybrid coordinator) what is cached is rounded to whole
        # blocks, except in an EAGLE group
        if self.hybrid and not self.use_eagle:
            num_tokens = num_tokens // self.block_size * self.block_size
        size = self.block_size
        if self.drop_eagle_checkpoint_block:  # EAGLE reads the whole prompt, then drops a block
            boundary = num_prompt_tokens(request) // size * size - size
        else:  # a resend recomputes the prompt's last token
            boundary = (num_prompt_tokens(request) - 1) // size * size
        index = num_tokens // self.block_size - 1
        if num_tokens <= 0 or num_tokens != boundary or index >= len(blocks):
            return
        block = blocks[index]
        if block.is_null or block.block_hash_num_tokens == num_tokens:
            return
        self.block_pool.cache_full_blocks(
            request, blocks, index, index + 1, self.block_size, self.kv_cache_group_id
        )
        key = block._primary_key()
        if key is not None:
            self.cached_blocks_this_step.add(key)

    def _cache_mask(self, request: Any, first: int, stop: int) -> list[bool] | None:
        """Under sparse retention the states ``kvpool.impl.retention.align_retention_mask``
        keeps (None, every state, when dense)."""
        interval = self.retention_interval
        if interval is None:
            return None
        alignment = self.cache_hit_alignment_tokens
        return align_retention_mask(
            first,
            stop,
            alignment,
            self.block_size,
            interval,
            self._replay_boundaries(request),
        )

    def _cache_and_offer(self, request: Any, num_tokens: int) -> list[KVCacheBlock]:
        """Cache the request's full blocks; note each newly keyed one as cached this step and
        offer its state (``take_boundary_state_offloads``). The request's table is returned."""
        rid = request.request_id
        before = self.num_cached_block.get(rid, 0)
        SingleTypeKVCacheManager.cache_blocks(self, request, num_tokens)
        blocks = self.req_to_blocks[rid]
        self._offer(rid, blocks, before, self.num_cached_block[rid])
        return blocks

    def _offer(self, rid: str, blocks: list[KVCacheBlock], before: int, after: int) -> None:
        """Note the keyed states at positions ``before..after`` as cached this step, and offer
        them (nulls and blocks left without a key passed over)."""
        for i in range(before, after):
            block = blocks[i]
            key = block._primary_key()
            if block.is_null or key is None:
                continue
            self.cached_blocks_this_step.add(key)
            tokens = block.block_hash_num_tokens or 0
            self._pending_boundary_state_offloads.append(
                (rid, self.kv_cache_group_id, block, tokens)
            )

    def free(self, request_id: str) -> None:
        """Forget the request's states and its offers not yet taken, then release its blocks."""
        self.forget(request_id)
        super().free(request_id)

    def forget(self, request_id: str) -> None:
        """Forget the request's states and its offers not yet taken (``free``, and the
        manager's ``pop_blocks_for_free`` as vLLM 0.33.0's ``MambaManager``'s)."""
        self._allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        self._num_retired_blocks.pop(request_id, None)
        self._pending_boundary_state_offloads = [
            entry for entry in self._pending_boundary_state_offloads if entry[0] != request_id
        ]

    def new_step_starts(self) -> None:
        """States cached in the last step are written now: hits on them may go ahead."""
        self.cached_blocks_this_step.clear()

    def take_pending_boundary_state_offloads(self) -> list[tuple[str, int, KVCacheBlock, int]]:
        """The boundary states offered since the last call, oldest first, and forget them."""
        pending, self._pending_boundary_state_offloads = self._pending_boundary_state_offloads, []
        return pending

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> tuple[int, KVCacheBlock, int] | None:
        """A producer's partial tail: never recorded with hash block = block (vLLM 0.33.0's
        comes from a prompt boundary inside a Mamba block)."""
        return None

    def table(self) -> GroupTable:
        offloads: tuple[Offload, ...] = tuple(
            (rid, group, block.block_id, tokens)
            for rid, group, block, tokens in self._pending_boundary_state_offloads
        )
        return GroupTable(
            req_to_blocks={
                r: tuple(b.block_id for b in blocks) for r, blocks in self.req_to_blocks.items()
            },
            num_cached_block=dict(self.num_cached_block),
            align=AlignTable(
                last_state=dict(self.last_state_block_idx),
                retired=dict(self._num_retired_blocks),
                allocated=frozenset(self._allocated_block_reqs),
                cached_this_step=frozenset(self.cached_blocks_this_step),
                offloads=offloads,
            ),
        )


def take_boundary_state_offloads(
    managers: Sequence[SingleTypeKVCacheManager],
) -> dict[str, list[tuple[int, int, int]]]:
    """Every "align" group's offers drained, by request: ``{request: [(group, block id,
    tokens), ...]}``, groups in order (what ``KVCacheManager.take_boundary_state_offloads``
    answers in vLLM 0.33.0)."""
    offers: dict[str, list[tuple[int, int, int]]] = {}
    for manager in managers:
        if isinstance(manager, MambaAlignManager):
            for rid, group, block, tokens in manager.take_pending_boundary_state_offloads():
                offers.setdefault(rid, []).append((group, block.block_id, tokens))
    return offers


def check_align_eagle(specs: Sequence[KVCacheSpec], use_eagle: bool) -> None:
    """Raise InvalidManagerConfig as the model's ``mamba_align_eagle.verify`` does: EAGLE
    beside a Mamba "align" group with prefill checkpoint blocks is not modelled.

    >>> from kvpool.model.single_type import mamba_reserving
    >>> check_align_eagle([mamba_reserving(4, 3)], True)
    """
    if use_eagle:
        for spec in specs:
            if spec.mamba_align and spec.prefill_checkpoint_alignment:
                raise InvalidManagerConfig(
                    'EAGLE beside a Mamba "align" group with prefill checkpoint blocks is not '
                    "modelled"
                )


def per_group_lookup(
    managers: Sequence[SingleTypeKVCacheManager],
    kinds: Sequence[tuple[KVCacheSpec, list[int]]],
    block_pool: BlockPool,
    scheduler_block_size: int,
    block_hashes: Sequence[bytes],
    max_length: int,
    extend: Callable[
        [tuple[list[KVCacheBlock], ...], Sequence[bytes], int, Sequence[int], KVCacheSpec], int
    ]
    | None = None,
) -> tuple[tuple[list[KVCacheBlock], ...], int, bool] | None:
    """vLLM 0.33.0's connector lookup beside a Mamba "align" group: every group searched on
    its own (same-spec groups together, hits on scheduler blocks); None when some group hit
    deeper than the first full-attention group (the plain lookup answers then); otherwise
    each group's own blocks, full attention's length and whether some group lags behind it.
    The caller checks that caching is on and that there are an "align" group and a
    full-attention one (``kvpool.model.per_group_hit``). Where hits may end inside a Mamba
    block, ``scheduler_block_size`` is 0 and ``extend`` extends a full-attention hit into
    its next block (the manager's)."""
    hits: list[list[KVCacheBlock]] = [[] for _ in managers]
    lengths = [0] * len(managers)
    num_hashed = len(block_hashes) * block_pool.hash_block_size
    for spec, ids in kinds:
        first = managers[ids[0]]
        if isinstance(first, MambaAlignManager) and first.fine:
            # hits inside a Mamba block (kvpool.impl.mamba_fine): on hash blocks
            found, length = first.find_fine_hit(block_hashes, max_length, ids)
        else:
            # an EAGLE group peeks one block past the limit and drops its last block; a
            # Mamba group neither peeks nor drops (its finder ignores the flag)
            reach = max_length
            if first.use_eagle and spec.attention is not AttentionType.MAMBA:
                reach = min(max_length + spec.block_size, num_hashed)
            found = type(first).find_longest_cache_hit(
                block_hashes, reach, ids, block_pool, spec, first.use_eagle, scheduler_block_size
            )
            length = len(found[0]) * spec.block_size
            if extend is not None:
                # fine-grained: a full-attention hit may end inside its next block
                length = extend(found, block_hashes, max_length, ids, spec)
        for g, blocks in zip(ids, found, strict=True):
            hits[g] = blocks
            lengths[g] = length
    full = 0
    while managers[full].kv_cache_spec.attention is not AttentionType.FULL:
        full += 1
    num_local = lengths[full]
    for length in lengths:
        if length > num_local:
            return None
    return tuple(hits), num_local, min(lengths) < num_local
