"""The v0 allocator: vLLM's ``PrefixCachingBlockAllocator``, one pure function per operation.

vLLM's first engine handed out KV-cache blocks through this allocator (seed
``003_502dc001e11fdc24.txt``; the class lived in
``vllm/core/block/prefix_caching_block.py`` from 0.6.6.post1 to 0.10.2).
Unlike the v1 pool it works on *block objects*: a sequence is a chain of
blocks, each linked to the one before it, that fill with tokens. This model
names a block object by a **handle**, an integer given out in creation
order (0, 1, 2, ...), and a physical block by its **block id**.

The rules, in one place:

* A block is **mutable** while it has empty slots and **immutable** once
  full. When a block fills, it is *promoted*: its **content hash** (here:
  every token of the sequence up to the end of the block, which is what a
  chained hash identifies) enters the cache. If the cache already maps that
  hash to another physical block, the full block is **de-duplicated**: its
  own physical block is released and the handle moves to the cached one.
* Free memory lives in two places. The **hash-less free list** holds blocks
  with no cached content; it is a stack (a freed block is pushed on the
  front and handed out next). The **evictor** holds cached blocks nobody
  holds; they stay reusable by a cache hit until they are evicted.
* Allocation takes the front of the hash-less list; only when it is empty
  does it evict: the evictor's block **least recently accessed** goes first,
  ties broken by the **most hashed tokens** (the deepest block of a prefix
  goes before its ancestors), then by the lowest block id.
* **Fork** gives a second sequence every block of the first (ref counts go
  up); appending to a block that others share **copies on write**: the
  appender moves to a fresh block and the move is recorded for the engine
  to copy the data.
* Time is an explicit argument (``now``); a held block's last access is
  reset whenever it is taken from free memory.

Every operation has the shape ``op(state, ...) -> (new_state, result)``
(queries return just their answer). Preconditions are checked under ``#
Verify`` comments before anything changes; a rejected call raises one of
``kvpool.model.v0_errors`` and the caller keeps the old state.

Swapping (``swap_in``, ``swap_out``, ``get_num_full_blocks_touched``) is not
modelled: it moves blocks between two allocators (GPU and CPU), which is the
business of vLLM's ``CpuGpuBlockAllocator``, not of one pool. Hit-rate
metrics are not modelled either: they observe, and decide nothing.
"""

from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvpool.model.errors import InvalidConfig, UnknownBlock
from kvpool.model.v0_errors import (
    BlockNotTracked,
    BlockOverflow,
    FreedPrefix,
    ImmutableBlock,
    NoFreeBlocks,
    NotPromotable,
    UnfilledPrefix,
    UnknownHandle,
    WrongTokenCount,
)

ContentHash = tuple[int, ...]
"""What a full block holds, as a chained hash identifies it: every token of its
sequence from the first up to the block's last. Equal hashes, equal prefixes."""

NEVER_ACCESSED: float = -1
"""The last-access time of a block nobody has marked as accessed since it was taken."""


# --------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class V0Config:
    """The allocator's parameters; they never change."""

    num_blocks: int
    block_size: int


@dataclass(frozen=True)
class PhysicalBlock:
    """What the allocator tracks about one physical block while it is held.

    A block with ref count 0 always has the defaults: its last access, if
    it is cached, moved into its evictor entry.
    """

    ref_cnt: int = 0
    last_accessed: float = NEVER_ACCESSED
    computed: bool = False
    """Whether a cache lookup may count the block as already computed."""


@dataclass(frozen=True)
class EvictorEntry:
    """A cached block nobody holds: what the evictor ranks it by."""

    content_hash: ContentHash
    num_hashed_tokens: int
    last_accessed: float


@dataclass(frozen=True)
class BlockHandle:
    """One block object of a sequence: where it is stored and what it holds."""

    block_id: int
    prev: int | None = None
    """The handle of the block before it in its sequence (None for a first block)."""
    token_ids: tuple[int, ...] = ()
    content_hash: ContentHash | None = None
    """Set when the block is full (and so promoted); None while it is mutable."""


