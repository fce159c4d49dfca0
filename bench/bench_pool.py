"""Throughput of kvpool.impl against vLLM's BlockPool and the model, on the same traces.

Run it with the project's interpreter::

    python bench/bench_pool.py            # impl and model; vLLM if importable

and, for the vLLM column, with an interpreter that has both vLLM and kvpool
(``pip install -e /path/to/kvpool --no-deps`` into vLLM's environment)::

    /path/to/vllm-venv/bin/python bench/bench_pool.py

Every trace is generated once from a fixed seed by a scheduler-like driver
run against kvpool.impl, which records each pool call. The recorded calls are
then replayed on every target, with block ids mapped to that target's own
block objects (the model, wrapped in a thin shim, takes the ids), so all
targets do exactly the same operations and the timings measure the pools, not
the driver. An untimed replay per target first checks every returned block id
against the recording. Each timing is the median of ``--repeat`` replays,
each on a fresh pool; the garbage collector is collected and frozen before
each timed replay (as a serving engine does after start-up), so a full
collection over a million long-lived blocks does not land inside one
measurement.

Printed: operations per second per trace and target, impl/vLLM and
impl/model ratios, and the impl's cost per operation for pools of 1e3..1e6
blocks on one allocate/cache/look up/free cycle with a fixed working set.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpool import model
from kvpool.impl import BlockPool as ImplPool

BLOCK_SIZE = 16
GROUPS = [0]

# --------------------------------------------------------------------------
# Requests and traces
# --------------------------------------------------------------------------


@dataclass(eq=False)
class Request:
    """What any of the pools reads from a request (vLLM's fields and the model's)."""

    block_hashes: list[bytes]
    all_token_ids: list[int]
    num_prompt_blocks: int
    lora_request: None = None
    lora_id: None = None
    lora_name: None = None
    mm_features: list[Any] = field(default_factory=list)
    cache_salt: None = None
    session_id: None = None
    prompt_embeds: None = None


def make_requests(
    seed: int,
    num_requests: int,
    num_prefixes: int,
    prefix_blocks: tuple[int, int],
    suffix_blocks: tuple[int, int],
    decode_blocks: tuple[int, int],
) -> list[Request]:
    """Requests that share one of ``num_prefixes`` prompt prefixes, then diverge."""
    rng = random.Random(seed)
    prefixes = [
        [f"p{p}.{i}".encode() for i in range(rng.randint(*prefix_blocks))]
        for p in range(num_prefixes)
    ]
    requests = []
    for r in range(num_requests):
        prefix = prefixes[rng.randrange(num_prefixes)]
        suffix = rng.randint(*suffix_blocks)
        decode = rng.randint(*decode_blocks)
        own = [f"r{r}.{i}".encode() for i in range(suffix + decode)]
        hashes = prefix + own
        tokens = list(range(len(hashes) * BLOCK_SIZE))
        requests.append(Request(hashes, tokens, len(prefix) + suffix))
    return requests


@dataclass
class Trace:
    name: str
    caching: bool
    events: bool
    num_blocks: int
    requests: list[Request]
    run: Callable[[Any, list[Request]], tuple[int, int]]
    """Drives a pool through the trace; returns (operations issued, fingerprint)."""
    model_fraction: float
    """The share of the requests the (slow) model replays."""
    prepare: Callable[[Any], None] | None = None
    """Untimed set-up of a fresh pool (e.g. warming the cache)."""


def serving(max_running: int, decode_per_arrival: int, take_events: bool) -> Callable[..., Any]:
    """A scheduler-like driver: prefix hits, allocation, caching, decode, reverse frees."""

    def run(pool: Any, requests: list[Request]) -> tuple[int, int]:
        get_cached_block = pool.get_cached_block
        running: deque[list[Any]] = deque()
        ops = 0
        fingerprint = 0

        def finish() -> None:
            nonlocal ops
            _request, blocks, _num_full = running.popleft()
            pool.free_blocks(blocks[::-1])
            ops += 1

        for request in requests:
            hashes = request.block_hashes
            num_prompt = request.num_prompt_blocks
            hits = []
            for i in range(num_prompt - 1):
                found = get_cached_block(hashes[i], GROUPS)
                ops += 1
                if found is None:
                    break
                hits.append(found[0])
            if hits:
                pool.touch(hits)
                ops += 1
            need = num_prompt - len(hits)
            while pool.get_num_free_blocks() < need and running:
                finish()
            ops += 1
            new = pool.get_new_blocks(need)
            ops += 1
            for block in new:
                fingerprint = (fingerprint * 31 + _block_id(block)) % 1_000_000_007
            blocks = hits + new
            pool.cache_full_blocks(request, blocks, len(hits), num_prompt, BLOCK_SIZE, 0)
            ops += 1
            running.append([request, blocks, num_prompt])
            # Decode: the oldest running requests each fill one more block.
            for entry in list(running)[:decode_per_arrival]:
                req, req_blocks, num_full = entry
                if num_full >= len(req.block_hashes) or pool.get_num_free_blocks() == 0:
                    continue
                req_blocks.extend(pool.get_new_blocks(1))
                pool.cache_full_blocks(req, req_blocks, num_full, num_full + 1, BLOCK_SIZE, 0)
                entry[2] = num_full + 1
                ops += 3
            while len(running) > max_running:
                finish()
            if take_events:
                pool.take_events()
                ops += 1
        while running:
            finish()
        return ops, fingerprint

    return run


def alloc_free(pool: Any, requests: list[Request]) -> tuple[int, int]:
    """Allocate/free cycles without caching: a window of held groups, freed in reverse."""
    held: deque[list[Any]] = deque()
    ops = 0
    fingerprint = 0
    for request in requests:
        need = request.num_prompt_blocks
        while pool.get_num_free_blocks() < need:
            pool.free_blocks(held.popleft()[::-1])
            ops += 2
        ops += 1
        blocks = pool.get_new_blocks(need)
        ops += 1
        fingerprint = (fingerprint * 31 + _block_id(blocks[-1])) % 1_000_000_007
        held.append(blocks)
        if len(held) > 64:
            pool.free_blocks(held.popleft()[::-1])
            ops += 1
    while held:
        pool.free_blocks(held.popleft()[::-1])
        ops += 1
    return ops, fingerprint


def warm_prefixes(pool: Any, requests: list[Request]) -> None:
    """Cache every distinct prefix once and release it (the blocks stay cached)."""
    seen: set[bytes] = set()
    for request in requests:
        first = request.block_hashes[0]
        if first in seen:
            continue
        seen.add(first)
        prefix_len = _prefix_len(request)
        blocks = pool.get_new_blocks(prefix_len)
        pool.cache_full_blocks(request, blocks, 0, prefix_len, BLOCK_SIZE, 0)
        pool.free_blocks(blocks[::-1])


def cache_hits(pool: Any, requests: list[Request]) -> tuple[int, int]:
    """Every request hits its whole cached prefix, adds one block, and finishes."""
    get_cached_block = pool.get_cached_block
    ops = 0
    fingerprint = 0
    for request in requests:
        hashes = request.block_hashes
        hits = []
        for i in range(request.num_prompt_blocks):
            found = get_cached_block(hashes[i], GROUPS)
            ops += 1
            if found is None:
                break
            hits.append(found[0])
        pool.touch(hits)
        new = pool.get_new_blocks(1)
        blocks = hits + new
        pool.cache_full_blocks(request, blocks, len(hits), len(hits) + 1, BLOCK_SIZE, 0)
        pool.free_blocks(blocks[::-1])
        ops += 4
        fingerprint = (fingerprint * 31 + len(hits) + _block_id(new[0])) % 1_000_000_007
    return ops, fingerprint


def _prefix_len(request: Request) -> int:
    return sum(1 for h in request.block_hashes if h.startswith(b"p"))


def _block_id(block: Any) -> int:
    return block if isinstance(block, int) else int(block.block_id)


def traces(scale: float) -> list[Trace]:
    n = max(50, int(4000 * scale))
    serving_requests = make_requests(1, n, 24, (8, 64), (1, 24), (1, 12))
    alloc_requests = make_requests(2, 4 * n, 1, (0, 0), (1, 32), (0, 0))
    hit_requests = [
        Request(r.block_hashes[: _prefix_len(r) + 1], r.all_token_ids, _prefix_len(r))
        for r in make_requests(3, 2 * n, 48, (16, 48), (1, 1), (0, 0))
    ]
    return [
        Trace(
            "serving (prefix sharing, eviction)",
            True,
            False,
            4096,
            serving_requests,
            serving(48, 4, False),
            0.03,
        ),
        Trace("alloc/free, no caching", False, False, 4096, alloc_requests, alloc_free, 0.03),
        Trace(
            "cache-hit heavy",
            True,
            False,
            4096,
            hit_requests,
            cache_hits,
            0.03,
            prepare=lambda pool: warm_prefixes(pool, hit_requests),
        ),
        Trace(
            "serving, events on",
            True,
            True,
            4096,
            serving_requests,
            serving(48, 4, True),
            0.03,
        ),
    ]


# --------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------


class ModelShim:
    """The model behind the block-object API, with block ids standing in for blocks."""

    def __init__(self, num_blocks: int, caching: bool, events: bool) -> None:
        self.state = model.new_pool(num_blocks, caching, BLOCK_SIZE, events)

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        self.state, ids = model.get_new_blocks(self.state, num_blocks)
        return list(ids)

    def touch(self, ids: list[int]) -> None:
        self.state, _ = model.touch(self.state, ids)

    def free_blocks(self, ids: list[int]) -> None:
        self.state, _ = model.free_blocks(self.state, ids)

    def cache_full_blocks(
        self, request: Any, ids: list[int], a: int, b: int, bs: int, g: int
    ) -> None:
        self.state, _ = model.cache_full_blocks(self.state, request, ids, a, b, bs, g)

    def get_cached_block(self, block_hash: bytes, groups: list[int]) -> list[int] | None:
        found = model.get_cached_block(self.state, block_hash, groups)
        return None if found is None else list(found)

    def get_num_free_blocks(self) -> int:
        return model.get_num_free_blocks(self.state)

    def take_events(self) -> tuple[model.KVCacheEvent, ...]:
        self.state, events = model.take_events(self.state)
        return events


def load_vllm() -> Callable[[int, bool, bool], Any] | None:
    try:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.block_pool import BlockPool as VllmPool
        from vllm.v1.core.kv_cache_utils import init_none_hash
    except Exception as error:  # vLLM is optional: any import failure skips its column
        print(f"note: vLLM is not importable here ({type(error).__name__}: {error});")
        print("      its column is skipped. Run this script with vLLM's interpreter after")
        print("      `pip install -e <kvpool checkout> --no-deps` to include it.")
        return None
    init_none_hash(sha256)

    def make(num_blocks: int, caching: bool, events: bool) -> Any:
        return VllmPool(num_blocks, caching, BLOCK_SIZE, enable_kv_cache_events=events)

    return make


def make_impl(num_blocks: int, caching: bool, events: bool) -> Any:
    return ImplPool(num_blocks, caching, BLOCK_SIZE, enable_kv_cache_events=events)


def make_model(num_blocks: int, caching: bool, events: bool) -> Any:
    return ModelShim(num_blocks, caching, events)


# --------------------------------------------------------------------------
# Recording and replay
# --------------------------------------------------------------------------

BLOCK_LIST_ARGS = {"touch": 0, "free_blocks": 0, "cache_full_blocks": 1}
"""Which argument of a call is a list of blocks (recorded as ids)."""


@dataclass
class Call:
    name: str
    args: tuple[Any, ...]
    result: Any
    """Block ids the impl returned (get_new_blocks, get_cached_block), else None."""


class Recorder:
    """Wraps an impl pool and records every call, with block objects as ids."""

    def __init__(self, pool: ImplPool) -> None:
        self.pool = pool
        self.calls: list[Call] = []

    def _call(self, name: str, *args: Any) -> Any:
        result = getattr(self.pool, name)(*args)
        recorded = list(args)
        if name in BLOCK_LIST_ARGS:
            at = BLOCK_LIST_ARGS[name]
            recorded[at] = [b.block_id for b in args[at]]
        ids = None
        if name in ("get_new_blocks", "get_cached_block") and result is not None:
            ids = [b.block_id for b in result]
        self.calls.append(Call(name, tuple(recorded), ids))
        return result

    def get_new_blocks(self, num_blocks: int) -> Any:
        return self._call("get_new_blocks", num_blocks)

    def touch(self, blocks: Any) -> None:
        self._call("touch", blocks)

    def free_blocks(self, blocks: Any) -> None:
        self._call("free_blocks", blocks)

    def cache_full_blocks(self, *args: Any) -> None:
        self._call("cache_full_blocks", *args)

    def get_cached_block(self, block_hash: bytes, groups: list[int]) -> Any:
        return self._call("get_cached_block", block_hash, groups)

    def get_num_free_blocks(self) -> int:
        result: int = self._call("get_num_free_blocks")
        return result

    def take_events(self) -> Any:
        return self._call("take_events")


def record(trace: Trace) -> tuple[list[Call], list[Call]]:
    """(set-up calls, timed calls) of one run of the trace's driver on the impl."""
    recorder = Recorder(make_impl(trace.num_blocks, trace.caching, trace.events))
    if trace.prepare is not None:
        trace.prepare(recorder)
    setup = recorder.calls
    recorder.calls = []
    trace.run(recorder, trace.requests)
    return setup, recorder.calls


