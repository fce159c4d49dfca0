"""The v1 block pool, one pure function per operation.

Every operation has the shape ``op(state, ...) -> (new_state, result)``;
queries that cannot change the pool return just their answer. Each
precondition is checked under a ``# Verify ...`` comment before anything is
computed, so a rejected call raises and the caller still holds the old state:
nothing here ever mutates.

The semantics are those of vLLM's ``vllm.v1.core.block_pool.BlockPool``
(seed ``000_9af5218a67917ebc.txt``); docs/semantics.md lists the places where
the seeds were silent and what decided them.
"""

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

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
from kvpool.model.state import (
    NULL_BLOCK_ID,
    BlockHash,
    BlockState,
    CacheRequest,
    HashKey,
    PoolConfig,
    PoolState,
    Reuse,
)

T = TypeVar("T")

# --------------------------------------------------------------------------
# Construction
# --------------------------------------------------------------------------


def new_pool(
    num_blocks: int,
    enable_caching: bool = True,
    hash_block_size: int = 1,
    enable_events: bool = False,
    profile: Profile = DEFAULT_PROFILE,
    medium: str = MEDIUM_GPU,
    num_hash_lookahead_tokens: int = 0,
) -> PoolState:
    """A fresh pool: block 0 is the null block, blocks 1..N-1 are free in id order.

    Complexity: O(N).

    >>> pool = new_pool(4)
    >>> pool.free_queue
    (1, 2, 3)
    """
    # Verify that the sizes are integers and the medium a string
    _verify_ints(num_blocks=num_blocks, hash_block_size=hash_block_size)
    _verify_ints(num_hash_lookahead_tokens=num_hash_lookahead_tokens)
    if not isinstance(medium, str):
        raise InvalidArgument(f"medium must be a string, got {type(medium).__name__}")
    # Verify that the pool has room for the null block
    if num_blocks < 1:
        raise InvalidConfig(f"num_blocks must be at least 1, got {num_blocks}")
    # Verify that hashes cover a positive number of tokens
    if hash_block_size < 1:
        raise InvalidConfig(f"hash_block_size must be at least 1, got {hash_block_size}")
    # Verify that the look-ahead is not negative
    if num_hash_lookahead_tokens < 0:
        raise InvalidConfig(f"num_hash_lookahead_tokens={num_hash_lookahead_tokens} is negative")

    config = PoolConfig(
        num_blocks,
        enable_caching,
        hash_block_size,
        enable_events,
        profile,
        medium,
        num_hash_lookahead_tokens,
    )
    return PoolState(
        config=config,
        blocks=tuple(BlockState() for _ in range(num_blocks)),
        free_queue=tuple(range(1, num_blocks)),
    )


# --------------------------------------------------------------------------
# Allocation and reference counting
# --------------------------------------------------------------------------


def get_new_blocks(state: PoolState, num_blocks: int) -> tuple[PoolState, tuple[int, ...]]:
    """Hand out the ``num_blocks`` blocks at the front of the free queue.

    Each one loses every hash it carried (it is evicted from the prefix
    cache) and is held once. Cache hits are not consulted here. A block
    unpinned with a watcher fires it first (``Reuse`` in ``pending_reuses``,
    carrying the key the block still has), in hand-out order.

    Complexity: O(num_blocks).

    >>> pool, ids = get_new_blocks(new_pool(4), 2)
    >>> ids, pool.free_queue
    ((1, 2), (3,))
    """
    # Verify that the count is an integer
    _verify_ints(num_blocks=num_blocks)
    # Verify that the count is not negative
    if num_blocks < 0:
        raise InvalidBlockCount(f"cannot get {num_blocks} blocks")
    # Verify that the free queue holds enough blocks
    if num_blocks > len(state.free_queue):
        raise NotEnoughFreeBlocks(
            f"cannot get {num_blocks} blocks: only {len(state.free_queue)} are free"
        )

    taken = state.free_queue[:num_blocks]
    state = replace(state, free_queue=state.free_queue[num_blocks:])
    state = _fire(state, [b for b in taken if b in state.watchers])
    for block_id in taken:
        state = _drop_keys(state, block_id)
        state = _set_block(state, block_id, ref_cnt=1)
    return state, taken


