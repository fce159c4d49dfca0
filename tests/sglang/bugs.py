"""SGLang's radix-cache bug history, planted back into 0.5.23's classes.

Each bug is a subclass of one of 0.5.23's caches (``RadixCache``, or
``UnifiedRadixCache`` over the Python or the Rust tree core) or a small
patch of one of its parts, with the story and the upstream link in its
docstring. ``BUGS`` lists each with the cores it is planted into, the
eviction policy and configurations that can show it, and when SGLang fixed
it. Importing this module imports SGLang.

The Rust core is compiled: only bugs that live in the Python layer above it
(``UnifiedRadixCache``'s own methods) can be planted into it.
"""

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.events import KVCacheEventRecorder
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from kvpool.specs.targets.sglang.radix import SglangRadixFactory

# --------------------------------------------------------------------------
# Events
# --------------------------------------------------------------------------


class SplitRemovesRadixCache(RadixCache):
    """sgl-project/sglang#14934 (fixed in 0.5.7): a split announced its pages as removed.

    After #13488, ``_split_node`` still began by recording a removal for the
    whole node being split, although every page stays cached and nothing is
    stored again. A KV-aware router (Dynamo) folding the events forgot the
    shared prefix (a system prompt, say) on that worker and routed its
    requests elsewhere. https://github.com/sgl-project/sglang/pull/14934
    """

    def _split_node(self, key: Any, child: Any, split_len: int) -> Any:
        self.kv_events.record_remove(child)
        return super()._split_node(key, child, split_len)


def split_removes_python_core(cache: Any) -> None:
    """sgl-project/sglang#14934 planted into the Python tree core's own ``_split_node``."""
    tree = cache.tree_core
    split = tree._split_node

    def buggy(key: Any, child: Any, split_len: int) -> Any:
        tree.kv_events.record_remove(child)
        return split(key, child, split_len)

    tree._split_node = buggy


class SplitRestoresRadixCache(RadixCache):
    """The split events of SGLang 0.5.5 and earlier: remove the node, store both halves.

    Before sgl-project/sglang#13488 and #14934, ``_split_node`` recorded a
    removal of the whole node, then stored the new upper node and the
    shortened lower one: every split churned remove/store events for pages
    that never left the cache. A consumer that folds the stream ends with
    the right set, but the churn is traffic, and a consumer that acts on a
    removal (drops a prefix from its index, cancels a transfer) acts on a
    lie. https://github.com/sgl-project/sglang/pull/14934
    """

    def _split_node(self, key: Any, child: Any, split_len: int) -> Any:
        self.kv_events.record_remove(child)
        new_node = super()._split_node(key, child, split_len)
        self.kv_events.record_store(new_node)
        self.kv_events.record_store(child)
        return new_node


class ContentHashRecorder(KVCacheEventRecorder):
    """sgl-project/sglang#13488 (fixed in 0.5.6): pages hashed by content alone, no parent link.

    Before #13488 a page's event hash was a hash of its own tokens, so equal
    pages at different positions (a repeated phrase, repeated output) got
    equal hashes and Dynamo's indexer built blocks that are their own
    ancestors; and the first page of a node never named its parent
    (``parent_block_hash`` was always None, the condition tested the wrong
    node). The plant hashes each page's tokens with SHA-256 (the original
    used Python's ``hash``: the same shape). https://github.com/sgl-project/sglang/pull/13488
    """

    def _node_event_hash_values(self, node: Any) -> list[str]:
        tokens = list(node.key.token_ids)
        size = self.page_size
        return [
            hashlib.sha256(str(tokens[i : i + size]).encode()).hexdigest()
            for i in range(0, len(tokens), size)
        ]

    def _parent_block_hash(self, node: Any) -> int | None:
        return None


def content_hashes(cache: Any) -> None:
    """Swap in ``ContentHashRecorder`` (legacy cache or Python tree core)."""
    owner = getattr(cache, "tree_core", cache)
    old = owner.kv_events
    owner.kv_events = ContentHashRecorder(enabled=old.enabled, page_size=old.page_size)
    owner.kv_events._queue = old._queue


