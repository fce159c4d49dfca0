"""Throughput of kvpool.impl, pure and compiled, against vLLM's BlockPool and KVCacheManager.

Run it with the project's interpreter (vLLM 0.33 installed light, as the
developers' guide says, for the vLLM column)::

    python bench/bench_pool.py --compiled .venv-compiled/lib/python3.11/site-packages

``--compiled`` names a directory holding a mypyc-compiled ``kvpool/impl``
(``pip install .`` into a second venv, as .ci/run does); both builds of the
impl are then loaded into this one process and timed interleaved. Run under
an interpreter whose own kvpool.impl is compiled, the pure-Python column
comes from the sources beside this script instead. Without either, the
compiled column is skipped with a note.

``--scale`` lengthens or shortens the traces, ``--only serving`` picks traces by
name (``--only requests`` and ``--only scaling`` run that part alone),
``--no-model``, ``--no-requests`` and ``--no-scaling`` skip parts.
``--per-call`` adds, per trace, each target's time in each kind of call (a
diagnostic: a timer around every call adds the same few tens of ns per call
to every target, which pulls every ratio towards 1).

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

Printed: calls per second per trace and target; the pure/vLLM, compiled/vLLM,
compiled/pure and pure/model ratios; requests per second through the request
layer (``get_computed_blocks`` + ``allocate_slots`` + ``free`` per request,
kvpool.impl.KVCacheManager against vLLM's); and each build's cost per
operation for pools of 1e3 to 1e6 blocks on one allocate/cache/look-up/free
cycle over a fixed working set.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import platform
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import kvpool.impl
from kvpool import model
from kvpool.impl import BlockPool as ImplPool
from kvpool.model.single_type import full_attention

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
        Trace(
            "serving, 100k-block pool",
            True,
            False,
            100_000,
            serving_requests,
            serving(48, 4, False),
            model_fraction=0.0,  # the model copies its 100k-block state on every call
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


def pool_factory(impl: ModuleType) -> PoolFactory:
    def make(num_blocks: int, caching: bool, events: bool) -> Any:
        return impl.BlockPool(num_blocks, caching, BLOCK_SIZE, enable_kv_cache_events=events)

    return make


def load_impl_copy(package_dir: Path) -> ModuleType:
    """Another copy of kvpool.impl, loaded from ``package_dir``, beside the one imported above.

    The copy's modules leave sys.modules again afterwards; its classes work
    through the returned package (both copies share kvpool.model, its errors
    included). A compiled copy's shared library (``*__mypyc``) sits in the
    directory above ``kvpool/``, which goes on sys.path for the import.
    """
    prefix = "kvpool.impl"
    mine = {k: v for k, v in sys.modules.items() if k == prefix or k.startswith(prefix + ".")}
    for name in mine:
        del sys.modules[name]
    site = str(package_dir.parent.parent)
    sys.path.append(site)
    try:
        spec = importlib.util.spec_from_file_location(
            prefix, package_dir / "__init__.py", submodule_search_locations=[str(package_dir)]
        )
        assert spec is not None and spec.loader is not None
        copy = importlib.util.module_from_spec(spec)
        sys.modules[prefix] = copy
        spec.loader.exec_module(copy)
        return copy
    finally:
        sys.path.remove(site)
        for name in [k for k in sys.modules if k == prefix or k.startswith(prefix + ".")]:
            del sys.modules[name]
        sys.modules.update(mine)


def impl_builds(compiled_site: str | None) -> dict[str, ModuleType]:
    """{"pure": ..., "compiled": ...}: the two builds of kvpool.impl, where both can be had."""
    here = Path(__file__).resolve().parent.parent / "impl"
    if kvpool.impl.COMPILED:
        return {"pure": load_impl_copy(here), "compiled": kvpool.impl}
    builds = {"pure": kvpool.impl}
    if compiled_site is None:
        print("note: no compiled kvpool.impl (--compiled DIR): its column is skipped.")
        return builds
    copy = load_impl_copy(Path(compiled_site) / "kvpool" / "impl")
    if not copy.COMPILED:
        raise SystemExit(f"{compiled_site}: its kvpool.impl is not the compiled build")
    builds["compiled"] = copy
    return builds


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
    header = f"{'trace':36} {'target':8} {'calls':>8} {'calls/s':>11}"
    print(header)
    print("-" * len(header))
    ratios: list[tuple[str, str, float]] = []
    for trace in traces(scale):
        if only is not None and only not in trace.name:
            continue
        setup, calls = record(trace)
        replayed = {name: calls for name in targets}
        runs = dict(targets)
        if "model" in runs and trace.model_fraction == 0:
            del runs["model"]
        elif "model" in runs:
            replayed["model"] = calls[: max(50, int(len(calls) * trace.model_fraction))]
        for name, make in runs.items():
            verify(make(trace.num_blocks, trace.caching, trace.events), setup + replayed[name])
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(repeat):
            for name, make in runs.items():
                times[name].append(replay_once(make, trace, setup, replayed[name]))
        rates = {name: len(replayed[name]) / statistics.median(times[name]) for name in runs}
        for name in runs:
            print(f"{trace.name:36} {name:8} {len(replayed[name]):8d} {rates[name]:11,.0f}")
        for mine, other in RATIOS:
            if mine in rates and other in rates:
                ratios.append((trace.name, f"{mine}/{other}", rates[mine] / rates[other]))
    print()
    for trace_name, pair, ratio in ratios:
        print(f"{pair:16} on {trace_name:36} {ratio:8.2f}x")


def replay_per_call(
    make: PoolFactory, trace: Trace, setup: list[Call], calls: list[Call]
) -> dict[str, float]:
    """Seconds spent in each kind of call while replaying ``calls`` on a fresh pool."""
    pool = make(trace.num_blocks, trace.caching, trace.events)
    for method, args in bind(pool, setup):
        method(*args)
    bound = bind(pool, calls)
    spent = dict.fromkeys((call.name for call in calls), 0)
    clock = time.perf_counter_ns
    gc.collect()
    gc.freeze()
    for call, (method, args) in zip(calls, bound, strict=True):
        start = clock()
        method(*args)
        spent[call.name] += clock() - start
    gc.unfreeze()
    return {name: ns / 1e9 for name, ns in spent.items()}


def bench_per_call(
    targets: dict[str, PoolFactory], scale: float, repeat: int, only: str | None = None
) -> None:
    print(f"\n== Traces: milliseconds per kind of call (median of {repeat}, timer included) ==")
    runs = {name: make for name, make in targets.items() if name != "model"}
    for trace in traces(scale):
        if only is not None and only not in trace.name:
            continue
        setup, calls = record(trace)
        spent: dict[str, dict[str, list[float]]] = {name: {} for name in runs}
        for _ in range(repeat):
            for name, make in runs.items():
                for kind, seconds in replay_per_call(make, trace, setup, calls).items():
                    spent[name].setdefault(kind, []).append(seconds)
        print(trace.name)
        for kind in dict.fromkeys(call.name for call in calls):
            count = sum(1 for call in calls if call.name == kind)
            ms = {name: statistics.median(spent[name][kind]) * 1e3 for name in runs}
            cells = "  ".join(f"{name} {value:7.2f}" for name, value in ms.items())
            ratio = f"  vllm/pure {ms['vllm'] / ms['pure']:5.2f}x" if "vllm" in ms else ""
            print(f"  {kind:20} {count:7d}  {cells}{ratio}")


RATIOS = [("pure", "vllm"), ("compiled", "vllm"), ("compiled", "pure"), ("pure", "model")]
"""The ratios printed, where both sides ran: (numerator, denominator)."""


# --------------------------------------------------------------------------
# The request layer: KVCacheManager
# --------------------------------------------------------------------------


class ManagerRequest:
    """What vLLM's KVCacheManager and kvpool.impl's read from a request, for both alike."""

    def __init__(self, request_id: str, block_hashes: list[bytes], status: Any) -> None:
        self.request_id = request_id
        self.block_hashes = block_hashes
        self.all_token_ids = list(range(len(block_hashes) * BLOCK_SIZE))
        self.num_tokens = self.num_prompt_tokens = len(self.all_token_ids)
        self.num_computed_tokens = 0
        self.hash_block_size = BLOCK_SIZE
        self.num_preemptions = 0
        self.skip_reading_prefix_cache = False
        self.num_in_flight_tokens = 0
        self.shared_prefix_boundary = 0
        self.status = status
        self.lora_request = None
        self.mm_features: list[Any] = []
        self.cache_salt = None
        self.prompt_embeds = None
        self.session_id = None


ManagerFactory = Callable[[int, int], Any]
"""(num_blocks, max_model_len) -> a KV cache manager of one full-attention group, caching on."""


def impl_manager_factory(impl: ModuleType) -> ManagerFactory:
    def make(num_blocks: int, max_model_len: int) -> Any:
        config = impl.KVCacheConfig(num_blocks, (full_attention(BLOCK_SIZE),))
        return impl.KVCacheManager(config, max_model_len, hash_block_size=BLOCK_SIZE)

    return make


def vllm_manager_factory() -> tuple[ManagerFactory, Any] | None:
    """vLLM's KVCacheManager factory and its RUNNING status, or None if vLLM cannot be imported."""
    try:
        import torch  # type: ignore[import-not-found,unused-ignore]
        from vllm.v1.core.kv_cache_manager import (  # type: ignore[import-not-found,unused-ignore]
            KVCacheManager,
        )
        from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found,unused-ignore]
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.request import RequestStatus  # type: ignore[import-not-found,unused-ignore]
    except Exception:  # reported once already by load_vllm
        return None

    def make(num_blocks: int, max_model_len: int) -> Any:
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32
        )
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        return KVCacheManager(
            config,
            max_model_len=max_model_len,
            enable_caching=True,
            hash_block_size=BLOCK_SIZE,
            scheduler_block_size=BLOCK_SIZE,
        )

    return make, RequestStatus.RUNNING


