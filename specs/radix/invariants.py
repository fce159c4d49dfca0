"""The named invariants of a radix cache, as predicates over the model's state and any tree.

Like ``kvpool.specs.pool.invariants``: each predicate returns ``None`` when it
holds and a one-line reason when it does not, and its docstring says what
breaks in a server when it fails.

Two kinds:

* **the tree's own** (``STATE_INVARIANTS``): a well-formed radix tree, lock
  counts that cover every lock below, stamps from the past; run on the
  model after every step;
* **engine-neutral** (``kvpool.specs.prefix_cache``), named once there and
  shared with the vLLM layers: the event stream folds to the cached page
  hashes; a child's pages are never cached without their parent's;
  evictable + protected = cached; every cached path, and every hit, serves
  the tokens inserted for it; locked data is never freed. ``check_all``
  applies them to the model, ``check_tree`` to what a target shows
  (its snapshot, its sizes, its events).
"""

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from kvpool.model import HashKey, KVCacheEvent
from kvpool.model.radix import (
    ROOT,
    Path,
    RadixState,
    evictable_size,
    page_hashes,
    protected_size,
    total_size,
    tree_view,
)
from kvpool.specs import prefix_cache
from kvpool.specs.errors import InvariantViolation

Reason = str | None
TreeView = tuple[tuple[Path, tuple[int, ...]], ...]


# --------------------------------------------------------------------------
# The tree's own invariants
# --------------------------------------------------------------------------


def tree_well_formed(state: RadixState) -> Reason:
    """Every node hangs under a shorter node (or the root), holds whole pages and a slot per token.

    Its parent's path is a proper prefix of its own, its segment is a
    non-empty whole number of pages, and no two children of one node begin
    with the same page. Otherwise a match walks into the wrong branch, or
    splits a page in two, and serves KV for tokens that were never its own.
    """
    page = state.config.page_size
    first_pages: set[tuple[Path, Path]] = set()
    for path, node in state.nodes.items():
        parent = node.parent
        if parent != ROOT and parent not in state.nodes:
            return f"node {path} hangs under {parent}, which is not a node"
        if len(parent) >= len(path) or path[: len(parent)] != parent:
            return f"node {path} hangs under {parent}, which is not a shorter prefix of it"
        segment = path[len(parent) :]
        if len(segment) % page:
            return f"node {path} holds {len(segment)} tokens, not a whole number of pages"
        if len(node.slots) != len(segment):
            return f"node {path} has {len(node.slots)} slot(s) for {len(segment)} token(s)"
        first = (parent, segment[:page])
        if first in first_pages:
            return f"two children of {parent} begin with the page {segment[:page]}"
        first_pages.add(first)
    return None


def lock_refs_cover_descendants(state: RadixState) -> Reason:
    """A node's lock count is never negative and at least the sum of its children's.

    A lock holds a node and every ancestor, so every lock below a node is
    counted in it too. A count too low lets eviction remove a prefix a
    running request still reads.
    """
    below: Counter[Path] = Counter()
    for node in state.nodes.values():
        below[node.parent] += node.lock_ref
    for path, node in state.nodes.items():
        if node.lock_ref < 0:
            return f"node {path} has lock count {node.lock_ref}"
        if node.lock_ref < below[path]:
            return f"node {path} has lock count {node.lock_ref}, its children {below[path]}"
    return None


def stamps_from_the_past(state: RadixState) -> Reason:
    """No node was accessed or created after the clock's present, or accessed before it was created.

    Recency decides eviction: a stamp from the future protects a node for
    ever, and the cache fills with it.
    """
    for path, node in state.nodes.items():
        if not node.created <= node.last_access <= state.clock:
            return (
                f"node {path} was created at {node.created} and accessed at "
                f"{node.last_access}, the clock reads {state.clock}"
            )
    return None


STATE_INVARIANTS: tuple[Callable[[RadixState], Reason], ...] = (
    tree_well_formed,
    lock_refs_cover_descendants,
    stamps_from_the_past,
)


# --------------------------------------------------------------------------
# The engine-neutral properties, applied to a tree
# --------------------------------------------------------------------------


def node_parents(view: TreeView) -> dict[Path, Path | None]:
    """Each node's path with the path its slots say it extends (None: the root).

    A node's slots cover its own segment; what lies before it must be
    another node. A snapshot whose node holds fewer slots than the tokens
    back to the nearest node above shows a hole in the middle of a prefix.
    """
    return {path: path[: len(path) - len(slots)] or None for path, slots in view}


def cached_pages(view: TreeView, page_size: int) -> Counter[HashKey]:
    """The (page hash, group 0) of every cached page: what the events must fold to."""
    pages: Counter[HashKey] = Counter()
    for path, slots in view:
        start = (len(path) - len(slots)) // page_size
        for page_hash in page_hashes(path, page_size)[start:]:
            pages[(page_hash, 0)] += 1
    return pages


