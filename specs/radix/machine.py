"""The lock-step machine for radix caches: the model and a target, operation by operation.

The pattern is the v0 machine's: Hypothesis builds programs on tiny caches
(pages of 1 to 3 tokens, keys of up to 8 tokens from a three-letter
alphabet, so prefixes are shared, nodes split and inserts de-duplicate all
the time). Each call runs on the model first; a call the model rejects is
not sent at level 1 and must be rejected alike at level 2. Results are
compared, and after every step the two sizes, the tree (when the target has
``snapshot()``) and every invariant are checked.

The machine plays SGLang's request layer and its KV allocator:

* it owns ``NUM_SLOTS`` KV slots; an insert writes the KV of the key's new
  tokens into fresh slots (``insert_computed``), or first matches the key
  and shares the hit, as a request does (``insert_after_match``, which passes
  the shared length as ``prev_prefix_len``); duplicates and evicted slots
  come back to it, and a reset returns every cached slot;
* it records what each slot holds (the **token ground truth**), so a hit or
  a cached path serving another prefix's KV is found even when the model and
  the target agree;
* it locks only the node the call just before returned (``lock_last``),
  as a request locks the node its match gave, and unlocks what it locked.

Level 2 adds calls no request layer should make: unlocking a node no lock
holds, locking or unlocking a node that was evicted, an insert with too few
slots or a negative ``prev_prefix_len``, and a negative eviction.

Insert results are compared by prefix length, node and the duplicate
*slots*, not by how they are cut into segments: SGLang's unified cache
frees them node by node, its legacy request layer in one call.
"""

import difflib
from collections.abc import Callable, Collection, Sequence
from typing import Any, ClassVar, NoReturn

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvpool.model import KVCacheEvent, PoolError
from kvpool.model import radix as model
from kvpool.model.radix import ROOT, InsertResult, Path, RadixConfig, RadixState
from kvpool.specs import prefix_cache
from kvpool.specs.errors import Divergence
from kvpool.specs.radix.invariants import (
    RadixInvariantViolation,
    TreeView,
    check_all,
    check_tree,
    dump_tree,
    rationale,
)
from kvpool.specs.radix.target import RadixTarget, RadixTargetFactory
from kvpool.specs.runner.lockstep import LockStep

NUM_SLOTS = 32
MAX_KEY = 8
PAGE_SIZES = (1, 2, 3)
TOKENS = st.lists(st.integers(1, 3), max_size=MAX_KEY)
SHORT = st.lists(st.integers(1, 3), max_size=3)
PICK = st.integers(0, 63)
PRIORITY = st.integers(0, 2)
INSERTED = st.integers(0, MAX_KEY)

InsertSeen = tuple[int, Path, tuple[int, ...]]
"""What the machine compares of an insert: prefix length, node, duplicate slots."""


class RadixDivergence(Divergence):
    """The target and the model parted: the message says where, and the calls that led there."""


def _compared(result: InsertResult) -> InsertSeen:
    return result.prefix_len, result.path, tuple(s for seg in result.duplicates for s in seg)