def touch(state: PoolState, block_ids: Sequence[int]) -> tuple[PoolState, None]:
    """Take one more reference on each block: a cache hit by another request.

    A free block leaves the free queue (it stops being an eviction
    candidate) and keeps its hashes. The null block is skipped.

    Complexity: O(len(block_ids)).

    >>> pool, _ = touch(new_pool(4), [2])
    >>> pool.free_queue, pool.blocks[2].ref_cnt
    ((1, 3), 1)
    """
    # Verify that the ids are a sequence
    block_ids = _id_list(block_ids)
    # Verify that every id names a block of the pool
    _verify_known(state, block_ids)

    for block_id in block_ids:
        if block_id == NULL_BLOCK_ID:
            continue
        block = state.blocks[block_id]
        if block.ref_cnt == 0:
            state = replace(state, free_queue=_without(state.free_queue, block_id))
        state = _set_block(state, block_id, ref_cnt=block.ref_cnt + 1)
    return state, None


def free_blocks(state: PoolState, ordered_block_ids: Sequence[int]) -> tuple[PoolState, None]:
    """Drop one reference per listed block; blocks that reach zero become free.

    ``ordered_block_ids`` is in eviction priority: of the blocks freed
    together, the first listed is evicted first. Where they go in the queue
    is the profile's free-order rule:

    * ``HASHLESS_FIRST``: blocks with no hash go to the front (they can
      never be a cache hit), hashed blocks to the back;
    * ``APPEND``: every freed block goes to the back.

    A block listed k times releases k references. The null block is skipped.

    Complexity: O(len(ordered_block_ids)).

    >>> pool, _ = get_new_blocks(new_pool(4), 2)
    >>> pool, _ = free_blocks(pool, [2, 1])
    >>> pool.free_queue
    (2, 1, 3)
    """
    # Verify that the ids are a sequence
    ordered_block_ids = _id_list(ordered_block_ids)
    # Verify that every id names a block of the pool
    _verify_known(state, ordered_block_ids)
    # Verify that no block is released more times than it is held
    releases = Counter(b for b in ordered_block_ids if b != NULL_BLOCK_ID)
    for block_id, count in releases.items():
        held = state.blocks[block_id].ref_cnt
        if held == 0:
            raise BlockNotHeld(f"block {block_id} is free: it cannot be freed")
        if count > held:
            raise OverFree(f"block {block_id} is held {held} time(s) but freed {count} times")

    newly_free: list[int] = []
    for block_id in ordered_block_ids:
        if block_id == NULL_BLOCK_ID:
            continue
        ref_cnt = state.blocks[block_id].ref_cnt - 1
        state = _set_block(state, block_id, ref_cnt=ref_cnt)
        if ref_cnt == 0:
            newly_free.append(block_id)

    rule = state.config.profile.free_order_for(state.config.enable_caching)
    if rule is FreeOrder.HASHLESS_FIRST:
        hashless = tuple(b for b in newly_free if state.blocks[b].block_hash is None)
        hashed = tuple(b for b in newly_free if state.blocks[b].block_hash is not None)
        queue = hashless + state.free_queue + hashed
    else:
        queue = state.free_queue + tuple(newly_free)
    return replace(state, free_queue=queue), None


# --------------------------------------------------------------------------
# Prefix caching
# --------------------------------------------------------------------------


def hashes_at_block_size(
    hashes: Sequence[BlockHash], hash_block_size: int, block_size: int
) -> tuple[BlockHash, ...]:
    """The request's hashes for blocks of ``block_size`` tokens.

    Hashes are chained, so the hash of a block's last hash block already
    covers the whole prefix: a block of ``k * hash_block_size`` tokens is
    named by every k-th hash. A trailing incomplete group names no block.

    >>> hashes_at_block_size([b"a", b"b", b"c"], 1, 2)
    (b'b',)
    """
    factor = block_size // hash_block_size
    return tuple(hashes[factor - 1 :: factor])