class PerPageRemovalRecorder(KVCacheEventRecorder):
    """The event shape of SGLang before 0.5.15: one ``BlockRemoved`` per page, nothing merged.

    sgl-project/sglang#29265 (0.5.15) batched a node's removals into one
    event; #31479 (0.5.19) made the queue merge chained stores and
    consecutive removals. Not a bug but a format: a consumer written for
    one shape and fed the other must still fold to the same set, and the
    check tells the shapes apart. https://github.com/sgl-project/sglang/pull/29265
    """

    def enqueue(self, event: Any) -> None:
        self._queue.append(event)

    def record_remove(self, node: Any, medium: Any = None) -> None:
        if not self.enabled:
            return
        hashes = self._node_event_hash_values(node)
        from sglang.srt.disaggregation.kv_events import BlockRemoved, StorageMedium
        from sglang.srt.mem_cache.utils import hash_str_to_int64

        for value in hashes:
            self.enqueue(
                BlockRemoved(block_hashes=[hash_str_to_int64(value)], medium=StorageMedium.GPU)
            )


def per_page_removals(cache: Any) -> None:
    """Swap in ``PerPageRemovalRecorder`` (legacy cache)."""
    old = cache.kv_events
    cache.kv_events = PerPageRemovalRecorder(enabled=old.enabled, page_size=old.page_size)
    cache.kv_events._queue = old._queue


class SilentUnifiedRadixCache(UnifiedRadixCache):
    """sgl-project/sglang#26387 (fixed in 0.5.13): the unified cache published no events.

    ``UnifiedRadixCache`` inherited the base class's no-op ``take_events``,
    so a server on the unified tree told routers nothing: the PR measured a
    router's prefix hit rate going from 50 % to 95 % with the fix.
    https://github.com/sgl-project/sglang/pull/26387
    """

    def take_events(self) -> list[Any]:
        return []


class ResetKeepsQuietRadixCache(RadixCache):
    """A reset that announces nothing: the tree is emptied, no ``AllBlocksCleared`` is sent.

    No upstream issue located for SGLang's tree (vLLM has the same
    contract: ``reset_prefix_cache`` emits ``AllBlocksCleared``). A router
    keeps routing to this worker for prefixes it no longer holds until
    each one happens to be evicted elsewhere; the constructor resets too,
    so not even the first clear is sent.
    """

    def reset(self) -> None:
        events = self.kv_events
        enabled, events.enabled = events.enabled, False
        try:
            super().reset()
        finally:
            events.enabled = enabled


class ResetKeepsQuietUnifiedRadixCache(UnifiedRadixCache):
    """A reset that announces nothing, on the unified cache (both tree cores).

    No upstream issue located. The clear is recorded inside the tree core
    (compiled, for Rust), so the plant drops the ``AllBlocksCleared`` each
    reset queued when the events are taken.
    """

    def reset(self) -> None:
        self._kvpool_resets = getattr(self, "_kvpool_resets", 0) + 1
        super().reset()

    def take_events(self) -> list[Any]:
        kept = []
        for event in super().take_events():
            if type(event).__name__ == "AllBlocksCleared" and self._kvpool_resets:
                self._kvpool_resets -= 1
                continue
            kept.append(event)
        return kept


# --------------------------------------------------------------------------
# Eviction, locks, recency, hits
# --------------------------------------------------------------------------


class GreedyEvictRadixCache(RadixCache):
    """sgl-project/sglang#4987 (fixed by #4989): eviction ignored the number of tokens asked.

    ``HiRadixCache.evict_host`` looped ``while num_evicted < num_tokens``
    without ever adding to ``num_evicted``, so one call drained every
    evictable host leaf. Planted in the device tree: evict asks for
    everything evictable. The cache then recomputes prefixes it could have
    kept. https://github.com/sgl-project/sglang/issues/4987
    """

    def evict(self, params: Any) -> Any:
        everything = max(params.num_tokens, self.evictable_size())
        return super().evict(EvictParams(num_tokens=everything))


class GreedyEvictUnifiedRadixCache(UnifiedRadixCache):
    """sgl-project/sglang#4987, planted into the unified cache (both tree cores).

    The same loop that never counted, at the cache's entry point.
    https://github.com/sgl-project/sglang/issues/4987
    """

    def evict(self, params: Any) -> Any:
        everything = max(params.num_tokens, self.evictable_size())
        return super().evict(EvictParams(num_tokens=everything))