@dataclass(frozen=True)
class V0State:
    """A whole v0 allocator: its physical blocks, its free memory and its live block objects."""

    config: V0Config
    blocks: tuple[PhysicalBlock, ...]
    hashless_free: tuple[int, ...]
    """Free blocks with no cached content; the front is handed out first."""
    cached: Mapping[ContentHash, int] = field(default_factory=dict)
    """Content hash to the one physical block holding it, held or evictable."""
    evictor: Mapping[int, EvictorEntry] = field(default_factory=dict)
    """Cached blocks with ref count 0, by block id."""
    handles: Mapping[int, BlockHandle] = field(default_factory=dict)
    """The live block objects, by handle."""
    next_handle: int = 0
    touched: frozenset[int] = frozenset()
    """Blocks promoted since the last mark_blocks_as_computed."""
    copy_on_writes: tuple[tuple[int, int], ...] = ()
    """(source, destination) block ids of the copies not yet taken by clear_copy_on_writes."""


# --------------------------------------------------------------------------
# Construction
# --------------------------------------------------------------------------


def new_allocator(num_blocks: int, block_size: int) -> V0State:
    """A fresh allocator: every block is hash-less and free, in id order.

    There is no null block in v0: block 0 is an ordinary block.

    Complexity: O(num_blocks).

    >>> new_allocator(3, 4).hashless_free
    (0, 1, 2)
    """
    # Verify that the number of blocks is not negative
    if num_blocks < 0:
        raise InvalidConfig(f"num_blocks must not be negative, got {num_blocks}")
    # Verify that a block holds at least one token
    if block_size < 1:
        raise InvalidConfig(f"block_size must be at least 1, got {block_size}")
    return V0State(
        config=V0Config(num_blocks, block_size),
        blocks=tuple(PhysicalBlock() for _ in range(num_blocks)),
        hashless_free=tuple(range(num_blocks)),
    )


# --------------------------------------------------------------------------
# Allocation
# --------------------------------------------------------------------------


def allocate_mutable_block(state: V0State, prev: int | None = None) -> tuple[V0State, int]:
    """A new empty block after ``prev``: the front hash-less block, or else an evicted one.

    Evicting a cached block drops its content hash from the cache. The
    block's previous block need not be full yet (vLLM allocates lookahead
    slots that way), but tokens can only be appended once it is.

    Complexity: O(1) from the hash-less list, O(evictor size) when evicting.

    >>> state, handle = allocate_mutable_block(new_allocator(2, 4))
    >>> handle, state.handles[handle].block_id, state.hashless_free
    (0, 0, (1,))
    """
    # Verify that the previous block, if any, is a live block object
    if prev is not None:
        _verify_live(state, prev)
    # Verify that a block can be taken from free memory
    _verify_free_block(state)

    state, block_id = _take_free_block(state)
    return _add_handle(state, BlockHandle(block_id=block_id, prev=prev))


def allocate_immutable_block(
    state: V0State, prev: int | None, token_ids: Sequence[int]
) -> tuple[V0State, int]:
    """A full block after ``prev`` holding ``token_ids``: a cache hit if its content is cached.

    On a hit the new handle shares the cached block (taking it back from the
    evictor if nobody held it; it then counts as computed). On a miss a
    block is allocated as by allocate_mutable_block, filled and promoted.

    Complexity: O(block_size) on a hit, plus the allocation on a miss.

    >>> state, a = allocate_immutable_block(new_allocator(2, 2), None, [7, 8])
    >>> state, b = allocate_immutable_block(state, None, [7, 8])
    >>> state.handles[b].block_id, state.blocks[0].ref_cnt
    (0, 2)
    """
    # Verify that the previous block, if any, is live and full
    content_hash = _hash_after(state, prev, token_ids)
    # Verify that exactly one block of tokens is given
    if len(token_ids) != state.config.block_size:
        raise WrongTokenCount(
            f"an immutable block holds {state.config.block_size} tokens, got {len(token_ids)}"
        )

    tokens = tuple(token_ids)
    cached_id = state.cached.get(content_hash)
    if cached_id is not None:
        state = _acquire_cached(state, cached_id)
        handle = BlockHandle(cached_id, prev, tokens, content_hash)
        return _add_handle(state, handle)
    # Verify that a block can be taken from free memory
    _verify_free_block(state)
    state, block_id = _take_free_block(state)
    state = _register(state, content_hash, block_id)
    return _add_handle(state, BlockHandle(block_id, prev, tokens, content_hash))