def cached_paths_serve_their_tokens(view: TreeView, truth: Mapping[int, Sequence[int]]) -> Reason:
    """``hit_serves_inserted_tokens`` for every cached path: what a hit on it would serve."""
    slots_of = dict(view)
    parents = node_parents(view)
    for path, _ in view:
        chain = [path]
        while (parent := parents.get(chain[-1])) is not None and parent in slots_of:
            chain.append(parent)
        slots = tuple(s for node in reversed(chain) for s in slots_of[node])
        tokens = path[len(path) - len(slots) :]
        if len(slots) != len(path):
            continue  # a hole: cached_prefix_closed reports it
        reason = prefix_cache.hit_serves_inserted_tokens(truth, tokens, slots)
        if reason is not None:
            return f"the node at {path}: {reason}"
    return None


# --------------------------------------------------------------------------
# Running them
# --------------------------------------------------------------------------


class RadixInvariantViolation(InvariantViolation):
    """A radix invariant failed; the message names it, explains it and dumps the state."""


def _raise(name: str, reason: Reason, dump: str) -> None:
    if reason is None:
        return
    function = globals().get(name) or getattr(prefix_cache, name)
    raise RadixInvariantViolation(name, reason, rationale(function), dump)


def rationale(function: Callable[..., object]) -> str:
    """A predicate's docstring without its examples: what breaks in a server when it fails."""
    doc = (function.__doc__ or "").split(">>>")[0]
    return doc.strip()


def check_all(state: RadixState, taken: Sequence[KVCacheEvent] = ()) -> None:
    """Run every invariant on the model's state; ``taken``: the events already handed out."""
    dump = dump_radix_state(state)
    for invariant in STATE_INVARIANTS:
        _raise(invariant.__name__, invariant(state), dump)
    view = tree_view(state)
    config = state.config
    _raise(
        "no_events_when_disabled",
        prefix_cache.no_events_when_disabled(config.enable_events, state.pending_events),
        dump,
    )
    if config.enable_events:
        events = (*taken, *state.pending_events)
        _raise(
            "event_stream_consistency",
            prefix_cache.event_stream_consistency(events, cached_pages(view, config.page_size)),
            dump,
        )
        _raise(
            "cached_prefix_closed",
            prefix_cache.cached_prefix_closed(prefix_cache.stored_parents(events)),
            dump,
        )
    _raise("cached_prefix_closed", prefix_cache.cached_prefix_closed(node_parents(view)), dump)
    _raise(
        "size_accounting",
        prefix_cache.size_accounting(
            evictable_size(state), protected_size(state), total_size(state)
        ),
        dump,
    )


def check_tree(
    view: TreeView,
    page_size: int,
    *,
    evictable: int,
    protected: int,
    truth: Mapping[int, Sequence[int]],
    taken: Iterable[KVCacheEvent] | None = None,
) -> None:
    """Run the engine-neutral properties on what a target shows.

    ``taken`` (every event the target handed out, oldest first) is given
    only right after a ``take_events``, when nothing is pending.
    """
    dump = dump_tree(view)
    _raise("cached_prefix_closed", prefix_cache.cached_prefix_closed(node_parents(view)), dump)
    cached = sum(len(slots) for _, slots in view)
    _raise("size_accounting", prefix_cache.size_accounting(evictable, protected, cached), dump)
    reason = cached_paths_serve_their_tokens(view, truth)
    _raise("hit_serves_inserted_tokens", reason, dump)
    if taken is not None:
        events = tuple(taken)
        _raise(
            "event_stream_consistency",
            prefix_cache.event_stream_consistency(events, cached_pages(view, page_size)),
            dump,
        )
        _raise(
            "cached_prefix_closed",
            prefix_cache.cached_prefix_closed(prefix_cache.stored_parents(events)),
            dump,
        )


def dump_tree(view: TreeView) -> str:
    """A tree view, one node per line."""
    lines = ["tree (path: slots):"]
    lines.extend(f"  {list(path)}: {list(slots)}" for path, slots in view)
    return "\n".join(lines)


def dump_radix_state(state: RadixState) -> str:
    """The whole state, one fact per line, for failure messages."""
    c = state.config
    lines = [
        f"radix cache: page_size={c.page_size} policy={c.policy} events={c.enable_events} "
        f"clock={state.clock}",
        f"evictable={evictable_size(state)} protected={protected_size(state)}",
    ]
    for path, node in sorted(state.nodes.items()):
        lines.append(
            f"  {list(path)}: slots={list(node.slots)} lock_ref={node.lock_ref} "
            f"accessed={node.last_access} created={node.created} hits={node.hit_count} "
            f"priority={node.priority}"
        )
    if state.pending_events:
        lines.append(f"pending events: {list(state.pending_events)}")
    return "\n".join(lines)