class LockSkipsNodeRadixCache(RadixCache):
    """sgl-project/mini-sglang#52: the lock walk began at the parent, so the node stayed evictable.

    In SGLang's sibling project the loop stepped to the parent before
    taking the lock, so the very node a request matched was never locked:
    eviction could free KV a running request was reading.
    https://github.com/sgl-project/mini-sglang/pull/52
    """

    def inc_lock_ref(self, node: Any) -> Any:
        return super().inc_lock_ref(node if node is self.root_node else node.parent)

    def dec_lock_ref(self, node: Any, params: Any = None) -> Any:
        return super().dec_lock_ref(node if node is self.root_node else node.parent)


class LockSkipsNodeUnifiedRadixCache(UnifiedRadixCache):
    """sgl-project/mini-sglang#52, planted into the unified cache (both tree cores).

    The lock is taken on the node's parent (found with ``collect_path_info``)
    and the receipt names the parent, so the unlock releases what was locked.
    https://github.com/sgl-project/mini-sglang/pull/52
    """

    def inc_lock_ref(self, node_id: Any, skip_lock_components: Any = ()) -> Any:
        (path,) = self.tree_core.collect_path_info([node_id])
        target = path[-1].parent_id if path else node_id
        return super().inc_lock_ref(target, skip_lock_components)

    def dec_lock_ref(self, node_id: Any, params: Any, skip_swa: bool = False) -> Any:
        return super().dec_lock_ref(params.node_id, params, skip_swa)


class KeepSuffixTimeRadixCache(RadixCache):
    """sgl-project/sglang#24892 (proposed, closed unmerged): a split keeps the suffix's recency.

    The PR argued that a partial match should not make the unmatched part
    of a node recently used; mini-sglang merged the same idea (#124).
    SGLang 0.5.23 refreshes it (every node of the walk is stamped before
    the split), so planting the proposal changes which leaf is evicted
    first. https://github.com/sgl-project/sglang/pull/24892
    """

    def _match_prefix_helper(self, node: Any, key: Any) -> Any:
        before = {}
        stack = [self.root_node]
        while stack:
            current = stack.pop()
            before[current] = (current.parent, current.last_access_time)
            stack.extend(current.children.values())
        value, last = super()._match_prefix_helper(node, key)
        for current, (parent, stamp) in before.items():
            if current.parent is not parent:  # split: now the suffix under a new node
                current.last_access_time = stamp
        return value, last


class NoHitCountRadixCache(RadixCache):
    """sgl-project/sglang#18843 (fixed in 0.5.10): hits were never counted, so LFU was LRU.

    ``RadixCache`` never incremented ``hit_count``: the LFU key was
    ``(0, last_access)`` for every node (and SLRU's protected segment stayed
    empty), so the policy a server was started with silently did not apply.
    https://github.com/sgl-project/sglang/pull/18843
    """

    def _inc_hit_count(self, node: Any) -> None:
        pass


def no_hit_count_python_core(cache: Any) -> None:
    """sgl-project/sglang#18843 planted into the Python tree core's hit counting."""
    cache.tree_core._inc_hit_count_and_check = lambda node: False


class NoAlignGuardRadixCache(RadixCache):
    """sgl-project/sglang#10637 (fixed in 0.5.3): no empty-key check after page alignment.

    ``match_prefix`` checked the key for emptiness before cutting it to
    whole pages, not after: a key shorter than a page became empty and the
    walk ran on it anyway. In 0.5.23's walk that raises ``IndexError``
    ("RadixKey child range out of bounds") where the answer is an empty hit.
    https://github.com/sgl-project/sglang/pull/10637
    """

    def match_prefix(self, params: Any) -> Any:
        key = params.key.page_aligned(self.page_size)
        value, node = self._match_prefix_helper(self.root_node, key)
        return self._empty_match_result._replace(
            device_prefix_len=sum(len(v) for v in value), last_device_node=node
        )


# --------------------------------------------------------------------------
# The corpus
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class SglangBug:
    """One bug: where it is planted, what shows it, and where it came from."""

    name: str
    upstream: str
    """``sglang#N``, ``mini-sglang#N`` or ``-``."""
    fixed_in: str
    plants: dict[str, tuple[type[Any] | None, Callable[[Any], None] | None]]
    """core -> (cache class, customize) of each core the bug is planted into."""
    policy: str = "lru"
    events: tuple[bool, ...] = (True, False)
    page_sizes: tuple[int, ...] = (1, 2, 3)
    story: str = ""

    def factory(self, core: str) -> SglangRadixFactory:
        cache_class, customize = self.plants[core]
        return SglangRadixFactory(core, cache_class, customize)