def cache_full_blocks(
    state: PoolState,
    request: CacheRequest,
    block_ids: Sequence[int],
    num_cached_blocks: int,
    num_full_blocks: int,
    block_size: int,
    kv_cache_group_id: int,
    block_mask: Sequence[bool] | None = None,
) -> tuple[PoolState, None]:
    """Insert ``block_ids[num_cached_blocks:num_full_blocks]`` into the hash map.

    Block i of the request gets the key (hash of its first i+1 blocks,
    group). Null blocks and blocks masked out by ``block_mask`` are skipped.
    A block that already carries a *partial* entry covering fewer tokens is
    promoted: its old keys are removed first. Duplicates are not merged: a
    second block with an existing hash is inserted beside the first.

    Complexity: O(num_full_blocks - num_cached_blocks).

    >>> pool, ids = get_new_blocks(new_pool(4), 2)
    >>> req = CacheRequest(block_hashes=(b"h0", b"h1"))
    >>> pool, _ = cache_full_blocks(pool, req, ids, 0, 2, 1, 0)
    >>> dict(pool.cached)
    {(b'h0', 0): (1,), (b'h1', 0): (2,)}
    """
    config = state.config
    # Verify that the arguments have the operation's types
    block_ids = _id_list(block_ids)
    _verify_ints(
        num_cached_blocks=num_cached_blocks,
        num_full_blocks=num_full_blocks,
        block_size=block_size,
        kv_cache_group_id=kv_cache_group_id,
    )
    _verify_request(request)
    if block_mask is not None:
        block_mask = _id_list(block_mask)
    # Verify that prefix caching is enabled
    if not config.enable_caching:
        raise CachingDisabled("cache_full_blocks on a pool without prefix caching")
    # Verify that the group id is not negative
    _verify_group(kv_cache_group_id)
    # Verify that the block size is a positive multiple of the hash block size
    _verify_block_size(block_size, config.hash_block_size, at_least=config.hash_block_size)
    # Verify that the range to cache is a slice of the request's blocks
    if num_cached_blocks < 0 or num_full_blocks > len(block_ids):
        raise InvalidBlockRange(
            f"cannot cache blocks [{num_cached_blocks}:{num_full_blocks}] "
            f"of a request with {len(block_ids)} blocks"
        )
    num_new = max(0, num_full_blocks - num_cached_blocks)
    # Verify that the mask, if any, has one entry per block to cache
    if block_mask is not None and len(block_mask) != num_new:
        raise InvalidBlockMask(f"block_mask has {len(block_mask)} entries for {num_new} blocks")
    if num_new == 0:
        return state, None
    # Verify that every block to cache is a block of the pool (the others are not read)
    _verify_known(state, block_ids[num_cached_blocks:num_full_blocks])

    hashes = hashes_at_block_size(request.block_hashes, config.hash_block_size, block_size)
    # Verify that the request has a hash for every block up to num_full_blocks
    if len(hashes) < num_full_blocks:
        raise NotEnoughHashes(
            f"request has {len(hashes)} hashes of size {block_size}, {num_full_blocks} are needed"
        )
    positions = [
        i
        for i in range(num_cached_blocks, num_full_blocks)
        if block_ids[i] != NULL_BLOCK_ID
        and (block_mask is None or block_mask[i - num_cached_blocks])
    ]
    to_cache = [block_ids[i] for i in positions]
    # Verify that no physical block stands at two positions
    _verify_distinct(to_cache)
    for i in positions:
        block = state.blocks[block_ids[i]]
        # Verify that each block to cache is held by someone
        if block.ref_cnt == 0:
            raise BlockNotHeld(f"block {block_ids[i]} is free: only held blocks can be cached")
        # Verify that a hashed block is only ever promoted to a longer prefix
        num_hash_tokens = (i + 1) * block_size
        if block.hash_num_tokens is not None and block.hash_num_tokens >= num_hash_tokens:
            raise AlreadyCached(
                f"block {block_ids[i]} already caches {block.hash_num_tokens} tokens"
            )

    # Verify that every hash the blocks get is bytes
    _verify_hashes(hashes[i] for i in range(num_cached_blocks, num_full_blocks))

    for i in positions:
        block_id = block_ids[i]
        state = _drop_keys(state, block_id)
        state = _insert_key(state, (hashes[i], kv_cache_group_id), block_id, (i + 1) * block_size)

    parent = hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
    start, end = num_cached_blocks * block_size, num_full_blocks * block_size
    stored = BlockStored(
        block_hashes=tuple(hashes[i] for i in positions),
        parent_block_hash=parent,
        token_ids=tuple(request.all_token_ids[start:end]),
        block_size=block_size,
        lora_id=request.lora_id,
        medium=config.medium,
        lora_name=request.lora_name,
        extra_keys=tuple(None for _ in positions) if positions else None,
        group_idx=kv_cache_group_id,
        lookahead_token_ids=_lookahead(config, request, [(i + 1) * block_size for i in positions]),
    )
    return _emit(state, stored), None


