"""The event machine: engines serve requests, their events go to a consumer, queries compare.

Each program builds one to three engines (workers), each a pool of 3 to 6
blocks of 1 or 2 tokens, and one consumer. Its steps are what engines do
while serving: admit a request (``serve``: hit, allocate, cache), fill one
more block (``extend``), finish one, evict a cached block, reset the prefix
cache (``drain_and_reset`` first finishes every request, so it succeeds),
and restart (the consumer is told ``remove_worker``). Tokens come from a
two-letter alphabet, so prompts share prefixes all the time, and a prompt
served twice holds its last block twice.

After every step the engine's events are taken and sent to the consumer as
one batch; then the consumer scores aimed queries: the six most recent
prompts and grown requests (cached, partly cached, evicted, held twice),
and a ``query`` rule adds any prefix. Each score is compared with what each
engine would actually hit (``Engine.cached_prefix``), by the named
invariants of ``kvpool.specs.events.invariants``.

Two ways to run it, one property ("a router can rebuild the engine"):

* ``under_test="consumer"``: the engines are the model's pool, the
  consumer is the target;
* ``under_test="producer"``: the engines are the target (any pool behind
  the pool target protocol), the consumer is the reference fold. A producer
  whose pool has ``snapshot()`` is also held to ``event_stream_consistency``.

The target's exceptions are target errors, never divergences: a consumer
that rejects an event or crashes cannot be scored. Passing queries change
nothing and are left out of the trace, so a shrunk failure reads as the
engines' actions, the batches of events they published, and the one query
the consumer got wrong. ``steps`` holds the same program as consumer-vector
steps (``kvpool.specs.vectors.events``).
"""

from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar, NoReturn, TypeVar

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvpool.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSemantics,
    KVCacheEvent,
)
from kvpool.specs.errors import InvariantViolation, TargetError
from kvpool.specs.events.engine import query_for
from kvpool.specs.events.invariants import STREAM_INVARIANTS, score_problems
from kvpool.specs.events.target import (
    MAIN_GROUP,
    Consumer,
    ConsumerConfig,
    ConsumerFactory,
    Engine,
    EngineConfig,
    EngineFactory,
    Query,
    RemovesWorkers,
)
from kvpool.specs.pool.machine import tokens_from_bits
from kvpool.specs.protocol import codec
from kvpool.specs.protocol.codec import Json
from kvpool.specs.runner.lockstep import LockStep

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)

MAX_WORKERS = 3
AIMED_QUERIES = 6
TOKENS = st.integers(0, 2**16 - 1).map(tokens_from_bits)
"""Sixteen tokens of a two-letter alphabet, drawn as one integer (``kvpool.specs.pool.machine``)."""
WORKER = st.integers(0, MAX_WORKERS - 1)
PICK = st.integers(0, 63)
ROLES = ("consumer", "producer")


