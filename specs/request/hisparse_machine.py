"""The request layer's HiSparse machine: slice 1 (two pools, write-back, publication).

A target whose scope says ``hisparse`` (``ManagerTargetSpec.hisparse``) is checked on
HiSparse managers built as vLLM 0.33.0's tests build them (``make_hisparse_kv_cache_config``
in ``tests/v1/core/test_prefix_caching.py``): group 0 the host-resident source, 1 an indexer,
then one or two (resident, hot) pairs, blocks of 16 tokens, a host pool of its own. The rules
play a scheduler and its workers (docs/hisparse.md, "How the vLLM side is driven"):

* ``admit`` and ``step`` call ``allocate_slots`` then ``advance_scheduled`` for the request,
  as vLLM's tests do (their ``_allocate_scheduled``). Since slice 2 the model allocates hot
  regions, so these calls reach unpinning and, under ``pressure``, lost pages; no rule
  admits a hit or external tokens, which the model still refuses (slices 3 and 4).
* ``connector_step`` runs what ``build_connector_meta`` runs, in its order:
  ``advance_scheduled`` over the running requests, ``build_offload_command``,
  ``build_row_mirrors``, ``all_context_pages_resident``, ``take_residency_updates``.
* ``acknowledge`` plays one or two workers: it picks one request's queued transfers, a
  worker count per transfer, partial completions, sometimes an unknown id, and calls
  ``update_spills``. One request's transfers per call: vLLM publishes the requests one call
  completes in the order of a set of ids, which ``PYTHONHASHSEED`` decides.
* ``leave`` frees a request (finished or preempted), directly or through
  ``pop_blocks_for_free`` and a later free of the popped blocks, each in its own pool.
* ``pressure`` takes blocks from either pool directly, as vLLM's tests do, or gives them back.
* ``probe`` asks for a prompt's hit; ``maintain`` resets the prefix cache, evicts device
  blocks from it, or marks a request for its hot region. A reset is sent only when both
  pools are idle or both hold blocks: with exactly one busy, vLLM 0.33.0 resets the idle
  one and the spec neither (docs/hisparse.md). Coordinator calls name running requests
  only: the spec refuses an unknown id where vLLM creates a book for it.

After every call both sides' block tables, free counts and events (by kind, medium, size
and tokens: the two hash with different functions) are compared, and, with
``hisparse_view``, both pools' blocks, free queues and the coordinator's books. The
invariants of ``kvpool.specs.request.hisparse_invariants`` run on the model's state.
"""

from collections.abc import Sequence
from typing import Any, ClassVar

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool.model import DEFAULT_PROFILE, Profile
from kvpool.model import hisparse as model_hisparse
from kvpool.model import manager as model_manager
from kvpool.model import pool as pool_ops
from kvpool.model.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvpool.model.hisparse_layout import HiSparseConfig
from kvpool.model.manager import Blocks, KVCacheManagerState
from kvpool.model.request import Request, append_tokens, new_request, with_computed
from kvpool.model.single_type import full_attention
from kvpool.specs.errors import Divergence
from kvpool.specs.request import model_target
from kvpool.specs.request.hisparse_invariants import check_hisparse
from kvpool.specs.request.target import ManagerFactory, ManagerSetup, ManagerTargetHiSparse
from kvpool.specs.runner.lockstep import LockStep

BLOCK = 16
"""Every group's block and hash block, as in vLLM's tests."""

STEMS = (
    tuple((7 * i) % 50 for i in range(80)),
    tuple((7 * i) % 50 for i in range(32)) + tuple((3 * i + 1) % 50 for i in range(48)),
    tuple((11 * i + 5) % 50 for i in range(80)),
)
"""The prompts are prefixes of these: the first two share two blocks, so that publication
and hits matter."""


def hisparse_roles(num_resident_groups: int, host_num_blocks: int | None) -> HiSparseConfig:
    """vLLM's tests' layout: 0 source, 1 indexer, then (resident, hot) pairs, the hot groups
    of ``blocks_per_request=2``.

    >>> hisparse_roles(2, 10).hot_groups
    ((3, 2), (5, 2))
    """
    return HiSparseConfig(
        (0,),
        host_num_blocks,
        (1,),
        tuple(2 + 2 * i for i in range(num_resident_groups)),
        tuple((3 + 2 * i, 2) for i in range(num_resident_groups)),
    )