def allocate_immutable_blocks(
    state: V0State, prev: int | None, block_token_ids: Sequence[Sequence[int]]
) -> tuple[V0State, tuple[int, ...]]:
    """allocate_immutable_block for each list of tokens, each block after the one before.

    All or nothing: if one block cannot be allocated, none is (vLLM keeps
    the blocks allocated before the failure, and loses their objects).

    Complexity: O(len(block_token_ids)) allocations.

    >>> state, handles = allocate_immutable_blocks(new_allocator(3, 1), None, [[1], [2]])
    >>> handles, state.handles[1].content_hash
    ((0, 1), (1, 2))
    """
    handles: list[int] = []
    for token_ids in block_token_ids:
        # Verify (each allocation verifies its own block; a rejection rejects the whole call)
        state, prev = allocate_immutable_block(state, prev, token_ids)
        handles.append(prev)
    return state, tuple(handles)


def append_token_ids(state: V0State, handle: int, token_ids: Sequence[int]) -> tuple[V0State, int]:
    """Write tokens into a mutable block; return the block id the handle ends up on.

    If other handles share the block, the appender first moves to a fresh
    block (copy-on-write, recorded for clear_copy_on_writes). If the block
    becomes full it is promoted, which may move the handle again onto a
    cached block with the same content (de-duplication). Appending nothing
    changes nothing.

    Complexity: O(len(token_ids)), plus one allocation for a copy-on-write.

    >>> state, a = allocate_mutable_block(new_allocator(3, 2))
    >>> state, b = allocate_mutable_block(state)
    >>> state, _ = append_token_ids(state, a, [5, 6])
    >>> state, block_id = append_token_ids(state, b, [5, 6])   # same content as a
    >>> block_id, state.hashless_free
    (0, (1, 2))
    """
    # Verify that the handle names a live block object
    _verify_live(state, handle)
    block = state.handles[handle]
    # Verify that the block is still mutable
    if block.content_hash is not None:
        raise ImmutableBlock(f"block object {handle} is full: it cannot take more tokens")
    # Verify that the tokens fit into the block's empty slots
    empty = state.config.block_size - len(block.token_ids)
    if len(token_ids) > empty:
        raise BlockOverflow(
            f"block object {handle} has {empty} empty slot(s), {len(token_ids)} tokens given"
        )
    if not token_ids:
        return state, block.block_id
    # Verify that the blocks before it are live and full (tokens are written in order)
    _verify_prefix_full(state, block.prev)
    shared = state.blocks[block.block_id].ref_cnt > 1
    # Verify that a shared block can be copied to a free block
    if shared:
        _verify_free_block(state)

    state = _set_handle(state, handle, token_ids=block.token_ids + tuple(token_ids))
    if shared:
        state = _copy_on_write(state, handle)
    if len(state.handles[handle].token_ids) == state.config.block_size:
        state = _promote(state, handle)
    return state, state.handles[handle].block_id


def promote_to_immutable_block(state: V0State, handle: int) -> tuple[V0State, int]:
    """Enter a full, never promoted block into the cache; return its (possibly new) block id.

    This is the step append_token_ids takes when a block fills: if the
    content is already cached under another block, the handle's own block
    is released (pushed on the hash-less list) and the handle moves to the
    cached block; otherwise the block is cached and *touched* (it becomes
    computed at the next mark_blocks_as_computed). Every other operation
    promotes full blocks itself, so calling this directly is only valid on a
    block object built full some other way; on anything else it rejects.

    Complexity: O(block_size).

    >>> promote_to_immutable_block(allocate_mutable_block(new_allocator(1, 1))[0], 0)
    Traceback (most recent call last):
    ...
    kvpool.model.v0_errors.NotPromotable: block object 0 holds 0 of 1 tokens: it is not full
    """
    # Verify that the handle names a live block object
    _verify_live(state, handle)
    block = state.handles[handle]
    # Verify that the block is full and was never promoted
    if block.content_hash is not None:
        raise NotPromotable(f"block object {handle} is already immutable")
    if len(block.token_ids) != state.config.block_size:
        raise NotPromotable(
            f"block object {handle} holds {len(block.token_ids)} of "
            f"{state.config.block_size} tokens: it is not full"
        )
    # Verify that the blocks before it are live and full
    _verify_prefix_full(state, block.prev)

    state = _promote(state, handle)
    return state, state.handles[handle].block_id


# --------------------------------------------------------------------------
# Sharing: fork and copy-on-write
# --------------------------------------------------------------------------


