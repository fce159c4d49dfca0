"""Drive kvpool's HiSparse model and vLLM 0.33.0's manager + coordinator side by side.

Each call runs on both and compares the answers; ``compare`` compares the states:
every group's block ids (per pool), every block's ref count and whether it is hashed,
both free queues, the queued transfers, ``hot_required``, the copies, the pending-work
queries. Events are compared by kind, medium, size and tokens (the two hash with
different functions). vLLM is built as its tests build it
(``make_hisparse_kv_cache_config`` and ``make_kv_cache_manager`` in
``tests/v1/core/test_prefix_caching.py``, 0.33.0): source, indexer, resident, hot
(``blocks_per_request=2``), then more resident and hot pairs.
"""

from collections.abc import Sequence
from functools import partial
from typing import Any

import kvpool.model.hisparse as hs
import kvpool.model.hisparse_core as core
import kvpool.model.manager as mgr
import kvpool.model.pool as pool_ops
from kvpool.model.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvpool.model.hisparse_layout import HiSparseConfig
from kvpool.model.hisparse_types import PageTransfer
from kvpool.model.request import Request, append_tokens, new_request, with_computed
from kvpool.specs.request.hisparse_machine import hisparse_roles, hisparse_setup
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import ManagerSetup

BLOCK = 16


def model_config(num_resident_groups: int = 1) -> HiSparseConfig:
    """Groups 0 source, 1 indexer, 2 resident, 3 hot, then (resident, hot) pairs."""
    return hisparse_roles(num_resident_groups, None)


def _setup(
    num_blocks: int,
    host_num_blocks: int,
    *,
    max_model_len: int = 128,
    max_in_flight_tokens: int | None = None,
    enable_caching: bool = False,
    num_prefill_lookahead: int = 0,
    enable_events: bool = False,
    num_resident_groups: int = 1,
) -> ManagerSetup:
    return hisparse_setup(
        num_blocks,
        host_num_blocks,
        max_model_len=max_model_len,
        enable_caching=enable_caching,
        enable_events=enable_events,
        num_prefill_lookahead=num_prefill_lookahead,
        num_resident_groups=num_resident_groups,
        max_in_flight_tokens=max_in_flight_tokens,
    )


def new_model(num_blocks: int, host_num_blocks: int, **kwargs: Any) -> mgr.KVCacheManagerState:
    """The model's manager, as the kit's model target builds it."""
    return ModelManagerTarget(_setup(num_blocks, host_num_blocks, **kwargs)).state


def _new_vllm(num_blocks: int, host_num_blocks: int, **kwargs: Any) -> Any:
    """vLLM's manager, as the kit's vLLM adapter builds it (its coordinator bound)."""
    from kvpool.specs.targets.vllm.hisparse import build_hisparse_manager

    return build_hisparse_manager(_setup(num_blocks, host_num_blocks, **kwargs))


def _summary(event: Any) -> tuple[Any, ...]:
    name = type(event).__name__
    if name == "BlockStored":
        return (name, event.medium, len(event.block_hashes), tuple(event.token_ids))
    if name == "BlockRemoved":
        return (name, event.medium, len(event.block_hashes))
    return (name,)


def _model_summary(event: KVCacheEvent) -> tuple[Any, ...]:
    if isinstance(event, BlockStored):
        return ("BlockStored", event.medium, len(event.block_hashes), tuple(event.token_ids))
    if isinstance(event, BlockRemoved):
        return ("BlockRemoved", event.medium, len(event.block_hashes))
    assert isinstance(event, AllBlocksCleared)
    return ("AllBlocksCleared",)


def _pool_of(host: Any, block: Any) -> str:
    """The medium of a vLLM block: the host pool's own object, or a device block."""
    on_host = block.block_id < len(host.blocks) and host.blocks[block.block_id] is block
    return "CPU" if on_host else "GPU"


