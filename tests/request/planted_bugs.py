"""Copies of the impl's KV cache manager with one bug planted each: the machine must find them.

Each bug is a real mistake a KV-cache-manager author makes. ``allocate_slots``
below is a copy of ``kvpool.impl.manager.KVCacheManager.allocate_slots`` with
switches for the three ordering mistakes; the other two bugs live in the
single-type managers.
"""

from collections.abc import Sequence
from typing import Any

from kvpool.impl.block import KVCacheBlock
from kvpool.impl.manager import KVCacheBlocks, KVCacheManager
from kvpool.impl.single_type import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    _cdiv,
)
from kvpool.specs.request.target import ManagerFactory, ManagerSetup
from kvpool.specs.targets.impl.request import ImplManagerTarget


class _OrderingBugs(KVCacheManager):
    """allocate_slots, copied, with switches for where each phase happens."""

    touch_before_check = False
    allocate_before_touch = False
    cache_allocated_slots = False

    # A copy of an earlier allocate_slots, without the connector's and the scheduler's later
    # arguments: the machine sends them only when they are not their defaults.
    def allocate_slots(  # type: ignore[override]
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
    ) -> KVCacheBlocks | None:
        managers = self.managers
        rid = request.request_id
        hits = (
            self.empty_kv_cache_blocks.blocks
            if new_computed_blocks is None
            else new_computed_blocks.blocks
        )
        if full_sequence_must_fit and not self._full_sequence_fits(
            request,
            hits,
            [False] * len(managers),
            request.num_computed_tokens + num_new_computed_tokens,
        ):
            return None
        for manager in managers:
            manager.remove_skipped_blocks(rid, request.num_computed_tokens)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        if self.touch_before_check and self.enable_caching:
            # BUG: the hits are taken before knowing whether the call succeeds
            for group_hits in hits:
                self.block_pool.touch(group_hits)
        needed = sum(
            m.get_num_blocks_to_allocate(rid, num_slots, h)
            for m, h in zip(managers, hits, strict=True)
        )
        if needed > self.block_pool.get_num_free_blocks():
            return None
        if self.allocate_before_touch:
            # BUG: new blocks come off the free queue while free hits are still in it
            new_blocks = []
            for manager, group_hits in zip(managers, hits, strict=True):
                held = manager.req_to_blocks.get(rid, [])
                lacking = _cdiv(num_slots, manager.block_size) - len(held) - len(group_hits)
                new_blocks.append(self.block_pool.get_new_blocks(max(0, lacking)))
            for manager, group_hits, new in zip(managers, hits, new_blocks, strict=True):
                if self.enable_caching:
                    self.block_pool.touch(group_hits)
                manager.save_new_computed_blocks(rid, group_hits)
                manager.req_to_blocks[rid].extend(new)
        else:
            if self.enable_caching and not self.touch_before_check:
                for group_hits in hits:
                    self.block_pool.touch(group_hits)
            for manager, group_hits in zip(managers, hits, strict=True):
                manager.save_new_computed_blocks(rid, group_hits)
            new_blocks = [manager.allocate_new_blocks(rid, num_slots) for manager in managers]
        if self.enable_caching and not delay_cache_blocks:
            num_to_cache = min(num_computed + num_new_tokens, request.num_tokens)
            if self.cache_allocated_slots:
                # BUG: caches every block that has a slot (look-ahead included), so a
                # block whose KV this step does not write enters the cache
                num_to_cache = min(num_slots, request.num_tokens)
            for manager in managers:
                manager.cache_blocks(request, num_to_cache)
        return self.create_kv_cache_blocks(tuple(new_blocks))


class TouchesHitsBeforeCapacityCheck(_OrderingBugs):
    """A refused allocation keeps the references it took on the hits: they leak."""

    touch_before_check = True


class PopsNewBlocksBeforeTouchingHits(_OrderingBugs):
    """A free hit block can be handed out as a new block of the same request."""

    allocate_before_touch = True


class CachesBlocksNotYetComputed(_OrderingBugs):
    """Caches up to the slots it allocates, not up to the tokens this step computes."""

    cache_allocated_slots = True


def _counting_null(cls: type[SingleTypeKVCacheManager]) -> type[SingleTypeKVCacheManager]:
    class CountsNull(cls):  # type: ignore[valid-type,misc]
        def get_num_blocks_to_allocate(
            self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
        ) -> int:
            held = len(self.req_to_blocks.get(request_id, ()))
            lacking = _cdiv(num_tokens, self.block_size) - len(new_computed_blocks) - held
            # BUG: the null block has ref_cnt 0 but is never in the free queue
            evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
            return max(0, lacking) + evictable

    return CountsNull


class CountsNullBlockAsEvictable(KVCacheManager):
    """Sliding-window and chunked-local hits start with null blocks: each costs a free block."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.managers = [
            _counting_null(type(m))(m.kv_cache_spec, self.block_pool, m.kv_cache_group_id)
            if isinstance(m, SlidingWindowManager | ChunkedLocalAttentionManager)
            else m
            for m in self.managers
        ]


class DropsEagleBlockTwice(KVCacheManager):
    """Full attention with EAGLE drops the last matched block, then drops another."""

    class _Manager(FullAttentionManager):
        @classmethod
        def find_longest_cache_hit(
            cls, *args: Any, **kwargs: Any
        ) -> tuple[list[KVCacheBlock], ...]:
            computed = super().find_longest_cache_hit(*args, **kwargs)
            use_eagle = args[5] if len(args) > 5 else kwargs["use_eagle"]
            if use_eagle and computed[0]:
                # BUG: the caller drops the EAGLE block as well
                for blocks in computed:
                    blocks.pop()
            return computed

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.managers = [
            self._Manager(m.kv_cache_spec, self.block_pool, m.kv_cache_group_id)
            if isinstance(m, FullAttentionManager)
            else m
            for m in self.managers
        ]


BUGS: dict[str, type[KVCacheManager]] = {
    "touch-before-capacity-check": TouchesHitsBeforeCapacityCheck,
    "pop-new-before-touching-hits": PopsNewBlocksBeforeTouchingHits,
    "null-block-counted-evictable": CountsNullBlockAsEvictable,
    "eagle-drop-twice": DropsEagleBlockTwice,
    "caches-blocks-not-yet-computed": CachesBlocksNotYetComputed,
}


def target_of(manager_class: type[KVCacheManager], snapshot: bool = True) -> ManagerFactory:
    """A factory building the impl adapter around ``manager_class`` (without snapshot if asked)."""

    class Target(ImplManagerTarget):
        pass

    Target.manager_class = manager_class
    if not snapshot:

        class Opaque(Target):
            snapshot = None  # type: ignore[assignment]

        def make_opaque(setup: ManagerSetup) -> Any:
            return Opaque(setup)

        return make_opaque
    return Target
