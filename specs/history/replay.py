"""Replaying a history against the model: two layers over one recording.

* ``ManagerReplay``: the calls a scheduler made on the KV cache manager
  (KV depth 0) against ``kvpool.model.manager``; every result compared, and
  the whole pool state too where the history carries snapshots.
* ``PoolReplay``: every pool call not made inside another pool call against
  ``kvpool.model.pool`` (evictions included), so the pool is checked even
  where the manager layer finds nothing (a manager that tells a correct pool
  to do the wrong thing is the manager layer's to find).

A result the model does not allow raises ``CallDiverges``; a history the
model cannot express (an unsupported configuration, an operation not
modelled) raises ``HistoryError``.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from kvpool.model import pool as pool_ops
from kvpool.model.errors import PoolError
from kvpool.model.profiles import HASHLESS_FIRST
from kvpool.model.request import Request
from kvpool.model.single_type import (
    AttentionType,
    KVCacheSpec,
    chunked_local,
    full_attention,
    sliding_window,
)
from kvpool.model.state import CacheRequest, PoolState
from kvpool.specs.history.format import Header, HistoryError
from kvpool.specs.history.oracle import ORACLES, ModelOracle, Oracle

Blocks = tuple[tuple[int, ...], ...]
T = TypeVar("T")


class CallDiverges(Exception):
    """The engine's answer to one call is not the model's."""

    def __init__(self, what: str, engine: Any, model: Any) -> None:
        super().__init__(what)
        self.what = what
        self.engine = engine
        self.model = model


# --------------------------------------------------------------------------
# Requests, rebuilt from their delta-encoded snapshots
# --------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """A request's tokens and hashes so far, as the engine reported them."""

    tokens: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    num_prompt: int = 0
    salt: str | None = None
    skip_read: bool = False


class Requests:
    """Every request seen so far, rebuilt from the ``request`` arguments in call order."""

    def __init__(self, hash_block_size: int) -> None:
        self.hash_block_size = hash_block_size
        self.by_id: dict[str, RequestRecord] = {}

    def apply(self, snap: Any) -> str:
        """Fold one snapshot in; returns the request id."""
        if not isinstance(snap, dict) or not isinstance(snap.get("id"), str):
            raise ValueError("a request must be an object with a string 'id'")
        if "lora" in snap or "mm" in snap:
            raise HistoryError(
                "LoRA and multimodal requests are not modelled by the history checker"
            )
        rid: str = snap["id"]
        record = self.by_id.get(rid)
        if record is None or snap.get("reset"):
            record = self.by_id[rid] = RequestRecord()
        if "tok+" in snap:
            record.tokens.extend(int(t) for t in snap["tok+"])
        if "h+" in snap:
            record.hashes.extend(bytes.fromhex(h) for h in snap["h+"])
        record.num_prompt = int(snap["np"])
        if "salt" in snap:
            record.salt = str(snap["salt"])
        if snap.get("skip_read"):
            record.skip_read = True
        if len(record.tokens) != snap["n"] or len(record.hashes) != snap["nh"]:
            raise HistoryError(
                f"request {rid!r}: {len(record.tokens)} tokens and {len(record.hashes)} hashes "
                f"recorded so far, the snapshot says {snap['n']} and {snap['nh']}"
            )
        return rid

    def model_request(self, snap: dict[str, Any]) -> Request:
        """The model's view of the request, with the engine's own block hashes.

        The model's pool compares hashes as bytes, so the engine's hashes stand in
        for the model's (``kvpool history check --verify-hashes`` checks them apart).
        """
        record = self.by_id[snap["id"]]
        return Request(
            request_id=snap["id"],
            prompt_token_ids=tuple(record.tokens[: record.num_prompt]),
            hash_block_size=self.hash_block_size,
            output_token_ids=tuple(record.tokens[record.num_prompt :]),
            cache_salt=record.salt,
            num_computed_tokens=int(snap["nc"]),
            num_preemptions=int(snap.get("npre", 0)),
            skip_reading_prefix_cache=record.skip_read,
            block_hashes=tuple(record.hashes),
        )

    def cache_request(self, rid: str) -> CacheRequest:
        record = self.by_id[rid]
        return CacheRequest(block_hashes=tuple(record.hashes), all_token_ids=tuple(record.tokens))