class Pair:
    """One HiSparse manager on each side, the same calls on both."""

    def __init__(self, num_blocks: int, host_num_blocks: int, **kwargs: Any) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

        init_none_hash(sha256)
        self.model = new_model(num_blocks, host_num_blocks, **kwargs)
        self.vllm = _new_vllm(num_blocks, host_num_blocks, **kwargs)
        self.coordinator = get_hisparse_coordinator(self.vllm)
        self.requests: dict[str, tuple[Request, Any]] = {}

    # -- requests --------------------------------------------------------

    def request(self, request_id: str, tokens: Sequence[int]) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request as VllmRequest

        params = SamplingParams(max_tokens=17)
        params.update_from_generation_config({}, eos_token_id=100)
        theirs = VllmRequest(
            request_id=request_id,
            prompt_token_ids=list(tokens),
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )
        self.requests[request_id] = (new_request(request_id, tokens, BLOCK), theirs)

    def computed(self, request_id: str, num_computed_tokens: int) -> None:
        ours, theirs = self.requests[request_id]
        theirs.num_computed_tokens = num_computed_tokens
        self.requests[request_id] = (with_computed(ours, num_computed_tokens), theirs)

    def append(self, request_id: str, tokens: Sequence[int]) -> None:
        ours, theirs = self.requests[request_id]
        theirs.append_output_token_ids(list(tokens))
        self.requests[request_id] = (append_tokens(ours, tokens), theirs)

    # -- the manager -----------------------------------------------------

    def allocate(self, request_id: str, num_new_tokens: int, **kwargs: Any) -> bool:
        ours, theirs = self.requests[request_id]
        self.model, mine = mgr.allocate_slots(self.model, ours, num_new_tokens, **kwargs)
        other = self.vllm.allocate_slots(theirs, num_new_tokens, **kwargs)
        assert (mine is None) == (other is None), (mine, other)
        if mine is not None:
            assert list(map(list, mine)) == [[b.block_id for b in g] for g in other.blocks]
        self.compare()
        return mine is not None

    def allocate_scheduled(self, request_id: str, num_new_tokens: int, **kwargs: Any) -> bool:
        """``allocate_slots`` then ``advance_scheduled``, as vLLM's ``_allocate_scheduled``."""
        if not self.allocate(request_id, num_new_tokens, **kwargs):
            return False
        ours, _ = self.requests[request_id]
        n = min(ours.num_computed_tokens + num_new_tokens, ours.num_tokens, 10**9)
        self.advance([(request_id, n)])
        return True

    def hit(self, request_id: str) -> int:
        ours, theirs = self.requests[request_id]
        self.model, (blocks, mine) = mgr.get_computed_blocks(self.model, ours)
        other_blocks, other, _ = self.vllm.get_computed_blocks(theirs)
        assert mine == other
        assert list(map(list, blocks)) == [[b.block_id for b in g] for g in other_blocks.blocks]
        return mine

    def free(self, request_id: str, finished: bool = False) -> None:
        from vllm.v1.request import RequestStatus

        _, theirs = self.requests[request_id]
        theirs.status = RequestStatus.FINISHED_STOPPED if finished else RequestStatus.PREEMPTED
        self.model, _ = mgr.free(self.model, request_id, finished=finished)
        self.vllm.free(theirs)
        self.compare()

    def pop(self, request_id: str, finished: bool = False) -> list[Any]:
        """``pop_blocks_for_free`` on both; vLLM's blocks back, to free later."""
        from vllm.v1.request import RequestStatus

        _, theirs = self.requests[request_id]
        theirs.status = RequestStatus.FINISHED_STOPPED if finished else RequestStatus.PREEMPTED
        self.model, mine = hs.pop_blocks_for_free(self.model, request_id, finished=finished)
        other = self.vllm.pop_blocks_for_free(theirs)
        host = self.coordinator.get_host_block_pool()
        assert list(mine) == [(_pool_of(host, b), b.block_id) for b in other]
        self.compare()
        return list(other)

    def free_popped(self, blocks: list[Any]) -> None:
        """Free popped blocks in reverse on the device pool, as vLLM's scheduler does: each
        goes to its own pool."""
        host = self.coordinator.get_host_block_pool()
        named = [(_pool_of(host, b), b.block_id) for b in blocks]
        self.model, _ = hs.free_pool_blocks(self.model, named[::-1])
        self.vllm.block_pool.free_blocks(reversed(blocks))
        self.compare()

    def reset(self) -> bool:
        self.model, mine = mgr.reset_prefix_cache(self.model)
        assert mine == self.vllm.reset_prefix_cache()
        self.compare()
        return mine

    def evict(self, block_ids: set[int]) -> None:
        self.model, _ = mgr.evict_blocks(self.model, block_ids)
        self.vllm.evict_blocks(block_ids)
        self.compare()

    def events(self) -> list[tuple[Any, ...]]:
        self.model, mine = mgr.take_events(self.model)
        other = [_summary(e) for e in self.vllm.take_events()]
        assert [_model_summary(e) for e in mine] == other
        return other

    # -- the coordinator ---------------------------------------------------

    def advance(self, pairs: list[tuple[str, int]]) -> None:
        self.model, _ = hs.advance_scheduled(self.model, pairs)
        self.coordinator.advance_scheduled(pairs)
        self.compare()

    def offload(self) -> tuple[PageTransfer, ...]:
        self.model, mine = hs.build_offload_command(self.model)
        other = self.coordinator.build_offload_command().page_transfers
        assert [
            (t.transfer_id, t.host_block_id, t.resident_block_ids, t.after_forward, t.restore)
            for t in mine
        ] == [
            (
                t.transfer_id,
                t.host_block_id,
                tuple(t.resident_block_ids),
                t.after_forward,
                t.restore,
            )
            for t in other
        ]
        return mine

    def spills(self, enqueued: dict[int, int], completed: dict[int, int]) -> None:
        self.model, _ = hs.update_spills(self.model, enqueued, completed)
        self.coordinator.update_spills(enqueued, completed)
        self.compare()

    def publish(self) -> None:
        """Ack every queued transfer with one worker (vLLM's ``_publish_hisparse_pages``)."""
        counts = {t.transfer_id: 1 for t in self.offload()}
        self.spills(counts, counts)

    def mirrors(self, spans: list[tuple[str, int, int]]) -> None:
        mine = hs.build_row_mirrors(self.model, spans)
        other = self.coordinator.build_row_mirrors(spans)
        assert [(m.source_starts, m.destination_start, m.num_rows) for m in mine] == [
            (tuple(m.source_starts), m.destination_start, m.num_rows) for m in other
        ]

    def all_resident(self, spans: list[tuple[str, int, int]]) -> bool:
        self.model, mine = hs.all_context_pages_resident(self.model, spans)
        assert mine == self.coordinator.all_context_pages_resident(spans)
        return mine

    def residency(self, request_ids: list[str]) -> None:
        self.model, mine = hs.take_residency_updates(self.model, request_ids)
        other = self.coordinator.take_residency_updates(request_ids)
        assert {r: (u.pages, u.block_ids) for r, u in mine.items()} == {
            r: (tuple(u.pages), tuple(tuple(g) for g in u.block_ids)) for r, u in other.items()
        }

    def press_host(self, count: int) -> list[Any]:
        """Take blocks from the host pool directly, as vLLM's tests do; vLLM's blocks back."""
        t, mine = core.host_pool(mgr.tiers(self.model), lambda p: pool_ops.get_new_blocks(p, count))
        self.model = mgr.with_tiers(self.model, t)
        other = self.coordinator.get_host_block_pool().get_new_blocks(count)
        assert list(mine) == [b.block_id for b in other]
        self.compare()
        return list(other)

    def release_host(self, blocks: list[Any]) -> None:
        ids = [b.block_id for b in blocks]
        t, _ = core.host_pool(mgr.tiers(self.model), lambda p: pool_ops.free_blocks(p, ids))
        self.model = mgr.with_tiers(self.model, t)
        self.coordinator.get_host_block_pool().free_blocks(blocks)
        self.compare()

    def press_device(self, count: int) -> list[Any]:
        """Take blocks from the device pool directly; vLLM's blocks back."""
        t, mine = core.device_pool(
            mgr.tiers(self.model), partial(pool_ops.get_new_blocks, num_blocks=count)
        )
        self.model = mgr.with_tiers(self.model, t)
        other = self.vllm.block_pool.get_new_blocks(count)
        assert list(mine) == [b.block_id for b in other]
        self.compare()
        return list(other)

    def release_device(self, blocks: list[Any]) -> None:
        ids = [b.block_id for b in blocks]
        t, _ = core.device_pool(
            mgr.tiers(self.model), partial(pool_ops.free_blocks, ordered_block_ids=ids)
        )
        self.model = mgr.with_tiers(self.model, t)
        self.vllm.block_pool.free_blocks(blocks)
        self.compare()

    # -- the states --------------------------------------------------------

    def compare(self) -> None:
        model, theirs, coordinator = self.model, self.vllm, self.coordinator
        host = coordinator.get_host_block_pool()
        assert model.host_pool is not None
        for mine, other in ((model.managers.pool, theirs.block_pool), (model.host_pool, host)):
            assert [(b.ref_cnt, b.block_hash is not None) for b in mine.blocks] == [
                (b.ref_cnt, b.block_hash is not None) for b in other.blocks
            ]
            assert list(mine.free_queue) == [
                b.block_id for b in other.free_block_queue.get_all_free_blocks()
            ]
        managers = theirs.coordinator.single_type_managers
        for g, table in enumerate(model.managers.tables):
            # vLLM's tables are defaultdicts: a hot group never allocated has no row
            assert {r: list(b) for r, b in table.req_to_blocks.items() if b} == {
                r: [b.block_id for b in blocks]
                for r, blocks in managers[g].req_to_blocks.items()
                if blocks
            }, g
        assert model.hisparse is not None
        for hot in coordinator.hot_managers:
            assert set(model.hisparse.hot_required) == hot.hot_required
        assert sorted(model.hisparse.copies.values()) == sorted(
            tuple(b.block_id for b in blocks) for blocks in coordinator.copies.values()
        )
        assert hs.has_pending_work(model) == coordinator.has_pending_work()
        assert hs.has_pending_reclamation(model) == coordinator.has_pending_reclamation()
        assert set(model.hisparse.books) == set(coordinator.request_states)
        for r, book in model.hisparse.books.items():
            state = coordinator.request_states[r]
            assert book.valid == state.valid_pages, r
            assert book.ready_prefix_pages == state.ready_prefix_pages, r
            assert dict(book.pending) == state.pending_pages, r
            assert book.pinned_clean == state.pinned_clean, r
            assert book.synced_pages == state.synced_pages, r
            assert book.unpinned == state.unpinned_pages, r
            assert book.stale == state.stale_pages, r
        # the residency rows: the table rows with lost pages as the null block
        t = mgr.tiers(model)
        for g in model.config.hisparse.residents:  # type: ignore[union-attr]
            manager = managers[g]
            for r in model.managers.tables[g].req_to_blocks:
                assert list(core.resident_row(t, g, r)) == [
                    b.block_id for b in manager.get_residency_row(r)
                ], (g, r)
        # the readers of each unpinned block (vLLM keeps emptied entries: left out)
        assert dict(model.hisparse.owners) == {
            b: frozenset(o) for b, o in coordinator._owners.items() if o
        }


