"""A corpus of block-pool bugs, each a small subclass of ``kvpool.impl.BlockPool``.

Every class plants one mistake that a real block-pool author made or could
plausibly make, most of them taken from vLLM's history or from forks that
patch vLLM's pool. The docstring tells the story and names the upstream issue
or pull request where one was located ("no upstream issue located" otherwise).

The corpus measures the *checks*, not the impl: ``tests/corpus/test_corpus.py``
requires the ``ci`` profile to find every bug, and ``bench/bug_corpus.py``
measures how fast each one is found, with and without the target's
``snapshot()`` (a black-box target shows only results, counts and events).
``BUGS`` lists them with the conformance level needed to reach them.

Several leave every named invariant intact on the target's state (a wrong
duplicate returned, a reversed free order, a partial key kept as an extra
key): only comparing results, events or the whole state with the model's
shows them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from kvpool.impl import BlockPool, KVCacheBlock
from kvpool.model import AllBlocksCleared, BlockRemoved, HashKey, PoolConfig
from kvpool.specs.targets.impl.pool import ImplTarget

# ----------------------------------------------------------------------
# Allocation and the free queue
# ----------------------------------------------------------------------


class StaleHashOnReuse(BlockPool):
    """Hands out an evicted cached block but leaves its entry in the hash map.

    A later lookup of that prefix returns a block that now holds another
    request's KV data: wrong output, nothing crashes. kvcached's vLLM block
    pool did this (ovg-project/kvcached#362, fixed in #363); the vLLM 0.33
    pool does it too when caching is off (findings §12).
    """

    def get_new_blocks(self, num_blocks: object) -> list[KVCacheBlock]:
        self._drop_keys = _forget_keys_only  # type: ignore[method-assign]
        try:
            return super().get_new_blocks(num_blocks)
        finally:
            del self._drop_keys


def _forget_keys_only(block: KVCacheBlock) -> None:
    block.reset_hash()


class TakesMostRecentlyFreed(BlockPool):
    """get_new_blocks hands out the *back* of the free queue (MRU) instead of the front.

    The back is where cached blocks wait longest: this evicts the most
    valuable prefixes first and keeps stale ones. A classic deque
    ``pop()``/``popleft()`` mix-up. No upstream issue located.
    """

    # Any: the parent takes any object and validates it; this bug reads it as an int unchecked
    def get_new_blocks(self, num_blocks: Any) -> list[KVCacheBlock]:
        queue = self.free_block_queue
        if not 0 < num_blocks <= queue.num_free_blocks:
            return super().get_new_blocks(num_blocks)
        out = list(queue)[-num_blocks:][::-1]
        for block in out:
            queue.remove(block)
            block.ref_cnt = 1
            if block._hash is not None:
                self._drop_keys(block)
        return out


class TouchLeavesBlockQueued(BlockPool):
    """touch takes a reference on a free cached block but leaves it in the free queue.

    The block is then handed out to a second request while the first reads
    it: two requests write one block. No upstream issue located (vLLM's
    0.33 touch unlinks only at ref_cnt == 0, findings §3, which is the
    related corner where a -1 count leaves a held block queued).
    """

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            if not block.is_null:
                block.ref_cnt += 1


class HashlessAppended(BlockPool):
    """Frees hash-less blocks to the back, as vLLM did before 0.24 (profile ``append``).

    A block without a hash can never be a cache hit, so 0.24 sends it to the
    front to be reused first; appending it keeps useless blocks and evicts
    cached prefixes earlier (vllm-project/vllm#33710 introduced the
    front/back split).
    """

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(ordered_blocks)
        super().free_blocks(blocks)
        freed = [b for b in dict.fromkeys(blocks) if b.ref_cnt == 0 and not b.is_null]
        for block in freed:
            if block._hash is None:
                self.free_block_queue.remove(block)
                self.free_block_queue.append(block)


class CachingOffAppends(BlockPool):
    """With prefix caching off, appends every freed block instead of prepending it.

    vLLM 0.27: a change meant as a pure no-op (#48017) routed every freed
    block to the back when caching is off, turning LIFO reuse into FIFO
    cycling through all block ids; vllm-project/vllm#51482 restored the
    prepend. kvpool's profile ``hashless-first-append-uncached`` is that
    release; this pool claims the default profile.
    """

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(ordered_blocks)
        super().free_blocks(blocks)
        if self.enable_caching:
            return
        for block in dict.fromkeys(blocks):
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
                self.free_block_queue.append(block)


class FreeOrderReversed(BlockPool):
    """Frees the listed blocks in reverse, so the last listed is evicted first.

    The caller lists blocks in eviction priority (vLLM's manager passes a
    request's blocks reversed, tail first); iterating the list backwards
    inverts that priority within each call. No upstream issue located.
    """

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        super().free_blocks(list(ordered_blocks)[::-1])


class FreeReleasesEveryReference(BlockPool):
    """A block held twice and freed once is released completely (ref_cnt set to 0).

    Written as ``block.ref_cnt = 0`` where ``-= 1`` was meant: the block
    joins the free queue while another request still reads it.
    No upstream issue located.
    """

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(ordered_blocks)
        for block in dict.fromkeys(blocks):
            if block.ref_cnt > 1 and not block.is_null and block.pool is self:
                block.ref_cnt = blocks.count(block)
        super().free_blocks(blocks)


class DuplicateFreeCountedTwice(BlockPool):
    """A block listed twice in one free_blocks call is counted free twice.

    The pool decrements every entry first and then collects "the entries at
    zero", so a block listed twice (ref_cnt 2) is queued for each entry;
    ``num_free_blocks`` grows by two while the list holds it once, and the
    pool later hands out its sentinel. Found in ai-dynamo/dynamo#13398's
    override of free_blocks; the same double count crashed vLLM with
    sliding-window attention and CPU offload (vllm-project/vllm#42571, PR #42612).
    """

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(ordered_blocks)
        super().free_blocks(blocks)
        for block in dict.fromkeys(blocks):
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.num_free_blocks += blocks.count(block) - 1


class DoubleFreeIgnored(BlockPool):
    """Silently skips a free of a block that is already free, instead of rejecting it.

    The "guard" patches forks put in after double-free crashes (warn and
    skip blocks with ref_cnt <= 0: ModelEngine-Group/unified-cache-management#1053,
    vllm-project/vllm-ascend#14301) hide the caller's bug: the model rejects
    the call with BlockNotHeld. Reached only at level 2.
    """

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks = [b for b in ordered_blocks if b.ref_cnt > 0 or b.is_null or b.pool is not self]
        super().free_blocks(blocks)


class NegativeCountInflatesFree(BlockPool):
    """get_new_blocks(-n) returns [] and adds n to the free count, as vLLM 0.33 does.

    vLLM's ``popleft_n`` subtracts ``n`` from ``num_free_blocks`` whatever its
    sign (findings §4: -1 then -3 took 5 free blocks to 9). The model rejects
    a negative count. Reached only at level 2. Reported upstream as vllm#52707
    (merged 2026-08-18).
    """

    # Any: the parent takes any object and validates it; this bug reads it as an int unchecked
    def get_new_blocks(self, num_blocks: Any) -> list[KVCacheBlock]:
        if num_blocks < 0:
            self.free_block_queue.num_free_blocks -= num_blocks
            return []
        return super().get_new_blocks(num_blocks)


class UsageCountsNullBlock(BlockPool):
    """get_usage divides by every block, the null block included.

    An idle pool reports a usage above zero and a full one never reaches
    1.0; dashboards and schedulers reading KV-cache usage are off by one
    block. vLLM divides by ``num_gpu_blocks - 1``. No upstream issue located.
    """

    def get_usage(self) -> float:
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_gpu_blocks


# ----------------------------------------------------------------------
# Prefix caching
# ----------------------------------------------------------------------


class LookupReturnsNewestDuplicate(BlockPool):
    """get_cached_block returns the *last* block inserted under a shared key, not the first.

    vLLM keeps duplicates (two requests computed the same prefix) and always
    hands out the first one so that references pile up on one block
    (vllm-project/vllm#9668, "we always allocate the first block in the
    list"). Returning the newest spreads hits over copies, and no invariant
    on the state can tell.
    """

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        found = super().get_cached_block(block_hash, kv_cache_group_ids)
        if found is None:
            return None
        out: list[KVCacheBlock] = []
        for group_id in kv_cache_group_ids:
            entry = self._maps[group_id][block_hash]
            out.append(
                list(entry.values())[-1] if type(entry) is dict else cast(KVCacheBlock, entry)
            )
        return out


class LookupSkipsMissingGroups(BlockPool):
    """get_cached_block returns the groups that hit instead of None when one misses.

    A hybrid model then gets fewer blocks than it has KV cache groups and
    pairs them with the wrong groups. vLLM returns None on the first miss
    (findings §11). No upstream issue located.
    """

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        found = []
        for group_id in kv_cache_group_ids:
            hit = super().get_cached_block(block_hash, [group_id])
            if hit is not None:
                found.extend(hit)
        return found if found else None


class NumCachedOffByOne(BlockPool):
    """cache_full_blocks starts one block late: blocks[num_cached_blocks] is never cached.

    An off-by-one between "number of cached blocks" and "index of the last
    cached block": the first newly full block of every step is left out of
    the prefix cache, so hits stop one block short. No upstream issue located.
    """

    def cache_full_blocks(
        self,
        request: Any,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        if 0 <= num_cached_blocks < num_full_blocks <= len(blocks):
            num_cached_blocks += 1
            if block_mask is not None:
                block_mask = list(block_mask)[1:]
        super().cache_full_blocks(
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            block_mask,
        )


class _FirstSubHashes:
    """A request whose hash at position i*k + k-1 is its hash at i*k (the bug below)."""

    def __init__(self, request: Any, factor: int) -> None:
        hashes = list(request.block_hashes)
        for i in range(len(hashes) // factor):
            hashes[i * factor + factor - 1] = request.block_hashes[i * factor]
        self.block_hashes = hashes
        self.all_token_ids = request.all_token_ids
        self.lora_request = getattr(request, "lora_request", None)


class BigBlockUsesFirstSubHash(BlockPool):
    """A block of k hash blocks is keyed by its *first* sub-hash instead of its last.

    With block_size = k * hash_block_size (hybrid models with several block
    sizes) the chained hash of a block's last hash block names the whole
    prefix; the first one names a prefix k-1 hash blocks shorter, so a
    different request that shares only that shorter prefix hits this block
    and reads KV it never computed. vLLM's BlockHashListWithBlockSize picks
    index (i+1)*k-1 (findings §5). No upstream issue located.
    """

    def cache_full_blocks(
        self,
        request: Any,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        factor = block_size // self.hash_block_size
        if factor > 1 and block_size % self.hash_block_size == 0:
            request = _FirstSubHashes(request, factor)
        super().cache_full_blocks(
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            block_mask,
        )


class PromotionKeepsPartialKey(BlockPool):
    """Promoting a partial block to a full one keeps the old partial key reachable.

    The block gets its full key, the partial key is reported removed
    (BlockRemoved), but it stays in the map as one of the block's extra
    keys: a lookup of the shorter prefix hits a block now holding more
    tokens, and event consumers are told the key is gone while it still
    hits. vllm-project/vllm#49125 ("Stale partial prefix-cache hash
    resurrected into the cache after full-block promotion"). The map and
    the block's own records agree, so no invariant on the state breaks
    without events.
    """

    def cache_full_blocks(
        self,
        request: Any,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        self._drop_keys = self._drop_but_keep_as_extra  # type: ignore[method-assign]
        try:
            super().cache_full_blocks(
                request,
                blocks,
                num_cached_blocks,
                num_full_blocks,
                block_size,
                kv_cache_group_id,
                block_mask,
            )
        finally:
            del self._drop_keys

    def _drop_but_keep_as_extra(self, block: KVCacheBlock) -> None:
        old = [block._primary_key(), *(block._extra_keys or ())]
        BlockPool._drop_keys(self, block)
        kept = [key for key in old if key is not None]
        block._extra_keys = kept or None
        for key in kept:
            self._insert(key, block)


class EvictEmitsNoRemoved(BlockPool):
    """evict_blocks drops the hashes but emits no BlockRemoved events.

    A KV-aware router mirroring the cache from the event stream keeps
    routing requests to this instance for prefixes it no longer has.
    No upstream issue located.
    """

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        before = len(self.kv_event_queue)
        super().evict_blocks(block_ids)
        del self.kv_event_queue[before:]


class EvictMovesBlockToFront(BlockPool):
    """evict_blocks moves a free evicted block to the front of the free queue.

    It looks like an improvement (a block without a hash is worthless, reuse
    it first), but vLLM leaves the block exactly where it stands (findings
    §8), and allocation order is observable. No upstream issue located.
    """

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        ids = set(block_ids)
        moved = [
            self.blocks[i]
            for i in sorted(ids)
            if 0 < i < self.num_gpu_blocks
            and self.blocks[i].ref_cnt == 0
            and self.blocks[i]._hash is not None
        ]
        super().evict_blocks(ids)
        for block in moved:
            self.free_block_queue.remove(block)
        self.free_block_queue.prepend_n(moved)


class ResetIgnoresHeldBlocks(BlockPool):
    """reset_prefix_cache clears every hash even while requests hold blocks.

    vLLM refuses (returns False) unless every block is free, because running
    requests still own cached blocks and will cache more
    (vllm-project/vllm#12284 added reset with that rule; #28827 later added
    an explicit option to reset running requests first).
    """

    def reset_prefix_cache(self) -> bool:
        for block in self.blocks:
            block.reset_hash()
        self._map0 = {}
        self._maps = {0: self._map0}
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True


class PartialEventWrongBlockSize(BlockPool):
    """A partial entry's BlockStored event reports the block size, not the hash block size.

    The event carries only the last hash block's tokens, so a consumer that
    trusts ``block_size`` mis-splits the token ids. vLLM reports the slice
    length (findings §6). Seen only with events on. No upstream issue located.
    """

    def cache_partial_block(
        self,
        request: Any,
        block: Any,
        num_tokens: Any,
        kv_cache_group_id: Any,
        block_size: Any,
        replace_existing_hashes: Any = False,
    ) -> HashKey | bytes | None:
        before = len(self.kv_event_queue)
        key = super().cache_partial_block(
            request, block, num_tokens, kv_cache_group_id, block_size, replace_existing_hashes
        )
        events = self.kv_event_queue
        for i in range(before, len(events)):
            if not isinstance(events[i], BlockRemoved):
                events[i] = _with_block_size(events[i], block_size)
        return key


def _with_block_size(event: Any, block_size: int) -> Any:
    from dataclasses import replace

    return replace(event, block_size=block_size)


# ----------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------


@dataclass(frozen=True)
class Bug:
    """One entry of the corpus."""

    name: str
    pool: type[BlockPool]
    level: int
    """The conformance level needed: 2 for bugs only invalid calls reach."""
    upstream: str
    """The vLLM (or fork) issue or pull request it reproduces, or ``-``."""


BUGS: tuple[Bug, ...] = (
    Bug("stale-hash-on-reuse", StaleHashOnReuse, 1, "kvcached#362"),
    Bug("takes-mru", TakesMostRecentlyFreed, 1, "-"),
    Bug("touch-leaves-queued", TouchLeavesBlockQueued, 1, "-"),
    Bug("hashless-appended", HashlessAppended, 1, "vllm#33710"),
    Bug("caching-off-appends", CachingOffAppends, 1, "vllm#51482"),
    Bug("free-order-reversed", FreeOrderReversed, 1, "-"),
    Bug("free-releases-all-refs", FreeReleasesEveryReference, 1, "-"),
    Bug("duplicate-free-counted-twice", DuplicateFreeCountedTwice, 1, "vllm#42571"),
    Bug("double-free-ignored", DoubleFreeIgnored, 2, "ucm#1053"),
    Bug("negative-count-inflates-free", NegativeCountInflatesFree, 2, "vllm#52707"),
    Bug("usage-counts-null-block", UsageCountsNullBlock, 1, "-"),
    Bug("lookup-newest-duplicate", LookupReturnsNewestDuplicate, 1, "vllm#9668"),
    Bug("lookup-skips-missing-groups", LookupSkipsMissingGroups, 1, "-"),
    Bug("num-cached-off-by-one", NumCachedOffByOne, 1, "-"),
    Bug("big-block-first-sub-hash", BigBlockUsesFirstSubHash, 1, "-"),
    Bug("promotion-keeps-partial-key", PromotionKeepsPartialKey, 1, "vllm#49125"),
    Bug("evict-emits-no-removed", EvictEmitsNoRemoved, 1, "-"),
    Bug("evict-moves-to-front", EvictMovesBlockToFront, 1, "-"),
    Bug("reset-ignores-held", ResetIgnoresHeldBlocks, 1, "vllm#12284"),
    Bug("partial-event-block-size", PartialEventWrongBlockSize, 1, "-"),
)


def target_of(pool_class: type[BlockPool]) -> Any:
    """A target factory that builds ``pool_class`` in place of the impl's pool."""

    def make(config: PoolConfig) -> ImplTarget:
        target = ImplTarget(config)
        target.pool = pool_class(
            config.num_blocks,
            enable_caching=config.enable_caching,
            hash_block_size=config.hash_block_size,
            enable_kv_cache_events=config.enable_events,
            profile=config.profile,
        )
        return target

    return make