def cache_partial_block(
    state: PoolState,
    request: CacheRequest,
    block_id: int,
    num_tokens: int,
    kv_cache_group_id: int,
    block_size: int,
    replace_existing_hashes: bool = False,
) -> tuple[PoolState, HashKey | None]:
    """Make ``block_id`` reachable from a prefix that ends inside it.

    The key is the request's hash at ``num_tokens`` (a multiple of the hash
    block size but not of ``block_size``). It becomes the block's primary key
    if it had none; it replaces a primary key covering fewer tokens
    (promotion); otherwise it is added beside the primary key. Returns the
    key, or None for the null block.

    With ``replace_existing_hashes`` every key of the block is removed first
    (one BlockRemoved each, even the same key) and the key becomes its only,
    primary key, with a BlockStored: a re-keying that may cover fewer tokens.

    Complexity: O(number of keys the block carries).

    >>> pool, (b,) = get_new_blocks(new_pool(2, hash_block_size=2), 1)
    >>> pool, key = cache_partial_block(pool, CacheRequest((b"p",)), b, 2, 0, 4)
    >>> key, pool.blocks[b].hash_num_tokens
    ((b'p', 0), 2)
    """
    config = state.config
    hbs = config.hash_block_size
    # Verify that the arguments have the operation's types
    _verify_ints(num_tokens=num_tokens, kv_cache_group_id=kv_cache_group_id)
    _verify_ints(block_size=block_size)
    _verify_request(request)
    _verify_bools(replace_existing_hashes=replace_existing_hashes)
    # Verify that prefix caching is enabled
    if not config.enable_caching:
        raise CachingDisabled("cache_partial_block on a pool without prefix caching")
    # Verify that the group id is not negative
    _verify_group(kv_cache_group_id)
    # Verify that the id names a block of the pool
    _verify_known(state, [block_id])
    if block_id == NULL_BLOCK_ID:
        return state, None
    # Verify that the block is held by someone
    if state.blocks[block_id].ref_cnt == 0:
        raise BlockNotHeld(f"block {block_id} is free: only held blocks can be cached")
    # Verify that a block holds more than one hash block, in whole hash blocks
    _verify_block_size(block_size, hbs, at_least=hbs + 1)
    # Verify that the prefix ends on a hash-block boundary inside a block
    if num_tokens <= 0 or num_tokens % hbs != 0 or num_tokens % block_size == 0:
        raise InvalidPartialBlock(
            f"num_tokens={num_tokens} must be a positive multiple of {hbs} "
            f"that is not a multiple of the block size {block_size}"
        )
    num_hash_blocks = num_tokens // hbs
    # Verify that the request has hashed that far
    if num_hash_blocks > len(request.block_hashes):
        raise NotEnoughHashes(
            f"request has {len(request.block_hashes)} hashes, {num_hash_blocks} are needed"
        )

    block_hash = request.block_hashes[num_hash_blocks - 1]
    # Verify that the hash the block gets is bytes
    _verify_hashes([block_hash])
    key = (block_hash, kv_cache_group_id)
    block = state.blocks[block_id]
    if replace_existing_hashes:
        state = _drop_keys(state, block_id)
    elif key in block.hash_keys():
        return state, key
    elif block.hash_num_tokens is not None and block.hash_num_tokens < num_tokens:
        state = _drop_keys(state, block_id)
    state = _insert_key(state, key, block_id, num_tokens)

    start = num_tokens - hbs
    stored = BlockStored(
        block_hashes=(block_hash,),
        parent_block_hash=(
            request.block_hashes[num_hash_blocks - 2] if num_hash_blocks > 1 else None
        ),
        token_ids=tuple(request.all_token_ids[start:num_tokens]),
        block_size=hbs,
        lora_id=request.lora_id,
        medium=config.medium,
        lora_name=request.lora_name,
        extra_keys=(None,),
        group_idx=kv_cache_group_id,
        lookahead_token_ids=_lookahead(config, request, [num_tokens]),
    )
    return _emit(state, stored), key