class EventsMachine(LockStep[list[Engine], Consumer], RuleBasedStateMachine):
    """Drives engines and a consumer. Subclass via ``events_machine(...)``."""

    make_consumer: ClassVar[ConsumerFactory]
    make_engine: ClassVar[EngineFactory]
    semantics: ClassVar[EventSemantics] = EventSemantics.MULTISET
    under_test: ClassVar[str] = "consumer"

    def __init__(self) -> None:
        super().__init__()
        self.model = None
        self.target = None
        self.trace = []
        self.steps: list[dict[str, Json]] = []
        self.recent: deque[tuple[int, ...]] = deque(maxlen=AIMED_QUERIES)
        self.config = ConsumerConfig(1, 1, self.semantics)
        self.taken: list[list[KVCacheEvent]] = []
        self.engine_config = EngineConfig(1, 1, self.semantics)
        self.last_action = ""

    # ------------------------------------------------------------------
    # Construction
    # ------------------------------------------------------------------

    @initialize(
        num_workers=st.integers(1, MAX_WORKERS),
        num_blocks=st.integers(3, 6),
        block_size=st.integers(1, 2),
    )
    def start(self, num_workers: int, num_blocks: int, block_size: int) -> None:
        self.config = ConsumerConfig(num_workers, block_size, self.semantics)
        self.engine_config = EngineConfig(num_blocks, block_size, self.semantics)
        self._note(
            f"{num_workers} worker(s), each a pool of {num_blocks} blocks of {block_size} "
            f"token(s); events: {self.semantics.value}"
        )
        self.model = [self._new_engine() for _ in range(num_workers)]
        self.taken = [[] for _ in range(num_workers)]
        make = type(self).make_consumer
        self.target = self._on_consumer("building the consumer", lambda: make(self.config))

    def _new_engine(self) -> Engine:
        make = type(self).make_engine
        return self._on_engine("building an engine", lambda: make(self.engine_config))

    def started(self) -> bool:
        return self.model is not None and self.target is not None

    def busy(self) -> list[int]:
        """The workers with a running request."""
        return [w for w, e in enumerate(self.model or ()) if e.running()]

    def engine(self, worker: int) -> Engine:
        assert self.model is not None
        return self.model[worker]

    def worker(self, index: int) -> int:
        return index % self.config.num_workers

    # ------------------------------------------------------------------
    # What engines do
    # ------------------------------------------------------------------

    @precondition(lambda self: self.started())
    @rule(worker=WORKER, tokens=TOKENS, blocks=st.integers(1, 4))
    def serve(self, worker: int, tokens: list[int], blocks: int) -> None:
        self._serve(self.worker(worker), tokens[: blocks * self.config.block_size])

    def _serve(self, w: int, prompt: list[int]) -> None:
        handle = self._on_engine(f"serve({prompt})", lambda: self.engine(w).serve(prompt))
        outcome = "not scheduled (no room)" if handle is None else f"request {w}.{handle}"
        self._act(w, f"worker {w}: serve {prompt} -> {outcome}")
        if tuple(prompt) in self.recent:
            self.recent.remove(tuple(prompt))
        self.recent.append(tuple(prompt))
        self._publish(w)

    @precondition(lambda self: self.started() and bool(self.recent))
    @rule(worker=WORKER, pick=PICK, blocks=st.integers(0, 3))
    def serve_again(self, worker: int, pick: int, blocks: int) -> None:
        """A recent prompt again, whole or cut short, on any worker: copies and shared prefixes.

        Drawn blindly, two prompts rarely match: in 164 ci programs a second copy
        of a block was never evicted while the first stayed, and a consumer that
        keeps a set instead of counts passed.
        """
        prompts = list(self.recent)
        prompt = list(prompts[pick % len(prompts)])
        size = self.config.block_size
        if blocks:
            prompt = prompt[: blocks * size] or prompt
        self._serve(self.worker(worker), prompt)

    @precondition(lambda self: self.started() and bool(self.busy()))
    @rule(worker=WORKER, pick=PICK, tokens=TOKENS)
    def extend(self, worker: int, pick: int, tokens: list[int]) -> None:
        busy = self.busy()
        w = busy[worker % len(busy)]
        handles = self.engine(w).running()
        handle = handles[pick % len(handles)]
        more = tokens[: self.config.block_size]
        done = self._on_engine(
            f"extend({handle}, {more})", lambda: self.engine(w).extend(handle, more)
        )
        self._act(w, f"worker {w}: request {w}.{handle} fills a block with {more}" + _no(done))
        tokens_of = getattr(self.engine(w), "tokens_of", None)
        if done and tokens_of is not None:
            self.recent.append(tuple(tokens_of(handle)))
        self._publish(w)

    @precondition(lambda self: self.started() and bool(self.busy()))
    @rule(worker=WORKER, pick=PICK)
    def finish(self, worker: int, pick: int) -> None:
        busy = self.busy()
        w = busy[worker % len(busy)]
        handles = self.engine(w).running()
        handle = handles[pick % len(handles)]
        self._on_engine(f"finish({handle})", lambda: self.engine(w).finish(handle))
        self._act(w, f"worker {w}: request {w}.{handle} finishes")
        self._publish(w)

    @precondition(lambda self: self.started())
    @rule(worker=WORKER, pick=PICK)
    def evict(self, worker: int, pick: int) -> None:
        w = self.worker(worker)
        block = self._on_engine(f"evict({pick})", lambda: self.engine(w).evict(pick))
        which = "a cached block" if block is None else f"block {block}"
        self._act(w, f"worker {w}: {which} is evicted from the cache")
        self._publish(w)

    @precondition(lambda self: self.started() and bool(self.busy()))
    @rule(worker=WORKER, pick=PICK, position=st.integers(0, 3))
    def evict_held(self, worker: int, pick: int, position: int) -> None:
        """Evict a block a running request holds (an engine with ``evict_held``).

        Blindly, ``evict`` rarely hits the last block of a request about to
        grow, or the middle of a chain about to be served again: in the ci
        profile neither of the two Dynamo findings behind them (parent
        missing, middle evicted) came up before the 147th program.
        """
        busy = self.busy()
        w = busy[worker % len(busy)]
        engine = self.engine(w)
        evict_held = getattr(engine, "evict_held", None)
        if evict_held is None:
            event("the engine cannot evict a held block")
            return
        handles = engine.running()
        handle = handles[pick % len(handles)]
        block = self._on_engine(
            f"evict_held({handle}, {position})", lambda: evict_held(handle, position)
        )
        self._act(
            w, f"worker {w}: block {block} of request {w}.{handle} is evicted (a failed load)"
        )
        self._publish(w)

    @precondition(lambda self: self.started())
    @rule(worker=WORKER)
    def drain_and_reset(self, worker: int) -> None:
        """Every request finishes, then the cache is reset (as an RL weight sync does)."""
        w = self.worker(worker)
        engine = self.engine(w)
        for handle in list(engine.running()):
            self._on_engine(f"finish({handle})", lambda h=handle: engine.finish(h))  # type: ignore[misc]
        done = self._on_engine("reset_prefix_cache()", engine.reset_prefix_cache)
        self._act(w, f"worker {w}: every request finishes, then reset_prefix_cache()" + _no(done))
        self._publish(w)

    @precondition(lambda self: self.started() and isinstance(self.target, RemovesWorkers))
    @rule(worker=WORKER)
    def restart(self, worker: int) -> None:
        """The engine restarts empty; the router is told to forget it."""
        w = self.worker(worker)
        assert self.model is not None and self.target is not None
        self.model[w] = self._new_engine()
        self.taken[w] = []
        self._act(w, f"worker {w}: restarts with an empty cache")
        consumer = self.target
        assert isinstance(consumer, RemovesWorkers)
        self.trace.append((f"remove_worker({w})", None))
        self.steps.append({"op": "remove_worker", "worker": w})
        self._on_consumer(f"remove_worker({w})", lambda: consumer.remove_worker(w))
        self._ask_aimed()

    @precondition(lambda self: self.started())
    @rule(tokens=TOKENS, blocks=st.integers(1, 5))
    def query(self, tokens: list[int], blocks: int) -> None:
        """Any prefix, cached or not."""
        self._ask(tuple(tokens[: blocks * self.config.block_size]))

    # ------------------------------------------------------------------
    # Events and queries
    # ------------------------------------------------------------------

    def _act(self, worker: int, what: str) -> None:
        self._note(what)
        self.last_action = what

    def _publish(self, worker: int) -> None:
        """Send the worker's new events to the consumer as one batch, then ask the queries."""
        engine = self.engine(worker)
        events = tuple(self._on_engine("take_events()", engine.take_events))
        if events:
            self.taken[worker].extend(events)
            self.trace.append((f"apply_events(worker={worker}, {show_events(events)})", None))
            self.steps.append(
                {
                    "op": "apply_events",
                    "worker": worker,
                    "events": [codec.encode_event(e) for e in events],
                    "comment": self.last_action,
                }
            )
            self._check_stream(worker)
            consumer = self.target
            assert consumer is not None
            self._on_consumer(
                f"apply_events(worker={worker}, {show_events(events)})",
                lambda: consumer.apply_events(worker, events),
            )
        self._ask_aimed()

    def _ask_aimed(self) -> None:
        for tokens in list(self.recent):
            self._ask(tokens)

    def _ask(self, tokens: tuple[int, ...]) -> None:
        query = self._query_for(tokens)
        if not query.block_hashes:
            return
        truth = {
            w: self._on_engine("cached_prefix", lambda e=e: e.cached_prefix(query))  # type: ignore[misc]
            for w, e in enumerate(self.model or ())
        }
        consumer = self.target
        assert consumer is not None
        scores = self._on_consumer(f"scores({list(tokens)})", lambda: consumer.scores(query))
        said = self._valid_scores(scores, query, tokens)
        problems = score_problems(truth, said)
        if not problems:
            return
        expected = [truth[w] for w in range(self.config.num_workers)]
        self.trace.append(
            (
                f"scores({list(tokens)}): the engines hold {expected}, the consumer says "
                f"{[said.get(w, 0) for w in range(self.config.num_workers)]}",
                None,
            )
        )
        self.steps.append({"op": "scores", "query": encode_query(query), "expect": expected})
        name, reason, rationale = problems[0]
        violation = InvariantViolation(
            name, f"scores({list(tokens)}): {reason}", rationale, self._dump()
        )
        said_list = [said.get(w, 0) for w in range(self.config.num_workers)]
        raise self._with_program(violation, said=said_list)

    def _query_for(self, tokens: tuple[int, ...]) -> Query:
        """The query a router makes of ``tokens``, hashed as the engines hash (``Engine.query``)."""
        own = getattr(self.engine(0), "query", None)
        if own is None:
            return query_for(tokens, self.config.block_size)
        query: Query = self._on_engine(f"query({list(tokens)})", lambda: own(tokens))
        return query

    def _valid_scores(
        self, scores: object, query: Query, tokens: tuple[int, ...]
    ) -> dict[int, int]:
        """The scores as a dict, or a target error if they are not scores of this query."""
        problem = scores_problem(scores, self.config.num_workers, len(query.block_hashes))
        if problem is not None:
            self._garbage(f"scores({list(tokens)}) answered {scores!r}: {problem}")
        assert isinstance(scores, Mapping)
        return {int(w): int(n) for w, n in scores.items()}

    def _check_stream(self, worker: int) -> None:
        """A producer with a snapshot: its stream folds to exactly its hash map."""
        if self.under_test != "producer":
            return
        snapshot = getattr(self.engine(worker), "snapshot", None)
        state = snapshot() if snapshot is not None else None
        if state is None:
            return
        for invariant in STREAM_INVARIANTS:
            reason = invariant(state, self.taken[worker])
            if reason is not None:
                doc = (invariant.__doc__ or "").strip()
                raise self._with_program(
                    InvariantViolation(
                        invariant.__name__, f"worker {worker}: {reason}", doc, self._dump()
                    )
                )

    # ------------------------------------------------------------------
    # Calls into the two sides
    # ------------------------------------------------------------------

    def _on_consumer(self, description: str, call: Callable[[], T]) -> T:
        return self._guarded("consumer", description, call)

    def _on_engine(self, description: str, call: Callable[[], T]) -> T:
        return self._guarded("producer", description, call)

    def _guarded(self, side: str, description: str, call: Callable[[], T]) -> T:
        """Run ``call``; if ``side`` is the target, any exception it raises is a target error."""
        if side != self.under_test:
            return call()
        try:
            return call()
        except TargetError:
            raise
        except Exception as error:
            raise self._with_program(
                TargetError(f"the {side} raised {error!r} during {description}\n\n{self._dump()}")
            ) from error

    def _garbage(self, what: str) -> NoReturn:
        raise self._with_program(
            TargetError(f"the {self.under_test} answers garbage: {what}\n\n{self._dump()}")
        )

    def _with_program(self, error: E, said: list[int] | None = None) -> E:
        """``error``, carrying this program as consumer-vector data (``events_program``).

        ``said``: the consumer's scores of the failing query, one per worker.
        """
        program = {
            "config": {
                "num_workers": self.config.num_workers,
                "block_size": self.config.block_size,
            },
            "steps": list(self.steps),
            "said": said,
        }
        setattr(error, "events_program", program)  # noqa: B010  (exceptions take attributes)
        return error

    def _dump(self) -> str:
        lines = ["the program (engines' actions, batches sent, the query):"]
        lines.extend(f"  {line}" for line in self.trace_lines())
        describe = getattr(self.target, "describe", None)
        if describe is not None:
            try:
                text = str(describe())
            except Exception as error:  # a broken describe must not hide the failure
                text = f"(describe() raised {error!r})"
            lines.append("what the consumer holds:")
            lines.extend(f"  {line}" for line in text.splitlines())
        return "\n".join(lines)

    def trace_lines(self) -> list[str]:
        return [line for line, _ in self.trace]


