"""HiSparse slices 1 and 2: kvpool.impl's manager and coordinator against vLLM 0.33.0's, side
by side.

Both are built from the same vLLM ``KVCacheConfig`` (laid out as vLLM's tests lay it out:
source, indexer, resident and hot groups of 16-token blocks) and driven by the same script
of scheduler and worker calls, each on its own vLLM ``Request`` objects. After every step
the answers and everything observable are compared: block ids per group, both pools' free
counts, every block's reference count and whether it is cached, the transfers, residency
updates, row mirrors, hits, events and the coordinator's page bookkeeping (unpinned and
stale pages included). Scripted scenarios first (slice 2's after vLLM's own: hot regions,
unpinning, lost pages), then 40 programs drawn from seeds (admissions in chunks with
look-ahead, offloads, acknowledgements by one or two workers, frees by status, lookups,
device pool pressure, evictions, events, residency updates, hot regions required), and 20
weighted toward hot regions (requests sharing no page, written back at once, the whole
pool pressed so unpinned pages are lost); a call kvpool refuses as a later slice's
(``HiSparseNotModelled``) is dropped from both sides. Run once by hand (2026-11-29, branch
``hisparse2-impl``): seeds 0-199 of the first kind, 60 calls each, under PYTHONHASHSEED 3
(7,966 calls compared, a hot region held after 1,165 of them); seeds 0-199 of the second,
100 calls each, under PYTHONHASHSEED 1 and 3 (11,314 calls each, 146 seeds reach a hot
region, 76 lose pages, 371 pages lost); no divergence."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("require_vllm")

PAGE = 16


def _config(num_blocks: int, host_num_blocks: int, num_resident_groups: int = 1) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HiSparseHotSpec,
        HiSparseResidentSpec,
        KVCacheConfig,
        KVCacheGroupRole,
        KVCacheGroupSpec,
    )

    source = FullAttentionSpec(block_size=PAGE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [
        KVCacheGroupSpec(
            ["source"], source, role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True
        ),
        KVCacheGroupSpec(["indexer"], source, role=KVCacheGroupRole.HISPARSE_INDEXER),
    ]
    for i in range(num_resident_groups):
        groups.append(
            KVCacheGroupSpec(
                [f"resident{i}"], HiSparseResidentSpec(block_size=PAGE, page_size=PAGE * 4)
            )
        )
        groups.append(
            KVCacheGroupSpec(
                [f"hot{i}"],
                HiSparseHotSpec(block_size=PAGE, page_size=PAGE * 4, blocks_per_request=2),
                enable_kv_transfer=False,
            )
        )
    return KVCacheConfig(
        num_blocks=num_blocks,
        hisparse_host_num_blocks=host_num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
    )


class Side:
    """One manager (vLLM's or kvpool's), its coordinator and its own requests."""

    def __init__(self, kind: str, config: Any, **kwargs: Any) -> None:
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
        from vllm.v1.hisparse.coordinator import get_hisparse_coordinator as vllm_get

        import kvpool.impl as impl

        cls: Any = VllmManager if kind == "vllm" else impl.KVCacheManager
        get: Callable[[Any], Any] = vllm_get if kind == "vllm" else impl.get_hisparse_coordinator
        self.manager = cls(config, hash_block_size=PAGE, scheduler_block_size=PAGE, **kwargs)
        self.coordinator = get(self.manager)
        self.requests: dict[str, Any] = {}
        self.pressure: list[list[Any]] = []
        """Device blocks a program took straight from the pool, held until released."""

    def request(self, name: str, tokens: list[int]) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        params = SamplingParams(max_tokens=17)
        params.update_from_generation_config({}, eos_token_id=100)
        request = Request(
            request_id=name,
            prompt_token_ids=tokens,
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(PAGE, sha256),
        )
        self.requests[name] = request
        return request

    def observe(self) -> dict[str, Any]:
        host = self.coordinator.get_host_block_pool()
        device = self.manager.block_pool
        states = {
            rid: (
                sorted(s.valid_pages),
                s.ready_prefix_pages,
                sorted(s.pending_pages),
                sorted(s.pinned_clean),
                sorted(s.unpinned_pages),
                s.synced_pages,
                sorted(s.stale_pages),
            )
            for rid, s in self.coordinator.request_states.items()
        }
        return {
            "tables": {rid: self.manager.get_block_ids(rid) for rid in self.requests},
            "free": (device.get_num_free_blocks(), host.get_num_free_blocks()),
            "device": [(b.ref_cnt, b.block_hash is not None) for b in device.blocks],
            "host": [(b.ref_cnt, b.block_hash is not None) for b in host.blocks],
            "hot_required": [sorted(m.hot_required) for m in self.coordinator.hot_managers],
            "states": states,
            "copies": len(self.coordinator.copies),
            "pending": (
                self.coordinator.has_pending_work(),
                self.coordinator.has_pending_reclamation(),
            ),
            "rows": {
                rid: [
                    [b.block_id for b in m.get_residency_row(rid)]
                    for m in self.coordinator.resident_managers
                ]
                for rid in self.requests
            },
        }


def _transfers(command: Any) -> list[tuple[Any, ...]]:
    return [
        (t.transfer_id, t.host_block_id, tuple(t.resident_block_ids), t.after_forward, t.restore)
        for t in command.page_transfers
    ]


def _events(events: list[Any]) -> list[tuple[Any, ...]]:
    return [
        (type(e).__name__, getattr(e, "group_idx", None), getattr(e, "medium", None))
        for e in events
    ]


class Pair:
    """The two sides, driven alike; ``step`` runs a call on both and compares."""

    def __init__(self, config: Callable[[], Any], **kwargs: Any) -> None:
        self.sides = [Side("vllm", config(), **kwargs), Side("kvpool", config(), **kwargs)]

    def step(self, call: Callable[[Side], Any], what: str) -> Any:
        answers = [call(side) for side in self.sides]
        assert answers[0] == answers[1], f"{what}: vLLM {answers[0]!r} != kvpool {answers[1]!r}"
        observed = [side.observe() for side in self.sides]
        for key in observed[0]:
            assert observed[0][key] == observed[1][key], (
                f"after {what}, {key}: vLLM {observed[0][key]} != kvpool {observed[1][key]}"
            )
        return answers[0]

    def new(self, name: str, tokens: list[int]) -> None:
        for side in self.sides:
            side.request(name, tokens)

    def admit(self, name: str, num_new_tokens: int, **kwargs: Any) -> Any:
        def call(side: Side) -> Any:
            request = side.requests[name]
            blocks = side.manager.allocate_slots(request, num_new_tokens, **kwargs)
            if blocks is None:
                return None
            num = min(request.num_computed_tokens + num_new_tokens, request.num_tokens)
            side.coordinator.advance_scheduled([(name, num)])
            return blocks.get_block_ids()

        return self.step(call, f"admit {name} {num_new_tokens}")

    def computed(self, name: str, num_tokens: int) -> None:
        for side in self.sides:
            side.requests[name].num_computed_tokens = num_tokens

    def offload(self) -> list[tuple[Any, ...]]:
        sent: list[tuple[Any, ...]] = self.step(
            lambda s: _transfers(s.coordinator.build_offload_command()), "offload"
        )
        return sent

    def acks(self, enqueued: dict[int, int], completed: dict[int, int]) -> None:
        self.step(lambda s: s.coordinator.update_spills(enqueued, completed), "update_spills")

    def hit(self, name: str, tokens: list[int]) -> Any:
        def call(side: Side) -> Any:
            probe = side.request(name, tokens)
            del side.requests[name]
            blocks, num, _ = side.manager.get_computed_blocks(probe)
            ids = list(blocks.get_block_ids())
            # which of two host blocks under one key a lookup returns depends, in vLLM 0.33.0,
            # on the order update_spills publishes requests in: a set of ids (string hashes,
            # so PYTHONHASHSEED); the source's hit is compared by its length
            ids[0] = len(ids[0])
            return tuple(ids), num

        return self.step(call, f"hit {name}")

    def free(self, name: str, status: Any = None) -> None:
        def call(side: Side) -> None:
            request = side.requests[name]
            if status is not None:
                request.status = status
            side.manager.free(request)

        self.step(call, f"free {name}")
        for side in self.sides:
            del side.requests[name]


def test_the_worked_example_as_vllm() -> None:
    pair = Pair(
        lambda: _config(32, 16), max_model_len=128, enable_caching=True, enable_kv_cache_events=True
    )
    tokens = list(range(64))
    pair.new("a", tokens)
    assert pair.admit("a", 64) is not None
    transfers = pair.offload()
    assert len(transfers) == 4
    assert pair.hit("b", tokens)[1] == 0
    pair.acks({1: 1}, {1: 1})
    assert pair.hit("b", tokens)[1] == 0
    pair.acks({0: 1, 2: 1, 3: 1}, {0: 1, 2: 1, 3: 1})
    assert pair.hit("b", tokens)[1] == 48
    pair.step(lambda s: _events(s.manager.take_events()), "take_events")
    pair.step(
        lambda s: {
            r: (u.pages, u.block_ids)
            for r, u in s.coordinator.take_residency_updates(["a"]).items()
        },
        "take_residency_updates",
    )
    pair.step(
        lambda s: [
            (m.source_starts, m.destination_start, m.num_rows)
            for m in s.coordinator.build_row_mirrors([("a", 30, 20)])
        ],
        "build_row_mirrors",
    )
    pair.step(lambda s: s.coordinator.all_context_pages_resident([("a", 63, 1)]), "resident")
    pair.free("a")
    pair.step(lambda s: len(s.manager.block_pool.get_new_blocks(20)), "press the device pool")
    # a reset refused by the device pool (20 blocks held): vLLM still resets the idle host
    # pool, kvpool changes nothing (docs/hisparse.md, "Surprises": a deliberate difference)
    vllm, kvpool = pair.sides
    assert not vllm.manager.reset_prefix_cache() and not kvpool.manager.reset_prefix_cache()
    cached = [
        sum(b.block_hash is not None for b in side.coordinator.get_host_block_pool().blocks)
        for side in pair.sides
    ]
    assert cached == [0, 4]


def test_a_prefill_filling_its_window_as_vllm() -> None:
    pair = Pair(
        lambda: _config(24, 16), max_model_len=128, enable_caching=True, max_in_flight_tokens=64
    )
    pair.new("p", list(range(128)))
    assert pair.admit("p", 48) is not None
    pair.computed("p", 48)
    assert pair.admit("p", 16) is not None  # the fourth page fills the window
    assert pair.step(lambda s: sorted(s.coordinator.hot_managers[0].hot_required), "hot") == ["p"]
    pair.acks({t[0]: 1 for t in pair.offload()}, {0: 1, 1: 1})
    pair.computed("p", 64)
    pair.new("q", list(range(500, 500 + 16 * 7)))
    # q takes the device pool down to 1 free block: p's region then does not fit
    assert pair.admit("q", 16 * 7) is not None
    assert pair.admit("p", 16) is None


def test_workers_detached_publication_and_id_reuse_as_vllm() -> None:
    from vllm.v1.request import RequestStatus

    pair = Pair(lambda: _config(32, 8), max_model_len=128, enable_caching=True)
    tokens = list(range(2 * PAGE + 1))
    pair.new("reused", tokens)
    pair.admit("reused", len(tokens))
    transfers = pair.offload()
    counts = {t[0]: 2 for t in transfers}
    partial = dict.fromkeys(counts, 1)
    first = dict(partial)
    first[transfers[0][0]] = 2
    pair.acks(counts, first)
    pair.free("reused", RequestStatus.FINISHED_LENGTH_CAPPED)
    pair.new("reused", list(range(100, 117)))
    pair.admit("reused", 17)
    pair.step(
        lambda s: len(s.coordinator.get_host_block_pool().get_new_blocks(2)), "press the host"
    )
    pair.acks({}, partial)
    assert pair.hit("probe", tokens)[1] == 2 * PAGE
    pair.acks({}, partial)
    pair.free("reused", RequestStatus.FINISHED_STOPPED)
    pair.acks({t[0]: 1 for t in pair.offload()}, {})


@pytest.mark.parametrize("status", ["FINISHED_STOPPED", "RUNNING", "PREEMPTED"])
def test_cleanup_by_status_as_vllm(status: str) -> None:
    from vllm.v1.request import RequestStatus

    pair = Pair(lambda: _config(32, 16), max_model_len=128, enable_caching=True)
    pair.new("t", list(range(40)))
    pair.admit("t", 40)
    counts = {t[0]: 1 for t in pair.offload()}
    pair.free("t", RequestStatus[status])
    pair.acks(counts, counts)
    assert pair.hit("probe", list(range(40)))[1] == (32 if status == "FINISHED_STOPPED" else 0)


def test_host_exhaustion_mtp_and_full_sequence_as_vllm() -> None:
    pair = Pair(
        lambda: _config(32, 3), max_model_len=128, enable_caching=True, num_prefill_lookahead=3
    )
    pair.new("a", list(range(64)))
    assert pair.admit("a", 64) is None
    assert pair.admit("a", 32) is not None
    assert len(pair.offload()) == 1  # the last 2 tokens are re-prefilled: page 1 waits
    pair.new("b", list(range(1000, 1128)))
    assert pair.admit("b", 16, full_sequence_must_fit=True) is None
    pair.free("a")
    pair = Pair(lambda: _config(13, 9, 2), max_model_len=128, max_in_flight_tokens=32)
    pair.new("long", list(range(128)))
    assert pair.admit("long", 16, full_sequence_must_fit=True) is not None
    assert len(pair.offload()) == 1


def _require_hot(side: Side, name: str) -> None:
    for manager in side.coordinator.hot_managers:
        manager.require_hot(name)


def _press(side: Side, count: int | None = None) -> list[int]:
    """Take ``count`` device blocks (all the free ones if None) and hold them."""
    pool = side.manager.block_pool
    blocks = pool.get_new_blocks(pool.get_num_free_blocks() if count is None else count)
    side.pressure.append(blocks)
    return [b.block_id for b in blocks]


def _release(side: Side) -> None:
    side.manager.block_pool.free_blocks(side.pressure.pop(0))


def _resident(side: Side, scheduled: tuple[tuple[str, int, int], ...]) -> bool:
    return bool(side.coordinator.all_context_pages_resident(scheduled))


def test_losing_pages_under_a_hot_region_as_vllm() -> None:
    """vLLM's reports_when_context_is_fully_resident, then the free of a request with lost,
    unpinned and pinned pages, and a newcomer reusing all of them."""
    pair = Pair(lambda: _config(32, 16), max_model_len=128)
    tokens = list(range(4 * PAGE))
    pair.new("r", tokens)
    assert pair.admit("r", len(tokens)) is not None
    scheduled = (("r", len(tokens) - 1, 1),)
    assert pair.step(partial(_resident, scheduled=scheduled), "resident")
    pair.step(partial(_require_hot, name="r"), "require_hot")
    assert pair.admit("r", len(tokens)) is not None
    pair.acks(*([{t[0]: 1 for t in pair.offload()}] * 2))
    pair.step(partial(_updates, ids=["r"]), "take_residency_updates")
    pair.step(_press, "press the whole pool")
    assert not pair.step(partial(_resident, scheduled=scheduled), "resident")
    assert pair.step(partial(_updates, ids=["r"]), "take_residency_updates") == {
        "r": ([0, 1], ([0, 0],))
    }
    pair.step(_release, "release")
    pair.free("r")
    pair.new("n", list(range(500, 500 + 6 * PAGE)))
    assert pair.admit("n", 6 * PAGE) is not None
    assert not pair.step(lambda s: s.manager.reset_prefix_cache(), "reset, n running")
    pair.free("n")
    pair.acks(*([{t[0]: 1 for t in pair.offload()}] * 2))
    assert pair.step(lambda s: s.manager.reset_prefix_cache(), "reset, all freed")


def test_only_changed_pages_are_resent_as_vllm() -> None:
    """vLLM's residency_update_sends_only_changed_pages, then a loss before the worker was
    ever sent the page (not stale: it goes with the appended pages)."""
    pair = Pair(lambda: _config(32, 16), max_model_len=128)
    tokens = list(range(6 * PAGE))
    pair.new("r", tokens)
    assert pair.admit("r", len(tokens)) is not None
    pair.step(partial(_require_hot, name="r"), "require_hot")
    assert pair.admit("r", len(tokens)) is not None
    pair.step(partial(_updates, ids=["r"]), "take_residency_updates")
    never_used = pair.step(lambda s: s.manager.block_pool.get_num_free_blocks(), "free count")
    pair.acks(*([{t[0]: 1 for t in pair.offload()}] * 2))
    pair.step(partial(_press, count=never_used + 1), "press one past the never used")
    assert pair.step(partial(_updates, ids=["r"]), "take_residency_updates") == {"r": ([0], ([0],))}
    pair.step(_release, "release")
    pair.new("s", list(range(900, 900 + 5 * PAGE)))
    assert pair.admit("s", 4 * PAGE) is not None
    pair.step(partial(_require_hot, name="s"), "require_hot s")
    pair.computed("s", 4 * PAGE)
    assert pair.admit("s", PAGE) is not None
    pair.acks(*([{t[0]: 1 for t in pair.offload()}] * 2))
    pair.step(_press, "press the whole pool")
    pair.step(partial(_updates, ids=["r", "s"]), "take_residency_updates")


@pytest.mark.parametrize("enable_caching", [False, True])
def test_pages_stay_until_the_hot_region_exists_as_vllm(enable_caching: bool) -> None:
    """vLLM's keeps_resident_pages_until_hot_buffer_is_allocated, then spills completing
    after the region exists unpin their pages one by one, two workers each."""
    pair = Pair(lambda: _config(32, 32), max_model_len=256, enable_caching=enable_caching)
    pair.new("first", list(range(160)))
    assert pair.admit("first", 128) is not None
    pair.acks(*([{t[0]: 1 for t in pair.offload()}] * 2))
    pair.computed("first", 128)
    pair.step(
        lambda s: _press(s, s.manager.block_pool.get_num_free_blocks() - 3), "press all but 3"
    )
    assert pair.admit("first", 1) is not None
    pair.new("second", [1000] * 16)
    pair.admit("second", 16)
    scheduled = (("first", 128, 1),)
    assert pair.step(partial(_resident, scheduled=scheduled), "resident")
    pair.step(_release, "release")
    assert pair.admit("first", 1) is not None
    assert pair.step(lambda s: s.coordinator.hot_managers[0].has_hot("first"), "has_hot")
    pair.step(partial(_updates, ids=["first"]), "take_residency_updates")
    pair.computed("first", 129)
    assert pair.admit("first", 31) is not None
    transfers = pair.offload()
    counts = {t[0]: 2 for t in transfers}
    pair.acks(counts, dict.fromkeys(counts, 1))
    pair.acks({}, {transfers[0][0]: 1})
    pair.acks({}, dict.fromkeys(counts, 1))
    pair.step(_press, "press the whole pool")
    assert not pair.step(partial(_resident, scheduled=scheduled), "resident")
    assert "first" in pair.step(partial(_updates, ids=["first"]), "take_residency_updates")


def _advance(side: Side, name: str, done: int) -> None:
    side.coordinator.advance_scheduled([(name, done)])


def _evict(side: Side, block_id: int) -> None:
    side.manager.evict_blocks({block_id})


def _updates(side: Side, ids: list[str]) -> dict[str, Any]:
    updates = side.coordinator.take_residency_updates(ids)
    return {r: (u.pages, u.block_ids) for r, u in updates.items()}


OPS = [
    "new",
    "admit",
    "admit",
    "admit",
    "offload",
    "ack",
    "ack",
    "free",
    "hit",
    "press",
    "release",
    "evict",
    "events",
    "updates",
    "hot",
]
"""The calls a program draws from, each as likely as its number of entries."""

OPS_AROUND_HOT_REGIONS = [
    "new",
    "admit",
    "admit",
    "admit",
    "admit",
    "publish",
    "publish",
    "ack",
    "free",
    "press",
    "press",
    "release",
    "updates",
    "updates",
    "hot",
    "hot",
    "hot",
]
"""Weighted toward hot regions: required of a request still being admitted, its pages
written back (offload and acknowledge at once) and the pool pressed (unpinned pages lost)."""


def _random_program(seed: int, steps: int, around_hot: bool = False) -> tuple[int, int, int]:
    """A program of scheduler and worker calls drawn from ``seed``, run on both sides and
    compared after every call; calls kvpool refuses as a later slice's (HiSparseNotModelled)
    are dropped from both. Returns how many calls both sides ran, after how many of them a
    request held its hot region, and after how many a request had a lost (host-only) page."""
    import random

    from vllm.v1.request import RequestStatus

    from kvpool.model.errors import HiSparseNotModelled

    rng = random.Random(seed)
    sizes = [(32, 16), (40, 24)] if around_hot else [(16, 8), (24, 12), (32, 16), (40, 24)]
    num_blocks, host_blocks = rng.choice(sizes)
    num_resident_groups = rng.choice([1, 1, 2])
    pair = Pair(
        lambda: _config(num_blocks, host_blocks, num_resident_groups),
        max_model_len=128,
        enable_caching=rng.random() < 0.8,
        enable_kv_cache_events=True,
        max_in_flight_tokens=rng.choice([None, 32, 64]),
        num_prefill_lookahead=rng.choice([0, 0, 3]),
    )
    prompts = [list(range(base, base + 128)) for base in (0, 1000, 2000)]
    sent: list[int] = []
    ran = hot = lost = 0
    names = 0
    for _ in range(steps):
        live = sorted(pair.sides[0].requests)
        unfinished = [
            n
            for n in live
            if pair.sides[0].requests[n].num_computed_tokens < pair.sides[0].requests[n].num_tokens
        ]
        op = rng.choice(OPS_AROUND_HOT_REGIONS if around_hot else OPS)
        if op == "new" and len(live) < 4:
            names += 1
            length = rng.choice([64, 100, 128] if around_hot else [16, 17, 31, 32, 48, 64, 100])
            # around hot regions, no two requests share a page: when two requests publish a
            # page under one key in one update_spills, which GPU copy vLLM 0.33 keeps follows
            # PYTHONHASHSEED (docs/hisparse.md), and pressing the whole pool reveals it
            prompt = list(range(10_000 * names, 10_000 * names + 128))
            pair.new(f"r{names}", (prompt if around_hot else rng.choice(prompts))[:length])
        elif op == "admit" and unfinished:
            name = rng.choice(unfinished)
            request = pair.sides[0].requests[name]
            left = request.num_tokens - request.num_computed_tokens
            chunk = min(left, rng.choice([1, 15, 16, 32, 64]))
            lookahead = rng.choice([0, 0, 4])
            # kvpool first: a refusal (a later slice) is dropped from both sides
            vllm, kvpool = pair.sides
            try:
                mine = kvpool.manager.allocate_slots(
                    kvpool.requests[name], chunk, num_lookahead_tokens=lookahead
                )
            except HiSparseNotModelled:
                continue
            theirs = vllm.manager.allocate_slots(
                vllm.requests[name], chunk, num_lookahead_tokens=lookahead
            )
            assert (None if theirs is None else theirs.get_block_ids()) == (
                None if mine is None else mine.get_block_ids()
            ), f"admit {name} {chunk}"
            if mine is not None:
                done = request.num_computed_tokens + chunk
                pair.step(
                    partial(_advance, name=name, done=done),
                    f"advance {name} {done}",
                )
                pair.computed(name, done)
            pair.step(lambda s: None, f"admit {name} {chunk}")
        elif op == "offload":
            sent += [t[0] for t in pair.offload()]
        elif op == "publish":
            sent += [t[0] for t in pair.offload()]
            if not sent:
                continue
            pair.acks(dict.fromkeys(sent, 1), dict.fromkeys(sent, 1))
            sent = []
        elif op == "ack" and sent:
            chosen = rng.sample(sent, rng.randint(1, len(sent)))
            workers = rng.choice([1, 2])
            enqueued = {t: workers for t in chosen}
            completed = {t: rng.randint(1, workers) for t in chosen}
            pair.acks(enqueued, completed)
            if workers == 2:
                pair.acks({}, {t: workers - completed[t] for t in chosen if completed[t] < workers})
            sent = [t for t in sent if t not in chosen]
        elif op == "free" and live:
            name = rng.choice(live)
            status = rng.choice(
                [
                    RequestStatus.FINISHED_STOPPED,
                    RequestStatus.RUNNING,
                    RequestStatus.FINISHED_ABORTED,
                    RequestStatus.PREEMPTED,
                ]
            )
            pair.free(name, status)
        elif op == "hit":
            pair.hit("probe", rng.choice(prompts)[: rng.choice([17, 33, 64, 100])])
        elif op == "press":
            # 0 (around hot regions only): every free block, down to the unpinned pages at the
            # back of the queue
            count = rng.choice([1, 2, 3, 4, 0] if around_hot else [1, 2, 3, 4])

            def press(side: Side, count: int = count) -> Any:
                pool = side.manager.block_pool
                if count == 0:
                    count = pool.get_num_free_blocks()
                if pool.get_num_free_blocks() < count:
                    return None
                blocks = pool.get_new_blocks(count)
                side.pressure.append(blocks)
                return [b.block_id for b in blocks]

            pair.step(press, "press the device pool")
        elif op == "release":

            def release(side: Side) -> None:
                if side.pressure:
                    side.manager.block_pool.free_blocks(side.pressure.pop(0))

            pair.step(release, "release pressure")
        elif op == "evict":
            block_id = rng.randint(1, num_blocks - 1)
            pair.step(
                partial(_evict, block_id=block_id),
                f"evict {block_id}",
            )
        elif op == "events":
            pair.step(lambda s: _events(s.manager.take_events()), "take_events")
        elif op == "updates" and live:
            # scheduled requests hold blocks (kvpool refuses other ids, vLLM creates a state)
            held = [n for n in live if pair.sides[0].manager.get_block_ids(n)[0]]
            pair.step(
                partial(_updates, ids=held),
                "take_residency_updates",
            )
        elif op == "hot" and unfinished:
            # a request still to be admitted again, so that its next admission takes the region
            held = [n for n in unfinished if pair.sides[0].manager.get_block_ids(n)[0]]
            if not held:
                continue
            pair.step(partial(_require_hot, name=rng.choice(held)), "require_hot")
        else:
            continue
        ran += 1
        coordinator = pair.sides[1].coordinator
        ids = list(coordinator.request_states)
        if any(m.has_hot(r) for m in coordinator.hot_managers for r in ids):
            hot += 1
        if any(
            b.is_null
            for m in coordinator.resident_managers
            for r in ids
            for b in m.get_residency_row(r)
        ):
            lost += 1
    return ran, hot, lost


@pytest.mark.parametrize("seed", range(40))
def test_random_programs_as_vllm(seed: int) -> None:
    assert _random_program(seed, 40)[0] > 10


@pytest.mark.parametrize("seed", range(20))
def test_random_programs_around_hot_regions_as_vllm(seed: int) -> None:
    assert _random_program(seed, 100, around_hot=True)[0] > 20