def bind(pool: Any, calls: list[Call]) -> list[tuple[Callable[..., Any], tuple[Any, ...]]]:
    """The calls as (bound method, arguments) on ``pool``, ids turned into its blocks."""
    blocks = getattr(pool, "blocks", None)
    bound = []
    for call in calls:
        args = call.args
        if call.name in BLOCK_LIST_ARGS:
            at = BLOCK_LIST_ARGS[call.name]
            ids = args[at]
            items = list(ids) if blocks is None else [blocks[i] for i in ids]
            args = (*args[:at], items, *args[at + 1 :])
        bound.append((getattr(pool, call.name), args))
    return bound


def verify(pool: Any, calls: list[Call]) -> None:
    """Replay ``calls`` on ``pool``, checking every returned block id against the recording."""
    for call, (method, args) in zip(calls, bind(pool, calls), strict=True):
        result = method(*args)
        if call.result is not None:
            got = [b if isinstance(b, int) else b.block_id for b in result]
            if got != call.result:
                raise AssertionError(
                    f"{call.name}{call.args[:1]}: got {got}, recorded {call.result}"
                )
        elif call.name == "get_cached_block" and result is not None:
            raise AssertionError(f"get_cached_block hit where the impl missed: {call.args[0]!r}")


def replay_once(
    make: Callable[[int, bool, bool], Any], trace: Trace, setup: list[Call], calls: list[Call]
) -> float:
    """Seconds to replay ``calls`` on a fresh pool (after the untimed ``setup``)."""
    pool = make(trace.num_blocks, trace.caching, trace.events)
    for method, args in bind(pool, setup):
        method(*args)
    bound = bind(pool, calls)
    gc.collect()
    gc.freeze()
    start = time.perf_counter()
    for method, args in bound:
        method(*args)
    seconds = time.perf_counter() - start
    gc.unfreeze()
    return seconds


