"""The named invariants of the v0 allocator, as predicates over ``V0State``.

Like ``kvpool.specs.pool.invariants`` for v1: each predicate returns ``None`` when
it holds and a one-line reason when it does not, and its docstring says what
breaks in a server when it fails. ``check_all`` runs them all.

``cached_prefix_closed`` is kept apart: it is the *binary-search property*
that ``find_cached_blocks_prefix`` relies on, and the allocator does not
maintain it for every program (access times are the caller's). It is a
property to test a caller's discipline against, not an invariant.
"""

from collections import Counter
from collections.abc import Callable

from kvpool.model.v0 import NEVER_ACCESSED, ContentHash, V0State, eviction_order
from kvpool.specs import prefix_cache
from kvpool.specs.errors import InvariantViolation

Reason = str | None


def no_duplicate_content(state: V0State) -> Reason:
    """No two physical blocks hold the same cached content.

    The cache maps each content hash to one block and no block to two
    hashes, and every full block object sits on the block cached under its
    hash: de-duplication is complete. Without it two copies of one prefix
    occupy memory, and a later lookup finds only one of them.
    """
    owners: dict[int, ContentHash] = {}
    for content_hash, block_id in state.cached.items():
        if block_id in owners:
            return f"block {block_id} is cached under two hashes"
        owners[block_id] = content_hash
    for handle, block in state.handles.items():
        if block.content_hash is None:
            if block.block_id in owners:
                return f"mutable block object {handle} writes into cached block {block.block_id}"
            continue
        cached_id = state.cached.get(block.content_hash)
        if cached_id != block.block_id:
            return (
                f"full block object {handle} sits on block {block.block_id}, "
                f"but its content is cached on block {cached_id}"
            )
    return None


def ref_counts_match_holders(state: V0State) -> Reason:
    """Every block's ref count is the number of live block objects on it.

    Each block object of each sequence holds exactly one reference. A count
    too high leaks the block forever; a count too low frees it while a
    sequence still reads it, and the next owner overwrites its KV data.
    """
    holders = Counter(block.block_id for block in state.handles.values())
    for block_id, block in enumerate(state.blocks):
        if block.ref_cnt != holders.get(block_id, 0):
            return (
                f"block {block_id} has ref count {block.ref_cnt} "
                f"but {holders.get(block_id, 0)} block object(s) on it"
            )
    unknown = sorted(b for b in holders if not 0 <= b < state.config.num_blocks)
    if unknown:
        return f"block objects sit on unknown block id(s) {unknown}"
    return None


def copy_on_write_isolation(state: V0State) -> Reason:
    """Block objects that share a physical block agree on its content.

    Sharing is only safe while nobody writes: an append to a shared block
    must move the appender to a copy first. If two sequences' objects on
    one block disagree on its tokens, one of them wrote into memory the
    other still reads.
    """
    seen: dict[int, tuple[tuple[int, ...], ContentHash | None, int]] = {}
    for handle, block in sorted(state.handles.items()):
        content = (block.token_ids, block.content_hash)
        if block.block_id in seen and seen[block.block_id][:2] != content:
            other = seen[block.block_id][2]
            return (
                f"block objects {other} and {handle} share block {block.block_id} "
                f"but hold {seen[block.block_id][0]} and {block.token_ids}"
            )
        seen.setdefault(block.block_id, (*content, handle))
    return None


def evictor_holds_unused_cached(state: V0State) -> Reason:
    """The evictor holds exactly the cached blocks with ref count 0, under their own hash.

    A held block in the evictor gets evicted under its reader; a cached
    unused block missing from it can neither be evicted nor reused: it
    leaks. An entry with another hash would drop the wrong cache entry.
    """
    unused = {b for b in state.cached.values() if state.blocks[b].ref_cnt == 0}
    if set(state.evictor) != unused:
        return (
            f"the evictor holds {sorted(state.evictor)}, "
            f"the cached blocks nobody holds are {sorted(unused)}"
        )
    for block_id, entry in state.evictor.items():
        if state.cached.get(entry.content_hash) != block_id:
            return f"evictor entry of block {block_id} names content not cached on it"
        if entry.num_hashed_tokens != len(entry.content_hash):
            return f"evictor entry of block {block_id} counts {entry.num_hashed_tokens} tokens"
    return None


def free_memory_accounting(state: V0State) -> Reason:
    """Every block is exactly one of: held, hash-less free, or evictable.

    A hash-less free block that is also held or cached is handed out while
    in use (or with a stale hash); a block in none of the three is leaked.
    """
    queued = Counter(state.hashless_free)
    twice = sorted(b for b, n in queued.items() if n > 1)
    if twice:
        return f"block(s) {twice} appear more than once in the hash-less free list"
    cached = set(state.cached.values())
    for block_id, block in enumerate(state.blocks):
        places = [
            name
            for name, here in (
                ("held", block.ref_cnt > 0),
                ("hash-less free", block_id in queued),
                ("evictable", block_id in state.evictor),
            )
            if here
        ]
        if len(places) != 1:
            return f"block {block_id} is {' and '.join(places) or 'nowhere'}"
        if block_id in queued and block_id in cached:
            return f"hash-less free block {block_id} is still cached"
    return None


