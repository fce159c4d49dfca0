"""A corpus of request-layer bugs, each a small subclass of the impl's KV cache manager.

The pool corpus (``tests/corpus/bugs.py``) plants mistakes in the block pool;
this one plants them one layer up, in ``kvpool.impl.manager.KVCacheManager``
and the single-type managers of ``kvpool.impl.single_type``: how a request's
blocks are hashed, how a cache hit is searched for and cut, how free blocks
are counted before an allocation, how a finished request's blocks are
released, and what the prefix-cache stats count. Each class overrides one
method (or patches a copy of it), itself or in a single-type manager it
swaps in; its docstring tells the story and names
the upstream issue or pull request it reproduces ("No upstream issue
located" otherwise), and says what catches it.

Most leave every structural invariant intact: the pool stays consistent and
every block is held exactly as often as the tables list it. What shows them
is the lock-step comparison with the model (another hit, a free queue in
another order, other stats) or the token ground truth of
``kvpool.specs.request.invariants`` (a cached block holding KV of another
adapter or another prefix than its hash names).

The impl's manager takes each request's block hashes from the request, as
vLLM's does; the hashing bugs therefore hash the request again inside the
manager with a patched hasher (``_Rehashing``), which is where vLLM's
request block hasher would carry the same mistake.

``REQUEST_BUGS`` lists them with the layouts each one can show in;
``spec_of`` builds the ``ManagerTargetSpec`` that
``kvpool.specs.request.check.run_request_conformance`` checks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvpool.impl.block import KVCacheBlock
from kvpool.impl.manager import KVCacheBlocks, KVCacheManager
from kvpool.impl.pool import BlockPool
from kvpool.impl.single_type import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    _cdiv,
)
from kvpool.model.hashing import block_extra_keys, extend_block_hashes, hash_block_tokens
from kvpool.model.manager import record
from kvpool.model.request import Request, verify_hash_block_size
from kvpool.model.single_type import KVCacheSpec
from kvpool.model.state import BlockHash
from kvpool.specs.request.target import LAYOUTS, ManagerFactory, ManagerSetup, ManagerTargetSpec
from kvpool.specs.targets.impl.request import ImplManagerTarget

# ----------------------------------------------------------------------
# Hashing: what a block's hash names
# ----------------------------------------------------------------------


class _Rehashing(KVCacheManager):
    """Hashes every request again with ``rehash`` before looking up or caching its blocks."""

    @staticmethod
    def rehash(request: Request) -> tuple[BlockHash, ...]:
        raise NotImplementedError

    def _rehashed(self, request: Request) -> Request:
        return replace(request, block_hashes=self.rehash(request))

    def get_computed_blocks(self, request: Any) -> tuple[KVCacheBlocks, int, int]:
        return super().get_computed_blocks(self._rehashed(request))

    def allocate_slots(self, request: Any, *args: Any, **kwargs: Any) -> KVCacheBlocks | None:
        return super().allocate_slots(self._rehashed(request), *args, **kwargs)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        super().cache_blocks(self._rehashed(request), num_computed_tokens)


class LoraNotHashed(_Rehashing):
    """The block hasher leaves the LoRA adapter out: two adapters share one cached prefix.

    A request running adapter B with the same prompt as an earlier request
    running adapter A (or none) gets A's blocks as a cache hit and attends
    to KV computed with A's weights: wrong output, nothing fails. vLLM's
    automatic prefix caching shipped this way and vllm-project/vllm#3263 put
    the LoRA id into the block hash; block manager v2 repeated it
    (vllm-project/vllm#8240). The pool stays consistent, so no structural
    invariant sees it: the token ground truth does (a hit, or a block cached
    under a hash, holds another adapter's KV), and so does the lock-step
    snapshot (the cache keys differ from the model's).
    """

    @staticmethod
    def rehash(request: Request) -> tuple[BlockHash, ...]:
        return extend_block_hashes(
            (),
            request.all_token_ids,
            request.hash_block_size,
            None,
            request.mm_inputs,
            request.cache_salt,
            seed_hash=request.seed_hash,
        )


class SaltNotHashed(_Rehashing):
    """The block hasher drops the cache salt: tenants with different salts share blocks.

    The salt exists to split the prefix cache between tenants (vLLM's
    ``cache_salt``, vllm-project/vllm#17045, against timing side channels).
    llm-d's router recomputes vLLM's block hashes to route requests and
    left the salt out of them (llm-d/llm-d-router#1389, fixed by #1494);
    here the same omission sits in the manager's own hasher. Only the
    ground truth (a salted request's hit holds another tenant's KV) or the
    comparison with the model's cache keys catches it.
    """

    @staticmethod
    def rehash(request: Request) -> tuple[BlockHash, ...]:
        return extend_block_hashes(
            (),
            request.all_token_ids,
            request.hash_block_size,
            request.lora,
            request.mm_inputs,
            None,
            seed_hash=request.seed_hash,
        )


class ParentExtraKeysNotChained(_Rehashing):
    """A block's extra keys enter its own key but not the chain its children hash from.

    The chain carries only the tokens, so two requests whose prompts differ
    only by the image (or the salt) in their first block get the same keys
    for every later block. Full attention never hits those (its hit stops at
    the first block), but a sliding-window hit reads only the last blocks
    and serves another image's KV. vLLM V1 hashed this way until
    vllm-project/vllm#12603 mixed the extra keys into the chained value.
    Structural invariants hold throughout; the ground truth flags a cached
    key no request was given, and the snapshot shows other keys than the
    model's.
    """

    @staticmethod
    def rehash(request: Request) -> tuple[BlockHash, ...]:
        tokens = request.all_token_ids
        size = request.hash_block_size
        chain: BlockHash | None = None
        hashes: list[BlockHash] = []
        for start in range(0, len(tokens) - size + 1, size):
            block = tokens[start : start + size]
            extra = block_extra_keys(
                start, start + size, request.lora, request.mm_inputs, request.cache_salt
            )
            hashes.append(hash_block_tokens(chain, block, extra, seed_hash=request.seed_hash))
            chain = hash_block_tokens(chain, block, (), seed_hash=request.seed_hash)
        return tuple(hashes)


# ----------------------------------------------------------------------
# Hits: how much of a prompt the cache may serve
# ----------------------------------------------------------------------


class HitCoversWholePrompt(KVCacheManager):
    """get_computed_blocks may return a hit covering every token of the prompt.

    The scheduler must compute at least the last prompt token to get the
    logits it samples from, so a hit is capped at ``num_tokens - 1`` tokens
    (seed 004). Without the cap a fully cached prompt leaves nothing to
    schedule. vLLM's V0 prefix caching recomputed only the last token from
    vllm-project/vllm#7753 on; V1 recomputed the whole last block for a while
    (vllm-project/vllm#11186). The hit holds the request's own KV, so the
    ground truth is satisfied: the comparison with the model's hit shows it,
    and without a model the next call (an allocation of zero new tokens) is
    refused, where a scheduler would stall.
    """

    def get_computed_blocks(self, request: Any) -> tuple[KVCacheBlocks, int, int]:
        verify_hash_block_size(request, self.block_pool.hash_block_size)
        if not self.enable_caching or getattr(request, "skip_reading_prefix_cache", False):
            return self.empty_kv_cache_blocks, 0, 0
        self._uncached = 0
        # BUG: no room left for the last token
        blocks, num_tokens = self.find_longest_cache_hit(request.block_hashes, request.num_tokens)
        uncached = self._uncached
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats = record(
                self.prefix_cache_stats,
                request.num_tokens,
                num_tokens,
                request.num_preemptions > 0,
            )
        boundary = num_tokens + uncached if uncached else 0
        return self.create_kv_cache_blocks(blocks), num_tokens, boundary


class _KeepsEagleBlock(FullAttentionManager):
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
        # BUG: searches as if EAGLE were off, so the last matched block is kept
        return super().find_longest_cache_hit(
            block_hashes,
            max_length,
            kv_cache_group_ids,
            block_pool,
            kv_cache_spec,
            False,
            alignment,
        )


class EagleKeepsLastBlock(KVCacheManager):
    """With EAGLE, full attention keeps the last matched block instead of dropping it.

    EAGLE's draft model runs on the target model's hidden states, which the
    KV cache does not keep: the last matched block is recomputed to get them
    back. vllm-project/vllm#17137 made
    EAGLE compatible with prefix caching by dropping it. Without the drop
    the hit is one block longer but every block in it is the request's own
    KV, so only the comparison with the model's hit catches it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.managers = _replace_managers(self, FullAttentionManager, _KeepsEagleBlock)


class _DropsEagleBlockAfterWindow(SlidingWindowManager):
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
        # BUG: looks for a window without EAGLE's extra block, then drops one
        computed = super().find_longest_cache_hit(
            block_hashes,
            max_length,
            kv_cache_group_ids,
            block_pool,
            kv_cache_spec,
            False,
            alignment,
        )
        if use_eagle and computed[0]:
            for blocks in computed:
                blocks.pop()
        return computed


class SlidingWindowEagleDropsAfterSearch(KVCacheManager):
    """Sliding window with EAGLE finds a window of cached blocks, then drops its last block.

    What is left no longer covers the window: the request attends to
    positions whose blocks were never part of the hit (null placeholders).
    vllm-project/vllm#17137 dropped the last block for every attention type;
    vllm-project/vllm#17398 moved the drop into each manager so that sliding
    window searches for one extra contiguous block first. The hit's blocks
    hold the right KV and the null blocks are never read as KV by the ground
    truth, so only the comparison with the model's hit shows it. A window of
    one token needs no earlier block and both searches agree, so it is
    checked with windows of two tokens or more.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.managers = _replace_managers(self, SlidingWindowManager, _DropsEagleBlockAfterWindow)


# ----------------------------------------------------------------------
# Allocation: counting free blocks
# ----------------------------------------------------------------------


def _ignoring_free_hits(cls: type[SingleTypeKVCacheManager]) -> type[SingleTypeKVCacheManager]:
    class IgnoresFreeHits(cls):  # type: ignore[valid-type,misc]
        def get_num_blocks_to_allocate(
            self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
        ) -> int:
            held = len(self.req_to_blocks.get(request_id, ()))
            lacking = _cdiv(num_tokens, self.block_size) - len(new_computed_blocks) - held
            # BUG: a hit block that is free (ref_cnt 0) leaves the free queue when
            # touched, so it costs a free block too; it is not counted
            return max(0, lacking)

    return IgnoresFreeHits


class FreeHitsNotCounted(KVCacheManager):
    """The capacity check counts only the blocks to allocate, not the free hits it will touch.

    Touching a hit block that sits in the free queue (ref_cnt 0) takes it
    out of the queue, so it uses up a free block just like a new one. When
    vllm-project/vllm#11565 moved the touch after the capacity check (for
    #11562, where a refused allocation kept its touches), the review pointed
    out exactly this: with 4 blocks needed, 5 free and 2 of them free hits,
    the check passes and the allocation then runs out. Here the pool raises mid-allocation where the
    model refuses cleanly (returns None): the lock-step comparison of the
    allocation's outcome catches it. It is checked on full attention, where
    every block of a hit is a real block that can wait in the free queue.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.managers = [
            _ignoring_free_hits(type(m))(m.kv_cache_spec, self.block_pool, m.kv_cache_group_id)
            for m in self.managers
        ]


# ----------------------------------------------------------------------
# Freeing: which blocks the cache keeps longest
# ----------------------------------------------------------------------


class HybridFreeFlattened(KVCacheManager):
    """free() joins every group's blocks into one list and reverses it once.

    Each group must free its own blocks tail first, group after group: the
    tail of every group's chain is then evicted before its head. Reversing
    the concatenation puts the last group's blocks before the first group's
    instead. vLLM's deferred free path did exactly this for hybrid models
    (vllm-project/vllm#48489; vllm-project/vllm#48532 frees per group).
    Nothing is unsafe and every invariant holds; only the free queue's
    order differs, which the snapshot comparison shows at once and a later
    allocation (another block handed out) shows without one.
    """

    def free(self, request: Any) -> None:
        rid = request.request_id
        blocks: list[KVCacheBlock] = []
        for manager in self.managers:
            held = manager.req_to_blocks.pop(rid, None)
            if held is not None:
                del manager.num_cached_block[rid]
                blocks.extend(held)
        blocks.reverse()
        self.block_pool.free_blocks(blocks)


class _ReleasesButKeepsListed(SlidingWindowManager):
    def _release_before(self, request_id: str, first_useful: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        released: list[KVCacheBlock] = []
        for i in range(min(first_useful, len(blocks)) - 1, -1, -1):
            block = blocks[i]
            if block.is_null:
                break
            # BUG: the block is released but stays in the table, not replaced by the null block
            released.append(block)
        if released:
            self.block_pool.free_blocks(released)


class SlidingWindowDoubleFree(KVCacheManager):
    """Blocks that leave the sliding window are released but stay in the request's table.

    The next step releases them again, and so does free(): a double free.
    Until then the table lists blocks the request no longer holds, which
    the pool may hand to another request. A vLLM-derived engine fixed a
    double free in its sliding-window block handling (dphnAI/sonar#369,
    "fix: double free with sliding window"); the mechanism here is ours.
    The ground truth's reference count check (``ref_counts_match_tables``)
    catches it without a model; in lock-step the tables differ first.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.managers = _replace_managers(self, SlidingWindowManager, _ReleasesButKeepsListed)


# ----------------------------------------------------------------------
# Stats
# ----------------------------------------------------------------------


class PreemptedLookupsCounted(KVCacheManager):
    """The prefix-cache stats count a preempted request's second lookup as a new request.

    A preempted request finds its own blocks again on re-admission, so
    counting that lookup inflates the hit rate with work that was never
    saved. vllm-project/vllm#25787 (for #25780) counts those lookups apart:
    a throughput benchmark's reported hit rate fell from 30% to 0.2%. Only
    the comparison of the stats with the model's catches it.
    """

    def get_computed_blocks(self, request: Any) -> tuple[KVCacheBlocks, int, int]:
        verify_hash_block_size(request, self.block_pool.hash_block_size)
        if not self.enable_caching or getattr(request, "skip_reading_prefix_cache", False):
            return self.empty_kv_cache_blocks, 0, 0
        self._uncached = 0
        blocks, num_tokens = self.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        uncached = self._uncached
        if self.prefix_cache_stats is not None:
            # BUG: every lookup counted as a first admission
            self.prefix_cache_stats = record(
                self.prefix_cache_stats, request.num_tokens, num_tokens, False
            )
        boundary = num_tokens + uncached if uncached else 0
        return self.create_kv_cache_blocks(blocks), num_tokens, boundary


# ----------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------


def _replace_managers(
    manager: KVCacheManager,
    kind: type[SingleTypeKVCacheManager],
    buggy: type[SingleTypeKVCacheManager],
) -> list[SingleTypeKVCacheManager]:
    """The manager's single-type managers with every ``kind`` rebuilt as ``buggy``."""
    return [
        buggy(m.kv_cache_spec, manager.block_pool, m.kv_cache_group_id) if type(m) is kind else m
        for m in manager.managers
    ]


@dataclass(frozen=True)
class RequestBug:
    """One entry of the request-layer corpus."""

    name: str
    manager: type[KVCacheManager]
    upstream: str
    """The vLLM (or fork) issue or pull request it reproduces, or ``-``."""
    layouts: tuple[str, ...] = LAYOUTS
    """The machine's layouts it is checked on (see ``manager_machine.LAYOUTS``)."""
    min_window: int = 1
    """The smallest sliding window drawn: 2 for a bug a window of 1 cannot show."""
    unsafe: bool = False
    """True: it serves or keeps wrong KV, so the ground truth alone (no model) finds it."""


CACHING = ("full", "sliding_window", "chunked_local", "full+sliding_window")
"""The layouts with a prefix cache (a Mamba group never hits and never caches)."""

REQUEST_BUGS: tuple[RequestBug, ...] = (
    RequestBug("lora-not-hashed", LoraNotHashed, "vllm#3263", CACHING, unsafe=True),
    RequestBug("salt-not-hashed", SaltNotHashed, "llm-d-router#1389", CACHING, unsafe=True),
    RequestBug(
        "parent-extra-keys-not-chained",
        ParentExtraKeysNotChained,
        "vllm#12603",
        CACHING,
        unsafe=True,
    ),
    RequestBug("hit-covers-whole-prompt", HitCoversWholePrompt, "vllm#7753", CACHING),
    RequestBug("eagle-keeps-last-block", EagleKeepsLastBlock, "vllm#17137", ("full",)),
    RequestBug(
        "sliding-window-eagle-drop",
        SlidingWindowEagleDropsAfterSearch,
        "vllm#17398",
        ("sliding_window",),
        min_window=2,
    ),
    RequestBug("free-hits-not-counted", FreeHitsNotCounted, "vllm#11565", ("full",)),
    RequestBug(
        "hybrid-free-flattened", HybridFreeFlattened, "vllm#48532", ("full+sliding_window",)
    ),
    RequestBug(
        "sliding-window-double-free",
        SlidingWindowDoubleFree,
        "sonar#369",
        ("sliding_window", "full+sliding_window"),
        unsafe=True,
    ),
    RequestBug("preempted-lookups-counted", PreemptedLookupsCounted, "vllm#25787"),
)


def target_of(manager_class: type[KVCacheManager], snapshot: bool = True) -> ManagerFactory:
    """A factory building the impl's manager adapter around ``manager_class``.

    Without ``snapshot`` the target hides its state (a black-box target):
    only results, tables, counts, usage, events and stats are compared.
    """

    class Target(ImplManagerTarget):
        pass

    Target.manager_class = manager_class
    if snapshot:
        return Target

    class Opaque(Target):
        snapshot = None  # type: ignore[assignment]

    make: Callable[[ManagerSetup], Any] = Opaque
    return make


def spec_of(bug: RequestBug, factory: ManagerFactory | None = None) -> ManagerTargetSpec:
    """The conformance scope of ``bug``: its manager (or ``factory``) on its layouts."""
    return ManagerTargetSpec(
        factory or target_of(bug.manager), layouts=bug.layouts, min_window=bug.min_window
    )


def cli_target(bug: RequestBug) -> str:
    """The target string ``kvpool check --layer request --target ...`` checks ``bug`` with.

    Each bug's ``ManagerTargetSpec`` (its manager and the layouts it can show
    in) is a module attribute named after it, which the registry accepts as a
    request-layer target (``module:NAME``).
    """
    return f"{__name__}:{bug.name.replace('-', '_')}"


for _bug in REQUEST_BUGS:
    globals()[_bug.name.replace("-", "_")] = spec_of(_bug)

clean = spec_of(RequestBug("clean", KVCacheManager, "-"))
"""The unmodified impl's manager through the same factory, on every layout."""
