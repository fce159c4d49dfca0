"""The named invariants of a v1 block pool, as predicates over the model state.

Each predicate returns ``None`` when it holds and a one-line reason when it
does not; ``check_all`` runs them all and raises ``InvariantViolation`` with
the invariant's name, its docstring (what breaks in a server) and a dump of
the whole state. Any implementation is checked through its ``snapshot()``,
the abstraction function into ``PoolState``.

Two invariants need more than one state: LRU order needs the history of
frees (``FreeHistory``), event-stream consistency needs the events already
taken out of the pool. The fold of the events (``fold_events``) is the
model's (``kvpool.model.events``), shared with the event-consumer layer.
"""

from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from kvpool.model import (
    NULL_BLOCK_ID,
    EventSemantics,
    FreeOrder,
    HashKey,
    KVCacheEvent,
    PoolState,
)
from kvpool.specs import prefix_cache
from kvpool.specs.errors import InvariantViolation

Reason = str | None


def ref_counts_non_negative(state: PoolState) -> Reason:
    """Every block's ref count is at least 0.

    A negative count means a block was freed more often than it was taken:
    the next request to take it believes it owns it alone while another
    still reads it, and the two overwrite each other's KV data.
    """
    bad = [i for i, b in enumerate(state.blocks) if b.ref_cnt < 0]
    return f"negative ref count on block(s) {bad}" if bad else None


def free_list_membership(state: PoolState) -> Reason:
    """A non-null block is in the free queue exactly when its ref count is 0, and at most once.

    A held block in the queue is handed to a second request while the
    first still uses it (silent corruption); a free block missing from the
    queue is leaked forever; a block queued twice is handed out twice.
    """
    seen = Counter(state.free_queue)
    twice = sorted(b for b, n in seen.items() if n > 1)
    if twice:
        return f"block(s) {twice} appear more than once in the free queue"
    for block_id in range(1, state.config.num_blocks):
        held = state.blocks[block_id].ref_cnt > 0
        queued = block_id in seen
        if held and queued:
            return f"block {block_id} is held (ref_cnt > 0) but sits in the free queue"
        if not held and not queued:
            return f"block {block_id} has ref_cnt 0 but is missing from the free queue (leaked)"
    return None


def null_block(state: PoolState) -> Reason:
    """The null block (id 0) is never free, never hashed and never held.

    The null block stands in for skipped positions (sliding window, Mamba);
    if it were handed out or cached, real KV data would be written into the
    placeholder every request shares.
    """
    null = state.blocks[NULL_BLOCK_ID]
    if NULL_BLOCK_ID in state.free_queue:
        return "the null block is in the free queue"
    if null.hash_keys():
        return f"the null block carries hash keys {null.hash_keys()}"
    if null.ref_cnt != 0:
        return f"the null block has ref count {null.ref_cnt}"
    if any(NULL_BLOCK_ID in ids for ids in state.cached.values()):
        return "the hash map points at the null block"
    return None


def conservation(state: PoolState) -> Reason:
    """Free blocks plus held blocks equal the number of usable blocks (N - 1).

    When it fails, blocks have leaked (capacity silently shrinks until the
    server refuses requests it could serve) or been counted twice.
    """
    held = sum(1 for b in state.blocks[1:] if b.ref_cnt > 0)
    free = len(state.free_queue)
    usable = state.config.num_blocks - 1
    if held + free != usable:
        return f"{free} free + {held} held != {usable} usable blocks"
    return None


def hash_map_consistency(state: PoolState) -> Reason:
    """The hash map and the blocks' own hashes describe the same cache.

    Every map entry is non-empty, has no repeated block and points only at
    blocks carrying that key; every key a block carries leads back to it; a
    block has partial keys only beside a primary key, and a primary key
    exactly when it has a token count. A stale entry serves a request KV
    data computed for other tokens; an unreachable hash wastes the cache.
    """
    for key, ids in state.cached.items():
        if not ids:
            return f"empty map entry for {key!r}"
        if len(set(ids)) != len(ids):
            return f"map entry {key!r} repeats a block: {ids}"
        for block_id in ids:
            if not 0 <= block_id < state.config.num_blocks:
                return f"map entry {key!r} points at unknown block {block_id}"
            if key not in state.blocks[block_id].hash_keys():
                return f"map entry {key!r} points at block {block_id}, which does not carry it"
    for block_id, block in enumerate(state.blocks):
        if (block.block_hash is None) != (block.hash_num_tokens is None):
            return f"block {block_id} has a hash without a token count, or the reverse"
        if block.partial_keys and block.block_hash is None:
            return f"block {block_id} has partial keys but no primary key"
        if len(set(block.hash_keys())) != len(block.hash_keys()):
            return f"block {block_id} carries a key twice: {block.hash_keys()}"
        for key in block.hash_keys():
            if block_id not in state.cached.get(key, ()):
                return f"block {block_id} carries {key!r} but the map does not lead to it"
    if not state.config.enable_caching and state.cached:
        return "a pool without prefix caching has hash map entries"
    return None