def specs_from_header(header: Header) -> list[KVCacheSpec]:
    """The model's group specs; ``HistoryError`` for what it cannot check."""
    if header.partial_hash_hits:
        raise HistoryError(
            "cache.partial_hash_hits: hash blocks smaller than blocks are not modelled"
        )
    if header.use_eagle:
        raise HistoryError("cache.use_eagle: EAGLE histories are not checked yet")
    if header.watermark_blocks:
        raise HistoryError("cache.watermark_blocks > 0: the admission watermark is not modelled")
    specs = []
    for g, group in enumerate(header.groups):
        if group.attention == "full":
            specs.append(full_attention(group.block_size))
        elif group.attention == "sliding_window" and group.sliding_window is not None:
            specs.append(sliding_window(group.block_size, group.sliding_window))
        elif group.attention == "chunked_local" and group.attention_chunk_size is not None:
            specs.append(chunked_local(group.block_size, group.attention_chunk_size))
        else:
            raise HistoryError(f"group {g}: {group.attention} attention is not modelled here")
        if group.attention != "full" and header.retention != "dense":
            raise HistoryError(
                f"group {g}: sparse retention of {group.attention} blocks is not modelled "
                "(record with dense retention; vLLM: prefix_cache_retention_interval=None)"
            )
    return specs


def blocks_of(value: Any, groups: int) -> Blocks:
    """Block ids per group, checked to be integers in one list per group."""
    if not isinstance(value, list) or len(value) != groups:
        raise HistoryError(f"expected block ids for {groups} group(s), got {str(value)[:80]}")
    out = []
    for ids in value:
        if not isinstance(ids, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) for b in ids
        ):
            raise HistoryError(f"block ids must be integers, got {str(ids)[:80]}")
        out.append(tuple(ids))
    return tuple(out)


def id_list(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(b, int) and not isinstance(b, bool) for b in value
    ):
        raise HistoryError(f"expected a list of block ids, got {str(value)[:80]}")
    return value


class Renaming:
    """Engine block ids against model block ids.

    Strict (the default): equal. Loose (minimising, where dropped requests
    shift which physical block serves whom): a one-to-one renaming, fixed the
    first time a pair is seen.
    """

    def __init__(self, loose: bool = False) -> None:
        self.loose = loose
        self.to_model: dict[int, int] = {0: 0}
        self.to_engine: dict[int, int] = {0: 0}

    def same(
        self, engine: Sequence[Sequence[int]] | None, model: Sequence[Sequence[int]] | None
    ) -> bool:
        if engine is None or model is None or not self.loose:
            return engine == model
        if len(engine) != len(model) or any(
            len(e) != len(m) for e, m in zip(engine, model, strict=True)
        ):
            return False
        pairs = [
            (e, m)
            for es, ms in zip(engine, model, strict=True)
            for e, m in zip(es, ms, strict=True)
        ]
        for e, m in pairs:
            if self.to_model.get(e, m) != m or self.to_engine.get(m, e) != e:
                return False
        for e, m in pairs:
            self.to_model[e] = m
            self.to_engine[m] = e
        return True

    def rebind(self, engine: Blocks, model: Blocks) -> bool:
        """Loose only: newly handed-out blocks pair up afresh, whatever they were before.

        Which free block is reused depends on the whole pool's history, including
        the dropped requests'; only how many blocks each group got must agree.
        """
        if [len(g) for g in engine] != [len(g) for g in model]:
            return False
        for es, ms in zip(engine, model, strict=True):
            for e, m in zip(es, ms, strict=True):
                self.to_engine.pop(self.to_model.pop(e, -1), None)
                self.to_model.pop(self.to_engine.pop(m, -1), None)
                self.to_model[e] = m
                self.to_engine[m] = e
        return True

    def engine_ids(self, model: Sequence[int]) -> list[int]:
        """Model ids as the engine names them (identity where unknown)."""
        return [self.to_engine.get(b, b) for b in model] if self.loose else list(model)


