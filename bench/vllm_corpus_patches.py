"""The bug corpus re-expressed as patches of vLLM's own classes (0.33.0; 0.28.0 too).

``tests/corpus/bugs.py`` plants each bug in a subclass of kvpool's impl.
Here the same mistake is planted in vLLM's code instead, so that vLLM's own
test suite and kvpool can both be run against it (``bench/vllm_own_tests.py``).

Each patch is a set of *wrappers*: a function that takes vLLM's original
method and returns a replacement that calls it and distorts its arguments,
its result or the pool's state around the call. No vLLM code is copied. A
patch is applied two ways:

* ``apply(name)`` replaces the methods on vLLM's class itself, in place, so
  that every reference to the class sees the bug (what vLLM's tests run
  against: they import ``BlockPool`` or build a ``KVCacheManager``);
* ``pool_class(name)`` returns a subclass of vLLM's ``BlockPool`` with the
  wrapped methods, for ``kvpool check --target vllm:bench.vllm_corpus_patches:Class``
  (each pool bug's class is also a module attribute, named as in the corpus).

Importing this module imports vLLM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import BlockStored
from vllm.v1.core import block_pool as block_pool_module
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

VllmBlockPool = block_pool_module.BlockPool

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]
"""Takes vLLM's original method, returns the buggy replacement."""


@dataclass(frozen=True)
class Patch:
    """One corpus bug as a patch of a vLLM class."""

    bug: str
    """The corpus entry's name (``tests/corpus/bugs.py`` or ``request_bugs.py``)."""
    class_name: str
    """The corpus class's name, reused for the patched subclass."""
    owner: str
    """The vLLM class patched, as ``module:Class``, or the module (its functions)."""
    wrappers: dict[str, Wrapper] = field(default_factory=dict)
    """Method (or function) name -> wrapper; empty when the bug is not a patch (see ``note``)."""
    note: str = ""
    """How the patch differs from the corpus class, or why there is none."""
    level: int = 1
    layer: str = "pool"

    @property
    def expressible(self) -> bool:
        return bool(self.wrappers)


PATCHES: dict[str, Patch] = {}


def _register(
    bug: str, class_name: str, owner: str = "vllm.v1.core.block_pool:BlockPool", **kw: Any
) -> Callable[[Callable[[], dict[str, Wrapper]]], Callable[[], dict[str, Wrapper]]]:
    def register(build: Callable[[], dict[str, Wrapper]]) -> Callable[[], dict[str, Wrapper]]:
        PATCHES[bug] = Patch(bug, class_name, owner, build(), **kw)
        return build

    return register


def _owner(owner: str) -> Any:
    """The class ``module:Class``, or the module ``module``."""
    import importlib

    module_name, _, attribute = owner.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attribute) if attribute else module


def missing_in_this_vllm(bug: str) -> list[str]:
    """The methods or functions ``bug`` wraps that the importable vLLM lacks."""
    patch = PATCHES[bug]
    owner = _owner(patch.owner)
    where = owner.__dict__ if isinstance(owner, type) else vars(owner)
    return [name for name in patch.wrappers if name not in where]


def _wrapped(original: Any, wrap: Wrapper) -> Any:
    if isinstance(original, classmethod):
        return classmethod(functools.wraps(original.__func__)(wrap(original.__func__)))
    return functools.wraps(original)(wrap(original))


def apply(bug: str) -> Callable[[], None]:
    """Plant ``bug`` in vLLM's class (or module) in place; returns a function that removes it."""
    patch = PATCHES[bug]
    owner = _owner(patch.owner)
    where = owner.__dict__ if isinstance(owner, type) else vars(owner)
    originals = {name: where[name] for name in patch.wrappers}
    for name, wrap in patch.wrappers.items():
        setattr(owner, name, _wrapped(originals[name], wrap))

    def restore() -> None:
        for name, original in originals.items():
            setattr(owner, name, original)

    return restore


