"""SGLang's radix prefix cache, one pure function per operation.

SGLang keeps cached KV in a **token radix tree** (``RadixCache`` and the
server's ``UnifiedRadixCache``, release 0.5.23), not in a hash map over
blocks. Each node holds a run of tokens (its *segment*, a whole number of
pages) and the KV slot of each token; the tokens from the root to the end of
a node are its **path**, and this model names a node by its path (``()`` is
the root). The rules, in one place:

* **Insert** walks the tree along the page-aligned key. The part already
  cached is the **prefix length** returned; the caller's slots for that
  part are **duplicates** (the tree keeps its own), returned per node the
  walk crossed, from ``prev_prefix_len`` on (what the caller already shares
  with the tree). The rest becomes one new leaf. A walk that ends inside a
  node **splits** it at the page boundary: the new upper node keeps the
  first pages, the old node the rest.
* **match_prefix** finds the longest page-aligned cached prefix and splits
  the last node so that a node ends exactly there; it returns that node's
  path and the slots along it.
* Time is a **logical clock**: every insert or match that walks the tree
  stamps every node it walks, and a node it splits, with one tick; the leaf
  an insert adds gets the next tick. Lock, unlock and evict stamp nothing.
* **lock** adds one reference to a node and every ancestor; a node going
  from 0 to 1 moves its tokens from *evictable* to *protected*. **unlock**
  undoes it. Locked nodes are never evicted.
* **evict(n)** removes whole unlocked leaves until at least ``n`` tokens
  are gone (or nothing is evictable), smallest *eviction key* first; a
  parent that loses its last child competes in the same call. The key is
  the policy's (``lru``: last access; see ``eviction_key``), then the last
  access, then the path: a written tie-break that reachable states never
  need (two leaves never share a stamp; see docs/semantics.md).
* **Events** use vLLM's types (``kvpool.model.events``): a new leaf is
  stored (one ``BlockStored`` per page, chained by parent hash), an evicted
  node removed (one ``BlockRemoved``), ``reset`` (and construction) clear
  everything; nothing else emits one, a split neither. The queue
  **coalesces** as SGLang's does: a store whose parent is the last hash of
  the stored event at the tail extends it, a removal after a removal
  joins it. A page's hash is a SHA-256 chain over the path's pages, each
  page's tokens as little-endian 32-bit words, cut to its first 8 bytes.

Every operation has the shape ``op(state, ...) -> (new_state, result)``.
Preconditions are checked under ``# Verify`` comments before anything
changes; a rejected call raises one of ``kvpool.model.radix_errors`` and
the caller keeps the old state. docs/semantics.md ("SGLang's radix cache")
gives the source of every rule.
"""

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from kvpool.model.errors import InvalidConfig
from kvpool.model.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from kvpool.model.radix_errors import (
    InvalidPrefixLength,
    InvalidPriority,
    InvalidSlots,
    InvalidTokenCount,
    InvalidTokens,
    NotLocked,
    TooFewSlots,
    UnknownNode,
)

Path = tuple[int, ...]
"""The tokens from the root to the end of a node; ``()`` names the root."""

ROOT: Path = ()

POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru")
"""SGLang's eviction policies that this model specifies (its ``tlru`` is not)."""

MAX_TOKEN = 2**32 - 1
"""Larger token ids are hashed in another encoding, which the model does not specify."""


# --------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class RadixConfig:
    """The cache's parameters; they never change."""

    page_size: int = 1
    policy: str = "lru"
    enable_events: bool = True
    slru_protected_threshold: int = 2
    """``slru``: a node hit this often is in the protected segment."""


@dataclass(frozen=True)
class RadixNode:
    """One node of the tree; its segment is its path after its parent's path."""

    parent: Path
    slots: tuple[int, ...]
    """The KV slot of each token of the segment."""
    lock_ref: int = 0
    last_access: int = 0
    created: int = 0
    hit_count: int = 0
    priority: int = 0