def bench_traces(
    targets: dict[str, Callable[[int, bool, bool], Any]], scale: float, repeat: int
) -> None:
    print(f"\n== Traces: replayed pool calls per second (median of {repeat}) ==")
    header = f"{'trace':38} {'target':6} {'calls':>9} {'calls/s':>12}"
    print(header)
    print("-" * len(header))
    ratios: list[tuple[str, str, float]] = []
    for trace in traces(scale):
        setup, calls = record(trace)
        replayed = {
            name: calls[: max(50, int(len(calls) * trace.model_fraction))]
            if name == "model"
            else calls
            for name in targets
        }
        for name, make in targets.items():
            verify(make(trace.num_blocks, trace.caching, trace.events), setup + replayed[name])
        # Interleave the targets, so a slow spell of the machine hits them alike.
        times: dict[str, list[float]] = {name: [] for name in targets}
        for _ in range(repeat):
            for name, make in targets.items():
                times[name].append(replay_once(make, trace, setup, replayed[name]))
        rates = {name: len(replayed[name]) / statistics.median(times[name]) for name in targets}
        for name in targets:
            print(f"{trace.name:38} {name:6} {len(replayed[name]):9d} {rates[name]:12,.0f}")
        for other in ("vllm", "model"):
            if other in rates:
                ratios.append((trace.name, other, rates["impl"] / rates[other]))
    print()
    for trace_name, other, ratio in ratios:
        print(f"impl/{other:5} on {trace_name:38} {ratio:8.2f}x")


