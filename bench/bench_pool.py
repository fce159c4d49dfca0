"""Throughput of kvpool.impl against vLLM's BlockPool and the model, on the same traces.

Run it with the project's interpreter::

    python bench/bench_pool.py            # impl and model; vLLM if importable

and, for the vLLM column, with an interpreter that has both vLLM and kvpool
(``pip install -e /path/to/kvpool --no-deps`` into vLLM's environment)::

    /path/to/vllm-venv/bin/python bench/bench_pool.py

``--scale`` lengthens or shortens the traces, ``--only serving`` picks traces by
name, ``--no-model`` and ``--no-scaling`` skip parts.

How it measures:

* Each trace is produced once, from a fixed seed, by a scheduler-like driver
  running against kvpool.impl while a recorder notes every pool call.
* The recorded calls are replayed on every target, with block ids mapped to
  that target's own block objects (the model, behind a thin shim, takes the
  ids). All targets therefore do exactly the same operations, and the timing
  covers the pool calls (plus one Python call dispatch each), not the driver.
* Before timing, one untimed replay per target checks every returned block id
  against the recording, so the targets really agree.
* Each figure is the median of ``--repeat`` replays, each on a fresh pool, with
  the targets interleaved so a slow spell of the machine hits them alike. The
  garbage collector is collected and frozen before each timed replay (as a
  serving engine does after start-up).
* The model replays only the first few percent of each trace (it copies the
  pool on every operation); its rate is still calls per second.

Printed: calls per second per trace and target, the impl/vLLM and impl/model
ratios, and the impl's cost per operation for pools of 1e3 to 1e6 blocks on
one allocate/cache/look-up/free cycle over a fixed working set.
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

PoolFactory = Callable[[int, bool, bool], Any]
"""(num_blocks, enable_caching, enable_events) -> a pool with vLLM's BlockPool API."""

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
        hashes = prefix + [f"r{r}.{i}".encode() for i in range(suffix + decode)]
        tokens = list(range(len(hashes) * BLOCK_SIZE))
        requests.append(Request(hashes, tokens, len(prefix) + suffix))
    return requests


def serving(max_running: int, decode_per_arrival: int, take_events: bool) -> Callable[..., None]:
    """A scheduler-like driver: prefix hits, allocation, caching, decode, reverse frees."""

    def run(pool: Any, requests: list[Request]) -> None:
        running: deque[list[Any]] = deque()

        def finish() -> None:
            _request, blocks, _num_full = running.popleft()
            pool.free_blocks(blocks[::-1])

        for request in requests:
            hashes = request.block_hashes
            num_prompt = request.num_prompt_blocks
            hits = []
            for i in range(num_prompt - 1):
                found = pool.get_cached_block(hashes[i], GROUPS)
                if found is None:
                    break
                hits.append(found[0])
            if hits:
                pool.touch(hits)
            need = num_prompt - len(hits)
            while pool.get_num_free_blocks() < need and running:
                finish()
            blocks = hits + pool.get_new_blocks(need)
            pool.cache_full_blocks(request, blocks, len(hits), num_prompt, BLOCK_SIZE, 0)
            running.append([request, blocks, num_prompt])
            # Decode: the oldest running requests each fill one more block.
            for entry in list(running)[:decode_per_arrival]:
                req, req_blocks, num_full = entry
                if num_full >= len(req.block_hashes) or pool.get_num_free_blocks() == 0:
                    continue
                req_blocks.extend(pool.get_new_blocks(1))
                pool.cache_full_blocks(req, req_blocks, num_full, num_full + 1, BLOCK_SIZE, 0)
                entry[2] = num_full + 1
            while len(running) > max_running:
                finish()
            if take_events:
                pool.take_events()
        while running:
            finish()

    return run


def alloc_free(pool: Any, requests: list[Request]) -> None:
    """Allocate/free cycles without caching: a window of held groups, freed in reverse."""
    held: deque[list[Any]] = deque()
    for request in requests:
        need = request.num_prompt_blocks
        while pool.get_num_free_blocks() < need:
            pool.free_blocks(held.popleft()[::-1])
        held.append(pool.get_new_blocks(need))
        if len(held) > 64:
            pool.free_blocks(held.popleft()[::-1])
    while held:
        pool.free_blocks(held.popleft()[::-1])


def warm_prefixes(pool: Any, requests: list[Request]) -> None:
    """Cache every distinct prefix once and release it (the blocks stay cached)."""
    seen: set[bytes] = set()
    for request in requests:
        if request.block_hashes[0] in seen:
            continue
        seen.add(request.block_hashes[0])
        prefix_len = request.num_prompt_blocks
        blocks = pool.get_new_blocks(prefix_len)
        pool.cache_full_blocks(request, blocks, 0, prefix_len, BLOCK_SIZE, 0)
        pool.free_blocks(blocks[::-1])