@dataclass(frozen=True)
class RadixState:
    """A whole radix cache: its nodes by path, its clock and its pending events."""

    config: RadixConfig
    nodes: Mapping[Path, RadixNode] = field(default_factory=dict)
    """Every node but the root, by path. Never mutated."""
    clock: int = 0
    pending_events: tuple[KVCacheEvent, ...] = ()


@dataclass(frozen=True)
class InsertResult:
    """What an insert did: the cached prefix length, the key's node and the duplicates."""

    prefix_len: int
    path: Path
    """The node the key ends at (the new leaf, or the deepest node walked)."""
    duplicates: tuple[tuple[int, ...], ...]
    """The caller's slots for already cached tokens past ``prev_prefix_len``, one
    segment per node the walk crossed: the caller frees them."""


@dataclass(frozen=True)
class MatchResult:
    """The longest cached page-aligned prefix: its length, its node and its slots."""

    prefix_len: int
    path: Path
    slots: tuple[int, ...]


@dataclass(frozen=True)
class EvictResult:
    """How many tokens an evict removed, and each removed node's slots in order."""

    num_evicted: int
    freed: tuple[tuple[int, ...], ...]


# --------------------------------------------------------------------------
# Construction
# --------------------------------------------------------------------------


def new_radix_cache(
    page_size: int = 1,
    policy: str = "lru",
    enable_events: bool = True,
    slru_protected_threshold: int = 2,
) -> RadixState:
    """An empty cache. With events on, its queue already holds one ``AllBlocksCleared``.

    SGLang's constructor resets the tree, and a reset announces itself.

    >>> cache = new_radix_cache(page_size=2)
    >>> cache.nodes, cache.pending_events
    ({}, (AllBlocksCleared(),))
    """
    # Verify that a page holds at least one token
    if type(page_size) is not int or page_size < 1:
        raise InvalidConfig(f"page_size must be an integer of at least 1, got {page_size!r}")
    # Verify that the eviction policy is one the model specifies
    if policy not in POLICIES:
        raise InvalidConfig(f"unknown eviction policy {policy!r}; known: {', '.join(POLICIES)}")
    # Verify that the protected threshold of slru is an integer
    if type(slru_protected_threshold) is not int:
        raise InvalidConfig(
            f"slru_protected_threshold must be an integer, not {slru_protected_threshold!r}"
        )
    config = RadixConfig(page_size, policy, bool(enable_events), slru_protected_threshold)
    return RadixState(config, pending_events=(AllBlocksCleared(),) if enable_events else ())


# --------------------------------------------------------------------------
# Insert and match
# --------------------------------------------------------------------------