def pool_class(bug: str) -> type:
    """A subclass of vLLM's ``BlockPool`` with ``bug`` planted (pool bugs only)."""
    patch = PATCHES[bug]
    if patch.owner != "vllm.v1.core.block_pool:BlockPool" or not patch.expressible:
        raise ValueError(f"{bug} is not a patch of vLLM's BlockPool")
    methods = {
        name: _wrapped(VllmBlockPool.__dict__[name], wrap) for name, wrap in patch.wrappers.items()
    }
    methods["__doc__"] = f"vLLM's BlockPool with the corpus bug {bug!r} planted."
    methods["__module__"] = __name__
    return type(patch.class_name, (VllmBlockPool,), methods)


# ----------------------------------------------------------------------
# Allocation and the free queue
# ----------------------------------------------------------------------


def _owned(pool: Any, block: Any) -> bool:
    """Whether ``pool`` frees ``block`` itself (0.33 forwards other pools' blocks)."""
    return getattr(block, "pool", None) in (pool, None)


def _distinct(blocks: list[Any]) -> list[tuple[Any, int]]:
    """Each block of ``blocks`` once, with how often it is listed (by identity:
    vLLM's blocks compare by value and cannot be hashed)."""
    counts: dict[int, list[Any]] = {}
    for block in blocks:
        counts.setdefault(id(block), [block, 0])[1] += 1
    return [(block, count) for block, count in counts.values()]


@_register("stale-hash-on-reuse", "StaleHashOnReuse")
def _stale_hash() -> dict[str, Wrapper]:
    def wrap(get_new_blocks: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any, num_blocks: int) -> Any:
            def forget_keys_only(block: Any) -> bool:
                # BUG: the block forgets its keys, the hash map keeps pointing at it
                self.cached_block_hashes_by_block.pop(block.block_id, None)
                block.reset_hash()
                return False

            self._maybe_evict_cached_block = forget_keys_only
            try:
                return get_new_blocks(self, num_blocks)
            finally:
                del self._maybe_evict_cached_block

        return patched

    return {"get_new_blocks": wrap}


@_register("takes-mru", "TakesMostRecentlyFreed")
def _takes_mru() -> dict[str, Wrapper]:
    def wrap(get_new_blocks: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any, num_blocks: int) -> Any:
            queue = self.free_block_queue
            if 0 < num_blocks <= queue.num_free_blocks:
                # BUG: the back of the queue (most recently freed) goes first
                taken = queue.get_all_free_blocks()[-num_blocks:][::-1]
                for block in taken:
                    queue.remove(block)
                queue.prepend_n(taken)
            return get_new_blocks(self, num_blocks)

        return patched

    return {"get_new_blocks": wrap}


@_register("touch-leaves-queued", "TouchLeavesBlockQueued")
def _touch_leaves_queued() -> dict[str, Wrapper]:
    def wrap(touch: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any, blocks: Sequence[Any]) -> None:
            # BUG: a touched free block is never unlinked from the free queue
            self.free_block_queue.remove = lambda block: None
            try:
                touch(self, blocks)
            finally:
                del self.free_block_queue.remove

        return patched

    return {"touch": wrap}


def _freeing_to_back(only_when_caching_off: bool) -> Wrapper:
    def wrap(free_blocks: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any, ordered_blocks: Iterable[Any]) -> None:
            blocks = list(ordered_blocks)
            if only_when_caching_off and self.enable_caching:
                free_blocks(self, blocks)
                return
            queue = self.free_block_queue
            released: list[Any] = []
            queue.prepend_n = released.extend
            queue.append_n = released.extend
            try:
                free_blocks(self, blocks)
            finally:
                del queue.prepend_n, queue.append_n
            # BUG: every released block goes to the back, in the order listed
            position = {id(b): i for i, b in reversed(list(enumerate(blocks)))}
            queue.append_n(sorted(released, key=lambda b: position[id(b)]))

        return patched

    return wrap


_register(
    "hashless-appended",
    "HashlessAppended",
    note="frees every block to the back in the order listed, as vLLM before 0.24 did "
    "(the corpus class appends the hash-less ones after the hashed ones)",
)(lambda: {"free_blocks": _freeing_to_back(only_when_caching_off=False)})

_register("caching-off-appends", "CachingOffAppends")(
    lambda: {"free_blocks": _freeing_to_back(only_when_caching_off=True)}
)