def manager_requests(requests: list[Request], status: Any) -> list[ManagerRequest]:
    return [
        ManagerRequest(f"req{i}", r.block_hashes[: r.num_prompt_blocks], status)
        for i, r in enumerate(requests)
    ]


def admit(manager: Any, requests: list[ManagerRequest], window: int) -> tuple[int, int]:
    """Each request: look up its prefix, allocate the rest, run; the oldest finish.

    Returns (tokens found cached, blocks allocated), so the targets can be compared.
    """
    running: deque[ManagerRequest] = deque()
    hit_tokens = allocated = 0
    for request in requests:
        request.num_computed_tokens = 0
        hits, num_hit = manager.get_computed_blocks(request)[:2]
        hit_tokens += num_hit
        new = request.num_tokens - num_hit
        while (blocks := manager.allocate_slots(request, new, num_hit, hits)) is None:
            manager.free(running.popleft())
        allocated += len(blocks.blocks[0])
        request.num_computed_tokens = request.num_tokens
        running.append(request)
        if len(running) > window:
            manager.free(running.popleft())
    while running:
        manager.free(running.popleft())
    return hit_tokens, allocated


def bench_requests(
    targets: dict[str, ManagerFactory], status: Any, scale: float, repeat: int
) -> None:
    print(f"\n== Request layer: requests per second (median of {repeat}) ==")
    n = max(50, int(4000 * scale))
    requests = manager_requests(make_requests(1, n, 24, (8, 64), (1, 24), (0, 0)), status)
    num_blocks, max_model_len = 4096, 128 * BLOCK_SIZE
    outcomes = {
        name: admit(make(num_blocks, max_model_len), requests, 48) for name, make in targets.items()
    }
    if len(set(outcomes.values())) != 1:
        raise AssertionError(f"the managers disagree (hit tokens, blocks): {outcomes}")
    times: dict[str, list[float]] = {name: [] for name in targets}
    for _ in range(repeat):
        for name, make in targets.items():
            manager = make(num_blocks, max_model_len)
            gc.collect()
            gc.freeze()
            start = time.perf_counter()
            admit(manager, requests, 48)
            times[name].append(time.perf_counter() - start)
            gc.unfreeze()
    rates = {name: len(requests) / statistics.median(times[name]) for name in targets}
    hit, allocated = next(iter(outcomes.values()))
    print(f"{len(requests)} requests, {hit} tokens from the cache, {allocated} blocks allocated")
    for name in targets:
        print(f"  {name:8} {rates[name]:11,.0f} requests/s")
    for mine, other in RATIOS:
        if mine in rates and other in rates:
            pair = f"{mine}/{other}"
            print(f"{pair:16} on the request layer {rates[mine] / rates[other]:8.2f}x")


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