def get_cached_block(
    state: PoolState, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
) -> tuple[int, ...] | None:
    """The cached block for ``block_hash`` in each group, or None if any group misses.

    Where several blocks share a key, the one inserted first is returned.

    Complexity: O(len(kv_cache_group_ids)).

    >>> get_cached_block(new_pool(2), b"h", [0]) is None
    True
    """
    # Verify that the hash is bytes and the group ids a sequence of integers
    if not isinstance(block_hash, bytes):
        raise InvalidArgument(f"a block hash is bytes, not {type(block_hash).__name__}")
    kv_cache_group_ids = _id_list(kv_cache_group_ids)
    _verify_ints(**{f"kv_cache_group_ids[{i}]": g for i, g in enumerate(kv_cache_group_ids)})
    # Verify that no group id is negative
    for group_id in kv_cache_group_ids:
        _verify_group(group_id)

    found: list[int] = []
    for group_id in kv_cache_group_ids:
        block_ids = state.cached.get((block_hash, group_id), ())
        if not block_ids:
            return None
        found.append(block_ids[0])
    return tuple(found)


def evict_blocks(state: PoolState, block_ids: Iterable[int]) -> tuple[PoolState, None]:
    """Remove every hash of the given blocks from the prefix cache.

    The blocks themselves stay where they are: a held block stays held, a
    free block keeps its place in the free queue. Ids are processed in
    ascending order, each once.

    Complexity: O(number of keys the blocks carry).

    >>> pool, _ = evict_blocks(new_pool(3), {1, 2})
    >>> pool == new_pool(3)
    True
    """
    # Verify that the ids are a collection of block ids of the pool
    listed = _id_list(block_ids)
    _verify_known(state, listed)
    ids = sorted(set(listed))

    for block_id in ids:
        state = _drop_keys(state, block_id)
    return state, None


def reset_prefix_cache(state: PoolState) -> tuple[PoolState, bool]:
    """Forget every hash, if no block is held; report whether it happened.

    Refusal is an answer, not an error: with any block held the pool is
    left as it is and the result is False. The free queue keeps its order.
    A reset that happens fires every registered watcher, in registration
    order, with the key the block carried before the reset.

    Complexity: O(N).

    >>> reset_prefix_cache(new_pool(3))[1]
    True
    """
    if len(state.free_queue) != state.config.num_blocks - 1:
        return state, False

    state = _fire(state, list(state.watchers))
    state = replace(
        state,
        blocks=tuple(
            replace(b, block_hash=None, hash_num_tokens=None, partial_keys=()) for b in state.blocks
        ),
        cached={},
    )
    return _emit(state, AllBlocksCleared()), True


# --------------------------------------------------------------------------
# Queries and events
# --------------------------------------------------------------------------


def get_num_free_blocks(state: PoolState) -> int:
    """How many blocks the free queue holds (eviction candidates included).

    Complexity: O(1).

    >>> get_num_free_blocks(new_pool(4))
    3
    """
    return len(state.free_queue)


def get_usage(state: PoolState) -> float:
    """The fraction of usable (non-null) blocks that are held, from 0.0 to 1.0.

    Complexity: O(1).

    >>> get_usage(new_pool(5))
    0.0
    """
    usable = state.config.num_blocks - 1
    if usable == 0:
        return 0.0
    return 1.0 - len(state.free_queue) / usable


def take_events(state: PoolState) -> tuple[PoolState, tuple[KVCacheEvent, ...]]:
    """Every event emitted since the last call, oldest first; the queue is emptied.

    Complexity: O(number of events).

    >>> take_events(new_pool(2, enable_events=True))[1]
    ()
    """
    return replace(state, pending_events=()), state.pending_events