@_register("free-order-reversed", "FreeOrderReversed")
def _free_order_reversed() -> dict[str, Wrapper]:
    def wrap(free_blocks: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any, ordered_blocks: Iterable[Any]) -> None:
            free_blocks(self, list(ordered_blocks)[::-1])  # BUG

        return patched

    return {"free_blocks": wrap}


@_register("free-releases-all-refs", "FreeReleasesEveryReference")
def _free_releases_all() -> dict[str, Wrapper]:
    def wrap(free_blocks: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any, ordered_blocks: Iterable[Any]) -> None:
            blocks = list(ordered_blocks)
            for block, count in _distinct(blocks):
                if block.ref_cnt > 1 and not block.is_null and _owned(self, block):
                    block.ref_cnt = count  # BUG: `= 0` where `-= 1` was meant
            free_blocks(self, blocks)

        return patched

    return {"free_blocks": wrap}


@_register("duplicate-free-counted-twice", "DuplicateFreeCountedTwice")
def _duplicate_free() -> dict[str, Wrapper]:
    def wrap(free_blocks: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any, ordered_blocks: Iterable[Any]) -> None:
            blocks = list(ordered_blocks)
            free_blocks(self, blocks)
            for block, count in _distinct(blocks):
                if block.ref_cnt == 0 and not block.is_null:
                    # BUG: counted free once per entry of the list
                    self.free_block_queue.num_free_blocks += count - 1

        return patched

    return {"free_blocks": wrap}


@_register("double-free-ignored", "DoubleFreeIgnored", level=2)
def _double_free_ignored() -> dict[str, Wrapper]:
    def wrap(free_blocks: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any, ordered_blocks: Iterable[Any]) -> None:
            # BUG: a free of a block nobody holds is dropped silently
            free_blocks(
                self,
                [b for b in ordered_blocks if b.ref_cnt > 0 or b.is_null or not _owned(self, b)],
            )

        return patched

    return {"free_blocks": wrap}


_register(
    "negative-count-inflates-free",
    "NegativeCountInflatesFree",
    level=2,
    note="no patch: vLLM 0.33 itself behaves so (kvpool's known finding negative-get); "
    "the row measures unpatched vLLM",
)(dict)


@_register("usage-counts-null-block", "UsageCountsNullBlock")
def _usage_counts_null() -> dict[str, Wrapper]:
    def wrap(get_usage: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any) -> float:
            # BUG: divides by every block, the null block included
            usage: float = 1.0 - self.get_num_free_blocks() / self.num_gpu_blocks
            return usage

        return patched

    return {"get_usage": wrap}


# ----------------------------------------------------------------------
# Prefix caching
# ----------------------------------------------------------------------


@_register("lookup-newest-duplicate", "LookupReturnsNewestDuplicate")
def _lookup_newest() -> dict[str, Wrapper]:
    def wrap(get_cached_block: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any, block_hash: Any, kv_cache_group_ids: list[int]) -> Any:
            found = get_cached_block(self, block_hash, kv_cache_group_ids)
            if found is None:
                return None
            table = self.cached_block_hash_to_block._cache
            out = []
            for group_id in kv_cache_group_ids:
                entry = table[make_block_hash_with_group_id(block_hash, group_id)]
                # BUG: the newest duplicate instead of the first
                out.append(list(entry.values())[-1] if isinstance(entry, dict) else entry)
            return out

        return patched

    return {"get_cached_block": wrap}


@_register("lookup-skips-missing-groups", "LookupSkipsMissingGroups")
def _lookup_skips() -> dict[str, Wrapper]:
    def wrap(get_cached_block: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any, block_hash: Any, kv_cache_group_ids: list[int]) -> Any:
            found: list[Any] = []
            for group_id in kv_cache_group_ids:
                found.extend(get_cached_block(self, block_hash, [group_id]) or ())
            return found or None  # BUG: the groups that hit, not None

        return patched

    return {"get_cached_block": wrap}