def bench_scaling(builds: dict[str, ModuleType], repeat: int, cycles: int) -> None:
    print(f"\n== impl cost per call against pool size (median of {repeat}, {cycles} cycles) ==")
    working = 8
    request = Request(
        [f"s{i}".encode() for i in range(working)], list(range(working * BLOCK_SIZE)), working
    )
    sizes = (10**3, 10**4, 10**5, 10**6)
    runs = [(build, size) for build in builds for size in sizes]
    pools = {(build, size): builds[build].BlockPool(size, True, BLOCK_SIZE) for build, size in runs}
    times: dict[tuple[str, int], list[float]] = {run: [] for run in runs}
    calls = 0
    for _ in range(repeat):
        for run in runs:  # interleaved, as for the traces
            gc.collect()
            gc.freeze()
            start = time.perf_counter()
            calls = cycle(pools[run], request, cycles)
            times[run].append(time.perf_counter() - start)
            gc.unfreeze()
    for build in builds:
        costs = {size: statistics.median(times[build, size]) / calls for size in sizes}
        for size in sizes:
            print(f"  {build:8} {size:>9,} blocks: {costs[size] * 1e9:7.1f} ns/call")
        growth = costs[10**6] / costs[10**3] - 1
        print(f"  {build:8} growth 1e6 vs 1e3: {growth * 100:+.1f}%  (target: at most +10%)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--scale", type=float, default=1.0, help="trace length multiplier")
    parser.add_argument("--repeat", type=int, default=5, help="timed replays per figure")
    parser.add_argument("--cycles", type=int, default=20_000, help="cycles per pool size")
    parser.add_argument("--no-model", action="store_true", help="skip the model column")
    parser.add_argument("--no-scaling", action="store_true", help="skip the pool-size sweep")
    parser.add_argument("--no-requests", action="store_true", help="skip the request layer")
    parser.add_argument("--only", help="run only the traces whose name contains this")
    parser.add_argument("--compiled", help="site-packages directory of a compiled kvpool")
    parser.add_argument(
        "--per-call", action="store_true", help="also time each kind of call (diagnostic)"
    )
    args = parser.parse_args(argv)

    print(f"Python {sys.version.split()[0]} on {platform.machine()}, {os.cpu_count()} CPUs")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    builds = impl_builds(args.compiled)
    targets: dict[str, PoolFactory] = {name: pool_factory(impl) for name, impl in builds.items()}
    vllm = load_vllm()
    if vllm is not None:
        targets["vllm"] = vllm
    if not args.no_model:
        targets["model"] = make_model
    if args.only not in ("requests", "scaling"):
        bench_traces(targets, args.scale, args.repeat, args.only)
        if args.per_call:
            bench_per_call(targets, args.scale, args.repeat, args.only)
    if not args.no_requests and args.only != "scaling":
        managers = {name: impl_manager_factory(impl) for name, impl in builds.items()}
        found = vllm_manager_factory() if vllm is not None else None
        status = None
        if found is not None:
            managers["vllm"], status = found
        bench_requests(managers, status, args.scale, args.repeat)
    if not args.no_scaling and args.only in (None, "scaling"):
        bench_scaling(builds, args.repeat, args.cycles)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