def _no(done: object) -> str:
    if not done:
        event("engine step refused (no room, or requests still running)")
    return "" if done else " (refused)"


def scores_problem(scores: object, num_workers: int, num_blocks: int) -> str | None:
    """Why ``scores`` is not an answer to a query of ``num_blocks`` blocks, or None.

    >>> scores_problem({0: 1}, 2, 1) is None
    True
    >>> scores_problem({0: 2}, 1, 1)
    'worker 0 scored 2, but the query has 1 full block(s)'
    """
    if not isinstance(scores, Mapping):
        return "not a mapping from worker to score"
    for worker, score in scores.items():
        if isinstance(worker, bool) or not isinstance(worker, int):
            return f"worker {worker!r} is not an integer"
        if not 0 <= worker < num_workers:
            return f"worker {worker} is not one of 0..{num_workers - 1}"
        if isinstance(score, bool) or not isinstance(score, int):
            return f"worker {worker}'s score {score!r} is not an integer"
        if not 0 <= score <= num_blocks:
            return f"worker {worker} scored {score}, but the query has {num_blocks} full block(s)"
    return None


def show_event(event: KVCacheEvent) -> str:
    """One event in a line a person can read; hashes as hex, like the vectors.

    >>> show_event(BlockRemoved((b"\\x01\\x02",), "GPU", 0))
    'removed 0102'
    """
    group = "" if getattr(event, "group_idx", MAIN_GROUP) == MAIN_GROUP else " (group "
    if group:
        group += f"{getattr(event, 'group_idx', '?')})"
    if isinstance(event, BlockStored):
        parent = "root" if event.parent_block_hash is None else event.parent_block_hash.hex()
        hashes = " ".join(h.hex() for h in event.block_hashes) or "nothing"
        return f"stored {hashes} under {parent}{group}"
    if isinstance(event, BlockRemoved):
        return f"removed {' '.join(h.hex() for h in event.block_hashes)}{group}"
    if isinstance(event, AllBlocksCleared):
        return "cleared"
    return repr(event)