def hisparse_setup(
    num_blocks: int,
    host_num_blocks: int,
    *,
    max_model_len: int = 128,
    enable_caching: bool = True,
    enable_events: bool = False,
    num_prefill_lookahead: int = 0,
    num_resident_groups: int = 1,
    max_in_flight_tokens: int | None = None,
    profile: Profile | None = None,
) -> ManagerSetup:
    """A HiSparse ``ManagerSetup`` in vLLM's tests' layout (``hisparse_roles``)."""
    extra = {} if profile is None else {"profile": profile}
    return ManagerSetup(
        num_blocks=num_blocks,
        specs=(full_attention(BLOCK),) * (2 + 2 * num_resident_groups),
        max_model_len=max_model_len,
        hash_block_size=BLOCK,
        enable_caching=enable_caching,
        enable_events=enable_events,
        max_in_flight_tokens=max_in_flight_tokens,
        num_prefill_lookahead=num_prefill_lookahead,
        hisparse=hisparse_roles(num_resident_groups, host_num_blocks),
        **extra,  # type: ignore[arg-type]
    )


def event_summary(event: KVCacheEvent) -> tuple[object, ...]:
    """What is compared of a HiSparse event: kind, medium, number of hashes, tokens."""
    if isinstance(event, BlockStored):
        return ("BlockStored", event.medium, len(event.block_hashes), tuple(event.token_ids))
    if isinstance(event, BlockRemoved):
        return ("BlockRemoved", event.medium, len(event.block_hashes))
    assert isinstance(event, AllBlocksCleared), event
    return ("AllBlocksCleared",)


ACKED = st.sampled_from([True, True, True, False])
"""Whether a queued transfer is acknowledged in this call (most are)."""


class HiSparseDivergence(Divergence):
    """The HiSparse manager under test and the model parted."""


