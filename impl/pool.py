"""The fast v1 block pool: kvpool.model's semantics on mutable, intrusive structures.

Every public method does what the model's function of the same name does
(``kvpool.model.pool``), raises the model's exception for the model's first
failing precondition, and leaves the pool untouched when it raises. Its cost
depends only on the blocks and keys the call names, never on the pool size.

Representation (``snapshot()`` is the abstraction function back to the model):

* ``blocks[i]`` is the ``KVCacheBlock`` with id ``i``; block 0 is the null block.
* the free queue is an intrusive doubly linked list through the blocks
  (``free_queue.py``), front first. A block is in it exactly when its
  ref_cnt is 0 (and it is not the null block); the hot paths do not clear a
  block's links when it leaves the queue, so a held block's links are stale
  and never read;
* the hash map is one dict per KV cache group, ``_maps[group id]``, mapping a
  hash (bytes) to the one block under the key ``(hash, group id)``, or, when
  several blocks share it, to a ``{block_id: block}`` dict in insertion order
  (the first entry is the one a lookup returns). A dict entry always has at
  least two blocks: one left alone collapses back to the block. Group 0's map
  is also ``_map0`` (the only one with a single group). Keying by the bare
  hash makes a lookup build no ``(hash, group)`` tuple: no allocation, and the
  bytes' hash is cached in the object (measured in docs/performance.md).
* each block records its own keys: the primary one in ``_hash`` and ``_group``, the
  further (partial) ones in ``_extra_keys``, oldest first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from operator import length_hint
from typing import Any, Protocol, cast

from mypy_extensions import mypyc_attr

from kvpool.impl.block import KVCacheBlock, vllm_key
from kvpool.impl.free_queue import FreeKVCacheBlockQueue
from kvpool.model.errors import (
    AlreadyCached,
    BlockNotHeld,
    CachingDisabled,
    DuplicateBlock,
    InvalidArgument,
    InvalidBlockCount,
    InvalidBlockMask,
    InvalidBlockRange,
    InvalidBlockSize,
    InvalidConfig,
    InvalidGroup,
    InvalidPartialBlock,
    NotEnoughFreeBlocks,
    NotEnoughHashes,
    OverFree,
    UnknownBlock,
)
from kvpool.model.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from kvpool.model.profiles import DEFAULT_PROFILE, EventSemantics, FreeOrder, Profile
from kvpool.model.state import BlockState, HashKey, PoolConfig, PoolState

ReuseWatcher = Callable[[KVCacheBlock], object]
"""What ``unpin_blocks`` registers: called with the block when the pool reuses it."""

EventHook = Callable[[KVCacheEvent, Any], object]
"""What a pool built with ``event_hook`` queues instead of each of its events: the hook's
result for (the event, the request that caused it or None). ``kvpool.impl.vllm_shape.CallerEvents``
builds the caller's own event classes (vLLM's msgspec ones, with int hashes) this way."""
"""What ``unpin_blocks`` registers: called with the block when the pool reuses it."""

CacheEntry = KVCacheBlock | dict[int, KVCacheBlock]
"""What the hash map holds under one key: a block, or several in insertion order."""


Unchecked = Any
"""An argument the operation validates itself, raising the model's named error.

Typed ``Any`` because the compiled build (mypyc) checks annotated argument
types on entry and would raise a bare ``TypeError`` first; the pure build and
the compiled one must reject an ill-typed argument alike (``InvalidArgument``).
"""


class MetricsCollector(Protocol):
    """The observer hooks vLLM's pool calls; they never influence the pool."""

    def on_block_allocated(self, block: KVCacheBlock) -> None: ...

    def on_block_accessed(self, block: KVCacheBlock) -> None: ...

    def on_block_evicted(self, block: KVCacheBlock) -> None: ...

    def reset(self) -> None: ...