def show_events(events: Sequence[KVCacheEvent]) -> str:
    """A batch of events on one line."""
    return "[" + "; ".join(show_event(e) for e in events) + "]"


def encode_query(query: Query) -> dict[str, Json]:
    """A query as the consumer protocol's JSON."""
    return {
        "token_ids": list(query.token_ids),
        "block_hashes": [codec.encode_hash(h) for h in query.block_hashes],
    }


ENGINE_STEPS = (
    "serve",
    "serve_again",
    "extend",
    "finish",
    "evict",
    "evict_held",
    "drain_and_reset",
    "restart",
)
"""The machine's engine steps; ``without`` leaves some out."""


def events_machine(
    make_consumer: ConsumerFactory,
    make_engine: EngineFactory,
    semantics: EventSemantics,
    under_test: str = "consumer",
    name: str = "EventsMachine",
    without: Collection[str] = (),
) -> type[EventsMachine]:
    """A machine class checking ``make_consumer`` against ``make_engine``'s engines (or back).

    ``without`` names engine steps (``ENGINE_STEPS``) no program takes: a
    survey of a consumer's findings leaves out the step behind one found
    already, to see what else diverges.
    """
    if under_test not in ROLES:
        raise ValueError(f"under_test must be one of {ROLES}, not {under_test!r}")
    unknown = set(without) - set(ENGINE_STEPS)
    if unknown:
        raise ValueError(f"unknown engine steps {sorted(unknown)}; known: {ENGINE_STEPS}")
    attrs: dict[str, Any] = {
        "make_consumer": staticmethod(make_consumer),
        "make_engine": staticmethod(make_engine),
        "semantics": semantics,
        "under_test": under_test,
    }
    attrs.update({step: None for step in without})
    return type(name, (EventsMachine,), attrs)