def no_events_when_disabled(state: PoolState) -> Reason:
    """A pool built without events never queues one.

    Events nobody takes grow without bound: a memory leak in a long-lived
    server. (``kvpool.specs.prefix_cache.no_events_when_disabled``, applied
    to the pool.)
    """
    return prefix_cache.no_events_when_disabled(state.config.enable_events, state.pending_events)


def watchers_on_usable_blocks(state: PoolState) -> Reason:
    """Reuse watchers are registered only for real blocks of the pool, never the null block.

    A watcher on the null block, or on an id the pool does not have, is
    never fired: the reader it stands for keeps reading a block the pool
    has long handed to someone else.
    """
    bad = sorted(b for b in state.watchers if not 0 < b < state.config.num_blocks)
    return f"watcher(s) registered for block(s) {bad}" if bad else None


STATE_INVARIANTS: tuple[Callable[[PoolState], Reason], ...] = (
    ref_counts_non_negative,
    free_list_membership,
    null_block,
    conservation,
    hash_map_consistency,
    no_events_when_disabled,
    watchers_on_usable_blocks,
)


# --------------------------------------------------------------------------
# LRU order: a predicate over the history of frees
# --------------------------------------------------------------------------

FRONT, INITIAL, BACK = 0, 1, 2


@dataclass(frozen=True)
class FreeHistory:
    """For each free block, where and when it entered the free queue.

    A stamp is ``(segment, recency, position)``. Blocks free since the pool
    was built sit in the INITIAL segment by id. A block freed by call number
    t goes to the BACK segment as ``(BACK, t, p)`` or, under the
    hash-less-first rule when it has no hash, to the FRONT as ``(FRONT, -t,
    p)``, where p is the index of its last occurrence in that call's list
    (the occurrence that released its last reference).
    """

    stamps: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    frees: int = 0
    unexplained: frozenset[int] = frozenset()
    """Blocks that entered the free queue without being freed."""

    @staticmethod
    def start(state: PoolState) -> "FreeHistory":
        """The history of a freshly built pool."""
        return FreeHistory({b: (INITIAL, 0, b) for b in state.free_queue})

    def observe(
        self,
        before: PoolState,
        after: PoolState,
        freed: Sequence[int] = (),
        unpinned: Sequence[int] = (),
    ) -> "FreeHistory":
        """The history after one operation; ``freed`` is free_blocks' argument, if it was one.

        ``unpinned`` is unpin_blocks' argument: those blocks go to the back,
        hashed or not (vLLM 0.33), as a call of their own.
        """
        if unpinned:
            freed = unpinned
        was_free, now_free = set(before.free_queue), set(after.free_queue)
        frees = self.frees + (1 if freed else 0)
        stamps = {b: s for b, s in self.stamps.items() if b in now_free}
        rule = after.config.profile.free_order_for(after.config.enable_caching)
        last_position = {b: p for p, b in enumerate(freed)}
        unexplained = set(self.unexplained & now_free)
        for block_id in now_free - was_free:
            if block_id not in last_position:
                unexplained.add(block_id)
            position = last_position.get(block_id, -1)
            hashless = after.blocks[block_id].block_hash is None
            if rule is FreeOrder.HASHLESS_FIRST and hashless and not unpinned:
                stamps[block_id] = (FRONT, -frees, position)
            else:
                stamps[block_id] = (BACK, frees, position)
        return FreeHistory(stamps, frees, frozenset(unexplained))


