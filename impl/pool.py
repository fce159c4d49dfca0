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
* ``_cached`` maps a hash key ``(hash, group id)`` to the one block under it,
  or, when several blocks share it, to a ``{block_id: block}`` dict in
  insertion order (the first entry is the one a lookup returns). A dict entry
  always has at least two blocks: one left alone collapses back to the block.
* each block records its own keys: the primary one in ``_block_hash`` and the
  further (partial) ones in ``_extra_keys``, oldest first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import length_hint
from typing import Any, Protocol

from mypy_extensions import mypyc_attr

from kvpool.impl.block import KVCacheBlock
from kvpool.impl.free_queue import FreeKVCacheBlockQueue
from kvpool.model.errors import (
    AlreadyCached,
    BlockNotHeld,
    CachingDisabled,
    DuplicateBlock,
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

CacheEntry = KVCacheBlock | dict[int, KVCacheBlock]
"""What the hash map holds under one key: a block, or several in insertion order."""


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

    ``num_hash_lookahead_tokens`` is accepted for compatibility and recorded;
    the model's events carry no look-ahead tokens, so it changes nothing.

    >>> pool = BlockPool(4, enable_caching=True, hash_block_size=1)
    >>> [b.block_id for b in pool.get_new_blocks(2)], pool.get_num_free_blocks()
    ([1, 2], 1)
    """

    __slots__ = (
        "_cached",
        "_epoch",
        "_free_by_hash",
        "_hashless_first",
        "_removal_per_copy",
        "blocks",
        "enable_caching",
        "enable_kv_cache_events",
        "free_block_queue",
        "hash_block_size",
        "kv_event_queue",
        "medium",
        "metrics_collector",
        "null_block",
        "num_gpu_blocks",
        "num_hash_lookahead_tokens",
        "profile",
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
    ) -> None:
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
        self.blocks: list[KVCacheBlock] = [
            KVCacheBlock(i, pool=self) for i in range(num_gpu_blocks)
        ]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self._cached: dict[HashKey, CacheEntry] = {}
        self.kv_event_queue: list[KVCacheEvent] = []
        self._hashless_first = profile.free_order_for(enable_caching) is FreeOrder.HASHLESS_FIRST
        # Freed blocks need sorting by hash only when the rule looks at hashes
        # and hashes can exist; otherwise they all go to one end.
        self._free_by_hash = self._hashless_first and enable_caching
        # Under the last-copy event semantics a key other blocks still carry
        # is removed without a BlockRemoved.
        self._removal_per_copy = profile.event_semantics is EventSemantics.MULTISET
        self._epoch = 0

    # ------------------------------------------------------------------
    # Allocation and reference counting
    # ------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out the ``num_blocks`` front blocks of the free queue, each held once.

        Every hash a handed-out block carried is dropped (one BlockRemoved per key).

        Complexity: O(num_blocks + number of keys the blocks carried).

        >>> pool = BlockPool(4, True, 1)
        >>> [b.ref_cnt for b in pool.get_new_blocks(2)]
        [1, 1]
        """
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks or num_blocks < 0:
            # Verify that the count is not negative
            if num_blocks < 0:
                raise InvalidBlockCount(f"cannot get {num_blocks} blocks")
            # Verify that the free queue holds enough blocks
            raise NotEnoughFreeBlocks(
                f"cannot get {num_blocks} blocks: only {queue.num_free_blocks} are free"
            )

        # The blocks keep their (now stale) links: a held block's links are never
        # read, since ref_cnt == 0 is what says a block is in the queue.
        head = queue.fake_free_list_head
        node: Any = head.next_free_block
        out: list[KVCacheBlock]
        if num_blocks == 1:
            out = [node]
            node.ref_cnt = 1
            if node._block_hash is not None:
                self._drop_keys(node)
            node = node.next_free_block
        elif self.enable_caching:
            out = []
            for _ in range(num_blocks):
                out.append(node)
                node.ref_cnt = 1
                if node._block_hash is not None:
                    self._drop_keys(node)
                node = node.next_free_block
        else:
            out = []
            for _ in range(num_blocks):
                out.append(node)
                node.ref_cnt = 1
                node = node.next_free_block
        head.next_free_block = node
        node.prev_free_block = head
        queue.num_free_blocks -= num_blocks

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
        if type(blocks) is not list:
            blocks = list(blocks)
        unlinked = 0
        items = iter(blocks)
        for block in items:
            # Verify that every block belongs to this pool (a stranger undoes the pass)
            if block.pool is not self:
                self._undo_touch(blocks, len(blocks) - length_hint(items) - 1)
                raise UnknownBlock(f"block {block!r} does not belong to this pool")
            ref_cnt = block.ref_cnt
            if ref_cnt == 0:
                if block.is_null:
                    continue
                # Unlink, leaving the block's own links as they are (see _undo_touch).
                prev: Any = block.prev_free_block
                nxt: Any = block.next_free_block
                prev.next_free_block = nxt
                nxt.prev_free_block = prev
                unlinked += 1
            block.ref_cnt = ref_cnt + 1
        self.free_block_queue.num_free_blocks -= unlinked

        if self.metrics_collector is not None:
            self._report_accessed(blocks)

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
        seq = ordered_blocks if type(ordered_blocks) is list else list(ordered_blocks)
        queue = self.free_block_queue
        head = queue.fake_free_list_head
        tail = queue.fake_free_list_tail
        # The freed blocks grow two chains, spliced into the queue at the end
        # (see _FREE_SPLICE above): `front` ends the chain hanging off the fake
        # head, `back` the chain hanging off the fake tail's spare next link.
        old_first: Any = head.next_free_block
        front: Any = head
        back: Any = tail
        kept = 0  # entries that free nothing: the null block, blocks still held after
        items = iter(seq)
        # Validation and linking share one pass: the first block that is free
        # already or not ours stops it, and the undo below puts everything back.
        complete = False
        if self._free_by_hash:
            for block in items:
                ref_cnt = block.ref_cnt - 1
                if ref_cnt == 0 and block.pool is self:
                    block.ref_cnt = 0
                    if block._block_hash is None:
                        front.next_free_block = block
                        block.prev_free_block = front
                        front = block
                    else:
                        back.next_free_block = block
                        block.prev_free_block = back
                        back = block
                elif ref_cnt > 0 and block.pool is self:
                    block.ref_cnt = ref_cnt  # still held by someone else
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
                ref_cnt = block.ref_cnt - 1
                if ref_cnt == 0 and block.pool is self:
                    block.ref_cnt = 0
                    end.next_free_block = block
                    block.prev_free_block = end
                    end = block
                elif ref_cnt > 0 and block.pool is self:
                    block.ref_cnt = ref_cnt  # still held by someone else
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
                end = tail.prev_free_block
            if back is not tail:
                first: Any = tail.next_free_block
                end.next_free_block = first
                first.prev_free_block = end
                end = back
                tail.next_free_block = None
            end.next_free_block = tail
            tail.prev_free_block = end
            return

        # A rejected call: put everything back, then raise the model's error.
        head.next_free_block = old_first
        tail.next_free_block = None
        self._undo_free(seq, len(seq) - length_hint(items) - 1)
        self._raise_free_error(seq)

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
                prev: Any = block.prev_free_block
                nxt: Any = block.next_free_block
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

    def _raise_free_error(self, seq: Sequence[KVCacheBlock]) -> None:
        """Raise what the model raises for a free_blocks call known to be invalid."""
        # Verify that every block belongs to this pool
        self._verify_known(seq)
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
        raise AssertionError("free_blocks stopped on a call the model accepts")

    # ------------------------------------------------------------------
    # Prefix caching
    # ------------------------------------------------------------------

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
        for i in range(num_cached_blocks, num_full_blocks):
            if blocks[i].pool is not self:
                raise UnknownBlock(f"block {blocks[i]!r} does not belong to this pool")
        block_hashes = request.block_hashes
        factor = block_size // hbs
        # Verify that the request has a hash for every block up to num_full_blocks
        if len(block_hashes) // factor < num_full_blocks:
            raise NotEnoughHashes(
                f"request has {len(block_hashes) // factor} hashes of size {block_size}, "
                f"{num_full_blocks} are needed"
            )
        cached = self._cached
        events_on = self.enable_kv_cache_events
        stored: list[bytes] = []
        if events_on:
            # Read what the event needs before anything changes: a request that
            # cannot give it must leave the pool as it was (not cached, event lost).
            token_ids = tuple(
                request.all_token_ids[num_cached_blocks * block_size : num_full_blocks * block_size]
            )
            lora_id, lora_name = _lora_of(request)
        if num_new == 1:
            # One block (a decode step filled it): nothing can stand twice, no loops.
            block = blocks[num_cached_blocks]
            if not block.is_null and (block_mask is None or block_mask[0]):
                num_tokens = num_full_blocks * block_size
                # Verify that the block to cache is held by someone
                if block.ref_cnt == 0:
                    raise BlockNotHeld(f"block {block.block_id} is free: it cannot be cached")
                covered = block._block_hash_num_tokens
                if covered is not None:
                    # Verify that a hashed block is only ever promoted to a longer prefix
                    if covered >= num_tokens:
                        raise AlreadyCached(f"block {block.block_id} caches {covered} tokens")
                    self._drop_keys(block)
                block_hash = block_hashes[num_full_blocks * factor - 1]
                key = (block_hash, kv_cache_group_id)
                block._block_hash = key
                block._block_hash_num_tokens = num_tokens
                entry = cached.setdefault(key, block)
                if entry is not block:
                    self._add_beside(key, entry, block)
                if events_on:
                    stored.append(block_hash)
        else:
            self._verify_all_cacheable(
                blocks, num_cached_blocks, num_full_blocks, block_size, block_mask
            )
            last = factor - 1
            for i in range(num_cached_blocks, num_full_blocks):
                block = blocks[i]
                if block.is_null or (
                    block_mask is not None and not block_mask[i - num_cached_blocks]
                ):
                    continue
                # Hashes are chained: a block's last hash block names the whole prefix.
                block_hash = block_hashes[i * factor + last]
                if block._block_hash is not None:
                    self._drop_keys(block)
                key = (block_hash, kv_cache_group_id)
                block._block_hash = key
                block._block_hash_num_tokens = (i + 1) * block_size
                entry = cached.setdefault(key, block)
                if entry is not block:
                    self._add_beside(key, entry, block)
                if events_on:
                    stored.append(block_hash)

        if events_on:
            parent = block_hashes[num_cached_blocks * factor - 1] if num_cached_blocks else None
            self.kv_event_queue.append(
                BlockStored(
                    block_hashes=tuple(stored),
                    parent_block_hash=parent,
                    token_ids=token_ids,
                    block_size=block_size,
                    lora_id=lora_id,
                    medium=self.medium,
                    lora_name=lora_name,
                    extra_keys=(None,) * len(stored) if stored else None,
                    group_idx=kv_cache_group_id,
                )
            )

    def cache_partial_block(
        self,
        request: Any,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
    ) -> HashKey | None:
        """Make ``block`` reachable from the prefix of ``num_tokens`` tokens ending inside it.

        The key is the request's hash at ``num_tokens``. It becomes the
        block's primary key if it has none, replaces a primary key covering
        fewer tokens (promotion), and is otherwise added beside it. Returns
        the key, or None for the null block.

        Complexity: O(number of keys the block carries).

        >>> from kvpool.model import CacheRequest
        >>> pool = BlockPool(2, True, hash_block_size=2)
        >>> (b,) = pool.get_new_blocks(1)
        >>> pool.cache_partial_block(CacheRequest((b"p",)), b, 2, 0, 4)
        (b'p', 0)
        """
        hbs = self.hash_block_size
        # Verify that prefix caching is enabled
        if not self.enable_caching:
            raise CachingDisabled("cache_partial_block on a pool without prefix caching")
        # Verify that the group id is not negative
        if kv_cache_group_id < 0:
            raise InvalidGroup(f"KV cache group id {kv_cache_group_id} is negative")
        # Verify that the block belongs to this pool
        if block.pool is not self:
            raise UnknownBlock(f"block {block!r} does not belong to this pool")
        if block.is_null:
            return None
        # Verify that the block is held by someone
        if block.ref_cnt == 0:
            raise BlockNotHeld(f"block {block.block_id} is free: only held blocks can be cached")
        # Verify that a block holds more than one hash block, in whole hash blocks
        if block_size <= hbs or block_size % hbs != 0:
            raise InvalidBlockSize(
                f"block_size={block_size} must be a multiple of hash_block_size={hbs} "
                f"and larger than it"
            )
        # Verify that the prefix ends on a hash-block boundary inside a block
        if num_tokens <= 0 or num_tokens % hbs != 0 or num_tokens % block_size == 0:
            raise InvalidPartialBlock(
                f"num_tokens={num_tokens} must be a positive multiple of {hbs} "
                f"that is not a multiple of the block size {block_size}"
            )
        num_hash_blocks = num_tokens // hbs
        block_hashes = request.block_hashes
        # Verify that the request has hashed that far
        if num_hash_blocks > len(block_hashes):
            raise NotEnoughHashes(
                f"request has {len(block_hashes)} hashes, {num_hash_blocks} are needed"
            )

        block_hash = block_hashes[num_hash_blocks - 1]
        key = (block_hash, kv_cache_group_id)
        primary = block._block_hash
        if primary is not None:
            extra = block._extra_keys
            if primary == key or (extra is not None and key in extra):
                return key
            num_primary = block._block_hash_num_tokens
            if num_primary is not None and num_primary < num_tokens:
                self._drop_keys(block)
                primary = None
        if primary is None:
            block._block_hash = key
            block._block_hash_num_tokens = num_tokens
        elif block._extra_keys is None:
            block._extra_keys = [key]
        else:
            block._extra_keys.append(key)
        entry = self._cached.setdefault(key, block)
        if entry is not block:
            self._add_beside(key, entry, block)

        if self.enable_kv_cache_events:
            lora_id, lora_name = _lora_of(request)
            self.kv_event_queue.append(
                BlockStored(
                    block_hashes=(block_hash,),
                    parent_block_hash=(
                        block_hashes[num_hash_blocks - 2] if num_hash_blocks > 1 else None
                    ),
                    token_ids=tuple(request.all_token_ids[num_tokens - hbs : num_tokens]),
                    block_size=hbs,
                    lora_id=lora_id,
                    medium=self.medium,
                    lora_name=lora_name,
                    extra_keys=(None,),
                    group_idx=kv_cache_group_id,
                )
            )
        return key

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """The cached block under ``block_hash`` in each group, or None if any group misses.

        Where several blocks share a key, the one inserted first is returned.

        Complexity: O(len(kv_cache_group_ids)).

        >>> BlockPool(2, True, 1).get_cached_block(b"h", [0]) is None
        True
        """
        entry: Any
        if len(kv_cache_group_ids) == 1:
            # The common case of one KV cache group, without the loops.
            group_id = kv_cache_group_ids[0]
            # Verify that no group id is negative
            if group_id < 0:
                raise InvalidGroup(f"KV cache group id {group_id} is negative")
            entry = self._cached.get((block_hash, group_id))
            if entry is None:
                return None
            if type(entry) is dict:
                return [next(iter(entry.values()))]
            return [entry]
        # Verify that no group id is negative
        for group_id in kv_cache_group_ids:
            if group_id < 0:
                raise InvalidGroup(f"KV cache group id {group_id} is negative")
        cached = self._cached
        found: list[KVCacheBlock] = []
        for group_id in kv_cache_group_ids:
            entry = cached.get((block_hash, group_id))
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
        ids = (
            block_ids if type(block_ids) is set or type(block_ids) is frozenset else set(block_ids)
        )
        if not ids:
            return
        # Verify that every id names a block of the pool
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
            if block._block_hash is not None:
                self._drop_keys(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash if no block is held; report whether it happened.

        Complexity: O(number of cached keys).

        >>> BlockPool(3, True, 1).reset_prefix_cache()
        True
        """
        if self.free_block_queue.num_free_blocks != self.num_gpu_blocks - 1:
            return False
        for entry in self._cached.values():
            if type(entry) is dict:
                for block in entry.values():
                    block.reset_hash()
            else:
                assert isinstance(entry, KVCacheBlock)
                entry.reset_hash()
        self._cached = {}
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
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
        )
        blocks = tuple(
            BlockState(
                ref_cnt=b.ref_cnt,
                block_hash=b._block_hash,
                hash_num_tokens=b._block_hash_num_tokens,
                partial_keys=() if b._extra_keys is None else tuple(b._extra_keys),
            )
            for b in self.blocks
        )
        cached: dict[HashKey, tuple[int, ...]] = {}
        for key, entry in self._cached.items():
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
            assert sentinel._block_hash is None, f"fake {name} carries a hash"
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

        cached = self._cached
        # Without prefix caching nothing is ever cached.
        if not self.enable_caching:
            assert not cached, "a pool without prefix caching has cached keys"

        for block in blocks:
            bid = block.block_id
            key = block._block_hash
            extra = block._extra_keys
            # A block has a primary key exactly when it has a token count for it.
            assert (key is None) == (block._block_hash_num_tokens is None), (
                f"block {bid}: primary key and token count disagree"
            )
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
                assert block._block_hash == k or (block._extra_keys and k in block._extra_keys), (
                    f"key {k!r} maps to block {bid}, which does not record it"
                )

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
        for key, entry in self._cached.items():
            ids = list(entry) if isinstance(entry, dict) else entry.block_id
            lines.append(f"    {key!r} -> {ids}")
        lines.append(f"  pending events: {len(self.kv_event_queue)}")
        return "\n".join(lines)

    # ------------------------------------------------------------------
    # Helpers (not operations)
    # ------------------------------------------------------------------

    def _verify_known(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Raise UnknownBlock unless every block is one of this pool's own."""
        for block in blocks:
            if block.pool is not self:
                raise UnknownBlock(f"block {block!r} does not belong to this pool")

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
        if covered is not None and covered >= num_tokens:
            raise AlreadyCached(f"block {block.block_id} already caches {covered} tokens")

    def _verify_all_cacheable(
        self,
        blocks: Sequence[KVCacheBlock],
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
                block.ref_cnt == 0
                or (
                    block._block_hash_num_tokens is not None
                    and block._block_hash_num_tokens >= (i + 1) * block_size
                )
            ):
                first_bad = (block, (i + 1) * block_size)
        if first_bad is not None:
            self._verify_cacheable(*first_bad)

    def _add_beside(self, key: HashKey, entry: Any, block: KVCacheBlock) -> None:
        """Put ``block`` under ``key`` after ``entry``, what the key already held."""
        if type(entry) is dict:
            entry[block.block_id] = block
        else:
            self._cached[key] = {entry.block_id: entry, block.block_id: block}

    def _drop_keys(self, block: KVCacheBlock) -> None:
        """Remove every key pointing at ``block`` (primary first), a BlockRemoved each.

        Under the last-copy event semantics only keys no other block carries
        are announced.
        """
        key: Any = block._block_hash
        entry = self._cached.pop(key)
        if entry is not block:
            self._put_back(key, entry, block)
        if self.enable_kv_cache_events and (self._removal_per_copy or entry is block):
            self.kv_event_queue.append(
                BlockRemoved(block_hashes=(key[0],), medium=self.medium, group_idx=key[1])
            )
        if block._extra_keys is not None:
            for key in block._extra_keys:
                self._unmap(key, block)
        block._block_hash = None
        block._block_hash_num_tokens = None
        block._extra_keys = None

    def _unmap(self, key: HashKey, block: KVCacheBlock) -> None:
        """Take ``block`` out from under ``key`` in the map and report it."""
        entry = self._cached.pop(key)
        if entry is not block:
            self._put_back(key, entry, block)
        if self.enable_kv_cache_events and (self._removal_per_copy or entry is block):
            self.kv_event_queue.append(
                BlockRemoved(block_hashes=(key[0],), medium=self.medium, group_idx=key[1])
            )

    def _put_back(self, key: HashKey, entry: Any, block: KVCacheBlock) -> None:
        """Restore a popped shared entry without ``block``."""
        del entry[block.block_id]
        # One block left: store it bare again, as a first insertion would.
        self._cached[key] = next(iter(entry.values())) if len(entry) == 1 else entry


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