def unheld_blocks_are_reset(state: V0State) -> Reason:
    """A block nobody holds carries no access time and no computed mark.

    Those belong to the tenure of one owner; left over, they would rank or
    count the block's next content by its previous one's history.
    """
    for block_id, block in enumerate(state.blocks):
        if block.ref_cnt < 0:
            return f"block {block_id} has negative ref count {block.ref_cnt}"
        if block.ref_cnt == 0 and (block.last_accessed != NEVER_ACCESSED or block.computed):
            return f"free block {block_id} kept its access time or computed mark"
    return None


def block_objects_well_formed(state: V0State) -> Reason:
    """A block object holds at most a block of tokens, and has a content hash exactly when full.

    The hash ends with the block's own tokens and covers whole blocks; the
    previous block of an object is an older object. Otherwise the cache is
    keyed by content the block does not hold.
    """
    size = state.config.block_size
    for handle, block in state.handles.items():
        if handle >= state.next_handle or (block.prev is not None and block.prev >= handle):
            return f"block object {handle} is newer than the allocator or than its successor"
        if len(block.token_ids) > size:
            return f"block object {handle} holds {len(block.token_ids)} > {size} tokens"
        full = len(block.token_ids) == size
        if full != (block.content_hash is not None):
            return (
                f"block object {handle} is {'full' if full else 'not full'} "
                f"but {'has no' if full else 'has a'} content hash"
            )
        content = block.content_hash
        if content is not None and (
            len(content) % size != 0 or content[len(content) - size :] != block.token_ids
        ):
            return f"block object {handle} has a hash that does not end with its tokens"
    return None


STATE_INVARIANTS: tuple[Callable[[V0State], Reason], ...] = (
    no_duplicate_content,
    ref_counts_match_holders,
    copy_on_write_isolation,
    evictor_holds_unused_cached,
    free_memory_accounting,
    unheld_blocks_are_reset,
    block_objects_well_formed,
)


# --------------------------------------------------------------------------
# The binary-search property (not an invariant)
# --------------------------------------------------------------------------


def cached_prefix_closed(state: V0State) -> Reason:
    """If a block's content is cached, so is the content of every block before it.

    ``find_cached_blocks_prefix`` binary-searches a sequence's hashes on
    this assumption. Chained hashes make it natural (a block's content
    includes its whole prefix) and the evictor's tie-break (deepest block
    first) protects it, but eviction is by access time, so a caller who
    frees or touches the front of a sequence before its end can break it;
    then the search may skip cached blocks or count an evicted one. (The
    property is ``kvpool.specs.prefix_cache.cached_prefix_closed``, applied
    to the cache's contents.)
    """
    size = state.config.block_size
    parents = {h: (h[:-size] if len(h) > size else None) for h in state.cached}
    return prefix_cache.cached_prefix_closed(parents)


# --------------------------------------------------------------------------
# Running them all
# --------------------------------------------------------------------------


class V0InvariantViolation(InvariantViolation):
    """A v0 invariant failed; the message names it, explains it and dumps the state."""

    def __init__(self, name: str, reason: str, rationale: str, state: V0State) -> None:
        super().__init__(name, reason, rationale, dump_v0_state(state))


def check_all(state: V0State) -> None:
    """Run every state invariant; raise V0InvariantViolation naming the first that fails."""
    for invariant in STATE_INVARIANTS:
        reason = invariant(state)
        if reason is not None:
            doc = (invariant.__doc__ or "").strip()
            raise V0InvariantViolation(invariant.__name__, reason, doc, state)


def dump_v0_state(state: V0State) -> str:
    """The whole state, one fact per line, for failure messages."""
    c = state.config
    lines = [
        f"v0 allocator: {c.num_blocks} blocks of {c.block_size} tokens",
        f"hash-less free (next first): {list(state.hashless_free)}",
        f"evictor (next first): {list(eviction_order(state))}",
    ]
    for block_id, block in enumerate(state.blocks):
        if block.ref_cnt or block.computed or block.last_accessed != NEVER_ACCESSED:
            lines.append(
                f"  block {block_id}: ref_cnt={block.ref_cnt} "
                f"last_accessed={block.last_accessed} computed={block.computed}"
            )
    for block_id, entry in sorted(state.evictor.items()):
        lines.append(
            f"  evictable {block_id}: hash={entry.content_hash} "
            f"tokens={entry.num_hashed_tokens} last_accessed={entry.last_accessed}"
        )
    lines.append("cache:")
    lines.extend(f"  {h} -> {b}" for h, b in sorted(state.cached.items()))
    lines.append("block objects:")
    for handle, obj in sorted(state.handles.items()):
        lines.append(
            f"  #{handle}: block {obj.block_id} prev={obj.prev} "
            f"tokens={list(obj.token_ids)} hash={obj.content_hash}"
        )
    lines.append(f"touched: {sorted(state.touched)}  copy-on-writes: {list(state.copy_on_writes)}")
    return "\n".join(lines)
