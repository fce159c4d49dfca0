"""The properties every prefix cache must have, whatever its data structure.

vLLM's v1 pool keeps a hash map over blocks, its v0 allocator a map from
content to block, SGLang a token radix tree; a KV-aware router or a request
relies on the same few promises from each. Each promise is named **once**
here, as a predicate over engine-neutral data (slots, token prefixes, event
streams, multisets of page hashes) that returns ``None`` when it holds and a
one-line reason when it does not. The layers apply them to their own state:

=================================  ==============================  ==========================
property                           vLLM layers                     radix layer (SGLang)
=================================  ==============================  ==========================
``event_stream_consistency``       pool (its hash map's entries)   the tree's page hashes
``cached_prefix_closed``           v0 (a property of the caller)   the tree, and the events
``hit_serves_inserted_tokens``     request (``hit_matches_         every ``match_prefix`` hit
                                   request``: richer provenance)
``locked_data_never_freed``        pool (held blocks never free)   evict and insert frees
``size_accounting``                pool (``conservation``)         evictable + protected
``no_events_when_disabled``        pool                            radix
=================================  ==============================  ==========================

Nothing here imports a layer: the layer packages import this module
(``kvpool.specs.pool.invariants``, ``kvpool.specs.v0.invariants``,
``kvpool.specs.radix.invariants``).
"""

from collections import Counter
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from typing import TypeVar

from kvpool.model import AllBlocksCleared, BlockRemoved, BlockStored, HashKey, KVCacheEvent
from kvpool.model.events import fold_events
from kvpool.model.profiles import EventSemantics

Reason = str | None
K = TypeVar("K", bound=Hashable)


# --------------------------------------------------------------------------
# Events
# --------------------------------------------------------------------------


def event_stream_consistency(
    events: Iterable[KVCacheEvent],
    cached: Counter[HashKey],
    semantics: EventSemantics = EventSemantics.MULTISET,
    holder: str = "the cache",
) -> Reason:
    """Folding every event emitted so far gives exactly the cache's entries.

    ``events`` are all the events of the cache's life, oldest first, folded
    under ``semantics`` (``kvpool.model.events.fold_events``); ``cached`` is
    the multiset of (hash, group) entries the cache holds. A KV-aware router
    routes by this stream; if it drifts from the cache, the router sends
    requests to engines that no longer hold their prefix, or away from
    engines that do.

    >>> event_stream_consistency([AllBlocksCleared()], Counter({(b"a", 0): 1}))
    "events describe {}, the cache holds {(b'a', 0): 1}"
    """
    folded = fold_events(events, semantics)
    negative = {k: n for k, n in folded.items() if n < 0}
    if negative:
        return f"events remove entries never stored: {negative}"
    folded = +folded
    if folded != +cached:
        return f"events describe {dict(folded)}, {holder} holds {dict(+cached)}"
    return None


def stored_parents(events: Iterable[KVCacheEvent]) -> dict[bytes, bytes | None]:
    """Each page hash still stored after the events, with the hash it says it follows.

    The first hash of a ``BlockStored`` follows its ``parent_block_hash``,
    every later one the hash before it.

    >>> stored = BlockStored((b"a", b"b"), None, (1, 2), 1, None, "GPU", None, None, 0)
    >>> stored_parents([stored])
    {b'a': None, b'b': b'a'}
    """
    parents: dict[bytes, bytes | None] = {}
    for event in events:
        if isinstance(event, BlockStored):
            before = event.parent_block_hash
            for block_hash in event.block_hashes:
                parents[block_hash] = before
                before = block_hash
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                parents.pop(block_hash, None)
        elif isinstance(event, AllBlocksCleared):
            parents.clear()
    return parents


def no_events_when_disabled(enabled: bool, pending: Sequence[KVCacheEvent]) -> Reason:
    """A cache built without events never queues one.

    Events nobody takes grow without bound: a memory leak in a long-lived server.

    >>> no_events_when_disabled(False, [AllBlocksCleared()])
    '1 event(s) queued with events disabled'
    """
    if not enabled and pending:
        return f"{len(pending)} event(s) queued with events disabled"
    return None


# --------------------------------------------------------------------------
# Structure
# --------------------------------------------------------------------------


def cached_prefix_closed(parents: Mapping[K, K | None]) -> Reason:
    """A child's pages are never cached without their parent's.

    ``parents`` maps every cached entry (a block, a page, a node) to the
    entry it extends, ``None`` for one that starts a sequence. A prefix
    cache serves prefixes: an entry whose parent is gone can never be hit
    again (it wastes memory until evicted), and a consumer that rebuilds the
    cache from events (a router) finds a hole in the middle of a prefix.

    >>> cached_prefix_closed({"ab": "a", "a": None})
    >>> cached_prefix_closed({"ab": "a"})
    "'ab' is cached but the entry it extends, 'a', is not"
    """
    for entry, parent in parents.items():
        if parent is not None and parent not in parents:
            return f"{entry!r} is cached but the entry it extends, {parent!r}, is not"
    return None


def size_accounting(evictable: int, protected: int, cached: int) -> Reason:
    """Evictable plus protected tokens equal the tokens cached.

    The scheduler admits requests by these two numbers: if they drift from
    what the cache holds, it either refuses requests it could serve or
    admits requests whose KV cannot be found room for.

    >>> size_accounting(3, 1, 5)
    '3 evictable + 1 protected != 5 cached tokens'
    """
    if evictable < 0 or protected < 0 or evictable + protected != cached:
        return f"{evictable} evictable + {protected} protected != {cached} cached tokens"
    return None


# --------------------------------------------------------------------------
# Ground truth: what each slot holds
# --------------------------------------------------------------------------


def hit_serves_inserted_tokens(
    truth: Mapping[int, Sequence[int]], tokens: Sequence[int], slots: Sequence[int]
) -> Reason:
    """Every slot of a hit holds the KV of the request's own prefix at its position.

    ``truth`` maps each KV slot to the token prefix whose last token's KV
    was last written there (its provenance); a hit for ``tokens`` giving
    ``slots`` must give, at position i, a slot written for ``tokens[:i+1]``.
    A hit that fails makes the request skip computing tokens and attend to
    another prefix's keys and values, with no error anywhere.

    >>> hit_serves_inserted_tokens({7: (1,), 8: (1, 3)}, [1, 2], [7, 8])
    'position 1 of the hit is slot 8, which holds the KV of (1, 3), not the KV of (1, 2)'
    """
    for position, slot in enumerate(slots):
        expected = tuple(tokens[: position + 1])
        held = truth.get(slot)
        if held is None or tuple(held) != expected:
            what = "nothing" if held is None else f"the KV of {tuple(held)}"
            return (
                f"position {position} of the hit is slot {slot}, which holds {what}, "
                f"not the KV of {expected}"
            )
    return None


def locked_data_never_freed(freed: Iterable[int], locked: Collection[int]) -> Reason:
    """No slot (or block) a lock holds is ever freed.

    A request locks the prefix it reads; freeing any of it hands its KV to
    the next allocation while the request still attends to it.

    >>> locked_data_never_freed([4, 5], {5, 6})
    'slot(s) [5] were freed while a lock held them'
    """
    bad = sorted(set(freed) & set(locked))
    return f"slot(s) {bad} were freed while a lock held them" if bad else None