def cache_hits(pool: Any, requests: list[Request]) -> None:
    """Every request looks up its whole cached prefix, adds one block, and finishes."""
    for request in requests:
        hashes = request.block_hashes
        hits = []
        for i in range(request.num_prompt_blocks):
            found = pool.get_cached_block(hashes[i], GROUPS)
            if found is None:
                break
            hits.append(found[0])
        pool.touch(hits)
        blocks = hits + pool.get_new_blocks(1)
        pool.cache_full_blocks(request, blocks, len(hits), len(hits) + 1, BLOCK_SIZE, 0)
        pool.free_blocks(blocks[::-1])


@dataclass
class Trace:
    name: str
    caching: bool
    events: bool
    num_blocks: int
    requests: list[Request]
    run: Callable[[Any, list[Request]], None]
    model_fraction: float = 0.03
    """The share of the calls the (slow) model replays."""
    prepare: Callable[[Any], None] | None = None
    """Untimed set-up of a fresh pool (e.g. warming the cache)."""


def traces(scale: float) -> list[Trace]:
    n = max(50, int(4000 * scale))
    serving_requests = make_requests(1, n, 24, (8, 64), (1, 24), (1, 12))
    alloc_requests = make_requests(2, 4 * n, 1, (0, 0), (1, 32), (0, 0))
    # A cached prefix of 16..48 blocks plus one block of the request's own.
    hit_requests = make_requests(3, 2 * n, 48, (16, 48), (1, 1), (0, 0))
    for request in hit_requests:
        request.num_prompt_blocks -= 1
    return [
        Trace(
            "serving (prefix sharing, eviction)",
            True,
            False,
            4096,
            serving_requests,
            serving(48, 4, False),
        ),
        Trace("alloc/free, no caching", False, False, 4096, alloc_requests, alloc_free),
        Trace(
            "cache-hit heavy",
            True,
            False,
            4096,
            hit_requests,
            cache_hits,
            prepare=lambda pool: warm_prefixes(pool, hit_requests),
        ),
        Trace("serving, events on", True, True, 4096, serving_requests, serving(48, 4, True)),
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
        self, request: Any, ids: list[int], start: int, stop: int, block_size: int, group: int
    ) -> None:
        self.state, _ = model.cache_full_blocks(
            self.state, request, ids, start, stop, block_size, group
        )

    def get_cached_block(self, block_hash: bytes, groups: list[int]) -> list[int] | None:
        found = model.get_cached_block(self.state, block_hash, groups)
        return None if found is None else list(found)

    def get_num_free_blocks(self) -> int:
        return model.get_num_free_blocks(self.state)

    def take_events(self) -> tuple[model.KVCacheEvent, ...]:
        self.state, events = model.take_events(self.state)
        return events


def make_impl(num_blocks: int, caching: bool, events: bool) -> Any:
    return ImplPool(num_blocks, caching, BLOCK_SIZE, enable_kv_cache_events=events)


def make_model(num_blocks: int, caching: bool, events: bool) -> Any:
    return ModelShim(num_blocks, caching, events)


def load_vllm() -> PoolFactory | None:
    """vLLM's BlockPool factory, or None (with a note) if vLLM cannot be imported here."""
    try:
        from vllm.utils.hashing import sha256  # type: ignore[import-not-found,unused-ignore]
        from vllm.v1.core.block_pool import (  # type: ignore[import-not-found,unused-ignore]
            BlockPool as VllmPool,
        )
        from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found,unused-ignore]
            init_none_hash,
        )
    except Exception as error:  # vLLM is optional: any import failure skips its column
        print(f"note: vLLM is not importable here ({type(error).__name__}: {error});")
        print("      its column is skipped. Run this script with vLLM's interpreter after")
        print("      `pip install -e <kvpool checkout> --no-deps` to include it.")
        return None
    init_none_hash(sha256)

    def make(num_blocks: int, caching: bool, events: bool) -> Any:
        return VllmPool(num_blocks, caching, BLOCK_SIZE, enable_kv_cache_events=events)

    return make


# --------------------------------------------------------------------------
# Recording and replay
# --------------------------------------------------------------------------

BLOCK_LIST_ARGS = {"touch": 0, "free_blocks": 0, "cache_full_blocks": 1}
"""Which argument of a call is a list of blocks (recorded as ids)."""


@dataclass
class Call:
    name: str
    args: tuple[Any, ...]
    result: list[int] | None
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
                raise AssertionError(f"{call.name}: got {got}, recorded {call.result}")
        elif call.name == "get_cached_block" and result is not None:
            raise AssertionError(f"get_cached_block hit where the impl missed: {call.args[0]!r}")


