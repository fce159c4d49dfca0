"""The lock-step machine for the v0 allocator: the model and a target, operation by operation.

The pattern is the v1 machine's (``kvpool.specs.pool.machine``): Hypothesis builds
programs of allocator calls on tiny allocators (1 to 6 blocks of 1 to 3
tokens, tokens from a two-letter alphabet so contents repeat and
de-duplication happens all the time). Each call runs on the model first; a
call the model rejects is not sent (level 1: valid programs only). Then it
runs on the target, the results are compared, and after every step the whole
state (``snapshot()``) is compared and every v0 invariant is run on both.

Block objects are named by handles, numbered in creation order on both
sides. Rules pick a live handle by position (``pick`` modulo the number of
live handles), so every program is valid by construction or filtered by the
model. Divergences print the calls made so far, one per line.

Two **disciplines** decide which programs are generated:

* ``any``: every valid call, at any time value, on any block.
* ``engine``: what vLLM's v0 block manager does. Time comes from a clock
  that never goes back; only held blocks are marked as accessed (whole
  sequences at once); a sequence is freed whole, first block first, right
  after its blocks are marked with a fresh time; a new block is only
  appended to the end of a sequence. Under this discipline the
  binary-search property (``v0_invariants.cached_prefix_closed``) is checked
  as an invariant too: it holds for every program the engine can make.
  vLLM's allocator conforms under this discipline; under ``any`` the
  machine finds its evictor bugs (docs/semantics.md, "The v0 allocator").
"""

from collections.abc import Sequence
from typing import ClassVar, NoReturn

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvpool.model import PoolError
from kvpool.model import v0 as model
from kvpool.model.v0 import V0Config, V0State
from kvpool.specs.errors import Divergence
from kvpool.specs.runner.lockstep import LockStep, dump_diff
from kvpool.specs.v0.invariants import (
    V0InvariantViolation,
    cached_prefix_closed,
    check_all,
    dump_v0_state,
)
from kvpool.specs.v0.target import V0Target, V0TargetFactory

MAX_BLOCKS = 6
MAX_BLOCK_SIZE = 3
TOKENS = st.lists(st.integers(1, 2), min_size=MAX_BLOCK_SIZE * 3, max_size=MAX_BLOCK_SIZE * 3)
PICK = st.integers(0, 63)
DISCIPLINES = ("any", "engine")


class V0Divergence(Divergence):
    """The target and the model parted: the message says where, and the calls that led there."""