def fork(state: V0State, last_block: int) -> tuple[V0State, tuple[int, ...]]:
    """A new sequence sharing every physical block of the sequence ending at ``last_block``.

    One new handle per block, first to last, each linked to the one before;
    every physical block gains a reference. Nothing is copied until someone
    appends to a shared block.

    Complexity: O(length of the sequence).

    >>> state, a = allocate_mutable_block(new_allocator(2, 2))
    >>> state, (b,) = fork(state, a)
    >>> state.handles[b].block_id, state.blocks[0].ref_cnt
    (0, 2)
    """
    # Verify that the handle names a live block object
    _verify_live(state, last_block)
    # Verify that every block before it is live too
    chain = _chain(state, last_block)

    new_handles: list[int] = []
    prev: int | None = None
    for handle in chain:
        source = state.handles[handle]
        state = _add_ref(state, source.block_id)
        copy = BlockHandle(source.block_id, prev, source.token_ids, source.content_hash)
        state, prev = _add_handle(state, copy)
        new_handles.append(prev)
    return state, tuple(new_handles)


def cow_block_if_not_appendable(state: V0State, handle: int) -> tuple[V0State, int]:
    """The block id the handle may append to: its own block if nobody shares it, else a copy.

    A shared mutable block is copied: the handle drops its reference, moves
    to a freshly allocated block, and the pair (source, destination) is
    recorded for clear_copy_on_writes.

    Complexity: O(1), plus one allocation when copying.

    >>> state, a = allocate_mutable_block(new_allocator(2, 2))
    >>> state, _ = fork(state, a)
    >>> state, block_id = cow_block_if_not_appendable(state, a)
    >>> block_id, state.copy_on_writes
    (1, ((0, 1),))
    """
    # Verify that the handle names a live block object
    _verify_live(state, handle)
    block = state.handles[handle]
    # Verify that the block is mutable (a full block is never written)
    if block.content_hash is not None:
        raise ImmutableBlock(f"block object {handle} is full: it is never written again")
    if state.blocks[block.block_id].ref_cnt <= 1:
        return state, block.block_id
    # Verify that a shared block can be copied to a free block
    _verify_free_block(state)

    state = _copy_on_write(state, handle)
    return state, state.handles[handle].block_id


def clear_copy_on_writes(state: V0State) -> tuple[V0State, tuple[tuple[int, int], ...]]:
    """Every (source, destination) copy recorded since the last call, oldest first; then none.

    Complexity: O(number of copies).

    >>> clear_copy_on_writes(new_allocator(1, 1))[1]
    ()
    """
    return replace(state, copy_on_writes=()), state.copy_on_writes


# --------------------------------------------------------------------------
# Freeing
# --------------------------------------------------------------------------


def free(state: V0State, handle: int) -> tuple[V0State, None]:
    """Release a block object: its physical block loses one reference.

    A full (cached) block nobody holds any more joins the evictor with its
    last-access time and its number of hashed tokens; a mutable one goes to
    the *front* of the hash-less free list. The handle is dead afterwards.

    Complexity: O(1).

    >>> state, a = allocate_immutable_block(new_allocator(2, 1), None, [9])
    >>> state, _ = free(state, a)
    >>> sorted(state.evictor), state.hashless_free
    ([0], (1,))
    """
    # Verify that the handle names a live block object
    _verify_live(state, handle)

    block = state.handles[handle]
    if block.content_hash is None:
        state = _release_hashless(state, block.block_id)
    else:
        state = _release_cached(state, block.block_id, block.content_hash)
    handles = dict(state.handles)
    del handles[handle]
    return replace(state, handles=handles), None


def reset_prefix_cache(state: V0State) -> tuple[V0State, bool]:
    """Forget every cached block, if no block is held; report whether it happened.

    The evictor is emptied in eviction order, each block pushed on the
    front of the hash-less list (so the last one evicted ends up first).
    Copy-on-write records and touched blocks are kept.

    Complexity: O(num_blocks log num_blocks).

    >>> state, a = allocate_immutable_block(new_allocator(2, 1), None, [9])
    >>> reset_prefix_cache(state)[1]
    False
    """
    if any(block.ref_cnt > 0 for block in state.blocks):
        return state, False
    order = eviction_order(state)
    state = replace(
        state,
        hashless_free=tuple(reversed(order)) + state.hashless_free,
        cached={},
        evictor={},
        blocks=tuple(PhysicalBlock() for _ in state.blocks),
    )
    return state, True