def _doc(item: Any) -> str:
    return " ".join((item.__doc__ or "").split())


BUGS: tuple[SglangBug, ...] = (
    SglangBug(
        "split-removes-stored-pages",
        "sglang#14934",
        "0.5.7",
        {
            "legacy": (SplitRemovesRadixCache, None),
            "python": (None, split_removes_python_core),
        },
        events=(True,),
        story=_doc(SplitRemovesRadixCache),
    ),
    SglangBug(
        "split-removes-and-restores",
        "sglang#14934",
        "0.5.6",
        {"legacy": (SplitRestoresRadixCache, None)},
        events=(True,),
        story=_doc(SplitRestoresRadixCache),
    ),
    SglangBug(
        "content-only-page-hashes",
        "sglang#13488",
        "0.5.6",
        {"legacy": (None, content_hashes), "python": (None, content_hashes)},
        events=(True,),
        story=_doc(ContentHashRecorder),
    ),
    SglangBug(
        "unified-publishes-no-events",
        "sglang#26387",
        "0.5.13",
        {"python": (SilentUnifiedRadixCache, None), "rust": (SilentUnifiedRadixCache, None)},
        events=(True,),
        story=_doc(SilentUnifiedRadixCache),
    ),
    SglangBug(
        "reset-emits-no-clear",
        "-",
        "-",
        {
            "legacy": (ResetKeepsQuietRadixCache, None),
            "python": (ResetKeepsQuietUnifiedRadixCache, None),
            "rust": (ResetKeepsQuietUnifiedRadixCache, None),
        },
        events=(True,),
        story=_doc(ResetKeepsQuietRadixCache),
    ),
    SglangBug(
        "per-page-removals",
        "sglang#29265",
        "0.5.15",
        {"legacy": (None, per_page_removals)},
        events=(True,),
        story=_doc(PerPageRemovalRecorder),
    ),
    SglangBug(
        "evict-ignores-budget",
        "sglang#4987",
        "PR #4989",
        {
            "legacy": (GreedyEvictRadixCache, None),
            "python": (GreedyEvictUnifiedRadixCache, None),
            "rust": (GreedyEvictUnifiedRadixCache, None),
        },
        story=_doc(GreedyEvictRadixCache),
    ),
    SglangBug(
        "lock-skips-node",
        "mini-sglang#52",
        "-",
        {
            "legacy": (LockSkipsNodeRadixCache, None),
            "python": (LockSkipsNodeUnifiedRadixCache, None),
            "rust": (LockSkipsNodeUnifiedRadixCache, None),
        },
        story=_doc(LockSkipsNodeRadixCache),
    ),
    SglangBug(
        "split-suffix-keeps-recency",
        "sglang#24892",
        "never merged",
        {"legacy": (KeepSuffixTimeRadixCache, None)},
        story=_doc(KeepSuffixTimeRadixCache),
    ),
    SglangBug(
        "lfu-hits-never-counted",
        "sglang#18843",
        "0.5.10",
        {"legacy": (NoHitCountRadixCache, None), "python": (None, no_hit_count_python_core)},
        policy="lfu",
        story=_doc(NoHitCountRadixCache),
    ),
    SglangBug(
        "subpage-match-no-guard",
        "sglang#10637",
        "0.5.3",
        {"legacy": (NoAlignGuardRadixCache, None)},
        page_sizes=(2, 3),
        story=_doc(NoAlignGuardRadixCache),
    ),
)

UPSTREAM_URLS = {
    "sglang#14934": "https://github.com/sgl-project/sglang/pull/14934",
    "sglang#13488": "https://github.com/sgl-project/sglang/pull/13488",
    "sglang#26387": "https://github.com/sgl-project/sglang/pull/26387",
    "sglang#29265": "https://github.com/sgl-project/sglang/pull/29265",
    "sglang#4987": "https://github.com/sgl-project/sglang/issues/4987",
    "mini-sglang#52": "https://github.com/sgl-project/mini-sglang/pull/52",
    "sglang#24892": "https://github.com/sgl-project/sglang/pull/24892",
    "sglang#18843": "https://github.com/sgl-project/sglang/pull/18843",
    "sglang#10637": "https://github.com/sgl-project/sglang/pull/10637",
}