def run_random_program(seed: int, steps: int) -> Pair:
    """A seeded random program over every slice-1 and slice-2 call, on both sides, compared
    at each call.

    Prompts share prefixes so that hits and publication matter; transfers are
    acknowledged by one or two workers, partially, out of order, after frees; the
    pools are pressed directly, as vLLM's tests do, which loses unpinned pages. A call
    the model refuses as not modelled is not sent to vLLM.
    """
    import random

    from kvpool.model.errors import HiSparseNotModelled

    rng = random.Random(seed)
    caching = rng.random() < 0.8
    pair = Pair(
        rng.choice([12, 20, 32]),
        rng.choice([6, 10, 16]),
        max_model_len=rng.choice([64, 128]),
        enable_caching=caching,
        enable_events=True,
        num_prefill_lookahead=rng.choice([0, 0, 3]),
        num_resident_groups=rng.choice([1, 1, 2]),
        max_in_flight_tokens=rng.choice([None, 48]),
    )
    max_len = pair.model.config.max_model_len
    stems = [[rng.randrange(50) for _ in range(80)] for _ in range(3)]
    running: dict[str, int] = {}
    workers: dict[int, int] = {}
    held_host: list[Any] = []
    held_device: list[Any] = []
    counter = 0

    def schedule(rid: str, chunk: int, **kwargs: Any) -> None:
        ours, _ = pair.requests[rid]
        try:
            ok = pair.allocate_scheduled(rid, chunk, **kwargs)
        except HiSparseNotModelled:
            return
        if ok:
            running[rid] = min(ours.num_computed_tokens + chunk, ours.num_tokens)

    for _ in range(steps):
        op = rng.choice(
            [
                "admit",
                "admit",
                "step",
                "step",
                "step",
                "ack",
                "ack",
                "free",
                "pop",
                "press",
                "release",
                "reset",
                "hit",
                "views",
                "hot",
            ]
        )
        if op == "admit":
            counter += 1
            rid = f"r{counter % 7}" if rng.random() < 0.3 else f"r{counter}"
            if rid in running:
                continue
            stem = rng.choice(stems)
            length = rng.randrange(1, min(80, max_len))
            pair.request(rid, stem[:length])
            schedule(rid, rng.randrange(1, length + 1), full_sequence_must_fit=rng.random() < 0.3)
        elif op == "step" and running:
            rid = rng.choice(sorted(running))
            ours, _ = pair.requests[rid]
            pair.computed(rid, running[rid])
            if running[rid] >= ours.num_tokens:
                if ours.num_tokens >= max_len:
                    continue
                pair.append(rid, [rng.randrange(50)])
            ours, _ = pair.requests[rid]
            remaining = ours.num_tokens - ours.num_computed_tokens
            schedule(
                rid, rng.randrange(1, remaining + 1), num_lookahead_tokens=rng.choice([0, 0, 4])
            )
        elif op == "ack":
            for t in pair.offload():
                workers[t.transfer_id] = rng.choice([1, 1, 2])
            # one request's transfers per call: vLLM publishes the requests a call completes in
            # the order of a set of ids, which PYTHONHASHSEED decides (docs/hisparse.md)
            assert pair.model.hisparse is not None
            owners = {tid: pair.model.hisparse.transfers[tid].request_id for tid in workers}
            owner = rng.choice(sorted(set(owners.values()))) if owners else None
            chosen = [tid for tid in sorted(workers) if owners[tid] == owner and rng.random() < 0.7]
            enqueued = {tid: workers[tid] for tid in chosen}
            completed = {tid: rng.randrange(1, workers[tid] + 1) for tid in chosen}
            if rng.random() < 0.2:
                completed[10_000] = 1
            pair.spills(enqueued, completed)
            done = set(pair.model.hisparse.transfers) if pair.model.hisparse else set()
            workers = {tid: w for tid, w in workers.items() if tid in done}
        elif op in ("free", "pop") and running:
            rid = rng.choice(sorted(running))
            del running[rid]
            finished = rng.random() < 0.5
            if op == "free":
                pair.free(rid, finished=finished)
            else:
                pair.free_popped(pair.pop(rid, finished=finished))
        elif op == "press":
            if rng.random() < 0.5:
                count = rng.randrange(0, len(pair.model.host_pool.free_queue) + 1)  # type: ignore[union-attr]
                held_host.extend(pair.press_host(count))
            else:
                count = rng.randrange(0, len(pair.model.managers.pool.free_queue) + 1)
                held_device.extend(pair.press_device(count))
        elif op == "release":
            if held_host:
                pair.release_host(held_host)
                held_host = []
            if held_device:
                pair.release_device(held_device)
                held_device = []
                pair.compare()
        elif op == "reset":
            # with exactly one pool busy vLLM resets the idle one, the spec neither (a
            # finding, docs/hisparse.md; test_vllm_resets_the_idle_pool_when_the_other_refuses)
            host, device = pair.model.host_pool, pair.model.managers.pool
            assert host is not None
            busy = [pool_ops.get_num_free_blocks(p) != len(p.blocks) - 1 for p in (host, device)]
            if busy[0] == busy[1]:
                pair.reset()
        elif op == "hit":
            counter += 1
            probe = f"probe{counter}"
            stem = rng.choice(stems)
            pair.request(probe, stem[: rng.randrange(1, 80)])
            pair.hit(probe)
        elif op == "views" and running:
            spans = [(rid, pair.requests[rid][0].num_computed_tokens, 1) for rid in running]
            pair.mirrors(spans)
            pair.all_resident(spans)
            pair.residency(sorted(running))
        elif op == "hot" and running:
            rid = rng.choice(sorted(running))
            pair.model, _ = hs.require_hot(pair.model, rid)
            for hot in pair.coordinator.hot_managers:
                hot.require_hot(rid)
            pair.compare()
        pair.events()
    return pair