class RadixMachine(LockStep[RadixState, RadixTarget], RuleBasedStateMachine):
    """Drives ``make_target`` against the radix model. Subclass via ``radix_machine(...)``."""

    make_target: ClassVar[RadixTargetFactory]
    policy: ClassVar[str] = "lru"
    events: ClassVar[tuple[bool, ...]] = (True, False)
    page_sizes: ClassVar[tuple[int, ...]] = PAGE_SIZES
    skip: ClassVar[frozenset[tuple[str, str]]] = frozenset()
    """(operation, model error) pairs not sent even at level 2: known findings stepped over."""
    divergence = RadixDivergence

    def __init__(self) -> None:
        super().__init__()
        self.model = None
        self.target = None
        self.trace = []
        self.free_slots: list[int] = list(range(NUM_SLOTS))
        self.truth: dict[int, tuple[int, ...]] = {}
        self.held: list[tuple[Path, tuple[int, ...]]] = []
        self.last_node: Path | None = None
        self.seen: set[Path] = set()
        self.taken: list[KVCacheEvent] = []
        self.after_take = False

    # ------------------------------------------------------------------
    # Construction and helpers
    # ------------------------------------------------------------------

    @initialize(page=st.integers(0, 63), events=st.integers(0, 63))
    def new_radix_cache(self, page: int, events: int) -> None:
        page_size = self.page_sizes[page % len(self.page_sizes)]
        enable_events = self.events[events % len(self.events)]
        config = RadixConfig(page_size, self.policy, enable_events)
        self.model = model.new_radix_cache(page_size, self.policy, enable_events)
        self._note(
            f"new_radix_cache(page_size={page_size}, policy={self.policy!r}, "
            f"enable_events={enable_events})"
        )
        self.target = type(self).make_target(config)

    def ready(self) -> bool:
        return self.model is not None

    def aligned(self, tokens: Sequence[int]) -> int:
        assert self.model is not None
        page = self.model.config.page_size
        return len(tokens) - len(tokens) % page

    def take_slots(self, count: int, tokens: Sequence[int], start: int) -> list[int] | None:
        """``count`` fresh slots, with the KV of ``tokens[start:]`` written into them."""
        if count > len(self.free_slots):
            event("not enough free slots: insert skipped")
            return None
        slots, self.free_slots = self.free_slots[:count], self.free_slots[count:]
        for offset, slot in enumerate(slots):
            self.truth[slot] = tuple(tokens[: start + offset + 1])
        return slots

    def give_back(self, slots: Sequence[int]) -> None:
        self.free_slots = sorted({*self.free_slots, *slots})

    def locked_slots(self) -> set[int]:
        return {slot for _, slots in self.held for slot in slots}

    def returned(self, path: Path) -> None:
        self.last_node = path
        self.seen.add(path)

    # ------------------------------------------------------------------
    # Insert and match
    # ------------------------------------------------------------------

    @precondition(ready)
    @rule(tokens=TOKENS, priority=PRIORITY, inserted=INSERTED)
    def insert_computed(self, tokens: list[int], priority: int, inserted: int) -> None:
        """A request that computed the KV of every page-aligned token inserts it all."""
        slots = self.take_slots(self.aligned(tokens), tokens, 0)
        if slots is not None:
            self._insert(tokens, slots, 0, priority, inserted, slots)

    @precondition(ready)
    @rule(tokens=TOKENS, share=st.integers(0, MAX_KEY), priority=PRIORITY, inserted=INSERTED)
    def insert_after_match(
        self, tokens: list[int], share: int, priority: int, inserted: int
    ) -> None:
        """A request matches its key, shares up to ``share`` hit tokens and inserts the rest."""
        hit = self._match(tokens)
        if hit is None:
            return
        prev = min(share, hit.prefix_len)
        fresh = self.take_slots(self.aligned(tokens) - prev, tokens, prev)
        if fresh is not None:
            self._insert(tokens, [*hit.slots[:prev], *fresh], prev, priority, inserted, fresh)

    @precondition(ready)
    @rule(tokens=TOKENS, priority=PRIORITY, earlier=st.integers(0, MAX_KEY), finish=st.booleans())
    def request_checkpoint(
        self, tokens: list[int], priority: int, earlier: int, finish: bool
    ) -> None:
        """A request as SGLang's scheduler runs it (``RadixCache.checkpoint``).

        It matches its key and locks the hit, writes the rest, inserts the
        key sharing the hit (``earlier`` of its tokens counted as inserted by
        an earlier chunk), then moves its lock from the hit's node to the
        key's node; a request that ``finish`` es releases it at once, the
        others keep it (``unlock`` releases it later). Four arguments, so
        that shrinking prefers the one-call rules to this one.
        """
        hit = self._match(tokens)
        if hit is None or not self._lock(hit.path):
            return
        fresh = self.take_slots(self.aligned(tokens) - hit.prefix_len, tokens, hit.prefix_len)
        if fresh is None:
            return
        prev = hit.prefix_len
        self._insert(tokens, [*hit.slots, *fresh], prev, priority, min(earlier, prev), fresh)
        node = self.last_node
        if node is not None and node != hit.path:
            self.held.remove(next(h for h in self.held if h[0] == hit.path))
            self._unlock(hit.path)
            self._lock(node)
        if finish and self.held:
            self._unlock(self.held.pop()[0])

    def _insert(
        self,
        tokens: list[int],
        slots: list[int],
        prev: int,
        priority: int,
        inserted: int,
        fresh: list[int],
    ) -> None:
        applied, seen = self._step(
            f"insert({tokens}, {slots}, prev_prefix_len={prev}, priority={priority}, "
            f"inserted_len={inserted})",
            lambda s: self._compared_insert(s, tokens, slots, prev, priority, inserted),
            lambda t: _compared(t.insert(tokens, slots, prev, priority, inserted)),
        )
        if not applied:
            self.give_back(fresh)
            return
        assert seen is not None
        _, path, duplicates = seen
        self._check_freed(duplicates)
        self.give_back(duplicates)
        self.returned(path)

    @staticmethod
    def _compared_insert(
        state: RadixState,
        tokens: list[int],
        slots: list[int],
        prev: int,
        priority: int,
        inserted: int,
    ) -> tuple[RadixState, InsertSeen]:
        state, result = model.insert(
            state, tokens, slots, prev_prefix_len=prev, priority=priority, inserted_len=inserted
        )
        return state, _compared(result)

    @precondition(ready)
    @rule(tokens=TOKENS)
    def match_prefix(self, tokens: list[int]) -> None:
        self._match(tokens)

    @precondition(lambda self: self.model is not None and bool(self.model.nodes))
    @rule(pick=PICK, cut=st.integers(0, MAX_KEY), tail=SHORT)
    def match_cached(self, pick: int, cut: int, tail: list[int]) -> None:
        """Match a cached path, cut short by up to ``cut`` tokens, followed by ``tail``."""
        assert self.model is not None
        paths = sorted(self.model.nodes)
        path = paths[pick % len(paths)]
        self._match([*path[: max(len(path) - cut, 0)], *tail])

    def _match(self, tokens: list[int]) -> model.MatchResult | None:
        applied, hit = self._step(
            f"match_prefix({tokens})",
            lambda s: model.match_prefix(s, tokens),
            lambda t: t.match_prefix(tokens),
        )
        if not applied or hit is None:
            return None
        reason = prefix_cache.hit_serves_inserted_tokens(self.truth, tokens, hit.slots)
        if reason is not None:
            self._violated("hit_serves_inserted_tokens", reason)
        self.returned(hit.path)
        return hit

    # ------------------------------------------------------------------
    # Locks
    # ------------------------------------------------------------------

    @precondition(lambda self: self.model is not None and self.last_node is not None)
    @rule()
    def lock_last(self) -> None:
        """Lock the node the latest match or insert returned, as a request does."""
        assert self.last_node is not None
        self._lock(self.last_node)

    def _lock(self, path: Path) -> bool:
        applied, _ = self._step(
            f"lock({list(path)})", lambda s: model.lock(s, path), lambda t: t.lock(path)
        )
        if applied:
            assert self.model is not None
            self.held.append((path, model.path_slots(self.model, path)))
        return applied

    @precondition(lambda self: self.model is not None and bool(self.held))
    @rule(pick=PICK)
    def unlock(self, pick: int) -> None:
        path, _ = self.held.pop(pick % len(self.held))
        self._unlock(path)

    def _unlock(self, path: Path) -> None:
        self._step(
            f"unlock({list(path)})",
            lambda s: _unlocked(s, path),
            lambda t: t.unlock(path),
            returns_none=True,
        )

    # ------------------------------------------------------------------
    # Eviction, reset, events
    # ------------------------------------------------------------------

    @precondition(ready)
    @rule(num_tokens=st.integers(0, 10))
    def evict(self, num_tokens: int) -> None:
        self._evict(num_tokens)

    def _evict(self, num_tokens: int) -> None:
        applied, result = self._step(
            f"evict({num_tokens})",
            lambda s: model.evict(s, num_tokens),
            lambda t: t.evict(num_tokens),
        )
        if applied:
            assert result is not None
            freed = [slot for segment in result.freed for slot in segment]
            self._check_freed(freed)
            self.give_back(freed)
            self.last_node = None

    @precondition(ready)
    @rule(really=st.integers(0, 3))
    def reset(self, really: int) -> None:
        """Reset the cache, one time in four (a reset empties everything the program built)."""
        assert self.model is not None
        if really:
            return
        cached = [s for node in self.model.nodes.values() for s in node.slots]
        applied, _ = self._step("reset()", model.reset, lambda t: t.reset(), returns_none=True)
        if applied:
            self.give_back(cached)
            self.held = []
            self.last_node = None

    @precondition(ready)
    @rule()
    def take_events(self) -> None:
        applied, events = self._step(
            "take_events()", model.take_events, lambda t: tuple(t.take_events())
        )
        if applied and events is not None:
            self.taken.extend(events)
            self.after_take = True

    # ------------------------------------------------------------------
    # Level 2: calls no request layer makes
    # ------------------------------------------------------------------

    @precondition(lambda self: self.level >= 2 and self.last_node not in (None, ROOT))
    @rule()
    def unlock_unlocked(self) -> None:
        """Unlock the node just returned when no lock holds it."""
        assert self.model is not None and self.last_node is not None
        path = self.last_node
        if path not in self.model.nodes or self.model.nodes[path].lock_ref:
            return
        self._step(
            f"unlock({list(path)})",
            lambda s: _unlocked(s, path),
            lambda t: t.unlock(path),
            returns_none=True,
        )

    @precondition(lambda self: self.level >= 2 and bool(self.gone()))
    @rule(pick=PICK, unlock=st.booleans())
    def lock_gone(self, pick: int, unlock: bool) -> None:
        """Lock or unlock a node that was returned once and is gone (evicted or reset)."""
        gone = self.gone()
        path = gone[pick % len(gone)]
        name = "unlock" if unlock else "lock"
        self._step(
            f"{name}({list(path)})",
            lambda s: _unlocked(s, path) if unlock else model.lock(s, path),
            lambda t: t.unlock(path) if unlock else t.lock(path),
            returns_none=unlock,
        )

    def gone(self) -> list[Path]:
        assert self.model is not None
        return sorted(p for p in self.seen if p != ROOT and p not in self.model.nodes)

    @precondition(lambda self: self.level >= 2 and self.model is not None)
    @rule(tokens=st.lists(st.integers(1, 3), min_size=3, max_size=MAX_KEY), short=st.booleans())
    def insert_bad_arguments(self, tokens: list[int], short: bool) -> None:
        """An insert with one slot too few, or with ``prev_prefix_len=-1``."""
        count = self.aligned(tokens) - (1 if short else 0)
        slots = self.take_slots(count, tokens, 0)
        if slots is not None:
            self._insert(tokens, slots, 0 if short else -1, 0, 0, slots)

    @precondition(lambda self: self.level >= 2 and self.model is not None)
    @rule(num_tokens=st.integers(-3, -1))
    def evict_negative(self, num_tokens: int) -> None:
        self._evict(num_tokens)

    # ------------------------------------------------------------------
    # After every step
    # ------------------------------------------------------------------

    @invariant()
    def target_agrees_with_model(self) -> None:
        if self.model is None or self.target is None:
            return
        sizes = (self.target.evictable_size(), self.target.protected_size())
        self._compare(
            "evictable_size(), protected_size()",
            (model.evictable_size(self.model), model.protected_size(self.model)),
            sizes,
        )
        check_all(self.model, self.taken)
        snapshot = getattr(self.target, "snapshot", None)
        view: TreeView | None = None
        if snapshot is not None:
            view = tuple(snapshot())
            expected = model.tree_view(self.model)
            if view != expected:
                raise RadixDivergence(
                    self._history(
                        "the target's tree differs from the model's:\n" + _diff(expected, view)
                    )
                )
        taken = self.taken if self.after_take and self.model.config.enable_events else None
        self.after_take = False
        check_tree(
            view if view is not None else model.tree_view(self.model),
            self.model.config.page_size,
            evictable=sizes[0],
            protected=sizes[1],
            truth=self.truth,
            taken=taken,
        )
        if view is not None:
            self._slot_conservation(view)

    def _slot_conservation(self, view: TreeView) -> None:
        cached = [slot for _, slots in view for slot in slots]
        twice = sorted({s for s in cached if cached.count(s) > 1})
        both = sorted(set(cached) & set(self.free_slots))
        lost = sorted(set(range(NUM_SLOTS)) - set(cached) - set(self.free_slots))
        if twice or both or lost:
            self._violated(
                "slot_conservation",
                f"slots cached twice {twice}, cached and freed {both}, neither {lost}",
            )

    def _check_freed(self, freed: Sequence[int]) -> None:
        reason = prefix_cache.locked_data_never_freed(freed, self.locked_slots())
        if reason is not None:
            self._violated("locked_data_never_freed", reason)

    def _violated(self, name: str, reason: str) -> NoReturn:
        function = getattr(prefix_cache, name, None)
        why = rationale(function) if function is not None else SLOT_CONSERVATION.strip()
        raise RadixInvariantViolation(name, reason, why, self._history("the calls so far"))

    # ------------------------------------------------------------------
    # Lock-step machinery (the rest is kvpool.specs.runner.lockstep)
    # ------------------------------------------------------------------

    def _rejected_by_model(
        self, description: str, expected: type[PoolError], on_target: Callable[[RadixTarget], Any]
    ) -> None:
        operation = description.split("(")[0]
        if (operation, expected.__name__) in self.skip:
            event(f"known finding stepped over: {operation} {expected.__name__}")
            return
        super()._rejected_by_model(description, expected, on_target)

    def _diverge(self, description: str, what: str) -> NoReturn:
        raise RadixDivergence(self._history(f"{description}: {what}"))

    def _history(self, what: str) -> str:
        calls = "\n".join(f"  {line}" for line in self.trace_lines())
        return f"{what}\n\ncalls (model results):\n{calls}"