def take_reuses(state: PoolState) -> tuple[PoolState, tuple[Reuse, ...]]:
    """Every watcher that fired since the last call, oldest first; the list is emptied.

    In the model a watcher is a value and firing it is recorded; the impl
    and vLLM call it. The conformance adapters record their calls here.

    Complexity: O(number of reuses).

    >>> take_reuses(new_pool(2))[1]
    ()
    """
    return replace(state, pending_reuses=()), state.pending_reuses


def emit_cached_block_events(
    state: PoolState,
    request: CacheRequest,
    num_cached_blocks: int,
    block_size: int,
    kv_cache_group_id: int,
) -> tuple[PoolState, None]:
    """Announce the request's first ``num_cached_blocks`` blocks as stored, once more.

    For consumers that asked for a full report of every hit: one BlockStored
    naming the request's hashes at ``block_size`` for blocks 0..n-1, with no
    parent. The pool itself does not change, and nothing checks that those
    blocks are cached. With events off, or n = 0, nothing is emitted.

    Complexity: O(num_cached_blocks * block_size).

    >>> pool = new_pool(2, enable_events=True)
    >>> pool, _ = emit_cached_block_events(pool, CacheRequest((b"a",), (7,)), 1, 1, 0)
    >>> pool.pending_events[0].block_hashes
    (b'a',)
    """
    config = state.config
    # Verify that the arguments have the operation's types
    _verify_ints(
        num_cached_blocks=num_cached_blocks,
        block_size=block_size,
        kv_cache_group_id=kv_cache_group_id,
    )
    _verify_request(request)
    # Verify that the group id is not negative
    _verify_group(kv_cache_group_id)
    # Verify that the block size is a positive multiple of the hash block size
    _verify_block_size(block_size, config.hash_block_size, at_least=config.hash_block_size)
    # Verify that the count is not negative
    if num_cached_blocks < 0:
        raise InvalidBlockCount(f"cannot announce {num_cached_blocks} blocks")
    hashes = hashes_at_block_size(request.block_hashes, config.hash_block_size, block_size)
    # Verify that the request has a hash for every block announced
    if num_cached_blocks > len(hashes):
        raise NotEnoughHashes(
            f"request has {len(hashes)} hashes of size {block_size}, {num_cached_blocks} are needed"
        )
    # Verify that every hash announced is bytes
    _verify_hashes(hashes[:num_cached_blocks])
    if num_cached_blocks == 0:
        return state, None
    stored = BlockStored(
        block_hashes=tuple(hashes[:num_cached_blocks]),
        parent_block_hash=None,
        token_ids=tuple(request.all_token_ids[: num_cached_blocks * block_size]),
        block_size=block_size,
        lora_id=request.lora_id,
        medium=config.medium,
        lora_name=request.lora_name,
        extra_keys=(None,) * num_cached_blocks,
        group_idx=kv_cache_group_id,
        lookahead_token_ids=_lookahead(
            config, request, [(i + 1) * block_size for i in range(num_cached_blocks)]
        ),
    )
    return _emit(state, stored), None


# --------------------------------------------------------------------------
# Helpers (not operations)
# --------------------------------------------------------------------------