# --------------------------------------------------------------------------
# Access times and computed blocks
# --------------------------------------------------------------------------


def mark_blocks_as_accessed(
    state: V0State, block_ids: Iterable[int], now: float
) -> tuple[V0State, None]:
    """Set the last-access time of held or evictable blocks to ``now``.

    An evictable block is re-ranked by its new time.

    Complexity: O(len(block_ids)).

    >>> state, a = allocate_mutable_block(new_allocator(1, 1))
    >>> state, _ = mark_blocks_as_accessed(state, [0], 5.0)
    >>> state.blocks[0].last_accessed
    5.0
    """
    ids = list(block_ids)
    # Verify that every id names a block of the allocator
    _verify_known(state, ids)
    # Verify that every block is held or evictable
    for block_id in ids:
        if state.blocks[block_id].ref_cnt == 0 and block_id not in state.evictor:
            raise BlockNotTracked(f"block {block_id} is neither held nor evictable")

    evictor = dict(state.evictor)
    for block_id in ids:
        if state.blocks[block_id].ref_cnt > 0:
            state = _set_block(state, block_id, last_accessed=now)
        else:
            evictor[block_id] = replace(evictor[block_id], last_accessed=now)
    return replace(state, evictor=evictor), None


def mark_blocks_as_computed(state: V0State, block_ids: Iterable[int] = ()) -> tuple[V0State, None]:
    """Every block promoted since the last call becomes computed; ``block_ids`` is ignored.

    A touched block is recorded by id: if it was freed and taken again
    since, the id's new content is what becomes computed (vLLM's rule).

    Complexity: O(number of touched blocks).

    >>> state, a = allocate_immutable_block(new_allocator(1, 1), None, [3])
    >>> state.blocks[0].computed, mark_blocks_as_computed(state)[0].blocks[0].computed
    (False, True)
    """
    for block_id in sorted(state.touched):
        if state.blocks[block_id].ref_cnt > 0:
            state = _set_block(state, block_id, computed=True)
    return replace(state, touched=frozenset()), None


# --------------------------------------------------------------------------
# Queries
# --------------------------------------------------------------------------


def get_num_free_blocks(state: V0State) -> int:
    """Hash-less free blocks plus evictable cached blocks.

    Complexity: O(1).

    >>> get_num_free_blocks(new_allocator(3, 1))
    3
    """
    return len(state.hashless_free) + len(state.evictor)


def get_num_total_blocks(state: V0State) -> int:
    """The number of physical blocks.

    >>> get_num_total_blocks(new_allocator(3, 1))
    3
    """
    return state.config.num_blocks


def eviction_order(state: V0State) -> tuple[int, ...]:
    """The evictor's blocks in the order allocation would evict them.

    Least recently accessed first; among equal times, the block with the
    most hashed tokens first; then the lowest id.

    Complexity: O(e log e) for e evictable blocks.

    >>> state, (a, b) = allocate_immutable_blocks(new_allocator(2, 1), None, [[1], [2]])
    >>> state, _ = free(state, a)
    >>> state, _ = free(state, b)
    >>> eviction_order(state)     # same time: the longer prefix goes first
    (1, 0)
    """
    return tuple(sorted(state.evictor, key=lambda b: _eviction_key(state.evictor[b], b)))


def block_is_computed(state: V0State, block_id: int) -> bool:
    """Whether a cache lookup may use the block: computed while held, always while evictable.

    >>> block_is_computed(new_allocator(1, 1), 0)
    False
    """
    # Verify that the id names a block of the allocator
    _verify_known(state, [block_id])
    if state.blocks[block_id].ref_cnt > 0:
        return state.blocks[block_id].computed
    return block_id in state.evictor