# --------------------------------------------------------------------------
# The manager layer
# --------------------------------------------------------------------------

DRAINS: dict[str, Any] = {
    "step_starts": None,
    "take_new_block_ids": [],
    "take_block_copies": [[], []],
    "take_offloads": {},
    "take_events": [],
}
"""Per-step calls whose answer must be empty: zeroing, copy-on-write, offloads and
events are not in use in a checkable history (events off in the header)."""

IGNORED = frozenset({"record_hit_stats", "lookup_enabled", "make_stats"})
"""Statistics and helper calls that change no cache state."""

UNMODELLED_ARGS = {
    "num_external_computed_tokens": 0,
    "num_encoder_tokens": 0,
    "reserved_blocks": 0,
    "skip_zeroing_group_ids": [],
}


class _BothRejected(Exception):
    """Engine and model both rejected the call: they agree."""


class ManagerReplay:
    """The model of the engine's KV cache manager, fed the scheduler's calls."""

    def __init__(
        self,
        header: Header,
        loose: bool = False,
        relax_before: int | None = None,
        oracle: str = "model",
    ) -> None:
        self.header = header
        self.position = -1
        self.relax_before = relax_before
        """Loose replays: calls before this one may pair new blocks afresh (``Renaming.rebind``)."""
        self.groups = len(header.groups)
        self.requests = Requests(header.hash_block_size)
        self.ids = Renaming(loose)
        self.loose = loose
        # A loose replay takes back a refusal the model would grant: only the
        # model's immutable state can be put back, so loose replays use it.
        kind = "model" if loose else oracle
        try:
            self.oracle: Oracle = ORACLES[kind](
                header.num_blocks,
                specs_from_header(header),
                header.max_model_len,
                header.hash_block_size,
                header.enable_caching,
            )
        except PoolError as error:
            raise HistoryError(f"the model cannot be built from the header: {error}", 1) from None
        self.checked = 0
        self.skipped_refusals = 0

    def step(self, call: dict[str, Any]) -> None:
        """Replay one call (any call: only the scheduler's manager calls are checked)."""
        args = call["a"]
        self.position += 1
        if "request" in args:
            self.requests.apply(args["request"])
        if call["o"] != "manager" or call["d"] != 0:
            return
        method = call["m"]
        handler = self.HANDLERS.get(method)
        if handler is None:
            if method in IGNORED:
                return
            if method in DRAINS:
                if call.get("r") != DRAINS[method]:
                    raise CallDiverges(
                        f"{method} should have nothing", call.get("r"), DRAINS[method]
                    )
                return
            raise HistoryError(f"manager call {method!r} is not modelled")
        self.checked += 1
        try:
            handler(self, call)
        except _BothRejected:
            return
        if "s" in call and not self.loose:
            self.compare_state(call["s"])

    def _model(self, call: dict[str, Any], fn: Callable[..., T], *args: Any) -> T:
        """Run one operation of the specification; a rejection the engine did not make diverges."""
        try:
            result = fn(*args)
        except PoolError as error:
            if "x" in call:
                raise _BothRejected from None
            raise CallDiverges(
                f"{call['m']}", "accepted", f"rejects: {type(error).__name__}"
            ) from None
        if "x" in call:
            raise CallDiverges(call["m"], f"raised {call['x']}", "accepts")
        return result

    def get_computed_blocks(self, call: dict[str, Any]) -> None:
        request = self.requests.model_request(call["a"]["request"])
        blocks, tokens = self._model(call, self.oracle.get_computed_blocks, request)
        engine = call["r"]
        if not isinstance(engine, list) or len(engine) != 2:
            raise HistoryError("get_computed_blocks must return [blocks, num_tokens]")
        engine_blocks = blocks_of(engine[0], self.groups)
        if engine[1] != tokens or not self.ids.same(engine_blocks, blocks):
            raise CallDiverges("cache hit", [engine_blocks, engine[1]], [blocks, tokens])

    def allocate_slots(self, call: dict[str, Any]) -> None:
        args = call["a"]
        for name, neutral in UNMODELLED_ARGS.items():
            if args.get(name, neutral) != neutral:
                raise HistoryError(f"allocate_slots({name}={args[name]!r}) is not modelled")
        request = self.requests.model_request(args["request"])
        hits = args.get("new_computed_blocks")
        model_hits = None
        if hits is not None:
            engine_hits = blocks_of(hits, self.groups)
            model_hits = tuple(
                tuple(self.ids.to_model.get(b, b) for b in g) if self.loose else g
                for g in engine_hits
            )
            if not any(model_hits):
                model_hits = None
        engine = None if call.get("r") is None else blocks_of(call["r"], self.groups)
        if args.get("full_sequence_must_fit") and not self._fits(request, args, model_hits):
            if engine is not None:
                raise CallDiverges("admission of the whole sequence", engine, None)
            return
        before = self.oracle.state if isinstance(self.oracle, ModelOracle) else None
        blocks = self._model(
            call,
            self.oracle.allocate_slots,
            request,
            args["num_new_tokens"],
            args.get("num_new_computed_tokens", 0),
            model_hits,
            args.get("num_lookahead_tokens", 0),
            bool(args.get("delay_cache_blocks", False)),
        )
        if self.loose and engine is None and blocks is not None:
            # Refused for want of blocks that dropped requests held: not part of the witness.
            assert isinstance(self.oracle, ModelOracle) and before is not None
            self.oracle.state = before
            self.skipped_refusals += 1
            return
        relax = self.relax_before is not None and self.position < self.relax_before
        if relax and engine is not None and blocks is not None and self.ids.rebind(engine, blocks):
            return
        if not self.ids.same(engine, blocks):
            raise CallDiverges("new blocks", engine, blocks)

    def _fits(self, request: Request, args: dict[str, Any], hits: Blocks | None) -> bool:
        """The whole-sequence admission gate (vLLM 0.32's ``full_sequence_must_fit``).

        Counted before anything is released, over the whole sequence (capped at
        ``max_model_len``), each group's count capped at its admission cap.
        """
        oracle = self.oracle
        num_tokens = min(request.num_tokens, oracle.max_model_len())
        computed = request.num_computed_tokens + int(args.get("num_new_computed_tokens", 0))
        needed = 0
        for g, spec in enumerate(oracle.specs):
            needed += self._admission_need(
                g, spec, request.request_id, num_tokens, hits[g] if hits else (), computed
            )
        return needed <= oracle.num_free_blocks()

    def _admission_need(
        self,
        g: int,
        spec: KVCacheSpec,
        rid: str,
        num_tokens: int,
        hits: Sequence[int],
        computed: int,
    ) -> int:
        bs = spec.block_size
        required = -(-num_tokens // bs)
        cap = self.header.groups[g].admission_cap_blocks
        if cap is not None:
            required = min(required, cap)
        held = self.oracle.held(g, rid)
        if held is not None:
            return max(required - len(held), 0)
        skipped = 0
        if spec.attention is AttentionType.SLIDING_WINDOW:
            skipped = max(0, computed - spec.sliding_window + 1) // bs
        elif spec.attention is AttentionType.CHUNKED_LOCAL:
            skipped = computed // spec.attention_chunk_size * spec.attention_chunk_size // bs
        new = max(required - max(skipped, len(hits)), 0)
        evictable = sum(1 for b in hits[skipped:] if b != 0 and self.oracle.ref_cnt(b) == 0)
        return new + evictable

    def free(self, call: dict[str, Any]) -> None:
        self._model(call, self.oracle.free, call["a"]["request"]["id"])

    def get_block_ids(self, call: dict[str, Any]) -> None:
        rid = call["a"]["request_id"]
        if not isinstance(rid, str):
            raise HistoryError("request_id must be a string")
        model = self.oracle.get_block_ids(rid)
        engine = blocks_of(call["r"], self.groups)
        if not self.ids.same(engine, model):
            raise CallDiverges("the request's blocks", engine, model)

    def estimate_cached_tokens(self, call: dict[str, Any]) -> None:
        rid = call["a"]["request"]["id"]
        counts = []
        for g in range(len(self.oracle.specs)):
            held = self.oracle.held(g, rid) or ()
            counts.append(max((self.oracle.hash_num_tokens(b) or 0 for b in held), default=0))
        model = min(counts) if counts else 0
        if call["r"] != model:
            raise CallDiverges("cached tokens of the request", call["r"], model)

    def cache_blocks(self, call: dict[str, Any]) -> None:
        request = self.requests.model_request(call["a"]["request"])
        self._model(call, self.oracle.cache_blocks, request, call["a"]["num_computed_tokens"])

    def evict_blocks(self, call: dict[str, Any]) -> None:
        ids = id_list(call["a"]["block_ids"])
        self._model(call, self.oracle.evict_blocks, [self.ids.to_model.get(b, b) for b in ids])

    def reset_prefix_cache(self, call: dict[str, Any]) -> None:
        done = self._model(call, self.oracle.reset_prefix_cache)
        if call["r"] != done:
            raise CallDiverges("reset_prefix_cache", call["r"], done)

    def compare_state(self, snap: Any) -> None:
        """The pool after the call: free queue front to back, ref counts, cached keys."""
        if not isinstance(snap, dict):
            raise HistoryError("'s' (the pool snapshot) must be an object")
        mine = pool_state(self.oracle.pool())
        for part in ("free_queue", "ref", "cached"):
            if part in snap and snap[part] != mine[part]:
                raise CallDiverges(f"pool state after the call ({part})", snap[part], mine[part])

    HANDLERS: ClassVar[dict[str, Callable[["ManagerReplay", dict[str, Any]], None]]] = {
        "get_computed_blocks": get_computed_blocks,
        "allocate_slots": allocate_slots,
        "free": free,
        "get_block_ids": get_block_ids,
        "estimate_cached_tokens": estimate_cached_tokens,
        "cache_blocks": cache_blocks,
        "evict_blocks": evict_blocks,
        "reset_prefix_cache": reset_prefix_cache,
    }


def pool_state(pool: PoolState) -> dict[str, Any]:
    """The snapshot form of a model pool (null block's count read as 0)."""
    refs = [b.ref_cnt for b in pool.blocks]
    refs[0] = 0
    return {
        "free_queue": list(pool.free_queue),
        "ref": refs,
        "cached": [
            {"hash": h.hex(), "group": g, "blocks": list(ids)}
            for (h, g), ids in sorted(pool.cached.items())
        ],
    }


# --------------------------------------------------------------------------
# The pool layer
# --------------------------------------------------------------------------


def _key_hex(key: tuple[bytes, int]) -> str:
    return f"{key[0].hex()}:{key[1]}"


class PoolReplay:
    """The model of the engine's block pool, fed every outermost pool call."""

    def __init__(self, header: Header) -> None:
        self.groups = len(header.groups)
        self.requests = Requests(header.hash_block_size)
        self.pool = pool_ops.new_pool(
            header.num_blocks, header.enable_caching, header.hash_block_size, False, HASHLESS_FIRST
        )
        self.origin: list[str] = []
        self.pending_evictions: list[tuple[int, list[str]]] = []
        self.checked = 0

    def step(self, call: dict[str, Any]) -> None:
        """Replay one call (only outermost pool calls and evictions are checked)."""
        args = call["a"]
        if "request" in args:
            self.requests.apply(args["request"])
        self.origin.append(call["o"])
        if call["o"] != "pool":
            return
        method = call["m"]
        parent = call["p"]
        if parent is not None and self.origin[parent] == "pool" and method != "evict_cached_block":
            return  # made inside a pool call that was replayed whole
        handler = self.HANDLERS.get(method)
        if handler is None:
            raise HistoryError(f"pool call {method!r} is not modelled")
        self.checked += 1
        try:
            handler(self, call)
        except PoolError as error:
            if "x" not in call:
                raise CallDiverges(method, "accepted", f"rejects: {type(error).__name__}") from None

    def _keys(self, pool: PoolState, block: int) -> list[str]:
        return sorted(_key_hex(k) for k in pool.blocks[block].hash_keys())

    def get_new_blocks(self, call: dict[str, Any]) -> None:
        before = self.pool
        self.pool, ids = pool_ops.get_new_blocks(self.pool, call["a"]["num_blocks"])
        if call["r"] != list(ids):
            raise CallDiverges("new blocks", call["r"], list(ids))
        self.pending_evictions = [(b, self._keys(before, b)) for b in ids]

    def evict_cached_block(self, call: dict[str, Any]) -> None:
        if not self.pending_evictions:
            raise HistoryError("an eviction outside get_new_blocks or evict_blocks")
        block, keys = self.pending_evictions.pop(0)
        engine_keys = sorted(call["a"].get("keys", []))
        if call["a"]["block"] != block or engine_keys != keys:
            raise CallDiverges(
                "eviction",
                {"block": call["a"]["block"], "keys": engine_keys},
                {"block": block, "keys": keys},
            )
        if call["r"] != bool(keys):
            raise CallDiverges("eviction happened", call["r"], bool(keys))

    def touch(self, call: dict[str, Any]) -> None:
        self.pool, _ = pool_ops.touch(self.pool, id_list(call["a"]["blocks"]))

    def free_blocks(self, call: dict[str, Any]) -> None:
        self.pool, _ = pool_ops.free_blocks(self.pool, id_list(call["a"]["ordered_blocks"]))

    def cache_full_blocks(self, call: dict[str, Any]) -> None:
        a = call["a"]
        if a["num_cached_blocks"] >= a["num_full_blocks"]:
            return  # nothing to cache: the engine returns at once
        self.pool, _ = pool_ops.cache_full_blocks(
            self.pool,
            self.requests.cache_request(a["request"]["id"]),
            id_list(a["blocks"]),
            a["num_cached_blocks"],
            a["num_full_blocks"],
            a["block_size"],
            a["group"],
            a.get("block_mask"),
        )

    def get_cached_block(self, call: dict[str, Any]) -> None:
        a = call["a"]
        found = pool_ops.get_cached_block(self.pool, bytes.fromhex(a["hash"]), a["groups"])
        model = None if found is None else list(found)
        if call["r"] != model:
            raise CallDiverges("cached block lookup", call["r"], model)

    def get_num_free_blocks(self, call: dict[str, Any]) -> None:
        model = pool_ops.get_num_free_blocks(self.pool)
        if call["r"] != model:
            raise CallDiverges("free blocks", call["r"], model)

    def evict_blocks(self, call: dict[str, Any]) -> None:
        before = self.pool
        ids = id_list(call["a"]["block_ids"])
        self.pool, _ = pool_ops.evict_blocks(self.pool, ids)
        self.pending_evictions = [(b, self._keys(before, b)) for b in ids]

    def reset_prefix_cache(self, call: dict[str, Any]) -> None:
        self.pool, done = pool_ops.reset_prefix_cache(self.pool)
        if call["r"] != done:
            raise CallDiverges("reset_prefix_cache", call["r"], done)

    def take_events(self, call: dict[str, Any]) -> None:
        if call["r"] != []:
            raise CallDiverges("events (events are off)", call["r"], [])

    HANDLERS: ClassVar[dict[str, Callable[["PoolReplay", dict[str, Any]], None]]] = {
        "get_new_blocks": get_new_blocks,
        "evict_cached_block": evict_cached_block,
        "touch": touch,
        "free_blocks": free_blocks,
        "cache_full_blocks": cache_full_blocks,
        "get_cached_block": get_cached_block,
        "get_num_free_blocks": get_num_free_blocks,
        "evict_blocks": evict_blocks,
        "reset_prefix_cache": reset_prefix_cache,
        "take_events": take_events,
    }