SLOT_CONSERVATION = """Every KV slot is either free or cached, never both, never cached twice.

The caller's allocator hands out free slots; the tree holds the rest. A slot
cached and free at once is overwritten by the next request while the tree
still serves it; a slot in neither is leaked; a slot cached twice serves one
prefix's KV for another.
"""


def _unlocked(state: RadixState, path: Path) -> tuple[RadixState, Any]:
    """unlock on the model, its result dropped: targets return nothing (SGLang's cores differ)."""
    return model.unlock(state, path)[0], None


def _diff(expected: TreeView, actual: TreeView) -> str:
    return "\n".join(
        difflib.unified_diff(
            dump_tree(expected).splitlines(),
            dump_tree(actual).splitlines(),
            fromfile="model",
            tofile="target",
            lineterm="",
        )
    )


def radix_machine(
    make_target: RadixTargetFactory,
    policy: str = "lru",
    level: int = 1,
    *,
    events: Sequence[bool] = (True, False),
    page_sizes: Sequence[int] = PAGE_SIZES,
    skip: Collection[tuple[str, str]] = (),
    name: str = "RadixMachine",
) -> type[RadixMachine]:
    """A state machine class that checks ``make_target`` under an eviction ``policy``."""
    if policy not in model.POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}; known: {', '.join(model.POLICIES)}")
    attrs: dict[str, Any] = {
        "make_target": staticmethod(make_target),
        "policy": policy,
        "level": level,
        "events": tuple(events),
        "page_sizes": tuple(page_sizes),
        "skip": frozenset(skip),
    }
    return type(name, (RadixMachine,), attrs)