# Subclassable from Python code in the mypyc build too (the bug corpus and users do).
@mypyc_attr(allow_interpreted_subclasses=True)
class BlockPool:
    """A v1 block pool with prefix caching, call-compatible with vLLM's ``BlockPool``.

    ``num_hash_lookahead_tokens`` L only changes the events: each stored
    block's ``BlockStored.lookahead_token_ids`` entry is the L tokens after it.

    Every public method checks its arguments before it changes anything: a
    call the model rejects, or an argument of the wrong type, raises the
    model's exception (``UnknownBlock`` for anything that is not one of this
    pool's blocks, ``InvalidArgument`` for other wrong types) and leaves the
    pool exactly as it was.

    ``strict=False`` is the one switch for vLLM's own semantics where kvpool
    is stricter on purpose: ``cache_partial_block`` then also takes a prefix
    ending on a block boundary and blocks of one hash block, as vLLM 0.32+
    do (docs/semantics.md, ``cache_partial_block``). It also shows the keys
    vLLM's own managers read in vLLM's shape (``hash + 4 group-id bytes``):
    ``block.block_hash``, ``cache_partial_block``'s result, and vLLM's
    internal map under its name, ``cached_block_hash_to_block``. It is off in
    every conformance check: the model has no such switch.

    ``event_hook`` (None: kvpool's own event dataclasses) turns each event
    into the caller's object as it is queued (``EventHook``); a drop-in for
    vLLM passes ``vllm_shape.CallerEvents`` with vLLM's event classes.

    >>> pool = BlockPool(4, enable_caching=True, hash_block_size=1)
    >>> [b.block_id for b in pool.get_new_blocks(2)], pool.get_num_free_blocks()
    ([1, 2], 1)
    """

    __slots__ = (
        "_epoch",
        "_free_by_hash",
        "_hashless_first",
        "_map0",
        "_maps",
        "_removal_per_copy",
        "_reuse_watchers",
        "blocks",
        "enable_caching",
        "enable_kv_cache_events",
        "event_hook",
        "event_owner",
        "free_block_queue",
        "hash_block_size",
        "kv_event_queue",
        "medium",
        "metrics_collector",
        "null_block",
        "num_gpu_blocks",
        "num_hash_lookahead_tokens",
        "profile",
        "strict",
    )

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector: MetricsCollector | None = None,
        num_hash_lookahead_tokens: int = 0,
        medium: str = MEDIUM_GPU,
        *,
        profile: Profile = DEFAULT_PROFILE,
        strict: bool = True,
        event_hook: EventHook | None = None,
        # Unchecked: the constructor names a stranger itself (InvalidArgument); a compiled
        # build would raise a bare TypeError at the call
        event_owner: Unchecked = None,
    ) -> None:
        # Verify that the sizes are integers and the medium a string
        for name, value in (
            ("num_gpu_blocks", num_gpu_blocks),
            ("hash_block_size", hash_block_size),
        ):
            if not _is_int(value):
                raise InvalidArgument(f"{name} must be an int, got {type(value).__name__}")
        # vLLM's callers pass a bool here (EAGLE's one look-ahead token): an int too
        if not isinstance(num_hash_lookahead_tokens, int):
            raise InvalidArgument("num_hash_lookahead_tokens must be an int")
        num_hash_lookahead_tokens = int(num_hash_lookahead_tokens)
        if not isinstance(medium, str):
            raise InvalidArgument(f"medium must be a string, got {type(medium).__name__}")
        if event_hook is not None and not callable(event_hook):
            raise InvalidArgument("event_hook must be callable")
        if event_owner is not None and not isinstance(event_owner, BlockPool):
            raise InvalidArgument(
                f"event_owner must be a kvpool BlockPool, got {type(event_owner).__name__}"
            )
        # Verify that the pool has room for the null block
        if num_gpu_blocks < 1:
            raise InvalidConfig(f"num_gpu_blocks must be at least 1, got {num_gpu_blocks}")
        # Verify that hashes cover a positive number of tokens
        if hash_block_size < 1:
            raise InvalidConfig(f"hash_block_size must be at least 1, got {hash_block_size}")
        if num_hash_lookahead_tokens < 0:
            raise InvalidConfig("num_hash_lookahead_tokens must not be negative")

        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = enable_kv_cache_events
        self.metrics_collector = metrics_collector
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.medium = medium
        self.profile = profile
        self.strict = strict
        self.event_hook = event_hook
        self.event_owner: BlockPool | None = event_owner
        """The pool whose queue this pool's events go into (None: its own). vLLM 0.33's
        HiSparse host pool queues into the device pool's (``SharedEventQueueBlockPool`` in
        ``vllm/v1/hisparse/block_pool.py``), so the manager's ``take_events`` returns both
        pools' events in the order they happened, each made by the owner's ``event_hook``."""
        self.blocks: list[KVCacheBlock] = [
            KVCacheBlock(i, pool=self) for i in range(num_gpu_blocks)
        ]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self._map0: dict[bytes, CacheEntry] = {}
        self._maps: dict[int, dict[bytes, CacheEntry]] = {0: self._map0}
        # kvpool's events, or what event_hook made of them
        self.kv_event_queue: list[Any] = []
        self._hashless_first = profile.free_order_for(enable_caching) is FreeOrder.HASHLESS_FIRST
        # Freed blocks need sorting by hash only when the rule looks at hashes
        # and hashes can exist; otherwise they all go to one end.
        self._free_by_hash = self._hashless_first and enable_caching
        # Under the last-copy event semantics a key other blocks still carry
        # is removed without a BlockRemoved.
        self._removal_per_copy = profile.event_semantics is EventSemantics.MULTISET
        self._epoch = 0
        self._reuse_watchers: dict[int, ReuseWatcher] = {}

    # ------------------------------------------------------------------
    # Allocation and reference counting
    # ------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: object) -> list[KVCacheBlock]:
        """Hand out the ``num_blocks`` front blocks of the free queue, each held once.

        Every hash a handed-out block carried is dropped (one BlockRemoved per key).

        Complexity: O(num_blocks + number of keys the blocks carried).

        >>> pool = BlockPool(4, True, 1)
        >>> [b.ref_cnt for b in pool.get_new_blocks(2)]
        [1, 1]
        """
        queue = self.free_block_queue
        if type(num_blocks) is int:
            count = num_blocks
        elif _is_int(num_blocks):
            count = int(cast(int, num_blocks))
        else:
            # Verify that the count is an integer
            raise InvalidArgument(f"num_blocks must be an int, got {type(num_blocks).__name__}")
        if count > queue.num_free_blocks or count < 0:
            # Verify that the count is not negative
            if count < 0:
                raise InvalidBlockCount(f"cannot get {count} blocks")
            # Verify that the free queue holds enough blocks
            raise NotEnoughFreeBlocks(
                f"cannot get {count} blocks: only {queue.num_free_blocks} are free"
            )
        if self._reuse_watchers:
            self._notify_reuse(count)

        # The blocks keep their (now stale) links: a held block's links are never
        # read, since ref_cnt == 0 is what says a block is in the queue.
        head = queue.fake_free_list_head
        # Typed locals (here and in the other hot loops) make the compiled build read
        # and write the fields natively. A queued block's links are never None (the
        # sentinels end the list), so the ignores below only skip a None check the
        # pure build would pay for; the compiled one checks the type anyway.
        node: KVCacheBlock = head.next_free_block  # type: ignore[assignment]
        out: list[KVCacheBlock]
        if count == 1:
            # One block (a decode step): no loop, and the eviction inlined as below.
            out = [node]
            node.ref_cnt = 1
            block_hash = node._hash
            if block_hash is not None:
                if node._extra_keys is None and not self.enable_kv_cache_events:
                    cached = self._maps[node._group]
                    entry = cached.pop(block_hash)
                    if entry is not node:
                        self._put_back(cached, block_hash, entry, node)
                    node._hash = None
                    node._group = 0
                    node._block_hash_num_tokens = 0
                else:
                    self._drop_keys(node)
            node = node.next_free_block  # type: ignore[assignment]
        elif self.enable_caching and not self.enable_kv_cache_events:
            # _drop_keys inlined for a block with its primary key only, events off:
            # the usual evicted block (serving evicts ~3 blocks per call). It saves two
            # method calls per evicted block.
            maps = self._maps
            out = []
            for _ in range(count):
                out.append(node)
                node.ref_cnt = 1
                block_hash = node._hash
                if block_hash is not None:
                    if node._extra_keys is None:
                        cached = maps[node._group]
                        entry = cached.pop(block_hash)
                        if entry is not node:
                            self._put_back(cached, block_hash, entry, node)
                        node._hash = None
                        node._group = 0
                        node._block_hash_num_tokens = 0
                    else:
                        self._drop_keys(node)
                node = node.next_free_block  # type: ignore[assignment]
        elif self.enable_caching:
            out = []
            for _ in range(count):
                out.append(node)
                node.ref_cnt = 1
                if node._hash is not None:
                    self._drop_keys(node)
                node = node.next_free_block  # type: ignore[assignment]
        else:
            out = []
            for _ in range(count):
                out.append(node)
                node.ref_cnt = 1
                node = node.next_free_block  # type: ignore[assignment]
        head.next_free_block = node
        node.prev_free_block = head
        queue.num_free_blocks -= count

        if self.metrics_collector is not None:
            self._report_allocated(out)
        return out

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take one more reference on each block (a cache hit); free ones leave the queue.

        A block keeps its hashes. The null block is skipped.

        Complexity: O(len(blocks)).

        >>> pool = BlockPool(4, True, 1)
        >>> pool.touch([pool.blocks[2]])
        >>> pool.blocks[2].ref_cnt, pool.get_num_free_blocks()
        (1, 2)
        """
        seq: list[KVCacheBlock] = blocks if type(blocks) is list else _as_list(blocks)
        unlinked = 0
        complete = False
        items = iter(seq)
        try:
            for block in items:
                # Verify that every block belongs to this pool (a stranger undoes the pass)
                if block.pool is not self:
                    break
                ref_cnt = block.ref_cnt
                if ref_cnt == 0:
                    if block.is_null:
                        continue
                    # Unlink, leaving the block's own links as they are (see _undo_touch).
                    prev: KVCacheBlock = block.prev_free_block  # type: ignore[assignment]
                    nxt: KVCacheBlock = block.next_free_block  # type: ignore[assignment]
                    prev.next_free_block = nxt
                    nxt.prev_free_block = prev
                    unlinked += 1
                    block.ref_cnt = 1  # (a constant: no addition on the cache-hit path)
                    continue
                block.ref_cnt = ref_cnt + 1
            else:
                complete = True
        except (AttributeError, TypeError):
            # Not a block at all: the pure build finds no ``pool`` slot, the compiled
            # one's typed loop variable refuses it. Undone below like a stranger.
            pass
        if complete:
            self.free_block_queue.num_free_blocks -= unlinked
            if self.metrics_collector is not None:
                self._report_accessed(seq)
            return
        stop = len(seq) - length_hint(items) - 1
        self._undo_touch(seq, stop)
        raise UnknownBlock(f"{_entry(seq, stop)!r} is not a block of this pool")

    # _FREE_SPLICE: how free_blocks puts the freed blocks into the queue.
    #
    # During the pass each freed block is only chained to the previous one of its
    # kind (two stores), never to the queue itself:
    #
    #   fake_head -> h1 <-> h2 <-> h3 = front      hash-less (HASHLESS_FIRST), as listed
    #   fake_tail -> g1 <-> g2 = back              all the others, as listed
    #
    #   (fake_tail.next is free to borrow: it is None whenever no call is running)
    #
    # The old queue  old_first <-> ... <-> old_last  is untouched except for
    # fake_head.next, and old_first was remembered. The splice then joins the pieces:
    #
    #   fake_head <-> h1 <-> h2 <-> h3 <-> old_first ... old_last <-> g1 <-> g2 <-> fake_tail
    #
    # which is the model's  hashless + queue + hashed (the end of free_blocks does
    # it inline). A rejected call only restores fake_head.next and fake_tail.next
    # and gives the references back: the chained blocks are held again, and a
    # held block's links are never read.

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per listed block; blocks reaching zero join the free queue.

        The list is in eviction priority (first listed, first evicted). Under
        the profile's HASHLESS_FIRST rule hash-less blocks go to the front of
        the queue and hashed ones to the back; under APPEND all go to the back.
        A block listed k times releases k references. The null block is skipped.

        Complexity: O(len(ordered_blocks)).

        >>> pool = BlockPool(4, True, 1)
        >>> pool.free_blocks(reversed(pool.get_new_blocks(2)))
        >>> [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        [2, 1, 3]
        """
        seq: list[KVCacheBlock] = (
            ordered_blocks if type(ordered_blocks) is list else _as_list(ordered_blocks)
        )
        queue = self.free_block_queue
        head = queue.fake_free_list_head
        tail = queue.fake_free_list_tail
        # The freed blocks grow two chains, spliced into the queue at the end
        # (see _FREE_SPLICE above): `front` ends the chain hanging off the fake
        # head, `back` the chain hanging off the fake tail's spare next link.
        old_first: KVCacheBlock = head.next_free_block  # type: ignore[assignment]
        front: KVCacheBlock = head
        back: KVCacheBlock = tail
        kept = 0  # entries that free nothing: the null block, blocks still held after
        items = iter(seq)
        # Validation and linking share one pass: the first block that is free
        # already or not ours stops it, and the undo below puts everything back.
        complete = False
        try:
            if self._free_by_hash:
                for block in items:
                    # Comparing the count read with 1 (not the count less 1 with 0)
                    # saves the subtraction on the path of the last reference.
                    ref_cnt = block.ref_cnt
                    if ref_cnt == 1 and block.pool is self:
                        block.ref_cnt = 0
                        if block._hash is None:
                            front.next_free_block = block
                            block.prev_free_block = front
                            front = block
                        else:
                            back.next_free_block = block
                            block.prev_free_block = back
                            back = block
                    elif ref_cnt > 1 and block.pool is self:
                        block.ref_cnt = ref_cnt - 1  # still held by someone else
                        kept += 1
                    elif block.is_null and block.pool is self:
                        kept += 1
                    else:
                        break  # free already, or not ours
                else:
                    complete = True
            else:
                # One destination for every freed block: the front or the back.
                end = front if self._hashless_first else back
                for block in items:
                    ref_cnt = block.ref_cnt
                    if ref_cnt == 1 and block.pool is self:
                        block.ref_cnt = 0
                        end.next_free_block = block
                        block.prev_free_block = end
                        end = block
                    elif ref_cnt > 1 and block.pool is self:
                        block.ref_cnt = ref_cnt - 1  # still held by someone else
                        kept += 1
                    elif block.is_null and block.pool is self:
                        kept += 1
                    else:
                        break  # free already, or not ours
                else:
                    complete = True
                    if self._hashless_first:
                        front = end
                    else:
                        back = end
        except (AttributeError, TypeError):
            # Not a block at all: no ref_cnt slot (pure build), or refused by the typed
            # loop variable (compiled build). Undone below.
            complete = False

        if complete:
            if front is head and back is tail:
                return  # nothing reached zero
            queue.num_free_blocks += len(seq) - kept
            # Splice the chains in (the pointer surgery of _FREE_SPLICE):
            # head..front, then old_first..old_last, then tail.next..back.
            end = front
            if old_first is not tail:
                end.next_free_block = old_first
                old_first.prev_free_block = end
                end = tail.prev_free_block  # type: ignore[assignment]
            if back is not tail:
                first: KVCacheBlock = tail.next_free_block  # type: ignore[assignment]
                end.next_free_block = first
                first.prev_free_block = end
                end = back
                tail.next_free_block = None
            end.next_free_block = tail
            tail.prev_free_block = end
            return

        # A stopped pass: put everything back; then either route blocks of other
        # pools, or raise the model's error.
        head.next_free_block = old_first
        tail.next_free_block = None
        self._undo_free(seq, len(seq) - length_hint(items) - 1)
        self._free_routed(seq)

    def _undo_touch(self, blocks: Sequence[KVCacheBlock], stop: int) -> None:
        """Take back the references the first ``stop`` entries of a touch took.

        touch unlinks a free block B without clearing B's own links, so going
        backwards B can be put back exactly where it was ("dancing links"):

            unlink:  P <-> B <-> N   becomes   P <-> N,   B still points at P and N
            relink:  P.next = B; N.prev = B   gives back   P <-> B <-> N

        Undoing in reverse order guarantees P and N are in the queue again
        (or were never taken out) when B is relinked.
        """
        for i in range(stop - 1, -1, -1):
            block = blocks[i]
            if block.is_null:
                continue
            ref_cnt = block.ref_cnt - 1
            block.ref_cnt = ref_cnt
            if ref_cnt == 0:
                prev: KVCacheBlock = block.prev_free_block  # type: ignore[assignment]
                nxt: KVCacheBlock = block.next_free_block  # type: ignore[assignment]
                prev.next_free_block = block
                nxt.prev_free_block = block

    def _undo_free(self, seq: Sequence[KVCacheBlock], stop: int) -> None:
        """Give back the references the first ``stop`` entries released.

        The blocks this pass chained keep links into the abandoned chains; they
        are held again, and a held block's links are never read.
        """
        for i in range(stop):
            block = seq[i]
            if block.is_null:
                continue
            block.ref_cnt += 1

    def _free_routed(self, seq: Sequence[Any]) -> None:
        """Free a list holding blocks of other kvpool pools: each pool frees its own.

        As vLLM 0.33 does (``free_blocks`` hands another pool's blocks to their
        ``block.pool``): this pool's blocks first, then each other pool's, pools
        in the order their first block is listed, blocks in listed order. Every
        part is checked before any pool changes, so a rejection changes none.
        Raises the model's error when the call is invalid (it always is when no
        block belongs to another pool: only then does the fast pass stop).
        """
        parts: dict[BlockPool, list[KVCacheBlock]] = {self: []}
        for block in seq:
            owner = getattr(block, "pool", None) if type(block) is KVCacheBlock else None
            # Verify that every entry is a block of a pool (this one, or one it routes to)
            if not isinstance(owner, BlockPool):
                raise UnknownBlock(f"{block!r} is not a block of this pool")
            parts.setdefault(owner, []).append(block)
        # Verify that no block is released more times than it is held, in every pool
        for pool, blocks in parts.items():
            pool._verify_free(blocks)
        if len(parts) == 1:
            raise AssertionError("free_blocks stopped on a call the model accepts")
        for pool, blocks in parts.items():
            pool.free_blocks(blocks)

    def _verify_free(self, seq: Sequence[KVCacheBlock]) -> None:
        """Raise what the model raises for freeing ``seq`` (this pool's blocks only)."""
        # Verify that no block is released more times than it is held
        releases: dict[KVCacheBlock, int] = {}
        for block in seq:
            if block is not self.null_block:
                releases[block] = releases.get(block, 0) + 1
        for block, count in releases.items():
            if block.ref_cnt == 0:
                raise BlockNotHeld(f"block {block.block_id} is free: it cannot be freed")
            if count > block.ref_cnt:
                raise OverFree(
                    f"block {block.block_id} is held {block.ref_cnt} time(s) "
                    f"but freed {count} times"
                )

    # ------------------------------------------------------------------
    # Pinning and relocation (vLLM 0.33; kvpool.model.pinning)
    # ------------------------------------------------------------------

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: ReuseWatcher) -> None:
        """Release one reference per listed block; call ``on_reuse(block)`` when it is reused.

        The watcher is registered per listed block (replacing an earlier one)
        even if the block stays held. Blocks reaching zero join the *back* of
        the free queue in listed order, hashed or not. The watcher fires once:
        when ``get_new_blocks`` hands the block out (before its keys are
        dropped) or when ``reset_prefix_cache`` succeeds. No event.

        Complexity: O(len(blocks)).

        >>> pool = BlockPool(4, True, 1)
        >>> a, b = pool.get_new_blocks(2)
        >>> seen = []
        >>> pool.unpin_blocks([a], seen.append)
        >>> [x.block_id for x in pool.get_new_blocks(2)], [x.block_id for x in seen]
        ([3, 1], [1])
        """
        seq = blocks if type(blocks) is list else _as_list(blocks)
        # Verify that every entry is a block of this pool
        for block in seq:
            if type(block) is not KVCacheBlock or block.pool is not self:
                raise UnknownBlock(f"{block!r} is not a block of this pool")
        # Verify that the watcher can be called
        if not callable(on_reuse):
            raise InvalidArgument(f"on_reuse must be callable, got {type(on_reuse).__name__}")
        # Verify that no block is released more times than it is held (the null block never is)
        releases: dict[KVCacheBlock, int] = {}
        for block in seq:
            releases[block] = releases.get(block, 0) + 1
        for block, count in releases.items():
            if block.ref_cnt == 0:
                raise BlockNotHeld(f"block {block.block_id} is not held: it cannot be unpinned")
            if count > block.ref_cnt:
                raise OverFree(
                    f"block {block.block_id} is held {block.ref_cnt} time(s) "
                    f"but unpinned {count} times"
                )

        watchers = self._reuse_watchers
        newly_free = []
        for block in seq:
            block.ref_cnt -= 1
            watchers[block.block_id] = on_reuse
            if block.ref_cnt == 0:
                newly_free.append(block)
        self.free_block_queue.append_n(newly_free)

    def _notify_reuse(self, num_blocks: int) -> None:
        """Fire the watchers of the ``num_blocks`` front blocks, front first, and forget them.

        Called before anything changes: a watcher sees the block still free
        and still keyed. If one raises, the pool has not changed and no
        watcher is forgotten (those before it did run).
        """
        watchers = self._reuse_watchers
        fired: list[tuple[ReuseWatcher, KVCacheBlock]] = []
        node: KVCacheBlock = self.free_block_queue.fake_free_list_head.next_free_block  # type: ignore[assignment]
        for _ in range(num_blocks):
            watcher = watchers.get(node.block_id)
            if watcher is not None:
                fired.append((watcher, node))
            node = node.next_free_block  # type: ignore[assignment]
        for watcher, block in fired:
            watcher(block)
        for _, block in fired:
            del watchers[block.block_id]

    def move_block_hashes(self, src_block: object, dst_block: object) -> None:
        """Re-point every key of ``src_block`` to ``dst_block``, with no event.

        ``dst_block`` takes ``src_block``'s primary key (with its token count)
        and partial keys, and is listed last under each key; ``src_block``
        ends with none. Counts and queue positions do not change.

        Complexity: O(number of keys ``src_block`` carries).

        >>> from kvpool.model import CacheRequest
        >>> pool = BlockPool(4, True, 1)
        >>> a, b = pool.get_new_blocks(2)
        >>> pool.cache_full_blocks(CacheRequest((b"k",)), [a], 0, 1, 1, 0)
        >>> pool.move_block_hashes(a, b)
        >>> a.block_hash, b.block_hash, pool.get_cached_block(b"k", [0])[0] is b
        (None, (b'k', 0), True)
        """
        # Verify that both are blocks of this pool
        src = self._own_block(src_block)
        dst = self._own_block(dst_block)
        # Verify that the destination is held (so neither free nor the null block)
        if dst.ref_cnt == 0:
            raise BlockNotHeld(f"block {dst.block_id} is not held: keys cannot move to it")
        # Verify that the destination carries no key yet
        if dst._hash is not None:
            raise AlreadyCached(f"block {dst.block_id} already carries a key")
        primary = src._primary_key()
        if primary is None:
            return
        extra = src._extra_keys
        for key in [primary] if extra is None else [primary, *extra]:
            cached = self._map(key[1])
            entry: Any = cached[key[0]]
            if entry is src:
                cached[key[0]] = dst
            else:
                del entry[src.block_id]
                entry[dst.block_id] = dst
        dst._hash = src._hash
        dst._group = src._group
        dst._block_hash_num_tokens = src._block_hash_num_tokens
        dst._extra_keys = extra
        src.reset_hash()

    def _own_block(self, block: object) -> KVCacheBlock:
        """``block``, if it is a block of this pool; else ``UnknownBlock``.

        The public operations take ``object`` where a block is expected, so the
        compiled build (mypyc checks annotated argument types on entry) rejects
        a non-block with the model's ``UnknownBlock``, as the pure build does.
        """
        if type(block) is not KVCacheBlock or block.pool is not self:
            raise UnknownBlock(f"{block!r} is not a block of this pool")
        return block

    def is_block_writable(self, block: object) -> bool:
        """Whether a request may write ``block`` in place: held once, no key, not null.

        Complexity: O(1).

        >>> pool = BlockPool(3, True, 1)
        >>> pool.is_block_writable(pool.get_new_blocks(1)[0])
        True
        """
        # Verify that the block belongs to this pool
        own = self._own_block(block)
        return not own.is_null and own.ref_cnt == 1 and own._hash is None

    def _maybe_evict_cached_block(self, block: object) -> bool:
        """Drop every key of ``block`` (``evict_blocks`` for one block); whether it had any.

        vLLM's own managers call this name (0.33: the Mamba manager drops a
        transient checkpoint key with it).

        >>> pool = BlockPool(2, True, 1)
        >>> pool._maybe_evict_cached_block(pool.blocks[1])
        False
        """
        # Verify that the block belongs to this pool
        own = self._own_block(block)
        if self.metrics_collector is not None:
            self.metrics_collector.on_block_evicted(own)
        if own._hash is None:
            return False
        self._drop_keys(own)
        return True

    # ------------------------------------------------------------------
    # Prefix caching
    # ------------------------------------------------------------------

    def cache_full_blocks(
        self,
        request: Any,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: Unchecked,
        num_full_blocks: Unchecked,
        block_size: Unchecked,
        kv_cache_group_id: Unchecked,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Insert ``blocks[num_cached_blocks:num_full_blocks]`` into the hash map.

        Block i gets the key (the request's hash of its first i+1 blocks, group).
        Null and masked-out blocks are skipped; a block whose partial entry
        covers fewer tokens is promoted (its old keys are removed first).

        Complexity: O(len(blocks) + number of keys the cached blocks carried).

        >>> from kvpool.model import CacheRequest
        >>> pool = BlockPool(4, True, 1)
        >>> blocks = pool.get_new_blocks(2)
        >>> pool.cache_full_blocks(CacheRequest((b"a", b"b")), blocks, 0, 2, 1, 0)
        >>> blocks[1].block_hash
        (b'b', 0)
        """
        hbs = self.hash_block_size
        # The decode step's call (one new, unhashed block of one hash block in group 0,
        # no mask, events off) in one pass of fewer tests. Only a call that passes every
        # test of the general path ends here; any other, valid or not, goes on to it, so
        # errors keep the model's order. (request.block_hashes may be read twice then.)
        if (
            type(num_cached_blocks) is int
            and type(num_full_blocks) is int
            and num_full_blocks - num_cached_blocks == 1
            and num_cached_blocks >= 0
            and type(block_size) is int
            and block_size == hbs
            and type(kv_cache_group_id) is int
            and kv_cache_group_id == 0
            and block_mask is None
            and type(blocks) is list
            and num_full_blocks <= len(blocks)
            and self.enable_caching
            and not self.enable_kv_cache_events
        ):
            block_hashes = getattr(request, "block_hashes", None)
            if (type(block_hashes) is list or type(block_hashes) is tuple) and len(
                block_hashes
            ) >= num_full_blocks:
                fast: Any = blocks[num_cached_blocks]
                block_hash = block_hashes[num_cached_blocks]
                if (
                    type(fast) is KVCacheBlock
                    and fast.pool is self
                    and fast.ref_cnt != 0
                    and fast._block_hash_num_tokens == 0
                    and not fast.is_null
                    and type(block_hash) is bytes
                ):
                    fast._hash = block_hash  # (_group is 0 already: it is without a key)
                    fast._block_hash_num_tokens = num_full_blocks * block_size
                    cached = self._map0
                    entry = cached.setdefault(block_hash, fast)
                    if entry is not fast:
                        self._add_beside(cached, block_hash, entry, fast)
                    return
        # Verify that the arguments have the operation's types
        if (
            type(num_cached_blocks) is not int
            or type(num_full_blocks) is not int
            or type(block_size) is not int
            or type(kv_cache_group_id) is not int
        ):
            _verify_ints(
                num_cached_blocks=num_cached_blocks,
                num_full_blocks=num_full_blocks,
                block_size=block_size,
                kv_cache_group_id=kv_cache_group_id,
            )
            # Ints of a subclass: the call again with plain ones. Falling through never
            # happens, so below the four are plain ints to mypy, and the compiled build
            # does their arithmetic natively.
            return BlockPool.cache_full_blocks(
                self,
                request,
                blocks,
                int(num_cached_blocks),
                int(num_full_blocks),
                int(block_size),
                int(kv_cache_group_id),
                block_mask,
            )
        if type(blocks) is not list:
            blocks = _as_list(blocks)
        try:
            block_hashes = request.block_hashes
        except AttributeError:
            raise InvalidArgument("the request has no block_hashes") from None
        if type(block_hashes) is not list and type(block_hashes) is not tuple:
            _verify_sequence("block_hashes", block_hashes)
        if block_mask is not None and type(block_mask) is not list:
            block_mask = _as_list(block_mask)
        # Verify that prefix caching is enabled
        if not self.enable_caching:
            raise CachingDisabled("cache_full_blocks on a pool without prefix caching")
        # Verify that the group id is not negative
        if kv_cache_group_id < 0:
            raise InvalidGroup(f"KV cache group id {kv_cache_group_id} is negative")
        # Verify that the block size is a positive multiple of the hash block size
        if block_size % hbs != 0 or block_size < hbs:
            raise InvalidBlockSize(
                f"block_size={block_size} must be a positive multiple of hash_block_size={hbs}"
            )
        # Verify that the range to cache is a slice of the request's blocks
        if num_cached_blocks < 0 or num_full_blocks > len(blocks):
            raise InvalidBlockRange(
                f"cannot cache blocks [{num_cached_blocks}:{num_full_blocks}] "
                f"of a request with {len(blocks)} blocks"
            )
        num_new = num_full_blocks - num_cached_blocks
        if num_new <= 0:
            # Verify that the mask, if any, has one entry per block to cache
            if block_mask is not None and len(block_mask) != 0:
                raise InvalidBlockMask(f"block_mask has {len(block_mask)} entries for 0 blocks")
            return
        # Verify that the mask, if any, has one entry per block to cache
        if block_mask is not None and len(block_mask) != num_new:
            raise InvalidBlockMask(f"block_mask has {len(block_mask)} entries for {num_new}")
        # Verify that every block to cache belongs to this pool (the others are not read)
        if num_new == 1:
            listed = blocks[num_cached_blocks]
            if type(listed) is not KVCacheBlock or listed.pool is not self:
                raise UnknownBlock(f"{listed!r} is not a block of this pool")
        else:
            for i in range(num_cached_blocks, num_full_blocks):
                listed = blocks[i]
                if type(listed) is not KVCacheBlock or listed.pool is not self:
                    raise UnknownBlock(f"{listed!r} is not a block of this pool")
        factor = block_size // hbs
        # Verify that the request has a hash for every block up to num_full_blocks
        if len(block_hashes) // factor < num_full_blocks:
            raise NotEnoughHashes(
                f"request has {len(block_hashes) // factor} hashes of size {block_size}, "
                f"{num_full_blocks} are needed"
            )
        cached = self._map0 if kv_cache_group_id == 0 else self._map(kv_cache_group_id)
        events_on = self.enable_kv_cache_events
        if events_on:
            # Read before anything changes: a request that cannot be read is rejected whole.
            token_ids = _token_ids(request)
            event_tokens = tuple(
                token_ids[num_cached_blocks * block_size : num_full_blocks * block_size]
            )
            lora_id, lora_name = _lora_of(request)
            stored: list[bytes] = []
        block: KVCacheBlock  # checked above; typed for the compiled build's field access
        if num_new == 1:
            # One block (a decode step filled it): nothing can stand twice, no loops.
            block = listed
            if not block.is_null and (block_mask is None or block_mask[0]):
                num_tokens = num_full_blocks * block_size
                # Verify that the block to cache is held by someone
                if block.ref_cnt == 0:
                    raise BlockNotHeld(f"block {block.block_id} is free: it cannot be cached")
                covered = block._block_hash_num_tokens
                # Verify that a hashed block is only ever promoted to a longer prefix
                if covered >= num_tokens:
                    raise AlreadyCached(f"block {block.block_id} caches {covered} tokens")
                block_hash = block_hashes[num_full_blocks * factor - 1]
                # Verify that the hash the block gets is bytes
                if type(block_hash) is not bytes:
                    _verify_hash(block_hash)
                if covered:
                    self._drop_keys(block)
                block._hash = block_hash
                block._group = kv_cache_group_id
                block._block_hash_num_tokens = num_tokens
                entry = cached.setdefault(block_hash, block)
                if entry is not block:
                    self._add_beside(cached, block_hash, entry, block)
                if events_on:
                    stored.append(block_hash)
        elif block_mask is None and factor == 1:
            # The usual prompt (no mask, a hash per block): the blocks and their hashes
            # walked side by side, without indexing. The checks of _verify_all_cacheable
            # and of the hashes share one pass, raising in the same order afterwards.
            # (zip without strict=: a keyword argument costs a parse on every call)
            new_blocks = blocks[num_cached_blocks:num_full_blocks]
            new_hashes = block_hashes[num_cached_blocks:num_full_blocks]
            self._epoch += 1
            epoch = self._epoch
            first_bad: KVCacheBlock | None = None
            bad_tokens = 0
            hashes_ok = True
            bad_hash: object = None
            num_tokens = num_cached_blocks * block_size
            for block, block_hash in zip(new_blocks, new_hashes):  # noqa: B905 (same length)
                num_tokens += block_size
                if type(block_hash) is not bytes and hashes_ok:
                    hashes_ok = False
                    bad_hash = block_hash
                if block.is_null:
                    continue
                # Verify that no physical block stands at two positions
                if block._mark == epoch:
                    raise DuplicateBlock(f"block {block.block_id} stands at two positions")
                block._mark = epoch
                if first_bad is None and (
                    block.ref_cnt == 0 or block._block_hash_num_tokens >= num_tokens
                ):
                    first_bad = block
                    bad_tokens = num_tokens
            if first_bad is not None:
                # Verify that each block is held and only ever promoted to a longer prefix
                self._verify_cacheable(first_bad, bad_tokens)
            if not hashes_ok:
                # Verify that every hash the blocks get is bytes
                _verify_hash(bad_hash)
            num_tokens = num_cached_blocks * block_size
            for block, block_hash in zip(new_blocks, new_hashes):  # noqa: B905 (same length)
                num_tokens += block_size
                if block.is_null:
                    continue
                if block._hash is not None:
                    self._drop_keys(block)
                block._hash = block_hash
                block._group = kv_cache_group_id
                block._block_hash_num_tokens = num_tokens
                entry = cached.setdefault(block_hash, block)
                if entry is not block:
                    self._add_beside(cached, block_hash, entry, block)
                if events_on:
                    stored.append(block_hash)
        else:
            self._verify_all_cacheable(
                blocks, num_cached_blocks, num_full_blocks, block_size, block_mask
            )
            last = factor - 1
            # Verify that every hash the blocks get is bytes
            for block_hash in block_hashes[
                num_cached_blocks * factor + last : num_full_blocks * factor : factor
            ]:
                if type(block_hash) is not bytes:
                    _verify_hash(block_hash)
            for i in range(num_cached_blocks, num_full_blocks):
                block = blocks[i]
                if block.is_null or (
                    block_mask is not None and not block_mask[i - num_cached_blocks]
                ):
                    continue
                # Hashes are chained: a block's last hash block names the whole prefix.
                block_hash = block_hashes[i * factor + last]
                if block._hash is not None:
                    self._drop_keys(block)
                block._hash = block_hash
                block._group = kv_cache_group_id
                block._block_hash_num_tokens = (i + 1) * block_size
                entry = cached.setdefault(block_hash, block)
                if entry is not block:
                    self._add_beside(cached, block_hash, entry, block)
                if events_on:
                    stored.append(block_hash)

        if events_on:
            parent = block_hashes[num_cached_blocks * factor - 1] if num_cached_blocks else None
            lookahead = None
            if self.num_hash_lookahead_tokens:
                ends = [
                    (i + 1) * block_size
                    for i in range(num_cached_blocks, num_full_blocks)
                    if not blocks[i].is_null
                    and (block_mask is None or block_mask[i - num_cached_blocks])
                ]
                lookahead = self._lookahead(token_ids, ends)
            self._emit(
                BlockStored(
                    block_hashes=tuple(stored),
                    parent_block_hash=parent,
                    token_ids=event_tokens,
                    block_size=block_size,
                    lora_id=lora_id,
                    medium=self.medium,
                    lora_name=lora_name,
                    extra_keys=(None,) * len(stored) if stored else None,
                    group_idx=kv_cache_group_id,
                    lookahead_token_ids=lookahead,
                ),
                request,
            )

    def cache_partial_block(
        self,
        request: Any,
        block: Unchecked,
        num_tokens: Unchecked,
        kv_cache_group_id: Unchecked,
        block_size: Unchecked,
        replace_existing_hashes: Unchecked = False,
    ) -> HashKey | bytes | None:
        """Make ``block`` reachable from the prefix of ``num_tokens`` tokens ending inside it.

        The key is the request's hash at ``num_tokens``. It becomes the
        block's primary key if it has none, replaces a primary key covering
        fewer tokens (promotion), and is otherwise added beside it. Returns
        the key (in vLLM's shape under ``strict=False``), or None for the null
        block. With ``replace_existing_hashes``
        every key of the block goes first (one BlockRemoved each) and the key
        becomes its only one, always with a BlockStored.

        Complexity: O(number of keys the block carries).

        >>> from kvpool.model import CacheRequest
        >>> pool = BlockPool(2, True, hash_block_size=2)
        >>> (b,) = pool.get_new_blocks(1)
        >>> pool.cache_partial_block(CacheRequest((b"p",)), b, 2, 0, 4)
        (b'p', 0)
        """
        hbs = self.hash_block_size
        # Verify that the arguments have the operation's types
        _verify_ints(num_tokens=num_tokens, kv_cache_group_id=kv_cache_group_id)
        _verify_ints(block_size=block_size)
        block_hashes, token_ids = _request_lists(request)
        if not isinstance(replace_existing_hashes, bool):
            raise InvalidArgument("replace_existing_hashes must be a bool")
        # Verify that prefix caching is enabled
        if not self.enable_caching:
            raise CachingDisabled("cache_partial_block on a pool without prefix caching")
        # Verify that the group id is not negative
        if kv_cache_group_id < 0:
            raise InvalidGroup(f"KV cache group id {kv_cache_group_id} is negative")
        # Verify that the block belongs to this pool
        if type(block) is not KVCacheBlock or block.pool is not self:
            raise UnknownBlock(f"{block!r} is not a block of this pool")
        if block.is_null:
            return None
        # Verify that the block is held by someone
        if block.ref_cnt == 0:
            raise BlockNotHeld(f"block {block.block_id} is free: only held blocks can be cached")
        # Verify that a block holds more than one hash block, in whole hash blocks
        # (not strict: vLLM 0.32+ also takes a block of one hash block)
        if block_size < hbs + self.strict or block_size % hbs != 0:
            raise InvalidBlockSize(
                f"block_size={block_size} must be a multiple of hash_block_size={hbs} "
                f"and larger than it"
            )
        # Verify that the prefix ends on a hash-block boundary inside a block
        # (not strict: vLLM 0.32+ also takes one on a block boundary)
        if (
            num_tokens <= 0
            or num_tokens % hbs != 0
            or (self.strict and num_tokens % block_size == 0)
        ):
            raise InvalidPartialBlock(
                f"num_tokens={num_tokens} must be a positive multiple of {hbs} "
                f"that is not a multiple of the block size {block_size}"
            )
        num_hash_blocks = num_tokens // hbs
        # Verify that the request has hashed that far
        if num_hash_blocks > len(block_hashes):
            raise NotEnoughHashes(
                f"request has {len(block_hashes)} hashes, {num_hash_blocks} are needed"
            )

        block_hash = block_hashes[num_hash_blocks - 1]
        # Verify that the hash the block gets is bytes
        _verify_hash(block_hash)
        key = (block_hash, kv_cache_group_id)
        if self.enable_kv_cache_events:
            lora_id, lora_name = _lora_of(request)
            stored = BlockStored(
                block_hashes=(block_hash,),
                parent_block_hash=(
                    block_hashes[num_hash_blocks - 2] if num_hash_blocks > 1 else None
                ),
                token_ids=tuple(token_ids[num_tokens - hbs : num_tokens]),
                block_size=hbs,
                lora_id=lora_id,
                medium=self.medium,
                lora_name=lora_name,
                extra_keys=(None,),
                group_idx=kv_cache_group_id,
                lookahead_token_ids=self._lookahead(token_ids, (num_tokens,)),
            )
        primary = block._primary_key()
        if replace_existing_hashes:
            if primary is not None:
                self._drop_keys(block)
                primary = None
        elif primary is not None:
            extra = block._extra_keys
            if primary == key or (extra is not None and key in extra):
                return key if self.strict else vllm_key(key)
            num_primary = block._block_hash_num_tokens
            if num_primary < num_tokens:
                self._drop_keys(block)
                primary = None
        if primary is None:
            block._hash = block_hash
            block._group = kv_cache_group_id
            block._block_hash_num_tokens = num_tokens
        elif block._extra_keys is None:
            block._extra_keys = [key]
        else:
            block._extra_keys.append(key)
        self._insert(key, block)

        if self.enable_kv_cache_events:
            self._emit(stored, request)
        return key if self.strict else vllm_key(key)

    def emit_cached_block_events(
        self,
        request: Any,
        num_cached_blocks: Unchecked,
        block_size: Unchecked,
        kv_cache_group_id: Unchecked,
    ) -> None:
        """Announce the request's first ``num_cached_blocks`` blocks as stored, once more.

        One BlockStored with the request's hashes at ``block_size`` and no
        parent; the pool does not change. Nothing with events off or n = 0.

        Complexity: O(num_cached_blocks * block_size).

        >>> from kvpool.model import CacheRequest
        >>> pool = BlockPool(2, True, 1, enable_kv_cache_events=True)
        >>> pool.emit_cached_block_events(CacheRequest((b"a",), (7,)), 1, 1, 0)
        >>> pool.take_events()[0].token_ids
        (7,)
        """
        hbs = self.hash_block_size
        # Verify that the arguments have the operation's types
        _verify_ints(
            num_cached_blocks=num_cached_blocks,
            block_size=block_size,
            kv_cache_group_id=kv_cache_group_id,
        )
        block_hashes, token_ids = _request_lists(request)
        # Verify that the group id is not negative
        if kv_cache_group_id < 0:
            raise InvalidGroup(f"KV cache group id {kv_cache_group_id} is negative")
        # Verify that the block size is a positive multiple of the hash block size
        if block_size % hbs != 0 or block_size < hbs:
            raise InvalidBlockSize(
                f"block_size={block_size} must be a positive multiple of hash_block_size={hbs}"
            )
        # Verify that the count is not negative
        if num_cached_blocks < 0:
            raise InvalidBlockCount(f"cannot announce {num_cached_blocks} blocks")
        factor = block_size // hbs
        # Verify that the request has a hash for every block announced
        if len(block_hashes) // factor < num_cached_blocks:
            raise NotEnoughHashes(
                f"request has {len(block_hashes) // factor} hashes of size {block_size}, "
                f"{num_cached_blocks} are needed"
            )
        hashes = [block_hashes[(i + 1) * factor - 1] for i in range(num_cached_blocks)]
        # Verify that every hash announced is bytes
        for block_hash in hashes:
            _verify_hash(block_hash)
        if not self.enable_kv_cache_events or num_cached_blocks == 0:
            return
        lora_id, lora_name = _lora_of(request)
        self._emit(
            BlockStored(
                block_hashes=tuple(hashes),
                parent_block_hash=None,
                token_ids=tuple(token_ids[: num_cached_blocks * block_size]),
                block_size=block_size,
                lora_id=lora_id,
                medium=self.medium,
                lora_name=lora_name,
                extra_keys=(None,) * num_cached_blocks,
                group_idx=kv_cache_group_id,
                lookahead_token_ids=self._lookahead(
                    token_ids, [(i + 1) * block_size for i in range(num_cached_blocks)]
                ),
            ),
            request,
        )

    def _lookahead(
        self, token_ids: Sequence[int], ends: Sequence[int]
    ) -> tuple[tuple[int, ...], ...] | None:
        """Per stored block ending at token ``end``, the look-ahead tokens after it."""
        n = self.num_hash_lookahead_tokens
        if n == 0:
            return None
        return tuple(tuple(token_ids[end : end + n]) for end in ends)

    def get_cached_block(
        self, block_hash: Unchecked, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """The cached block under ``block_hash`` in each group, or None if any group misses.

        Where several blocks share a key, the one inserted first is returned.

        Complexity: O(len(kv_cache_group_ids)).

        >>> BlockPool(2, True, 1).get_cached_block(b"h", [0]) is None
        True
        """
        entry: Any
        if type(block_hash) is not bytes or type(kv_cache_group_ids) is not list:
            # Verify that the hash is bytes and the group ids a list of ints
            _verify_hash(block_hash)
            kv_cache_group_ids = _as_list(kv_cache_group_ids)
        if len(kv_cache_group_ids) == 1:
            # The common case of one KV cache group, without the loops.
            group_id = kv_cache_group_ids[0]
            if type(group_id) is not int:
                _verify_ints(kv_cache_group_id=group_id)
                # An int of a subclass: again with a plain one (so that below it is an
                # int to mypy, compared natively in the compiled build).
                return BlockPool.get_cached_block(self, block_hash, [int(group_id)])
            if group_id == 0:
                cached = self._map0
            else:
                # Verify that no group id is negative
                if group_id < 0:
                    raise InvalidGroup(f"KV cache group id {group_id} is negative")
                other = self._maps.get(group_id)
                if other is None:
                    return None
                cached = other
            entry = cached.get(block_hash)
            if type(entry) is KVCacheBlock:  # a hit on a key one block has: one test
                return [entry]
            if entry is None:
                return None
            return [next(iter(entry.values()))]
        for group_id in kv_cache_group_ids:
            if type(group_id) is not int:
                _verify_ints(kv_cache_group_id=group_id)
        # Verify that no group id is negative
        for group_id in kv_cache_group_ids:
            if group_id < 0:
                raise InvalidGroup(f"KV cache group id {group_id} is negative")
        maps = self._maps
        found: list[KVCacheBlock] = []
        for group_id in kv_cache_group_ids:
            group_map = maps.get(group_id)
            entry = None if group_map is None else group_map.get(block_hash)
            if entry is None:
                return None
            found.append(next(iter(entry.values())) if type(entry) is dict else entry)
        return found

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Remove every hash of the given blocks from the prefix cache.

        The blocks stay where they are (held, or at their place in the free
        queue). Removal events come out in ascending block id order.

        Complexity: O(len(block_ids) + number of keys removed), plus a sort of
        the ids when events are on.

        >>> pool = BlockPool(3, True, 1)
        >>> pool.evict_blocks({1, 2}); pool.get_num_free_blocks()
        2
        """
        listed = block_ids if type(block_ids) is set else _as_list(block_ids)
        if not listed:
            return
        # Verify that every id names a block of the pool
        for block_id in listed:
            if type(block_id) is not int and not _is_int(block_id):
                raise UnknownBlock(f"{block_id!r} is not a block id")
        ids = listed if type(listed) is set else set(listed)
        if min(ids) < 0 or max(ids) >= self.num_gpu_blocks:
            raise UnknownBlock(
                f"block ids {sorted(ids)} are not all in 0..{self.num_gpu_blocks - 1}"
            )
        blocks = self.blocks
        collector = self.metrics_collector
        for block_id in sorted(ids) if self.enable_kv_cache_events else ids:
            block = blocks[block_id]
            if collector is not None:
                collector.on_block_evicted(block)
            if block._hash is not None:
                self._drop_keys(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash if no block is held; report whether it happened.

        Complexity: O(number of cached keys).

        >>> BlockPool(3, True, 1).reset_prefix_cache()
        True
        """
        if self.free_block_queue.num_free_blocks != self.num_gpu_blocks - 1:
            return False
        if self._reuse_watchers:
            # Every watcher, in registration order, before any key is dropped
            # (a watcher that raises leaves the pool as it was).
            blocks = self.blocks
            for block_id, watcher in list(self._reuse_watchers.items()):
                watcher(blocks[block_id])
            self._reuse_watchers = {}
        for _, entry in self._cached_items():
            if type(entry) is dict:
                for block in entry.values():
                    block.reset_hash()
            else:
                assert isinstance(entry, KVCacheBlock)
                entry.reset_hash()
        self._map0 = {}
        self._maps = {0: self._map0}
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            self._emit(AllBlocksCleared())
        return True

    # ------------------------------------------------------------------
    # Queries and events
    # ------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """How many blocks the free queue holds (eviction candidates included).

        Complexity: O(1).

        >>> BlockPool(4, True, 1).get_num_free_blocks()
        3
        """
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """The fraction of usable (non-null) blocks that are held, from 0.0 to 1.0.

        Complexity: O(1).

        >>> BlockPool(5, True, 1).get_usage()
        0.0
        """
        usable = self.num_gpu_blocks - 1
        if usable == 0:
            return 0.0
        return 1.0 - self.free_block_queue.num_free_blocks / usable

    def _emit(self, event: KVCacheEvent, request: object = None) -> None:
        """Queue ``event``, or what the pool's event hook makes of it (in the event owner's
        queue, by its hook, when the pool has one)."""
        owner = self.event_owner
        if owner is not None:
            owner._emit(event, request)
            return
        hook = self.event_hook
        self.kv_event_queue.append(event if hook is None else hook(event, request))

    @property
    def cached_block_hash_to_block(self) -> Any:
        """vLLM's internal hash map, keyed in vLLM's shape (``strict=False`` only).

        A view of the pool's own map (``vllm_shape.VllmHashMap``) for code
        written against vLLM's ``BlockPool``: writing through it changes the
        map alone, as writing vLLM's map does, so the block records and the
        invariants are the writer's business.
        """
        if self.strict:
            raise AttributeError(
                "cached_block_hash_to_block is vLLM's internal map; "
                "a pool built with strict=False shows it"
            )
        from kvpool.impl.vllm_shape import VllmHashMap

        return VllmHashMap(self)

    def take_events(self) -> list[KVCacheEvent]:
        """Every event emitted since the last call, oldest first; the queue is emptied.

        Complexity: O(1).

        >>> BlockPool(2, True, 1, enable_kv_cache_events=True).take_events()
        []
        """
        events = self.kv_event_queue
        if not events:
            return []
        self.kv_event_queue = []
        return events

    # ------------------------------------------------------------------
    # Abstraction function and invariants
    # ------------------------------------------------------------------

    def snapshot(self) -> PoolState:
        """The pool as the model's ``PoolState`` (the abstraction function).

        Complexity: O(N + number of cached keys + number of pending events).

        >>> from kvpool.model import new_pool
        >>> BlockPool(3, True, 1).snapshot() == new_pool(3)
        True
        """
        config = PoolConfig(
            num_blocks=self.num_gpu_blocks,
            enable_caching=self.enable_caching,
            hash_block_size=self.hash_block_size,
            enable_events=self.enable_kv_cache_events,
            profile=self.profile,
            medium=self.medium,
            num_hash_lookahead_tokens=self.num_hash_lookahead_tokens,
        )
        blocks = tuple(
            BlockState(
                ref_cnt=b.ref_cnt,
                block_hash=b._primary_key(),
                hash_num_tokens=b.block_hash_num_tokens,
                partial_keys=() if b._extra_keys is None else tuple(b._extra_keys),
            )
            for b in self.blocks
        )
        cached: dict[HashKey, tuple[int, ...]] = {}
        for key, entry in self._cached_items():
            if type(entry) is dict:
                cached[key] = tuple(entry)
            else:
                assert isinstance(entry, KVCacheBlock)
                cached[key] = (entry.block_id,)
        return PoolState(
            config=config,
            blocks=blocks,
            free_queue=tuple(b.block_id for b in self.free_block_queue),
            cached=cached,
            pending_events=tuple(self.kv_event_queue),
            watchers=dict(self._reuse_watchers),
        )

    def check_invariants(self) -> None:
        """Assert the representation invariants; AssertionError with a state dump if broken.

        These are the impl's own structural invariants (pointers, counters, the
        two directions of the hash map); the model's semantic invariants live in
        ``kvpool.specs.pool.invariants``. The message names the broken one.

        Complexity: O(N + number of cached keys).

        >>> BlockPool(3, True, 1).check_invariants()
        """
        try:
            self._check()
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self._dump()}") from None

    def _check(self) -> None:
        """One assertion per representation invariant (sortedcontainers' ``_check``)."""
        # list[Any]: a corrupted entry must fail the assertion below, not mypyc's type cast.
        blocks: list[Any] = self.blocks
        n = self.num_gpu_blocks
        queue = self.free_block_queue
        head = queue.fake_free_list_head
        tail = queue.fake_free_list_tail

        # Every block sits at the index of its own id, and there are num_gpu_blocks of them.
        assert len(blocks) == n, f"{len(blocks)} blocks for num_gpu_blocks={n}"
        for i, block in enumerate(blocks):
            assert type(block) is KVCacheBlock, f"blocks[{i}] is a {type(block).__name__}"
            assert block.block_id == i, f"blocks[{i}] has block_id {block.block_id}"
            # Every block names this pool as its owner (that is how calls recognise them).
            assert block.pool is self, f"blocks[{i}] belongs to {block.pool!r}"

        # The null block is block 0, flagged is_null, and the only block so flagged.
        assert self.null_block is blocks[0], "null_block is not blocks[0]"
        for block in blocks:
            assert block.is_null == (block is self.null_block), f"block {block.block_id}: is_null"

        # The sentinels have id -1, are no block of the pool, and end the list on both sides.
        for name, sentinel in (("head", head), ("tail", tail)):
            assert sentinel.block_id == -1, f"fake {name} has block_id {sentinel.block_id}"
            assert sentinel.ref_cnt == 0, f"fake {name} has ref_cnt {sentinel.ref_cnt}"
            assert sentinel.pool is None, f"fake {name} claims to belong to a pool"
            assert sentinel._hash is None, f"fake {name} carries a hash"
        assert head is not tail, "fake head and fake tail are one block"
        assert head.prev_free_block is None, "something precedes the fake head"
        assert tail.next_free_block is None, "something follows the fake tail"

        # Walking next from the head reaches the tail in at most N-1 steps: no cycle, no gap.
        order: list[KVCacheBlock] = []
        node = head.next_free_block
        while node is not tail:
            after = _id(order[-1] if order else head)
            assert node is not None, f"the list breaks off after {after}"
            assert len(order) < n - 1, "the free list is longer than the pool (a cycle)"
            order.append(node)
            node = node.next_free_block
        # Links are symmetric: each node's prev is the node whose next it is, up to the tail.
        prev = head
        for node in [*order, tail]:
            assert node.prev_free_block is prev, (
                f"block {node.block_id}: prev_free_block is not block {prev.block_id}"
            )
            prev = node
        # Every listed block is a non-null block of this pool (none is listed twice: the
        # walk above would have run into a cycle).
        listed: set[int] = set()
        for node in order:
            assert 0 <= node.block_id < n and blocks[node.block_id] is node, (
                f"listed block {node.block_id} does not belong to the pool"
            )
            assert node is not self.null_block, "the null block is in the free list"
            listed.add(node.block_id)

        # num_free_blocks is the length of the list.
        assert queue.num_free_blocks == len(listed), (
            f"num_free_blocks={queue.num_free_blocks} but the list holds {len(listed)}"
        )

        for block in blocks:
            bid = block.block_id
            # No ref count is negative; the null block's is always 0.
            assert block.ref_cnt >= 0, f"block {bid} has ref_cnt {block.ref_cnt}"
            assert not block.is_null or block.ref_cnt == 0, "the null block is held"
            # A block is in the list exactly when it is a non-null block with ref_cnt 0.
            should_list = block.ref_cnt == 0 and not block.is_null
            assert (bid in listed) == should_list, (
                f"block {bid} (ref_cnt {block.ref_cnt}) is {'' if bid in listed else 'not '}listed"
            )
            # (A held block's own links may be stale: nothing reads them.)

        # Group 0's map is the one kept at hand.
        assert self._maps.get(0) is self._map0, "_map0 is not group 0's map"
        cached = dict(self._cached_items())
        # Without prefix caching nothing is ever cached.
        if not self.enable_caching:
            assert not cached, "a pool without prefix caching has cached keys"

        for block in blocks:
            bid = block.block_id
            key = block._primary_key()
            extra = block._extra_keys
            # A block has a primary key exactly when it has a token count for it.
            assert (key is None) == (block._block_hash_num_tokens == 0), (
                f"block {bid}: primary key and token count disagree"
            )
            # Without a primary key the group field is 0 (so caching a block need not set it).
            assert key is not None or block._group == 0, f"block {bid}: group without a key"
            # Extra keys exist only beside a primary key, never empty, none repeated.
            if extra is not None:
                assert key is not None, f"block {bid} has extra keys but no primary key"
                assert extra, f"block {bid} has an empty extra-key list"
            keys = ([] if key is None else [key]) + (extra or [])
            assert len(set(keys)) == len(keys), f"block {bid} records a key twice: {keys}"
            # The null block is never cached.
            assert not (block.is_null and keys), "the null block carries a hash"
            # Every key a block records maps to an entry that holds that block.
            for k in keys:
                entry = cached.get(k)
                holds = entry is block or (isinstance(entry, dict) and entry.get(bid) is block)
                assert holds, f"block {bid} records key {k!r} but the map does not point back"

        # Together with the loop above, the map and the blocks' own keys are one relation.
        for k, entry in cached.items():
            # A map entry is a pool block, or a dict of two or more pool blocks keyed by id,
            # and each of those blocks records the key (the map points only at true owners).
            members = list(entry.items()) if isinstance(entry, dict) else [(entry.block_id, entry)]
            if isinstance(entry, dict):
                assert len(entry) >= 2, f"key {k!r} maps to a dict of {len(entry)} block(s)"
            for bid, block in members:
                assert 0 <= bid < n and blocks[bid] is block and block.block_id == bid, (
                    f"key {k!r} maps to block {bid}, which is not this pool's block {bid}"
                )
                assert block._primary_key() == k or (
                    block._extra_keys and k in block._extra_keys
                ), f"key {k!r} maps to block {bid}, which does not record it"

        # Watchers are registered for non-null blocks of the pool, and are callable.
        for bid, watcher in self._reuse_watchers.items():
            assert type(bid) is int and 0 < bid < n, f"a watcher for block {bid!r}"
            assert callable(watcher), f"the watcher of block {bid} is not callable"

        # Without events enabled, no event is ever queued.
        if not self.enable_kv_cache_events:
            assert not self.kv_event_queue, "events queued on a pool without events"

    def _dump(self) -> str:
        """A readable dump of the whole pool: config, every block, the list, the map, events."""
        queue = self.free_block_queue
        lines = [
            f"BlockPool(num_gpu_blocks={self.num_gpu_blocks}, "
            f"enable_caching={self.enable_caching}, "
            f"hash_block_size={self.hash_block_size}, "
            f"enable_kv_cache_events={self.enable_kv_cache_events}, profile={self.profile.name})",
            f"  num_free_blocks={queue.num_free_blocks}",
            f"  fake head: next={_id(queue.fake_free_list_head.next_free_block)}, "
            f"prev={_id(queue.fake_free_list_head.prev_free_block)}",
            f"  fake tail: prev={_id(queue.fake_free_list_tail.prev_free_block)}, "
            f"next={_id(queue.fake_free_list_tail.next_free_block)}",
        ]
        order: list[str] = []
        node = queue.fake_free_list_head.next_free_block
        for _ in range(self.num_gpu_blocks + 1):
            if node is None or node is queue.fake_free_list_tail:
                break
            order.append(str(node.block_id))
            node = node.next_free_block
        else:
            order.append("...")
        lines.append(f"  free list (front first, bounded walk): [{', '.join(order)}]")
        lines.append("  blocks:")
        everything: list[Any] = self.blocks  # a corrupted entry is shown, not type-checked
        lines.extend(f"    {block!r}" for block in everything)
        lines.append("  hash map:")
        for key, entry in self._cached_items():
            ids = list(entry) if isinstance(entry, dict) else entry.block_id
            lines.append(f"    {key!r} -> {ids}")
        lines.append(f"  pending events: {len(self.kv_event_queue)}")
        return "\n".join(lines)

    # ------------------------------------------------------------------
    # Helpers (not operations)
    # ------------------------------------------------------------------

    def _report_allocated(self, blocks: list[KVCacheBlock]) -> None:
        collector = self.metrics_collector
        assert collector is not None
        for block in blocks:
            if self.enable_caching:
                collector.on_block_evicted(block)
            collector.on_block_allocated(block)

    def _report_accessed(self, blocks: Sequence[KVCacheBlock]) -> None:
        collector = self.metrics_collector
        assert collector is not None
        for block in blocks:
            if not block.is_null:
                collector.on_block_accessed(block)

    def _verify_cacheable(self, block: KVCacheBlock, num_tokens: int) -> None:
        """Raise unless ``block`` may get a key covering ``num_tokens`` tokens."""
        # Verify that each block to cache is held by someone
        if block.ref_cnt == 0:
            raise BlockNotHeld(f"block {block.block_id} is free: only held blocks can be cached")
        # Verify that a hashed block is only ever promoted to a longer prefix
        covered = block._block_hash_num_tokens
        if covered >= num_tokens:
            raise AlreadyCached(f"block {block.block_id} already caches {covered} tokens")

    def _verify_all_cacheable(
        self,
        blocks: list[KVCacheBlock],
        start: int,
        stop: int,
        block_size: int,
        block_mask: Sequence[bool] | None,
    ) -> None:
        """The model's checks on the blocks to cache: distinct first, then each one."""
        self._epoch += 1
        epoch = self._epoch
        first_bad: tuple[KVCacheBlock, int] | None = None
        for i in range(start, stop):
            block = blocks[i]
            if block.is_null or (block_mask is not None and not block_mask[i - start]):
                continue
            # Verify that no physical block stands at two positions
            if block._mark == epoch:
                raise DuplicateBlock(f"block {block.block_id} stands at two positions")
            block._mark = epoch
            if first_bad is None and (
                block.ref_cnt == 0 or (block._block_hash_num_tokens >= (i + 1) * block_size)
            ):
                first_bad = (block, (i + 1) * block_size)
        if first_bad is not None:
            self._verify_cacheable(*first_bad)

    def _map(self, group_id: int) -> dict[bytes, CacheEntry]:
        """The hash map of KV cache group ``group_id`` (made on first use)."""
        if group_id == 0:
            return self._map0
        cached = self._maps.get(group_id)
        if cached is None:
            cached = self._maps[group_id] = {}
        return cached

    def _lookup(self, key: HashKey) -> CacheEntry | None:
        """What the map holds under ``key``, or None."""
        cached = self._maps.get(key[1])
        return None if cached is None else cached.get(key[0])

    def _cached_items(self) -> list[tuple[HashKey, CacheEntry]]:
        """Every (key, entry) of the map, group by group, each group's in insertion order."""
        return [
            ((block_hash, group_id), entry)
            for group_id, cached in self._maps.items()
            for block_hash, entry in cached.items()
        ]

    def _num_cached(self) -> int:
        """How many keys the map holds."""
        return sum(len(cached) for cached in self._maps.values())

    def _insert(self, key: HashKey, block: KVCacheBlock) -> None:
        """Put ``block`` under ``key``, after any block the key already holds."""
        cached = self._map(key[1])
        entry = cached.setdefault(key[0], block)
        if entry is not block:
            self._add_beside(cached, key[0], entry, block)

    def _add_beside(
        self, cached: dict[bytes, CacheEntry], block_hash: bytes, entry: Any, block: KVCacheBlock
    ) -> None:
        """Put ``block`` after ``entry``, what ``cached`` already held under ``block_hash``."""
        if type(entry) is dict:
            entry[block.block_id] = block
        else:
            cached[block_hash] = {entry.block_id: entry, block.block_id: block}

    def _drop_keys(self, block: KVCacheBlock) -> None:
        """Remove every key pointing at ``block`` (primary first), a BlockRemoved each.

        Under the last-copy event semantics only keys no other block carries
        are announced.
        """
        block_hash: Any = block._hash
        group_id = block._group
        cached = self._map(group_id)
        entry = cached.pop(block_hash)
        if entry is not block:
            self._put_back(cached, block_hash, entry, block)
        if self.enable_kv_cache_events and (self._removal_per_copy or entry is block):
            self._emit(
                BlockRemoved(block_hashes=(block_hash,), medium=self.medium, group_idx=group_id)
            )
        if block._extra_keys is not None:
            for key in block._extra_keys:
                self._unmap(key, block)
        block._hash = None
        block._group = 0
        block._block_hash_num_tokens = 0
        block._extra_keys = None

    def _unmap(self, key: HashKey, block: KVCacheBlock) -> None:
        """Take ``block`` out from under ``key`` in the map and report it."""
        cached = self._map(key[1])
        entry = cached.pop(key[0])
        if entry is not block:
            self._put_back(cached, key[0], entry, block)
        if self.enable_kv_cache_events and (self._removal_per_copy or entry is block):
            self._emit(BlockRemoved(block_hashes=(key[0],), medium=self.medium, group_idx=key[1]))

    def _put_back(
        self, cached: dict[bytes, CacheEntry], block_hash: bytes, entry: Any, block: KVCacheBlock
    ) -> None:
        """Restore a shared entry popped from ``cached`` without ``block``."""
        del entry[block.block_id]
        # One block left: store it bare again, as a first insertion would.
        cached[block_hash] = next(iter(entry.values())) if len(entry) == 1 else entry


def _entry(values: Sequence[object], index: int) -> object:
    """``values[index]`` read untyped (the compiled build would type-check a block)."""
    return values[index]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _verify_ints(**values: object) -> None:
    """Raise InvalidArgument naming the first value that is not an int (bool is not)."""
    for name, value in values.items():
        if not _is_int(value):
            raise InvalidArgument(f"{name} must be an int, got {type(value).__name__}")


def _verify_hash(block_hash: object) -> None:
    if not isinstance(block_hash, bytes):
        raise InvalidArgument(f"a block hash is bytes, not {type(block_hash).__name__}")


def _as_list(values: Any) -> list[Any]:
    """A list argument read once into a list; InvalidArgument if it is no collection."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise InvalidArgument(f"expected a list, got {type(values).__name__}")
    return list(values)


def _request_lists(request: Any) -> tuple[Sequence[bytes], Sequence[int]]:
    """The request's block hashes and token ids; InvalidArgument unless both are sequences."""
    hashes = getattr(request, "block_hashes", None)
    _verify_sequence("block_hashes", hashes)
    return hashes, _token_ids(request)  # type: ignore[return-value]


def _token_ids(request: Any) -> Sequence[int]:
    tokens = getattr(request, "all_token_ids", None)
    if type(tokens) is not list and type(tokens) is not tuple:
        _verify_sequence("all_token_ids", tokens)
    return tokens  # type: ignore[return-value]


def _verify_sequence(name: str, value: object) -> None:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise InvalidArgument(f"the request's {name} must be a sequence")


def _lora_of(request: Any) -> tuple[int | None, str | None]:
    """(lora id, lora name) of a request: vLLM's ``lora_request`` or the model's fields."""
    try:
        lora = request.lora_request
    except AttributeError:
        return getattr(request, "lora_id", None), getattr(request, "lora_name", None)
    if lora is None:
        return None, None
    return lora.adapter_id, lora.name


def _id(block: KVCacheBlock | None) -> str:
    return "None" if block is None else str(block.block_id)