def find_cached_blocks_prefix(
    state: V0State, block_hashes: Sequence[ContentHash]
) -> tuple[ContentHash, ...]:
    """The leading hashes that are cached and computed, found by binary search.

    The search relies on the *binary-search property*: if a block is cached,
    every block before it in its sequence is too. When the property holds
    the answer is the longest cached prefix. When it does not (eviction is
    by access time, and access times are the caller's), the answer is what
    a binary search (``bisect_left`` over "not cached") finds, which can be
    shorter than the cached prefix or even include uncached blocks; see
    ``kvpool.specs.v0_invariants.cached_prefix_closed``.

    Complexity: O(log len(block_hashes)) lookups.

    >>> state, _ = allocate_immutable_blocks(new_allocator(3, 1), None, [[1], [2]])
    >>> state, _ = mark_blocks_as_computed(state)
    >>> find_cached_blocks_prefix(state, [(1,), (1, 2), (1, 2, 3)])
    ((1,), (1, 2))
    """

    def not_cached(content_hash: ContentHash) -> bool:
        block_id = state.cached.get(content_hash)
        return block_id is None or not block_is_computed(state, block_id)

    end = bisect_left(block_hashes, True, key=not_cached)
    return tuple(block_hashes[:end])


def get_common_computed_block_ids(seq_block_ids: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The block ids every sequence of a group can skip: their common leading ids.

    The lists are each sequence's computed block ids. One list is returned
    as it is; otherwise empty lists are left out (a sequence with nothing
    computed does not shorten the answer) and the longest common prefix of
    the rest is returned. The allocator's state plays no part.

    Complexity: O(total length of the lists).

    >>> get_common_computed_block_ids([[4, 5, 6], [4, 5], []])
    (4, 5)
    """
    if len(seq_block_ids) == 1:
        return tuple(seq_block_ids[0])
    lists = [tuple(ids) for ids in seq_block_ids if ids]
    if not lists:
        return ()
    shortest = min(lists, key=len)
    for end, block_id in enumerate(shortest):
        if any(ids[end] != block_id for ids in lists):
            return shortest[:end]
    return shortest


def chain(state: V0State, handle: int) -> tuple[int, ...]:
    """The handles of the sequence ending at ``handle``, first block first.

    >>> state, a = allocate_mutable_block(new_allocator(2, 1))
    >>> state, b = allocate_mutable_block(state, a)
    >>> chain(state, b)
    (0, 1)
    """
    # Verify that the handle names a live block object
    _verify_live(state, handle)
    # Verify that every block before it is live too
    return _chain(state, handle)


def content_hashes(token_ids: Sequence[int], block_size: int) -> tuple[ContentHash, ...]:
    """The content hash of every full block of a sequence holding ``token_ids``.

    >>> content_hashes([1, 2, 3, 4, 5], 2)
    ((1, 2), (1, 2, 3, 4))
    """
    tokens = tuple(token_ids)
    return tuple(tokens[:end] for end in range(block_size, len(tokens) + 1, block_size))


# --------------------------------------------------------------------------
# Helpers (not operations)
# --------------------------------------------------------------------------


def _eviction_key(entry: EvictorEntry, block_id: int) -> tuple[float, int, int]:
    return (entry.last_accessed, -entry.num_hashed_tokens, block_id)


def _verify_known(state: V0State, block_ids: Iterable[int]) -> None:
    for block_id in block_ids:
        if not 0 <= block_id < state.config.num_blocks:
            raise UnknownBlock(f"block id {block_id} is not in 0..{state.config.num_blocks - 1}")


def _verify_live(state: V0State, handle: int) -> None:
    if handle not in state.handles:
        raise UnknownHandle(f"handle {handle} names no live block object")


def _verify_free_block(state: V0State) -> None:
    if not state.hashless_free and not state.evictor:
        raise NoFreeBlocks("no hash-less free block and no evictable cached block")


def _verify_prefix_full(state: V0State, prev: int | None) -> None:
    """The block before (if any) is live and full, and so are all before it."""
    if prev is None:
        return
    if prev not in state.handles:
        raise FreedPrefix(f"the previous block object {prev} was freed")
    if state.handles[prev].content_hash is None:
        raise UnfilledPrefix(f"the previous block object {prev} is not full")


def _hash_after(state: V0State, prev: int | None, token_ids: Sequence[int]) -> ContentHash:
    if prev is not None:
        _verify_live(state, prev)
    _verify_prefix_full(state, prev)
    before = () if prev is None else state.handles[prev].content_hash
    assert before is not None
    return before + tuple(token_ids)


def _chain(state: V0State, handle: int) -> tuple[int, ...]:
    handles = [handle]
    prev = state.handles[handle].prev
    while prev is not None:
        if prev not in state.handles:
            raise FreedPrefix(f"block object {prev}, earlier in the sequence, was freed")
        handles.append(prev)
        prev = state.handles[prev].prev
    return tuple(reversed(handles))


def _set_block(state: V0State, block_id: int, **changes: Any) -> V0State:
    block = replace(state.blocks[block_id], **changes)
    blocks = (*state.blocks[:block_id], block, *state.blocks[block_id + 1 :])
    return replace(state, blocks=blocks)


def _set_handle(state: V0State, handle: int, **changes: Any) -> V0State:
    handles = dict(state.handles)
    handles[handle] = replace(handles[handle], **changes)
    return replace(state, handles=handles)


def _add_handle(state: V0State, block: BlockHandle) -> tuple[V0State, int]:
    handle = state.next_handle
    handles = dict(state.handles)
    handles[handle] = block
    return replace(state, handles=handles, next_handle=handle + 1), handle


def _add_ref(state: V0State, block_id: int) -> V0State:
    return _set_block(state, block_id, ref_cnt=state.blocks[block_id].ref_cnt + 1)


def _take_free_block(state: V0State) -> tuple[V0State, int]:
    """Hash-less first, else evict; the block is held once, uncomputed, never accessed."""
    if state.hashless_free:
        block_id = state.hashless_free[0]
        state = replace(state, hashless_free=state.hashless_free[1:])
    else:
        block_id = eviction_order(state)[0]
        evictor = dict(state.evictor)
        entry = evictor.pop(block_id)
        cached = dict(state.cached)
        del cached[entry.content_hash]
        state = replace(state, evictor=evictor, cached=cached)
    state = _set_block(state, block_id, ref_cnt=1, last_accessed=NEVER_ACCESSED, computed=False)
    return state, block_id


def _release_hashless(state: V0State, block_id: int) -> V0State:
    ref_cnt = state.blocks[block_id].ref_cnt - 1
    if ref_cnt > 0:
        return _set_block(state, block_id, ref_cnt=ref_cnt)
    state = _set_block(state, block_id, ref_cnt=0, last_accessed=NEVER_ACCESSED, computed=False)
    return replace(state, hashless_free=(block_id, *state.hashless_free))


def _release_cached(state: V0State, block_id: int, content_hash: ContentHash) -> V0State:
    block = state.blocks[block_id]
    if block.ref_cnt > 1:
        return _set_block(state, block_id, ref_cnt=block.ref_cnt - 1)
    evictor = dict(state.evictor)
    evictor[block_id] = EvictorEntry(content_hash, len(content_hash), block.last_accessed)
    state = replace(state, evictor=evictor)
    return _set_block(state, block_id, ref_cnt=0, last_accessed=NEVER_ACCESSED, computed=False)


def _acquire_cached(state: V0State, block_id: int) -> V0State:
    """One more reference on a cached block; taken back from the evictor if nobody held it."""
    ref_cnt = state.blocks[block_id].ref_cnt
    if ref_cnt > 0:
        return _set_block(state, block_id, ref_cnt=ref_cnt + 1)
    evictor = dict(state.evictor)
    del evictor[block_id]
    state = replace(state, evictor=evictor)
    return _set_block(state, block_id, ref_cnt=1, last_accessed=NEVER_ACCESSED, computed=True)


def _register(state: V0State, content_hash: ContentHash, block_id: int) -> V0State:
    cached = dict(state.cached)
    cached[content_hash] = block_id
    return replace(state, cached=cached, touched=state.touched | {block_id})


def _copy_on_write(state: V0State, handle: int) -> V0State:
    source = state.handles[handle].block_id
    state = _release_hashless(state, source)
    state, destination = _take_free_block(state)
    state = _set_handle(state, handle, block_id=destination)
    return replace(state, copy_on_writes=(*state.copy_on_writes, (source, destination)))


def _promote(state: V0State, handle: int) -> V0State:
    """A full handle enters the cache, or moves onto the block that already holds its content."""
    block = state.handles[handle]
    content_hash = _hash_after(state, block.prev, block.token_ids)
    state = _set_handle(state, handle, content_hash=content_hash)
    cached_id = state.cached.get(content_hash)
    if cached_id is None:
        return _register(state, content_hash, block.block_id)
    state = _release_hashless(state, block.block_id)
    state = _set_handle(state, handle, block_id=cached_id)
    return _acquire_cached(state, cached_id)