class V0Machine(LockStep[V0State, V0Target], RuleBasedStateMachine):
    """Drives ``make_target`` against the v0 model. Subclass via ``v0_machine(...)``."""

    make_target: ClassVar[V0TargetFactory]
    discipline: ClassVar[str] = "any"
    divergence = V0Divergence

    def __init__(self) -> None:
        super().__init__()
        self.model = None
        self.target = None
        self.clock = 0
        self.trace = []

    @property
    def engine(self) -> bool:
        return self.discipline == "engine"

    # ------------------------------------------------------------------
    # Construction and picking
    # ------------------------------------------------------------------

    @initialize(num_blocks=st.integers(1, MAX_BLOCKS), block_size=st.integers(1, MAX_BLOCK_SIZE))
    def new_allocator(self, num_blocks: int, block_size: int) -> None:
        config = V0Config(num_blocks, block_size)
        self.model = model.new_allocator(num_blocks, block_size)
        self._note(f"new_allocator(num_blocks={num_blocks}, block_size={block_size})")
        self.target = type(self).make_target(config)

    def live(self) -> list[int]:
        assert self.model is not None
        return sorted(self.model.handles)

    def has_live(self) -> bool:
        return self.model is not None and bool(self.model.handles)

    def pick(self, pick: int) -> int:
        live = self.live()
        return live[pick % len(live)]

    def tails(self) -> list[int]:
        """Live handles that no live handle follows: the ends of sequences."""
        assert self.model is not None
        followed = {b.prev for b in self.model.handles.values()}
        return [h for h in self.live() if h not in followed]

    def pick_prev(self, pick: int | None) -> int | None:
        """A previous block for a new one: none, or (engine) the end of a sequence."""
        if pick is None or not self.has_live():
            return None
        candidates = self.tails() if self.engine else self.live()
        return candidates[pick % len(candidates)] if candidates else None

    def block_size(self) -> int:
        assert self.model is not None
        return self.model.config.block_size

    # ------------------------------------------------------------------
    # Allocation and appending
    # ------------------------------------------------------------------

    @precondition(lambda self: self.model is not None)
    @rule(prev=st.none() | PICK)
    def allocate_mutable_block(self, prev: int | None) -> None:
        after = self.pick_prev(prev)
        self._step(
            f"allocate_mutable_block(prev={after})",
            lambda s: model.allocate_mutable_block(s, after),
            lambda t: t.allocate_mutable_block(after),
        )

    @precondition(lambda self: self.model is not None)
    @rule(prev=st.none() | PICK, tokens=TOKENS)
    def allocate_immutable_block(self, prev: int | None, tokens: list[int]) -> None:
        after = self.pick_prev(prev)
        block = tokens[: self.block_size()]
        self._step(
            f"allocate_immutable_block(prev={after}, token_ids={block})",
            lambda s: model.allocate_immutable_block(s, after, block),
            lambda t: t.allocate_immutable_block(after, block),
        )

    @precondition(lambda self: self.model is not None)
    @rule(prev=st.none() | PICK, count=st.integers(1, 3), tokens=TOKENS)
    def allocate_immutable_blocks(self, prev: int | None, count: int, tokens: list[int]) -> None:
        after = self.pick_prev(prev)
        size = self.block_size()
        blocks = [tokens[i * size : (i + 1) * size] for i in range(count)]
        self._step(
            f"allocate_immutable_blocks(prev={after}, block_token_ids={blocks})",
            lambda s: model.allocate_immutable_blocks(s, after, blocks),
            lambda t: tuple(t.allocate_immutable_blocks(after, blocks)),
        )

    def fills_like_cached(self) -> list[tuple[int, tuple[int, ...]]]:
        """(mutable handle, tokens) pairs whose append makes a full block some live block holds."""
        if self.model is None:
            return []
        handles = self.model.handles
        found = []
        for h, block in sorted(handles.items()):
            if block.content_hash is not None:
                continue
            have = len(block.token_ids)
            for other in handles.values():
                same_start = other.token_ids[:have] == block.token_ids
                if other.content_hash is not None and other.prev == block.prev and same_start:
                    found.append((h, other.token_ids[have:]))
        return found

    @precondition(lambda self: bool(self.fills_like_cached()))
    @rule(pick=PICK)
    def fill_like_a_cached_block(self, pick: int) -> None:
        """Fill a mutable block with the content a cached block after the same block has.

        Promotion must then de-duplicate into the cached block. Drawn blindly,
        a fill rarely matches cached content once blocks hold 3 tokens: a planted
        no-deduplication bug went unfound in 6 of 20 seeds at 150 programs.
        """
        candidates = self.fills_like_cached()
        handle, appended = candidates[pick % len(candidates)]
        self._step(
            f"append_token_ids({handle}, {list(appended)})",
            lambda s: model.append_token_ids(s, handle, appended),
            lambda t: t.append_token_ids(handle, appended),
        )

    @precondition(lambda self: self.has_live())
    @rule(pick=PICK, count=st.integers(0, MAX_BLOCK_SIZE), fill=st.booleans(), tokens=TOKENS)
    def append_token_ids(self, pick: int, count: int, fill: bool, tokens: list[int]) -> None:
        """Append ``count`` tokens (capped to the empty slots), or fill the block."""
        assert self.model is not None
        handle = self.pick(pick)
        empty = self.block_size() - len(self.model.handles[handle].token_ids)
        appended = tokens[: empty if fill else min(count, empty)]
        self._step(
            f"append_token_ids({handle}, {appended})",
            lambda s: model.append_token_ids(s, handle, appended),
            lambda t: t.append_token_ids(handle, appended),
        )

    # ------------------------------------------------------------------
    # Sharing
    # ------------------------------------------------------------------

    @precondition(lambda self: self.has_live())
    @rule(pick=PICK)
    def fork(self, pick: int) -> None:
        handle = self.tails()[pick % len(self.tails())] if self.engine else self.pick(pick)
        self._step(
            f"fork({handle})",
            lambda s: model.fork(s, handle),
            lambda t: tuple(t.fork(handle)),
        )

    @precondition(lambda self: self.has_live())
    @rule(pick=PICK)
    def cow_block_if_not_appendable(self, pick: int) -> None:
        handle = self.pick(pick)
        self._step(
            f"cow_block_if_not_appendable({handle})",
            lambda s: model.cow_block_if_not_appendable(s, handle),
            lambda t: t.cow_block_if_not_appendable(handle),
        )

    @precondition(lambda self: self.model is not None)
    @rule()
    def clear_copy_on_writes(self) -> None:
        self._step(
            "clear_copy_on_writes()",
            model.clear_copy_on_writes,
            lambda t: tuple(tuple(pair) for pair in t.clear_copy_on_writes()),
        )

    # ------------------------------------------------------------------
    # Freeing
    # ------------------------------------------------------------------

    @precondition(lambda self: self.has_live() and not self.engine)
    @rule(pick=PICK)
    def free(self, pick: int) -> None:
        self._free(self.pick(pick))

    @precondition(lambda self: self.has_live())
    @rule(pick=PICK, mark=st.booleans(), now=st.integers(0, 4))
    def free_sequence(self, pick: int, mark: bool, now: int) -> None:
        """Free a whole sequence, first block first; engine: marked at a fresh time just before."""
        assert self.model is not None
        tails = self.tails()
        if not tails:
            return
        handle = tails[pick % len(tails)]
        try:
            handles = model.chain(self.model, handle)
        except PoolError:
            event("level 1: a sequence with a freed block is not freed whole")
            return
        if self.engine:
            self.clock += 1
            mark, now = True, self.clock
        if mark:
            self._mark_accessed(handles, now)
        for handle in handles:
            self._free(handle)

    def _free(self, handle: int) -> None:
        self._step(
            f"free({handle})",
            lambda s: model.free(s, handle),
            lambda t: t.free(handle),
        )

    # ------------------------------------------------------------------
    # Access times and computed blocks
    # ------------------------------------------------------------------

    @precondition(lambda self: self.has_live())
    @rule(pick=PICK, tick=st.integers(0, 2), now=st.integers(0, 4))
    def mark_sequence_as_accessed(self, pick: int, tick: int, now: int) -> None:
        """Mark every block of a sequence (engine: at the clock, moved on by ``tick``)."""
        assert self.model is not None
        handle = self.pick(pick)
        try:
            handles = model.chain(self.model, handle)
        except PoolError:
            event("level 1: a sequence with a freed block is not marked")
            return
        if self.engine:
            self.clock += tick
            now = self.clock
        self._mark_accessed(handles, now)

    def _mark_accessed(self, handles: Sequence[int], now: int) -> None:
        assert self.model is not None
        ids = [self.model.handles[h].block_id for h in handles]
        self._step(
            f"mark_blocks_as_accessed({ids}, now={now})",
            lambda s: model.mark_blocks_as_accessed(s, ids, now),
            lambda t: t.mark_blocks_as_accessed(ids, now),
        )

    @precondition(lambda self: self.model is not None and not self.engine)
    @rule(
        block_ids=st.lists(st.integers(0, MAX_BLOCKS - 1), min_size=1, max_size=3),
        now=st.integers(0, 4),
    )
    def mark_blocks_as_accessed(self, block_ids: list[int], now: int) -> None:
        """Any blocks, held or evictable (vLLM's block manager only marks held ones)."""
        self._step(
            f"mark_blocks_as_accessed({block_ids}, now={now})",
            lambda s: model.mark_blocks_as_accessed(s, block_ids, now),
            lambda t: t.mark_blocks_as_accessed(block_ids, now),
        )

    @precondition(lambda self: self.model is not None)
    @rule()
    def mark_blocks_as_computed(self) -> None:
        self._step(
            "mark_blocks_as_computed([])",
            lambda s: model.mark_blocks_as_computed(s, []),
            lambda t: t.mark_blocks_as_computed([]),
        )

    # ------------------------------------------------------------------
    # Queries and reset
    # ------------------------------------------------------------------

    @precondition(lambda self: self.model is not None)
    @rule(tokens=TOKENS, pick=st.none() | PICK)
    def find_cached_blocks_prefix(self, tokens: list[int], pick: int | None) -> None:
        """Hashes of random tokens, or of a live sequence's tokens followed by random ones."""
        assert self.model is not None
        prefix: tuple[int, ...] = ()
        if pick is not None and self.has_live():
            try:
                handles = model.chain(self.model, self.pick(pick))
                prefix = sum((self.model.handles[h].token_ids for h in handles), ())
            except PoolError:
                prefix = ()
        hashes = model.content_hashes(prefix + tuple(tokens), self.block_size())[:6]
        self._query(
            f"find_cached_blocks_prefix({list(hashes)})",
            lambda s: model.find_cached_blocks_prefix(s, hashes),
            lambda t: tuple(t.find_cached_blocks_prefix(hashes)),
        )

    @precondition(lambda self: self.model is not None)
    @rule(lists=st.lists(st.lists(st.integers(0, 3), max_size=3), max_size=3))
    def get_common_computed_block_ids(self, lists: list[list[int]]) -> None:
        self._query(
            f"get_common_computed_block_ids({lists})",
            lambda s: model.get_common_computed_block_ids(lists),
            lambda t: tuple(t.get_common_computed_block_ids(lists)),
        )

    @precondition(lambda self: self.model is not None)
    @rule()
    def reset_prefix_cache(self) -> None:
        self._step(
            "reset_prefix_cache()", model.reset_prefix_cache, lambda t: t.reset_prefix_cache()
        )

    # ------------------------------------------------------------------
    # After every step
    # ------------------------------------------------------------------

    @invariant()
    def target_agrees_with_model(self) -> None:
        if self.model is None or self.target is None:
            return
        self._compare(
            "get_num_free_blocks()",
            model.get_num_free_blocks(self.model),
            self._call("get_num_free_blocks()", lambda t: t.get_num_free_blocks()),
        )
        check_all(self.model)
        snapshot = self._call("snapshot()", lambda t: t.snapshot())
        if snapshot != self.model:
            raise V0Divergence(
                self._history(
                    "the target's state differs from the model's:\n"
                    + state_diff(self.model, snapshot)
                )
            )
        check_all(snapshot)
        reason = cached_prefix_closed(self.model)
        if reason is None:
            return
        if self.engine:
            doc = (cached_prefix_closed.__doc__ or "").strip()
            raise V0InvariantViolation("cached_prefix_closed", reason, doc, self.model)
        event("the binary-search property does not hold (cached prefix not closed)")

    # ------------------------------------------------------------------
    # Lock-step machinery (the rest is kvpool.specs.runner.lockstep)
    # ------------------------------------------------------------------

    def _diverge(self, description: str, what: str) -> NoReturn:
        raise V0Divergence(self._history(f"{description}: {what}"))

    def _history(self, what: str) -> str:
        calls = "\n".join(f"  {line}" for line in self.trace_lines())
        return f"{what}\n\ncalls (model results):\n{calls}"


def state_diff(expected: V0State, actual: V0State) -> str:
    """The two states side by side, as a unified diff of their dumps."""
    return dump_diff(dump_v0_state(expected), dump_v0_state(actual))


def v0_machine(
    make_target: V0TargetFactory, discipline: str = "any", name: str = "V0Machine"
) -> type[V0Machine]:
    """A state machine class that checks ``make_target`` under ``discipline``."""
    if discipline not in DISCIPLINES:
        raise ValueError(f"unknown discipline {discipline!r}; known: {', '.join(DISCIPLINES)}")
    attrs = {"make_target": staticmethod(make_target), "discipline": discipline}
    return type(name, (V0Machine,), attrs)