@_register("num-cached-off-by-one", "NumCachedOffByOne")
def _num_cached_off_by_one() -> dict[str, Wrapper]:
    def wrap(cache_full_blocks: Callable[..., Any]) -> Callable[..., Any]:
        def patched(
            self: Any,
            request: Any,
            blocks: list[Any],
            num_cached_blocks: int,
            num_full_blocks: int,
            block_size: int,
            kv_cache_group_id: int,
            block_mask: list[bool] | None = None,
        ) -> None:
            if 0 <= num_cached_blocks < num_full_blocks <= len(blocks):
                num_cached_blocks += 1  # BUG: starts one block late
                if block_mask is not None:
                    block_mask = list(block_mask)[1:]
            cache_full_blocks(
                self,
                request,
                blocks,
                num_cached_blocks,
                num_full_blocks,
                block_size,
                kv_cache_group_id,
                block_mask,
            )

        return patched

    return {"cache_full_blocks": wrap}


class _FirstSubHashes:
    """``request`` seen with each block's last sub-hash replaced by its first one."""

    def __init__(self, request: Any, factor: int) -> None:
        hashes = list(request.block_hashes)
        for i in range(len(hashes) // factor):
            hashes[i * factor + factor - 1] = hashes[i * factor]
        self.block_hashes = hashes
        self._request = request

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


@_register("big-block-first-sub-hash", "BigBlockUsesFirstSubHash")
def _first_sub_hash() -> dict[str, Wrapper]:
    def wrap(cache_full_blocks: Callable[..., Any]) -> Callable[..., Any]:
        def patched(
            self: Any,
            request: Any,
            blocks: list[Any],
            num_cached_blocks: int,
            num_full_blocks: int,
            block_size: int,
            kv_cache_group_id: int,
            block_mask: list[bool] | None = None,
        ) -> None:
            factor = block_size // self.hash_block_size
            if factor > 1 and block_size % self.hash_block_size == 0:
                request = _FirstSubHashes(request, factor)  # BUG
            cache_full_blocks(
                self,
                request,
                blocks,
                num_cached_blocks,
                num_full_blocks,
                block_size,
                kv_cache_group_id,
                block_mask,
            )

        return patched

    return {"cache_full_blocks": wrap}


@_register("promotion-keeps-partial-key", "PromotionKeepsPartialKey")
def _promotion_keeps_key() -> dict[str, Wrapper]:
    def wrap(cache_full_blocks: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any, *args: Any, **kwargs: Any) -> None:
            remove = self._remove_cached_block_hashes

            def remove_but_keep(block: Any) -> list[Any]:
                removed: list[Any] = remove(block)
                # BUG: the keys are reported removed but stay as the block's extra keys
                for key in removed:
                    self.cached_block_hashes_by_block.setdefault(block.block_id, set()).add(key)
                    self.cached_block_hash_to_block.insert(key, block)
                return removed

            self._remove_cached_block_hashes = remove_but_keep
            try:
                cache_full_blocks(self, *args, **kwargs)
            finally:
                del self._remove_cached_block_hashes

        return patched

    return {"cache_full_blocks": wrap}


@_register("evict-emits-no-removed", "EvictEmitsNoRemoved")
def _evict_no_events() -> dict[str, Wrapper]:
    def wrap(evict_blocks: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any, block_ids: set[int]) -> None:
            before = len(self.kv_event_queue)
            evict_blocks(self, block_ids)
            del self.kv_event_queue[before:]  # BUG

        return patched

    return {"evict_blocks": wrap}


@_register("evict-moves-to-front", "EvictMovesBlockToFront")
def _evict_moves_to_front() -> dict[str, Wrapper]:
    def wrap(evict_blocks: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any, block_ids: set[int]) -> None:
            moved = [
                self.blocks[i]
                for i in sorted(block_ids)
                if 0 < i < self.num_gpu_blocks
                and self.blocks[i].ref_cnt == 0
                and self.blocks[i].block_hash is not None
            ]
            evict_blocks(self, block_ids)
            for block in moved:  # BUG: the evicted free blocks jump to the front
                self.free_block_queue.remove(block)
            self.free_block_queue.prepend_n(moved)

        return patched

    return {"evict_blocks": wrap}


@_register("reset-ignores-held", "ResetIgnoresHeldBlocks")
def _reset_ignores_held() -> dict[str, Wrapper]:
    def wrap(reset_prefix_cache: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any) -> bool:
            # BUG: the check "every block is free" always passes
            self.get_num_free_blocks = lambda: self.num_gpu_blocks - 1
            try:
                return bool(reset_prefix_cache(self))
            finally:
                del self.get_num_free_blocks

        return patched

    return {"reset_prefix_cache": wrap}


@_register("partial-event-block-size", "PartialEventWrongBlockSize")
def _partial_event_block_size() -> dict[str, Wrapper]:
    import msgspec

    def wrap(cache_partial_block: Callable[..., Any]) -> Callable[..., Any]:
        def patched(
            self: Any,
            request: Any,
            block: Any,
            num_tokens: int,
            kv_cache_group_id: int,
            block_size: int,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            before = len(self.kv_event_queue)
            key = cache_partial_block(
                self, request, block, num_tokens, kv_cache_group_id, block_size, *args, **kwargs
            )
            events = self.kv_event_queue
            for i in range(before, len(events)):
                if isinstance(events[i], BlockStored):  # BUG: the block size, not the slice's
                    events[i] = msgspec.structs.replace(events[i], block_size=block_size)
            return key

        return patched

    return {"cache_partial_block": wrap}


# ----------------------------------------------------------------------
# The request layer (tests/corpus/request_bugs.py)
# ----------------------------------------------------------------------

UTILS = "vllm.v1.core.kv_cache_utils"
MANAGER = "vllm.v1.core.kv_cache_manager:KVCacheManager"
SINGLE_TYPE = "vllm.v1.core.single_type_kv_cache_manager"


class _Seen:
    """``request`` with some attributes read as other values."""

    def __init__(self, request: Any, **overrides: Any) -> None:
        self._request = request
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


def _call(original: Callable[..., Any], args: Any, kwargs: Any, **changes: Any) -> Any:
    """``original(*args, **kwargs)`` with the arguments named in ``changes`` replaced."""
    import inspect

    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.arguments.update(changes)
    return original(*bound.args, **bound.kwargs)


def _extra_keys_without(attribute: str) -> dict[str, Wrapper]:
    def wrap(generate: Callable[..., Any]) -> Callable[..., Any]:
        def patched(request: Any, *args: Any, **kwargs: Any) -> Any:
            # BUG: the block's extra keys are computed as if the request had no `attribute`
            return generate(_Seen(request, **{attribute: None}), *args, **kwargs)

        return patched

    return {"generate_block_hash_extra_keys": wrap}


_register(
    "lora-not-hashed",
    "LoraNotHashed",
    UTILS,
    layer="request",
    note="generate_block_hash_extra_keys sees no lora_request",
)(lambda: _extra_keys_without("lora_request"))
_register(
    "salt-not-hashed",
    "SaltNotHashed",
    UTILS,
    layer="request",
    note="generate_block_hash_extra_keys sees no cache_salt",
)(lambda: _extra_keys_without("cache_salt"))


@_register(
    "parent-extra-keys-not-chained",
    "ParentExtraKeysNotChained",
    UTILS,
    layer="request",
    note="hash_block_tokens chains from the parent's tokens-only hash",
)
def _parent_extra_keys() -> dict[str, Wrapper]:
    tokens_only: dict[Any, Any] = {}

    def wrap(hash_block_tokens: Callable[..., Any]) -> Callable[..., Any]:
        def patched(hash_function: Any, parent: Any, tokens: Any, extra_keys: Any = None) -> Any:
            # BUG: the chain carries only the tokens; the extra keys enter the
            # block's own key but not what its children hash from
            chain = tokens_only.get(parent, parent)
            key = hash_block_tokens(hash_function, chain, tokens, extra_keys)
            tokens_only[key] = hash_block_tokens(hash_function, chain, tokens, None)
            return key

        return patched

    return {"hash_block_tokens": wrap}


@_register("hit-covers-whole-prompt", "HitCoversWholePrompt", MANAGER, layer="request")
def _hit_covers_prompt() -> dict[str, Wrapper]:
    def wrap(get_computed_blocks: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            if not args and kwargs.get("max_cache_hit_length") is None:
                # BUG: the hit may cover the last prompt token too
                request = _Seen(request, num_tokens=request.num_tokens + 1)
            return get_computed_blocks(self, request, *args, **kwargs)

        return patched

    return {"get_computed_blocks": wrap}


@_register(
    "eagle-keeps-last-block",
    "EagleKeepsLastBlock",
    f"{SINGLE_TYPE}:FullAttentionManager",
    layer="request",
)
def _eagle_keeps_last() -> dict[str, Wrapper]:
    def wrap(find: Callable[..., Any]) -> Callable[..., Any]:
        def patched(cls: Any, *args: Any, **kwargs: Any) -> Any:
            return _call(find, (cls, *args), kwargs, drop_eagle_block=False)  # BUG

        return patched

    return {"find_longest_cache_hit": wrap}


@_register(
    "sliding-window-eagle-drop",
    "SlidingWindowEagleDropsAfterSearch",
    f"{SINGLE_TYPE}:SlidingWindowManager",
    layer="request",
)
def _sliding_window_eagle() -> dict[str, Wrapper]:
    import inspect

    def wrap(find: Callable[..., Any]) -> Callable[..., Any]:
        def patched(cls: Any, *args: Any, **kwargs: Any) -> Any:
            bound = inspect.signature(find).bind(cls, *args, **kwargs)
            drop = bound.arguments["drop_eagle_block"]
            # BUG: looks for a window as if EAGLE were off, then drops a block
            blocks, _ = _call(find, (cls, *args), kwargs, drop_eagle_block=False)
            if drop and blocks[0]:
                for group in blocks:
                    group.pop()
            return blocks, len(blocks[0]) * bound.arguments["kv_cache_spec"].block_size

        return patched

    return {"find_longest_cache_hit": wrap}


@_register(
    "free-hits-not-counted",
    "FreeHitsNotCounted",
    f"{SINGLE_TYPE}:SingleTypeKVCacheManager",
    layer="request",
)
def _free_hits_not_counted() -> dict[str, Wrapper]:
    def wrap(count: Callable[..., Any]) -> Callable[..., Any]:
        def patched(cls: Any, blocks: Any) -> int:
            return 0  # BUG: a free hit leaves the free queue when touched; not counted

        return patched

    return {"_get_num_evictable_blocks": wrap}


@_register(
    "hybrid-free-flattened",
    "HybridFreeFlattened",
    "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator",
    layer="request",
)
def _hybrid_free_flattened() -> dict[str, Wrapper]:
    def wrap(free: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any, request_id: str) -> None:
            managers = self.single_type_managers
            if len(managers) < 2:
                free(self, request_id)
                return
            # BUG: every group's blocks in one list, reversed once
            blocks = self.pop_blocks_for_free(request_id)
            managers[0].block_pool.free_blocks(reversed(blocks))

        return patched

    return {"free": wrap}


@_register(
    "sliding-window-double-free",
    "SlidingWindowDoubleFree",
    f"{SINGLE_TYPE}:SingleTypeKVCacheManager",
    layer="request",
    note="patched where sliding window inherits it: SingleTypeKVCacheManager, "
    "for sliding-window managers only",
)
def _sliding_window_double_free() -> dict[str, Wrapper]:
    def wrap(remove_skipped_blocks: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any, request_id: str, *args: Any, **kwargs: Any) -> None:
            from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

            held = list(self.req_to_blocks.get(request_id, ()))
            remove_skipped_blocks(self, request_id, *args, **kwargs)
            if isinstance(self, SlidingWindowManager) and held:
                # BUG: the released blocks stay in the table instead of null blocks
                self.req_to_blocks[request_id][: len(held)] = held

        return patched

    return {"remove_skipped_blocks": wrap}


@_register("preempted-lookups-counted", "PreemptedLookupsCounted", MANAGER, layer="request")
def _preempted_counted() -> dict[str, Wrapper]:
    def wrap(record: Callable[..., Any]) -> Callable[..., Any]:
        def patched(self: Any, request: Any, num_hits: int) -> None:
            # BUG: every lookup counted as a first admission
            record(self, _Seen(request, num_preemptions=0), num_hits)

        return patched

    return {"record_prefix_cache_stats": wrap}


POOL_BUGS = tuple(name for name, patch in PATCHES.items() if patch.layer == "pool")
REQUEST_BUGS = tuple(name for name, patch in PATCHES.items() if patch.layer == "request")

for _patch in PATCHES.values():
    if _patch.owner == "vllm.v1.core.block_pool:BlockPool" and _patch.expressible:
        globals()[_patch.class_name] = pool_class(_patch.bug)