def lru_order(state: PoolState, history: FreeHistory) -> Reason:
    """The free queue is in the order the profile's free rule produces.

    Front to back: hash-less blocks freed under the hash-less-first rule,
    newest call first; then the blocks free since construction, by id; then
    every other freed block, oldest call first. Within one call, blocks keep
    the order of the list they were freed with. A wrong order evicts a
    prefix another request is about to hit, or keeps dead blocks alive:
    the hit rate drops with no error anywhere.
    """
    if history.unexplained:
        return f"block(s) {sorted(history.unexplained)} entered the free queue without a free"
    if set(history.stamps) != set(state.free_queue):
        return "the history and the free queue disagree on which blocks are free"
    expected = tuple(sorted(state.free_queue, key=lambda b: history.stamps[b]))
    if expected != state.free_queue:
        return f"free queue is {state.free_queue}, the free-order rule gives {expected}"
    return None


# --------------------------------------------------------------------------
# Event-stream consistency
# --------------------------------------------------------------------------


def event_stream_consistency(
    state: PoolState, taken: Sequence[KVCacheEvent], reannounced: Collection[int] = ()
) -> Reason:
    """Folding every event emitted so far gives exactly the hash map's entries.

    ``taken`` are the events already handed out by take_events, oldest first.
    The fold is the profile's event semantics (``kvpool.model.events.fold_events``):
    one entry per block under a key (multiset), or the keys (last-copy).
    A KV-aware router routes by this stream; if it drifts from the map, the
    router sends requests to engines that no longer hold their prefix. (The
    property is ``kvpool.specs.prefix_cache.event_stream_consistency``, the
    same for every prefix cache; here it is applied to the hash map.)
    ``reannounced``: positions in the stream of BlockStored events that announce
    entries already stored (``emit_cached_block_events``); they add nothing.
    """
    if not state.config.enable_events:
        return None
    semantics = state.config.profile.event_semantics
    per_copy = semantics is EventSemantics.MULTISET
    actual: Counter[HashKey] = Counter(
        {k: len(ids) if per_copy else 1 for k, ids in state.cached.items()}
    )
    events = [
        event
        for position, event in enumerate((*taken, *state.pending_events))
        if position not in reannounced
    ]
    return prefix_cache.event_stream_consistency(events, actual, semantics, holder="the map")


# --------------------------------------------------------------------------
# Running them all
# --------------------------------------------------------------------------


def check_all(
    state: PoolState,
    history: FreeHistory | None = None,
    taken: Sequence[KVCacheEvent] | None = None,
    reannounced: Collection[int] = (),
) -> None:
    """Run every invariant; raise InvariantViolation naming the first that fails.

    LRU order runs when a history is given, event consistency when the events
    already taken are given (pass ``()`` if none were).
    """
    checks: list[tuple[Callable[..., Reason], tuple[object, ...]]] = [
        (inv, (state,)) for inv in STATE_INVARIANTS
    ]
    if history is not None:
        checks.append((lru_order, (state, history)))
    if taken is not None:
        checks.append((event_stream_consistency, (state, taken, reannounced)))
    for invariant, args in checks:
        reason = invariant(*args)
        if reason is not None:
            doc = (invariant.__doc__ or "").strip()
            raise InvariantViolation(invariant.__name__, reason, doc, dump_state(state))


def dump_state(state: PoolState) -> str:
    """The whole state, one fact per line, for failure messages."""
    c = state.config
    lines = [
        f"pool: {c.num_blocks} blocks, caching={c.enable_caching}, "
        f"hash_block_size={c.hash_block_size}, events={c.enable_events}, "
        f"profile={c.profile.name}",
        f"free queue (next to evict first): {list(state.free_queue)}",
    ]
    for block_id, block in enumerate(state.blocks):
        if block.ref_cnt or block.hash_keys():
            lines.append(
                f"  block {block_id}: ref_cnt={block.ref_cnt} hash={block.block_hash!r} "
                f"tokens={block.hash_num_tokens} partial={list(block.partial_keys)!r}"
            )
    lines.append("hash map:")
    lines.extend(f"  {key!r} -> {list(ids)}" for key, ids in state.cached.items())
    if state.pending_events:
        lines.append(f"pending events: {list(state.pending_events)}")
    if state.watchers:
        lines.append(f"reuse watchers (block: watcher): {dict(state.watchers)!r}")
    if state.pending_reuses:
        lines.append(f"pending reuses: {list(state.pending_reuses)!r}")
    return "\n".join(lines)