class HiSparseMachine(LockStep[KVCacheManagerState, ManagerTargetHiSparse], RuleBasedStateMachine):
    """Drives ``make_target`` against the model on HiSparse managers (``hisparse_machine``)."""

    make_target: ClassVar[ManagerFactory]
    profiles: ClassVar[tuple[Profile, ...]] = (DEFAULT_PROFILE,)
    """HiSparse is vLLM 0.33's: its profile, the default."""
    events_drawn: ClassVar[tuple[bool, ...]] = (False, True)
    divergence = HiSparseDivergence

    def __init__(self) -> None:
        super().__init__()
        self.model = None
        self.target = None
        self.trace = []
        self.requests: dict[str, Request] = {}
        self.scheduled: dict[str, int] = {}
        """Running requests: tokens computed once their last scheduled step runs."""
        self.workers: dict[int, int] = {}
        """Transfers handed out and not yet done: how many workers run each."""
        self.held: dict[str, list[int]] = {"CPU": [], "GPU": []}
        """Blocks pressed out of each pool and not yet released."""
        self.next_id = 0

    # ------------------------------------------------------------------

    @initialize(
        num_blocks=st.sampled_from([12, 20, 32, 48]),
        host=st.sampled_from([6, 10, 16]),
        max_model_len=st.sampled_from([64, 128]),
        caching=st.sampled_from([True, True, True, False]),
        events=st.sampled_from([False, True]),
        lookahead=st.sampled_from([0, 0, 3]),
        residents=st.sampled_from([1, 1, 2]),
        in_flight=st.sampled_from([None, 48]),
    )
    def start(
        self,
        num_blocks: int,
        host: int,
        max_model_len: int,
        caching: bool,
        events: bool,
        lookahead: int,
        residents: int,
        in_flight: int | None,
    ) -> None:
        cls = type(self)
        events = events if events in cls.events_drawn else cls.events_drawn[0]
        self.setup = hisparse_setup(
            num_blocks,
            host,
            max_model_len=max_model_len,
            enable_caching=caching,
            enable_events=events,
            num_prefill_lookahead=lookahead,
            num_resident_groups=residents,
            max_in_flight_tokens=in_flight,
            profile=cls.profiles[0],
        )
        self.model = model_target.ModelManagerTarget(self.setup).state
        self.target = cls.make_target(self.setup)  # type: ignore[assignment]

    # ------------------------------------------------------------------
    # The scheduler
    # ------------------------------------------------------------------

    def _new_request(self, stem: int, length: int) -> Request:
        self.next_id += 1
        assert self.model is not None
        length = max(1, min(length, self.model.config.max_model_len - 1, len(STEMS[stem])))
        request = new_request(f"r{self.next_id}", STEMS[stem][:length], BLOCK)
        self.requests[request.request_id] = request
        return request

    def _schedule(self, request: Request, chunk: int, lookahead: int, must_fit: bool) -> None:
        chunk = max(1, min(chunk, request.num_tokens - request.num_computed_tokens))
        done, blocks = self._step(
            f"allocate_slots({request.request_id!r}, {chunk}, lookahead={lookahead}, "
            f"full_sequence_must_fit={must_fit})",
            lambda m: model_manager.allocate_slots(
                m, request, chunk, 0, None, lookahead, False, must_fit
            ),
            lambda t: t.allocate_slots(
                request, chunk, num_lookahead_tokens=lookahead, full_sequence_must_fit=must_fit
            ),
        )
        if not done or blocks is None:
            return
        n = min(request.num_computed_tokens + chunk, request.num_tokens)
        self.scheduled[request.request_id] = n
        self._advance([(request.request_id, n)])

    def _advance(self, pairs: Sequence[tuple[str, int]]) -> None:
        self._step(
            f"advance_scheduled({list(pairs)!r})",
            lambda m: model_hisparse.advance_scheduled(m, pairs),
            lambda t: t.advance_scheduled(pairs),
            returns_none=True,
        )

    @precondition(lambda self: len(self.scheduled) < 5)
    @rule(
        stem=st.integers(0, len(STEMS) - 1),
        length=st.integers(1, 80),
        chunk=st.integers(1, 80),
        must_fit=st.sampled_from([False, False, True]),
    )
    def admit(self, stem: int, length: int, chunk: int, must_fit: bool) -> None:
        """A new request, scheduled without a hit (slice 1 models no host-tier hit)."""
        self._schedule(self._new_request(stem, length), chunk, 0, must_fit)

    @precondition(lambda self: bool(self.scheduled))
    @rule(
        which=st.integers(0, 4),
        chunk=st.integers(1, 80),
        lookahead=st.sampled_from([0, 0, 4]),
        token=st.integers(0, 49),
    )
    def step(self, which: int, chunk: int, lookahead: int, token: int) -> None:
        """The request's scheduled tokens were computed; it is scheduled again (decoding a
        new token once its prompt is done)."""
        assert self.model is not None
        rid = sorted(self.scheduled)[which % len(self.scheduled)]
        request = with_computed(self.requests[rid], self.scheduled[rid])
        if request.num_computed_tokens >= request.num_tokens:
            if request.num_tokens >= self.model.config.max_model_len:
                return
            request = append_tokens(request, [token])
        self.requests[rid] = request
        self._schedule(request, chunk, lookahead, False)

    @precondition(lambda self: bool(self.scheduled))
    @rule(which=st.integers(0, 4), token=st.integers(0, 49))
    def decode(self, which: int, token: int) -> None:
        """``step`` one token at a time (the common case once a prompt is done)."""
        self.step(which, 1, 0, token)

    @precondition(lambda self: bool(self.scheduled))
    @rule(chosen=st.sets(st.integers(0, 4), min_size=1))
    def advance(self, chosen: set[int]) -> None:
        """``advance_scheduled`` on its own, on some running requests."""
        ids = sorted(self.scheduled)
        picked = sorted({ids[i % len(ids)] for i in chosen})
        self._advance([(r, self.scheduled[r]) for r in picked])

    @rule()
    def connector_step(self) -> None:
        """``build_connector_meta``'s calls, in its order."""
        spans = [(r, max(0, self.scheduled[r] - 1), 1) for r in sorted(self.scheduled)]
        self._advance([(r, self.scheduled[r]) for r in sorted(self.scheduled)])
        self._offload()
        self._query(
            f"build_row_mirrors({spans!r})",
            lambda m: tuple(model_hisparse.build_row_mirrors(m, spans)),
            lambda t: tuple(t.build_row_mirrors(spans)),
        )
        self._step(
            f"all_context_pages_resident({spans!r})",
            lambda m: model_hisparse.all_context_pages_resident(m, spans),
            lambda t: t.all_context_pages_resident(spans),
        )
        ids = sorted(self.scheduled)
        self._step(
            f"take_residency_updates({ids!r})",
            lambda m: _updates(model_hisparse.take_residency_updates(m, ids)),
            lambda t: dict(t.take_residency_updates(ids)),
        )

    def _offload(self) -> None:
        _, transfers = self._step(
            "build_offload_command()",
            lambda m: _tuple(model_hisparse.build_offload_command(m)),
            lambda t: tuple(t.build_offload_command()),
        )
        for transfer in transfers or ():
            self.workers.setdefault(transfer.transfer_id, 1)

    @rule(
        data=st.data(),
        two=st.sampled_from([False, False, True]),
        unknown=st.sampled_from([False] * 4 + [True]),
    )
    def acknowledge(self, data: st.DataObject, two: bool, unknown: bool) -> None:
        """One or two workers acknowledge some of one request's transfers, partially."""
        assert self.model is not None and self.model.hisparse is not None
        self._offload()
        pending = self.model.hisparse.transfers
        live = sorted(t for t in self.workers if t in pending)
        if two:
            for tid in live:
                if not pending[tid].expected:  # no count sent yet: two workers run it
                    self.workers[tid] = 2
        owners = sorted({pending[t].request_id for t in live})
        enqueued: dict[int, int] = {}
        completed: dict[int, int] = {}
        if owners:
            owner = data.draw(st.sampled_from(owners), label="owner")
            for tid in live:
                if pending[tid].request_id == owner and data.draw(ACKED, label="ack"):
                    enqueued[tid] = self.workers[tid]
                    completed[tid] = data.draw(st.integers(1, self.workers[tid]), label="done")
        if unknown:
            completed[10_000] = 1
        self._step(
            f"update_spills({enqueued!r}, {completed!r})",
            lambda m: model_hisparse.update_spills(m, enqueued, completed),
            lambda t: t.update_spills(enqueued, completed),
            returns_none=True,
        )
        assert self.model.hisparse is not None
        self.workers = {t: w for t, w in self.workers.items() if t in self.model.hisparse.transfers}

    @precondition(lambda self: bool(self.scheduled))
    @rule(which=st.integers(0, 4), finished=st.booleans(), pop=st.booleans())
    def leave(self, which: int, finished: bool, pop: bool) -> None:
        """A request finishes or is preempted: freed, or popped and its blocks freed later."""
        rid = sorted(self.scheduled)[which % len(self.scheduled)]
        request = self.requests[rid]
        del self.scheduled[rid]
        if not pop:
            self._step(
                f"free({rid!r}, finished={finished})",
                lambda m: model_manager.free(m, rid, finished=finished),
                lambda t: t.free_request(request, finished),
                returns_none=True,
            )
            return
        _, popped = self._step(
            f"pop_blocks_for_free({rid!r}, finished={finished})",
            lambda m: model_hisparse.pop_blocks_for_free(m, rid, finished=finished),
            lambda t: tuple(t.pop_pool_blocks_for_free(request, finished)),
        )
        blocks = list(popped or ())[::-1]  # the scheduler frees them last first
        self._step(
            f"free_blocks({blocks!r})",
            lambda m: model_hisparse.free_pool_blocks(m, blocks),
            lambda t: t.free_pool_blocks(blocks),
            returns_none=True,
        )

    @rule(
        action=st.sampled_from(["press", "press", "release"]),
        host=st.booleans(),
        share=st.integers(0, 3),
    )
    def pressure(self, action: str, host: bool, share: int) -> None:
        """Take blocks from one pool directly (``get_new_blocks``), as vLLM's tests do, or
        give back every block taken so."""
        assert self.model is not None and self.model.host_pool is not None
        if action == "release":
            for pool, ids in self.held.items():
                if ids:
                    self._release(pool, tuple(ids))
            self.held = {"CPU": [], "GPU": []}
            return
        pool = "CPU" if host else "GPU"
        free = (self.model.host_pool if host else self.model.managers.pool).free_queue
        count = len(free) * share // 4
        _, taken = self._step(
            f"get_new_blocks({pool}, {count})",
            lambda m: model_target.press_pool(m, pool, count),
            lambda t: tuple(t.press_pool(pool, count)),
        )
        self.held[pool].extend(taken or ())

    def _release(self, pool: str, ids: tuple[int, ...]) -> None:
        self._step(
            f"free_blocks({pool}, {list(ids)!r})",
            lambda m: model_target.release_pool(m, pool, ids),
            lambda t: t.release_pool(pool, ids),
            returns_none=True,
        )

    @rule(stem=st.integers(0, len(STEMS) - 1), length=st.integers(1, 80))
    def probe(self, stem: int, length: int) -> None:
        """A new prompt's hit (the request is not scheduled)."""
        request = self._new_request(stem, length)
        self._step(
            f"get_computed_blocks({request.request_id!r})",
            lambda m: model_manager.get_computed_blocks(m, request),
            lambda t: t.get_computed_blocks(request),
        )

    @rule(
        action=st.sampled_from(["hot", "hot", "reset", "evict"]),
        which=st.integers(0, 4),
        block_ids=st.sets(st.integers(0, 47), max_size=4),
    )
    def maintain(self, action: str, which: int, block_ids: set[int]) -> None:
        """A running request is asked for its hot region, device blocks are evicted from the
        prefix cache (``evict_blocks``), or the prefix cache is reset."""
        if action == "evict":
            assert self.model is not None
            ids = sorted(b for b in block_ids if b < len(self.model.managers.pool.blocks))
            self._step(
                f"evict_blocks({ids!r})",
                lambda m: model_manager.evict_blocks(m, ids),
                lambda t: t.evict_blocks(ids),
                returns_none=True,
            )
            return
        if action == "reset" or not self.scheduled:
            if self._one_pool_busy():
                # vLLM 0.33.0 would reset the idle pool, the spec neither: not sent at
                # level 1 (docs/hisparse.md, "Surprises"; tests/vllm pins vLLM's answer)
                event("level 1: reset_prefix_cache with one pool busy not sent")
                return
            self._step(
                "reset_prefix_cache()",
                model_manager.reset_prefix_cache,
                lambda t: t.reset_prefix_cache(),
            )
            return
        rid = sorted(self.scheduled)[which % len(self.scheduled)]
        self._step(
            f"require_hot({rid!r})",
            lambda m: model_hisparse.require_hot(m, rid),
            lambda t: t.require_hot(rid),
            returns_none=True,
        )

    def _one_pool_busy(self) -> bool:
        """Whether exactly one of the two pools holds a block (beyond its null block)."""
        assert self.model is not None and self.model.host_pool is not None
        busy = [
            pool_ops.get_num_free_blocks(pool) != len(pool.blocks) - 1
            for pool in (self.model.host_pool, self.model.managers.pool)
        ]
        return busy[0] != busy[1]

    # ------------------------------------------------------------------
    # What is compared and checked after every step
    # ------------------------------------------------------------------

    @invariant()
    def target_agrees(self) -> None:
        if self.model is None or self.target is None:
            return
        target = self.target
        self._step(
            "take_events()",
            lambda m: _summaries(model_manager.take_events(m)),
            lambda t: tuple(event_summary(e) for e in t.take_events()),
        )
        for rid in sorted(self.requests):
            self._tables(rid)
        self._query(
            "num_free_blocks()", model_manager.num_free_blocks, lambda t: t.num_free_blocks()
        )
        self._query("usage()", model_manager.usage, lambda t: t.usage())
        view = getattr(target, "hisparse_view", None)
        if callable(view):
            self._query("hisparse_view()", model_target.hisparse_view, lambda t: view())
        assert self.model is not None
        check_hisparse(self.model, self.held)

    def _tables(self, rid: str) -> None:
        self._query(
            f"get_block_ids({rid!r})",
            lambda m: _ids(model_manager.get_block_ids(m, rid)),
            lambda t: _ids(t.get_block_ids(rid)),
        )