def replay_once(make: PoolFactory, trace: Trace, setup: list[Call], calls: list[Call]) -> float:
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
    targets: dict[str, PoolFactory], scale: float, repeat: int, only: str | None = None
) -> None:
    print(f"\n== Traces: replayed pool calls per second (median of {repeat}) ==")
    header = f"{'trace':36} {'target':6} {'calls':>8} {'calls/s':>11}"
    print(header)
    print("-" * len(header))
    ratios: list[tuple[str, str, float]] = []
    for trace in traces(scale):
        if only is not None and only not in trace.name:
            continue
        setup, calls = record(trace)
        replayed = {name: calls for name in targets}
        if "model" in targets:
            replayed["model"] = calls[: max(50, int(len(calls) * trace.model_fraction))]
        for name, make in targets.items():
            verify(make(trace.num_blocks, trace.caching, trace.events), setup + replayed[name])
        times: dict[str, list[float]] = {name: [] for name in targets}
        for _ in range(repeat):
            for name, make in targets.items():
                times[name].append(replay_once(make, trace, setup, replayed[name]))
        rates = {name: len(replayed[name]) / statistics.median(times[name]) for name in targets}
        for name in targets:
            print(f"{trace.name:36} {name:6} {len(replayed[name]):8d} {rates[name]:11,.0f}")
        for other in ("vllm", "model"):
            if other in rates:
                ratios.append((trace.name, other, rates["impl"] / rates[other]))
    print()
    for trace_name, other, ratio in ratios:
        print(f"impl/{other:5} on {trace_name:36} {ratio:8.2f}x")


# --------------------------------------------------------------------------
# Cost per operation against pool size
# --------------------------------------------------------------------------


def cycle(pool: ImplPool, request: Request, cycles: int) -> int:
    """Allocate, cache, look up and touch, free, evict, free: the same blocks every cycle.

    Evicting before the last free leaves the blocks hash-less, so they go back
    to the front of the queue and the next cycle takes them again: a fixed
    working set whatever the pool size. Returns the number of pool calls.
    """
    hashes = request.block_hashes
    n = request.num_prompt_blocks
    for _ in range(cycles):
        blocks = pool.get_new_blocks(n)
        pool.cache_full_blocks(request, blocks, 0, n, BLOCK_SIZE, 0)
        hits = []
        for block_hash in hashes:
            found = pool.get_cached_block(block_hash, GROUPS)
            assert found is not None
            hits.append(found[0])
        pool.touch(hits)
        pool.free_blocks(blocks[::-1])
        pool.evict_blocks({b.block_id for b in blocks})
        pool.free_blocks(blocks[::-1])
    return cycles * (6 + n)


def bench_scaling(repeat: int, cycles: int) -> None:
    print(f"\n== impl cost per call against pool size (median of {repeat}, {cycles} cycles) ==")
    working = 8
    request = Request(
        [f"s{i}".encode() for i in range(working)], list(range(working * BLOCK_SIZE)), working
    )
    costs: dict[int, float] = {}
    sizes = (10**3, 10**4, 10**5, 10**6)
    pools = {size: ImplPool(size, True, BLOCK_SIZE) for size in sizes}
    times: dict[int, list[float]] = {size: [] for size in sizes}
    calls = 0
    for _ in range(repeat):
        for size in sizes:  # interleaved, as for the traces
            gc.collect()
            gc.freeze()
            start = time.perf_counter()
            calls = cycle(pools[size], request, cycles)
            times[size].append(time.perf_counter() - start)
            gc.unfreeze()
    for size in sizes:
        costs[size] = statistics.median(times[size]) / calls
        print(f"  {size:>9,} blocks: {costs[size] * 1e9:7.1f} ns/call")
    growth = costs[10**6] / costs[10**3] - 1
    print(f"  growth 1e6 vs 1e3: {growth * 100:+.1f}%  (target: at most +10%)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--scale", type=float, default=1.0, help="trace length multiplier")
    parser.add_argument("--repeat", type=int, default=5, help="timed replays per figure")
    parser.add_argument("--cycles", type=int, default=20_000, help="cycles per pool size")
    parser.add_argument("--no-model", action="store_true", help="skip the model column")
    parser.add_argument("--no-scaling", action="store_true", help="skip the pool-size sweep")
    parser.add_argument("--only", help="run only the traces whose name contains this")
    args = parser.parse_args(argv)

    print(f"Python {sys.version.split()[0]}")
    targets: dict[str, PoolFactory] = {"impl": make_impl}
    vllm = load_vllm()
    if vllm is not None:
        targets["vllm"] = vllm
    if not args.no_model:
        targets["model"] = make_model
    bench_traces(targets, args.scale, args.repeat, args.only)
    if not args.no_scaling:
        bench_scaling(args.repeat, args.cycles)


if __name__ == "__main__":
    main()