def bench_scaling(repeat: int, cycles: int) -> None:
    """Per-operation cost of one fixed cycle at growing pool sizes."""
    print(f"\n== impl cost per operation vs pool size (median of {repeat}, {cycles} cycles) ==")
    working = 8
    request = Request(
        [f"s{i}".encode() for i in range(working)], list(range(working * BLOCK_SIZE)), working
    )
    costs: dict[int, float] = {}
    for size in (10**3, 10**4, 10**5, 10**6):
        times = []
        ops = 0
        for _ in range(repeat):
            pool = ImplPool(size, True, BLOCK_SIZE)
            gc.collect()
            gc.freeze()
            start = time.perf_counter()
            ops = _cycle(pool, request, cycles)
            times.append(time.perf_counter() - start)
            gc.unfreeze()
            del pool
        costs[size] = statistics.median(times) / ops
        print(f"  {size:>9,} blocks: {costs[size] * 1e9:8.1f} ns/op")
    growth = costs[10**6] / costs[10**3] - 1
    print(f"  growth 1e6 vs 1e3: {growth * 100:+.1f}%  (target: at most +10%)")


def _cycle(pool: ImplPool, request: Request, cycles: int) -> int:
    """Allocate, cache, look up and touch, free, evict, free: the same blocks every cycle.

    Evicting before the last free makes the blocks hash-less, so they return
    to the front of the queue and the next cycle reuses them: a fixed working
    set whatever the pool size.
    """
    hashes = request.block_hashes
    n = request.num_prompt_blocks
    for _ in range(cycles):
        blocks = pool.get_new_blocks(n)
        pool.cache_full_blocks(request, blocks, 0, n, BLOCK_SIZE, 0)
        hits = []
        for h in hashes:
            found = pool.get_cached_block(h, GROUPS)
            assert found is not None
            hits.append(found[0])
        pool.touch(hits)
        pool.free_blocks(blocks[::-1])
        pool.evict_blocks({b.block_id for b in blocks})
        pool.free_blocks(blocks[::-1])
    return cycles * (6 + n)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="trace length multiplier")
    parser.add_argument("--repeat", type=int, default=5, help="timed replays per measurement")
    parser.add_argument("--cycles", type=int, default=20_000, help="cycles per scaling run")
    parser.add_argument("--no-model", action="store_true", help="skip the model column")
    parser.add_argument("--no-scaling", action="store_true", help="skip the pool-size sweep")
    args = parser.parse_args(argv)

    print(f"Python {sys.version.split()[0]}")
    targets: dict[str, Callable[[int, bool, bool], Any]] = {"impl": make_impl}
    vllm = load_vllm()
    if vllm is not None:
        targets["vllm"] = vllm
    if not args.no_model:
        targets["model"] = make_model
    bench_traces(targets, args.scale, args.repeat)
    if not args.no_scaling:
        bench_scaling(args.repeat, args.cycles)


if __name__ == "__main__":
    main()