def _verify_known(state: PoolState, block_ids: Iterable[int]) -> None:
    for block_id in block_ids:
        if not _is_int(block_id):
            raise UnknownBlock(f"{block_id!r} is not a block id")
        if not 0 <= block_id < state.config.num_blocks:
            raise UnknownBlock(f"block id {block_id} is not in 0..{state.config.num_blocks - 1}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _verify_ints(**values: object) -> None:
    """Raise InvalidArgument naming the first value that is not an int (bool is not)."""
    for name, value in values.items():
        if not _is_int(value):
            raise InvalidArgument(f"{name} must be an int, got {type(value).__name__}")


def _verify_bools(**values: object) -> None:
    for name, value in values.items():
        if not isinstance(value, bool):
            raise InvalidArgument(f"{name} must be a bool, got {type(value).__name__}")


def _id_list(values: Iterable[T]) -> tuple[T, ...]:
    """The values of a list argument, read once; InvalidArgument if it is no collection."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise InvalidArgument(f"expected a list, got {type(values).__name__}")
    return tuple(values)


def _verify_request(request: CacheRequest) -> None:
    """Raise InvalidArgument unless the request's hashes and token ids are sequences.

    Only the hashes an operation reads must be bytes (``_verify_hashes``): checking
    every hash of a long request on every call would cost the impl its speed.
    """
    for name in ("block_hashes", "all_token_ids"):
        if not isinstance(getattr(request, name, None), Sequence):
            raise InvalidArgument(f"the request's {name} must be a sequence")


def _verify_hashes(hashes: Iterable[object]) -> None:
    for block_hash in hashes:
        if not isinstance(block_hash, bytes):
            raise InvalidArgument(f"a block hash is bytes, not {type(block_hash).__name__}")


def _lookahead(
    config: PoolConfig, request: CacheRequest, ends: Sequence[int]
) -> tuple[tuple[int, ...], ...] | None:
    """Per stored block ending at token ``end``, the look-ahead tokens after it."""
    n = config.num_hash_lookahead_tokens
    if n == 0:
        return None
    return tuple(tuple(request.all_token_ids[end : end + n]) for end in ends)


def _fire(state: PoolState, block_ids: Sequence[int]) -> PoolState:
    """Fire (and forget) the watchers of ``block_ids``, in that order."""
    if not block_ids:
        return state
    watchers = dict(state.watchers)
    fired = tuple(Reuse(watchers.pop(b), b, state.blocks[b].block_hash) for b in block_ids)
    return replace(state, watchers=watchers, pending_reuses=state.pending_reuses + fired)


def _verify_group(group_id: int) -> None:
    if group_id < 0:
        raise InvalidGroup(f"KV cache group id {group_id} is negative")


def _verify_block_size(block_size: int, hash_block_size: int, at_least: int) -> None:
    if block_size < at_least or block_size % hash_block_size != 0:
        raise InvalidBlockSize(
            f"block_size={block_size} must be a multiple of hash_block_size="
            f"{hash_block_size} and at least {at_least}"
        )


def _verify_distinct(block_ids: Sequence[int]) -> None:
    repeated = sorted(b for b, n in Counter(block_ids).items() if n > 1)
    if repeated:
        raise DuplicateBlock(f"block(s) {repeated} stand at more than one position")


def _without(queue: tuple[int, ...], block_id: int) -> tuple[int, ...]:
    return tuple(b for b in queue if b != block_id)


def _set_block(state: PoolState, block_id: int, **changes: Any) -> PoolState:
    block = replace(state.blocks[block_id], **changes)
    blocks = (*state.blocks[:block_id], block, *state.blocks[block_id + 1 :])
    return replace(state, blocks=blocks)


def _emit(state: PoolState, *events: KVCacheEvent) -> PoolState:
    if not state.config.enable_events:
        return state
    return replace(state, pending_events=state.pending_events + events)


def _insert_key(state: PoolState, key: HashKey, block_id: int, num_tokens: int) -> PoolState:
    """Point ``key`` at the block as well; the block's first key becomes its primary one."""
    block = state.blocks[block_id]
    if block.block_hash is None:
        state = _set_block(state, block_id, block_hash=key, hash_num_tokens=num_tokens)
    else:
        state = _set_block(state, block_id, partial_keys=(*block.partial_keys, key))
    cached = dict(state.cached)
    cached[key] = (*cached.get(key, ()), block_id)
    return replace(state, cached=cached)


def _drop_keys(state: PoolState, block_id: int) -> PoolState:
    """Remove every key that points at the block, emitting a BlockRemoved per key.

    Under the ``LAST_COPY`` event semantics a key that other blocks still
    carry is removed silently: only the last block under a key announces it.
    """
    keys = state.blocks[block_id].hash_keys()
    if not keys:
        return state
    cached = dict(state.cached)
    for key in keys:
        remaining = tuple(b for b in cached[key] if b != block_id)
        if remaining:
            cached[key] = remaining
        else:
            del cached[key]
    state = _set_block(state, block_id, block_hash=None, hash_num_tokens=None, partial_keys=())
    state = replace(state, cached=cached)
    per_copy = state.config.profile.event_semantics is EventSemantics.MULTISET
    medium = state.config.medium
    removed = [
        BlockRemoved(block_hashes=(h,), medium=medium, group_idx=g)
        for h, g in keys
        if per_copy or (h, g) not in cached
    ]
    return _emit(state, *removed)