def insert(
    state: RadixState,
    tokens: Sequence[int],
    slots: Sequence[int],
    *,
    prev_prefix_len: int = 0,
    priority: int = 0,
    inserted_len: int = 0,
) -> tuple[RadixState, InsertResult]:
    """Cache ``tokens`` (cut to whole pages) with the KV in ``slots``.

    Returns the number of key tokens that were cached already, the key's
    node, and the caller's duplicate slots (see ``InsertResult``). Every
    node walked gets the larger of its priority and ``priority``; a node
    walked past ``inserted_len`` tokens (what this request inserted before)
    counts one more hit, and so does a new leaf ending past it.

    Complexity: O(len(tokens) + number of nodes).

    >>> cache, r = insert(new_radix_cache(), [1, 2, 3], [10, 11, 12])
    >>> r.prefix_len, r.path, r.duplicates
    (0, (1, 2, 3), ())
    >>> cache, r = insert(cache, [1, 2, 4], [20, 21, 22])   # splits (1, 2, 3) after two tokens
    >>> r.prefix_len, r.duplicates, sorted(cache.nodes)
    (2, ((20, 21),), [(1, 2), (1, 2, 3), (1, 2, 4)])
    """
    # Verify that the tokens are integers in 0..2**32-1
    key = _verify_tokens(tokens)
    # Verify that the slots are non-negative integers, enough for the page-aligned key
    values = _verify_slots(slots)
    key = _aligned(state, key)
    if len(values) < len(key):
        raise TooFewSlots(f"{len(values)} slot(s) for a key of {len(key)} page-aligned tokens")
    # Verify that the prefix lengths are non-negative integers
    for name, length in (("prev_prefix_len", prev_prefix_len), ("inserted_len", inserted_len)):
        if type(length) is not int or length < 0:
            raise InvalidPrefixLength(f"{name} must be a non-negative integer, got {length!r}")
    # Verify that the priority is an integer
    if type(priority) is not int:
        raise InvalidPriority(f"priority must be an integer, got {priority!r}")

    if not key:
        return state, InsertResult(0, ROOT, ())
    nodes = dict(state.nodes)
    now = state.clock + 1
    node, position, duplicates = ROOT, 0, []
    while position < len(key):
        child = _child(nodes, node, key[position : position + state.config.page_size])
        if child is None:
            break
        start = position
        matched = _common_pages(child[start:], key[start:], state.config.page_size)
        position = start + matched
        if position < len(child):
            # The walk stamped the whole node before splitting it: the part
            # left below keeps the stamp, and the new upper node copies it.
            nodes[child] = replace(nodes[child], last_access=now)
            _split(nodes, child, position)
            child = key[:position]
        walked = nodes[child]
        hits = walked.hit_count + (1 if position > inserted_len else 0)
        nodes[child] = replace(
            walked, last_access=now, priority=max(walked.priority, priority), hit_count=hits
        )
        duplicate = values[max(start, prev_prefix_len) : position]
        if duplicate:
            duplicates.append(duplicate)
        node = child

    events = state.pending_events
    if position < len(key):
        leaf = key
        nodes[leaf] = RadixNode(
            parent=node,
            slots=values[position : len(key)],
            last_access=now + 1,
            created=now + 1,
            hit_count=1 if len(key) > inserted_len else 0,
            priority=priority,
        )
        if state.config.enable_events:
            events = _store_events(events, leaf, node, state.config.page_size)
    new_state = replace(state, nodes=nodes, clock=now + 1, pending_events=events)
    return new_state, InsertResult(position, key, tuple(duplicates))


def match_prefix(state: RadixState, tokens: Sequence[int]) -> tuple[RadixState, MatchResult]:
    """The longest cached page-aligned prefix of ``tokens``: its length, node and slots.

    If the prefix ends inside a node, that node is split so that one ends
    exactly there (no event: the pages stay cached). Every node walked is
    stamped, and so is the part a split leaves below the match. A key
    shorter than a page finds nothing and changes nothing.

    Complexity: O(len(tokens) + number of nodes).

    >>> cache, _ = insert(new_radix_cache(), [1, 2, 3, 4], [10, 11, 12, 13])
    >>> cache, hit = match_prefix(cache, [1, 2, 9])
    >>> hit, sorted(cache.nodes)
    (MatchResult(prefix_len=2, path=(1, 2), slots=(10, 11)), [(1, 2), (1, 2, 3, 4)])
    """
    # Verify that the tokens are integers in 0..2**32-1
    key = _aligned(state, _verify_tokens(tokens))
    if not key:
        return state, MatchResult(0, ROOT, ())
    nodes = dict(state.nodes)
    now = state.clock + 1
    node, position = ROOT, 0
    while position < len(key):
        child = _child(nodes, node, key[position : position + state.config.page_size])
        if child is None:
            break
        nodes[child] = replace(nodes[child], last_access=now)
        matched = _common_pages(child[position:], key[position:], state.config.page_size)
        position += matched
        if position < len(child):
            _split(nodes, child, position)
            node = key[:position]
            nodes[node] = replace(nodes[node], last_access=now)
            break
        node = child
    new_state = replace(state, nodes=nodes, clock=now + 1)
    return new_state, MatchResult(position, node, path_slots(new_state, node))


