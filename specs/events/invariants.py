"""What "a router can rebuild the engine" means, as named predicates over one query's scores.

``engine`` is what each worker would actually hit for the query (its own
lookups), ``consumer`` what the index built from the workers' events says.
Each predicate returns None when it holds and a one-line reason when it does
not; its docstring says what goes wrong in a server. A producer with a
whole-state snapshot is also held to the pool invariant
``event_stream_consistency`` (``kvpool.specs.pool.invariants``): its stream
folds to exactly its hash map.
"""

from collections.abc import Callable, Mapping

from kvpool.specs.pool.invariants import event_stream_consistency

Reason = str | None
Scores = Mapping[int, int]


def no_phantom_hits(engine: Scores, consumer: Scores) -> Reason:
    """No worker is credited with more leading blocks of a prefix than it holds.

    A phantom hit sends a request to an engine that no longer holds its
    prefix: the engine recomputes it while another one had it cached (time to
    first token rises), and requests keep piling onto the stale engine.
    """
    over = {w: (consumer.get(w, 0), n) for w, n in engine.items() if consumer.get(w, 0) > n}
    if not over:
        return None
    return "; ".join(
        f"worker {w}: the consumer scores {c}, the engine holds {n} leading block(s)"
        for w, (c, n) in sorted(over.items())
    )


def no_missed_hits(engine: Scores, consumer: Scores) -> Reason:
    """Every worker is credited with every leading block of a prefix it holds.

    A missed hit sends a request away from the engine that holds its prefix,
    or leaves it with a worse one: the prefix is computed again elsewhere,
    and the cache hit rate a router exists for is lost without an error.
    """
    under = {w: (consumer.get(w, 0), n) for w, n in engine.items() if consumer.get(w, 0) < n}
    if not under:
        return None
    return "; ".join(
        f"worker {w}: the consumer scores {c}, the engine holds {n} leading block(s)"
        for w, (c, n) in sorted(under.items())
    )


SCORE_INVARIANTS: tuple[Callable[[Scores, Scores], Reason], ...] = (
    no_phantom_hits,
    no_missed_hits,
)
"""Checked after every batch on every aimed query."""

STREAM_INVARIANTS = (event_stream_consistency,)
"""Checked on a producer that can show its whole state (``snapshot``)."""


def score_problems(engine: Scores, consumer: Scores) -> list[tuple[str, str, str]]:
    """(invariant name, reason, rationale) for each score invariant the query breaks."""
    found = []
    for invariant in SCORE_INVARIANTS:
        reason = invariant(engine, consumer)
        if reason is not None:
            found.append((invariant.__name__, reason, (invariant.__doc__ or "").strip()))
    return found