def _tuple(result: tuple[KVCacheManagerState, Any]) -> tuple[KVCacheManagerState, Any]:
    return result[0], tuple(result[1])


def _updates(result: tuple[KVCacheManagerState, Any]) -> tuple[KVCacheManagerState, Any]:
    return result[0], dict(result[1])


def _summaries(
    result: tuple[KVCacheManagerState, Sequence[KVCacheEvent]],
) -> tuple[KVCacheManagerState, tuple[tuple[object, ...], ...]]:
    return result[0], tuple(event_summary(e) for e in result[1])


def _ids(blocks: Blocks) -> tuple[tuple[int, ...], ...]:
    # vLLM's tables are defaultdicts: a group never allocated has an empty row
    return tuple(tuple(g) for g in blocks)


def hisparse_machine(
    make_target: ManagerFactory,
    profiles: Sequence[Profile] | None = None,
    events: Sequence[bool] = (False, True),
    name: str = "HiSparseMachine",
) -> type[HiSparseMachine]:
    """A HiSparse machine class checking ``make_target`` (``ManagerTargetHiSparse``)."""
    attrs = {
        "make_target": staticmethod(make_target),
        "profiles": tuple(profiles) if profiles else (DEFAULT_PROFILE,),
        "events_drawn": tuple(events),
    }
    return type(name, (HiSparseMachine,), attrs)