# --------------------------------------------------------------------------
# Locks
# --------------------------------------------------------------------------


def lock(state: RadixState, path: Path) -> tuple[RadixState, int]:
    """One more reference on the node at ``path`` and every ancestor; the tokens newly protected.

    Locking the root protects nothing.

    Complexity: O(depth of the node).

    >>> cache, _ = insert(new_radix_cache(), [1, 2], [10, 11])
    >>> cache, protected = lock(cache, (1, 2))
    >>> protected, evictable_size(cache), protected_size(cache)
    (2, 0, 2)
    """
    # Verify that the path names a node (or the root)
    _verify_node(state, path)
    nodes = dict(state.nodes)
    protected = 0
    for ancestor in _ancestors(state, path):
        node = nodes[ancestor]
        if node.lock_ref == 0:
            protected += len(node.slots)
        nodes[ancestor] = replace(node, lock_ref=node.lock_ref + 1)
    return replace(state, nodes=nodes), protected


def unlock(state: RadixState, path: Path) -> tuple[RadixState, int]:
    """Drop one reference from the node at ``path`` and every ancestor; the tokens released.

    Unlocking the root releases nothing.

    Complexity: O(depth of the node).

    >>> cache, _ = insert(new_radix_cache(), [1, 2], [10, 11])
    >>> unlock(cache, (1, 2))
    Traceback (most recent call last):
    ...
    kvpool.model.radix_errors.NotLocked: no lock holds the node at (1, 2)
    """
    # Verify that the path names a node (or the root)
    _verify_node(state, path)
    # Verify that a lock holds the node
    if path != ROOT and state.nodes[path].lock_ref == 0:
        raise NotLocked(f"no lock holds the node at {path}")
    nodes = dict(state.nodes)
    released = 0
    for ancestor in _ancestors(state, path):
        node = nodes[ancestor]
        if node.lock_ref == 1:
            released += len(node.slots)
        nodes[ancestor] = replace(node, lock_ref=node.lock_ref - 1)
    return replace(state, nodes=nodes), released


# --------------------------------------------------------------------------
# Eviction and reset
# --------------------------------------------------------------------------


def evict(state: RadixState, num_tokens: int) -> tuple[RadixState, EvictResult]:
    """Remove unlocked leaves, smallest eviction key first, until ``num_tokens`` are gone.

    Whole nodes go, so more than ``num_tokens`` may be evicted; fewer only
    when nothing evictable is left. A parent left without children (and
    unlocked) becomes a candidate in the same call. Each removed node is one
    ``BlockRemoved`` of all its pages, and its slots are returned.

    Complexity: O(number of nodes squared), a model's luxury.

    >>> cache, _ = insert(new_radix_cache(), [1, 2], [10, 11])
    >>> cache, _ = insert(cache, [3], [20])
    >>> evict(cache, 1)[1]      # the least recently used leaf goes first
    EvictResult(num_evicted=2, freed=((10, 11),))
    """
    # Verify that the number of tokens is a non-negative integer
    if type(num_tokens) is not int or num_tokens < 0:
        raise InvalidTokenCount(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
    nodes = dict(state.nodes)
    candidates = {p for p, n in nodes.items() if n.lock_ref == 0 and _is_leaf(nodes, p)}
    events = state.pending_events
    evicted, freed = 0, []
    while evicted < num_tokens and candidates:
        victim = min(candidates, key=lambda p: eviction_key(state.config, p, nodes[p]))
        candidates.remove(victim)
        node = nodes.pop(victim)
        evicted += len(node.slots)
        freed.append(node.slots)
        if state.config.enable_events:
            hashes = page_hashes(victim, state.config.page_size)[len(node.parent) // _ps(state) :]
            events = _enqueue(events, BlockRemoved(hashes, MEDIUM_GPU, 0))
        parent = node.parent
        if parent != ROOT and nodes[parent].lock_ref == 0 and _is_leaf(nodes, parent):
            candidates.add(parent)
    new_state = replace(state, nodes=nodes, pending_events=events)
    return new_state, EvictResult(evicted, tuple(freed))


def reset(state: RadixState) -> tuple[RadixState, None]:
    """Drop the whole tree (locks included) without freeing a slot; one ``AllBlocksCleared``.

    Events still pending are kept, before the clear.

    >>> cache, _ = insert(new_radix_cache(enable_events=False), [1], [10])
    >>> reset(cache)[0].nodes
    {}
    """
    events = state.pending_events
    if state.config.enable_events:
        events = (*events, AllBlocksCleared())
    return replace(state, nodes={}, pending_events=events), None


def take_events(state: RadixState) -> tuple[RadixState, tuple[KVCacheEvent, ...]]:
    """Hand out the queued events, oldest first, and empty the queue.

    >>> cache, _ = take_events(new_radix_cache(page_size=2))
    >>> cache, _ = insert(cache, [1, 2, 3, 4], [10, 11, 12, 13])
    >>> [(len(e.block_hashes), e.parent_block_hash, e.token_ids) for e in take_events(cache)[1]]
    [(2, None, (1, 2, 3, 4))]
    """
    return replace(state, pending_events=()), state.pending_events


# --------------------------------------------------------------------------
# Queries
# --------------------------------------------------------------------------


def evictable_size(state: RadixState) -> int:
    """Tokens in unlocked nodes.

    >>> evictable_size(insert(new_radix_cache(), [1, 2], [10, 11])[0])
    2
    """
    return sum(len(n.slots) for n in state.nodes.values() if n.lock_ref == 0)


def protected_size(state: RadixState) -> int:
    """Tokens in locked nodes.

    >>> protected_size(new_radix_cache())
    0
    """
    return sum(len(n.slots) for n in state.nodes.values() if n.lock_ref > 0)


def total_size(state: RadixState) -> int:
    """Tokens cached.

    >>> total_size(insert(new_radix_cache(page_size=2), [1, 2, 3], [10, 11, 12])[0])
    2
    """
    return sum(len(n.slots) for n in state.nodes.values())


def path_slots(state: RadixState, path: Path) -> tuple[int, ...]:
    """The slots from the root to the end of the node at ``path``.

    >>> path_slots(insert(new_radix_cache(), [1, 2], [10, 11])[0], (1, 2))
    (10, 11)
    """
    # Verify that the path names a node (or the root)
    _verify_node(state, path)
    slots: tuple[int, ...] = ()
    for ancestor in reversed(_ancestors(state, path)):
        slots += state.nodes[ancestor].slots
    return slots


def tree_view(state: RadixState) -> tuple[tuple[Path, tuple[int, ...]], ...]:
    """Every node as (path, slots), by path: what any radix cache's snapshot must equal.

    >>> cache, _ = insert(new_radix_cache(), [1, 2], [10, 11])
    >>> tree_view(match_prefix(cache, [1])[0])
    (((1,), (10,)), ((1, 2), (11,)))
    """
    return tuple(sorted((path, node.slots) for path, node in state.nodes.items()))


def longest_prefix(state: RadixState, tokens: Sequence[int]) -> int:
    """How many page-aligned tokens of ``tokens`` are cached, without touching anything.

    >>> longest_prefix(insert(new_radix_cache(), [1, 2, 3], [10, 11, 12])[0], [1, 2, 9])
    2
    """
    key = _aligned(state, _verify_tokens(tokens))
    node, position = ROOT, 0
    while position < len(key):
        child = _child(state.nodes, node, key[position : position + state.config.page_size])
        if child is None:
            break
        matched = _common_pages(child[position:], key[position:], state.config.page_size)
        position += matched
        if position < len(child):
            break
        node = child
    return position


def eviction_key(config: RadixConfig, path: Path, node: RadixNode) -> tuple[int, ...]:
    """What evict ranks a leaf by, smallest first: the policy's key, the last access, the path.

    ``lru``: oldest access; ``mru``: newest; ``fifo``: oldest creation;
    ``filo``: newest; ``lfu``: fewest hits; ``priority``: lowest priority;
    ``slru``: below the protected threshold of hits before above it (the
    last three then by oldest access).

    >>> eviction_key(RadixConfig(policy="lfu"), (1,), RadixNode((), (5,), last_access=3))
    (0, 3, 3, 1)
    """
    policy = {
        "lru": (node.last_access,),
        "mru": (-node.last_access,),
        "fifo": (node.created,),
        "filo": (-node.created,),
        "lfu": (node.hit_count, node.last_access),
        "priority": (node.priority, node.last_access),
        "slru": (int(node.hit_count >= config.slru_protected_threshold), node.last_access),
    }[config.policy]
    return (*policy, node.last_access, *path)


def eviction_order(state: RadixState) -> tuple[Path, ...]:
    """The paths evict would remove, first to last, if asked for every evictable token.

    >>> cache, _ = insert(new_radix_cache(), [1, 2], [10, 11])
    >>> cache, _ = insert(cache, [1, 3], [10, 12])
    >>> eviction_order(cache)
    ((1, 2), (1, 3), (1,))
    """
    nodes = dict(state.nodes)
    order: list[Path] = []
    candidates = {p for p, n in nodes.items() if n.lock_ref == 0 and _is_leaf(nodes, p)}
    while candidates:
        victim = min(candidates, key=lambda p: eviction_key(state.config, p, nodes[p]))
        candidates.remove(victim)
        parent = nodes.pop(victim).parent
        order.append(victim)
        if parent != ROOT and nodes[parent].lock_ref == 0 and _is_leaf(nodes, parent):
            candidates.add(parent)
    return tuple(order)


def page_hashes(path: Path, page_size: int) -> tuple[bytes, ...]:
    """The event hash of every whole page of ``path``: a SHA-256 chain, cut to 8 bytes.

    Page i's digest is SHA-256 of page i-1's whole digest (nothing for the
    first page) followed by page i's tokens as little-endian 32-bit words.
    SGLang publishes the first 8 bytes as a signed big-endian int64
    (``event_hash_int``).

    >>> [event_hash_int(h) for h in page_hashes((1, 2, 3, 4), 2)]
    [3817746824117602890, -4216701448867210342]
    """
    return tuple(digest[:8] for digest in _page_digests(tuple(path), page_size))


def event_hash_int(page_hash: bytes) -> int:
    """A page hash as the signed int64 SGLang's events carry.

    >>> event_hash_int(bytes([255] * 8))
    -1
    """
    return int.from_bytes(page_hash, "big", signed=True)


# --------------------------------------------------------------------------
# Helpers (not operations)
# --------------------------------------------------------------------------


def _ps(state: RadixState) -> int:
    return state.config.page_size


@lru_cache(maxsize=4096)
def _page_digests(path: Path, page_size: int) -> tuple[bytes, ...]:
    digests: list[bytes] = []
    prior = b""
    for start in range(0, len(path) - page_size + 1, page_size):
        page = path[start : start + page_size]
        prior = hashlib.sha256(prior + struct.pack(f"<{page_size}I", *page)).digest()
        digests.append(prior)
    return tuple(digests)


def _verify_tokens(tokens: object) -> tuple[int, ...]:
    if isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence):
        raise InvalidTokens(f"tokens must be a sequence of integers, not {type(tokens).__name__}")
    for token in tokens:
        if type(token) is not int or not 0 <= token <= MAX_TOKEN:
            raise InvalidTokens(f"token {token!r} is not an integer in 0..{MAX_TOKEN}")
    return tuple(tokens)


def _verify_slots(slots: object) -> tuple[int, ...]:
    if isinstance(slots, str | bytes) or not isinstance(slots, Sequence):
        raise InvalidSlots(f"slots must be a sequence of integers, not {type(slots).__name__}")
    for slot in slots:
        if type(slot) is not int or slot < 0:
            raise InvalidSlots(f"slot {slot!r} is not a non-negative integer")
    return tuple(slots)


def _verify_node(state: RadixState, path: object) -> None:
    if path != ROOT and (not isinstance(path, tuple) or path not in state.nodes):
        raise UnknownNode(f"no node ends at {path!r}")


def _aligned(state: RadixState, key: tuple[int, ...]) -> tuple[int, ...]:
    return key[: len(key) - len(key) % state.config.page_size]


def _child(nodes: Mapping[Path, RadixNode], parent: Path, page: Path) -> Path | None:
    """The child of ``parent`` whose segment starts with ``page``, if there is one."""
    start = len(parent)
    for path, node in nodes.items():
        if node.parent == parent and path[start : start + len(page)] == page:
            return path
    return None


def _common_pages(a: Path, b: Path, page_size: int) -> int:
    """The length of the common prefix of ``a`` and ``b``, rounded down to whole pages."""
    common = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        common += 1
    return common - common % page_size


def _split(nodes: dict[Path, RadixNode], path: Path, at: int) -> None:
    """Split the node at ``path`` after ``at`` tokens of its path (in place, on a copy).

    The new upper node copies everything but the slots from the old one
    (lock count, stamps, hits, priority), as SGLang's split does.
    """
    node = nodes[path]
    cut = at - len(node.parent)
    nodes[path[:at]] = replace(node, slots=node.slots[:cut])
    # The lower part keeps its path, so its children need no change.
    nodes[path] = replace(node, parent=path[:at], slots=node.slots[cut:])


def _ancestors(state: RadixState, path: Path) -> list[Path]:
    """The node at ``path`` and every ancestor, nearest first (the root left out)."""
    chain = []
    while path != ROOT:
        chain.append(path)
        path = state.nodes[path].parent
    return chain


def _is_leaf(nodes: Mapping[Path, RadixNode], path: Path) -> bool:
    return not any(node.parent == path for node in nodes.values())


def _store_events(
    events: tuple[KVCacheEvent, ...], leaf: Path, parent: Path, page_size: int
) -> tuple[KVCacheEvent, ...]:
    """One ``BlockStored`` per page of the new leaf, each enqueued (and so coalesced)."""
    hashes = page_hashes(leaf, page_size)
    previous = hashes[len(parent) // page_size - 1] if parent else None
    for index in range(len(parent) // page_size, len(hashes)):
        page = leaf[index * page_size : (index + 1) * page_size]
        stored = BlockStored(
            block_hashes=(hashes[index],),
            parent_block_hash=previous,
            token_ids=page,
            block_size=page_size,
            lora_id=None,
            medium=MEDIUM_GPU,
            lora_name=None,
            extra_keys=None,
            group_idx=0,
        )
        events = _enqueue(events, stored)
        previous = hashes[index]
    return events


def _enqueue(events: tuple[KVCacheEvent, ...], event: KVCacheEvent) -> tuple[KVCacheEvent, ...]:
    """SGLang's coalescing queue: chained stores extend the tail, removals join removals."""
    if events:
        tail = events[-1]
        if (
            isinstance(tail, BlockRemoved)
            and isinstance(event, BlockRemoved)
            and tail.medium == event.medium
        ):
            removed = replace(tail, block_hashes=tail.block_hashes + event.block_hashes)
            return (*events[:-1], removed)
        if (
            isinstance(tail, BlockStored)
            and isinstance(event, BlockStored)
            and (tail.medium, tail.lora_id, tail.block_size, tail.lora_name)
            == (event.medium, event.lora_id, event.block_size, event.lora_name)
            and tail.block_hashes
            and event.parent_block_hash == tail.block_hashes[-1]
        ):
            stored = replace(
                tail,
                block_hashes=tail.block_hashes + event.block_hashes,
                token_ids=tail.token_ids + event.token_ids,
            )
            return (*events[:-1], stored)
    return (*events, event)
