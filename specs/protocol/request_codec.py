"""The request layer's protocol codec: JSON values for every KV cache manager operation.

A KV cache manager written in any language is checked the way a pool is
(``kvpool.specs.protocol.codec``): a program reading one JSON request per
line and answering one JSON response per line. This module is the codec of
the request layer's dialect, version ``REQUEST_PROTOCOL_VERSION``, beside the
pool's; its JSON Schema is ``schemas/request-protocol-v1.json`` and
docs/formats.md describes the exchange.

Requests travel as token ids *and* their extra keys (LoRA adapter,
multimodal inputs, cache salt, prompt embeddings), with the hash block size
and the root hash they chain from, so a target may hash them itself; they
also carry kvpool's own block hashes for a target that does not. Hashes
and prompt embeddings are lowercase hex; block tables are one list of block
ids per KV cache group; rejections are named by the model's exception
classes (``kvpool.model.errors``), pool and request layer alike.
"""

from collections.abc import Mapping
from typing import Any

from kvpool.model import PROFILES, PoolConfig, PoolError
from kvpool.model import errors as model_errors
from kvpool.model.geometry import default_scheduler_block_size, effective_specs
from kvpool.model.hashing import NONE_HASH, LoraAdapter, MultiModalInput, none_hash
from kvpool.model.manager import (
    Blocks,
    KVCacheManagerState,
    ManagerConfig,
    PrefixCacheStats,
)
from kvpool.model.request import Request
from kvpool.model.single_type import AttentionType, GroupTable, KVCacheSpec, ManagersState
from kvpool.specs.protocol.codec import (
    MAX_HASH_BLOCK_SIZE,
    MAX_NUM_BLOCKS,
    Json,
    ProtocolError,
    _bool,
    _int,
    _list,
    _object,
    _optional_str,
    decode_event,
    decode_hash,
    decode_state,
    encode_event,
    encode_hash,
    encode_state,
)
from kvpool.specs.request.target import (
    OPERATIONS as TARGET_OPERATIONS,
)
from kvpool.specs.request.target import (
    OPERATIONS_033,
    OPERATIONS_SCHEDULER,
    ManagerSetup,
    ManagerSnapshottable,
    ManagerTarget,
    eagle_arguments,
    geometry_arguments,
    retention_arguments,
)

REQUEST_PROTOCOL_VERSION = 1
"""The version of the request layer's dialect that ``hello`` announces (docs/formats.md)."""

LAYER = "request"
"""What the kit's ``hello`` names, and the target's answer must name back."""

ATTENTION_NAMES = {
    AttentionType.FULL: "full",
    AttentionType.SLIDING_WINDOW: "sliding_window",
    AttentionType.CHUNKED_LOCAL: "chunked_local",
    AttentionType.MAMBA: "mamba",
}
"""A group spec's ``attention`` in JSON."""

HASHER_OPERATIONS = ("block_hashes", "none_hash")
"""The hasher's own operations: optional, announced by ``"hasher"`` in hello."""

HASHERS = ("none", "own", "kvpool")
"""What a target's hello may say of its hasher: it takes the hashes the requests
carry (``none``), hashes them with its own function (``own``: checked against the
token ground truth), or with kvpool's (``kvpool``: the hash vectors apply too)."""

OPERATIONS = (
    *TARGET_OPERATIONS,
    *HASHER_OPERATIONS,
)
"""Every operation of the dialect besides ``hello``, ``new_manager`` and ``FEATURE_OPERATIONS``."""

FEATURE_OPERATIONS = (*OPERATIONS_033, *OPERATIONS_SCHEDULER)
"""The operations asked only of a target whose hello announces their feature (``FEATURES``)."""

FEATURES: dict[str, str] = {
    "fine_grained": "vLLM 0.33's fine-grained hits: setups may carry fine_grained_hits, and "
    "the target answers OPERATIONS_033",
    "scheduler_calls": "the rest of vLLM 0.33's scheduler calls (OPERATIONS_SCHEDULER and "
    "free_blocks), allocate_slots' full_sequence_must_fit, setups' max_in_flight_tokens",
    "prefill_lookahead": "setups may carry num_prefill_lookahead (multi-module MTP)",
    "eagle_hybrids": "use_eagle on every layout vLLM 0.33 runs EAGLE on, hybrids included",
    "context_parallel": "setups may carry dcp_world_size and pcp_world_size (and group specs "
    "dcp_sharded)",
    "sparse_retention": "setups may carry retention_interval (vLLM 0.33's "
    "prefix_cache_retention_interval, in tokens) and requests shared_prefix_boundary "
    "(needs fine_grained)",
    "connector_loads": "allocate_slots may carry a KV connector's num_external_computed_tokens, "
    "reserved_blocks and skip_zeroing_group_ids (needs scheduler_calls)",
    "eagle_flags": "setups may carry eagle_groups: the groups flagged as EAGLE's (vLLM 0.33's "
    "per-group is_eagle_group)",
}
"""The optional features a request-layer target may announce in hello's ``features``, and
what each lets the kit send it. A target is never sent what it does not announce; a name
the kit does not know is ignored, so a program may announce features of a later kit."""

FEATURE_NEEDS: dict[str, str] = {
    "sparse_retention": "fine_grained",
    "connector_loads": "scheduler_calls",
}
"""A feature asked only with another: sparse retention's requests carry the shared-prefix
boundary of ``get_computed_blocks_with_boundary`` (a fine-grained call), and a KV connector's
loads come with the rest of the scheduler's calls (``kvpool.specs.request.machine``). A hello
announcing one without the other is refused: the feature would silently never be asked."""

MAX_FEATURES = 64
"""The most names hello's ``features`` may list (each at most ``MAX_FEATURE_NAME`` long)."""
MAX_FEATURE_NAME = 64


def _rejections() -> dict[str, type[PoolError]]:
    found: dict[str, type[PoolError]] = {}
    for value in vars(model_errors).values():
        if (
            isinstance(value, type)
            and issubclass(value, PoolError)
            and value not in (PoolError, model_errors.RequestError)
        ):
            found[value.__name__] = value
    return dict(sorted(found.items()))


REQUEST_ERROR_NAMES: dict[str, type[PoolError]] = _rejections()
"""The rejections a request-layer target may answer with, by class name: every
exception of ``kvpool.model.errors`` (pool, hash chain and request layer)."""


# --------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------


def encode_spec(spec: KVCacheSpec) -> Json:
    """A KV cache group's spec.

    >>> from kvpool.model.single_type import sliding_window
    >>> encode_spec(sliding_window(2, 4))
    {'attention': 'sliding_window', 'block_size': 2, 'sliding_window': 4, 'attention_chunk_size': 0}
    """
    encoded: dict[str, Json] = {
        "attention": ATTENTION_NAMES[spec.attention],
        "block_size": spec.block_size,
        "sliding_window": spec.sliding_window,
        "attention_chunk_size": spec.attention_chunk_size,
    }
    if spec.mamba_align:  # only when set: every other group's JSON is what it always was
        encoded["mamba_align"] = True
    # likewise a Mamba "align" group's reserved blocks (kvpool.model.mamba_reserve)
    if spec.num_speculative_blocks:
        encoded["num_speculative_blocks"] = spec.num_speculative_blocks
    if spec.prefill_checkpoint_alignment:
        encoded["prefill_checkpoint_alignment"] = spec.prefill_checkpoint_alignment
    # only when it is not the attention type's default, so older files keep their shape
    if spec.dcp_sharded != _default_dcp_sharded(spec.attention):
        encoded["dcp_sharded"] = spec.dcp_sharded
    return encoded


def _default_dcp_sharded(attention: AttentionType) -> bool:
    """vLLM 0.33's default: attention groups are sharded across decode ranks, Mamba is not."""
    return attention is not AttentionType.MAMBA


def decode_spec(value: Json) -> KVCacheSpec:
    """The inverse of ``encode_spec``."""
    obj = _object(value, "group spec")
    names = {name: kind for kind, name in ATTENTION_NAMES.items()}
    attention = obj.get("attention")
    if not isinstance(attention, str) or attention not in names:
        raise ProtocolError(f"unknown attention {attention!r:.100}; known: {', '.join(names)}")
    return KVCacheSpec(
        names[attention],
        _bounded(obj.get("block_size"), "block_size", MAX_TOKENS),
        sliding_window=_bounded(obj.get("sliding_window", 0), "sliding_window", MAX_TOKENS),
        attention_chunk_size=_bounded(
            obj.get("attention_chunk_size", 0), "attention_chunk_size", MAX_TOKENS
        ),
        mamba_align=_mamba_align(obj.get("mamba_align", False)),
        num_speculative_blocks=_bounded(
            obj.get("num_speculative_blocks", 0), "num_speculative_blocks", MAX_TOKENS
        ),
        prefill_checkpoint_alignment=_bounded(
            obj.get("prefill_checkpoint_alignment", 0), "prefill_checkpoint_alignment", MAX_TOKENS
        ),
        dcp_sharded=_bool(
            obj.get("dcp_sharded", _default_dcp_sharded(names[attention])), "dcp_sharded"
        ),
    )


def _mamba_align(value: object) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"mamba_align must be a boolean, got {value!r:.100}")
    return value


MAX_TOKENS = 65536
"""The most tokens a setup's sizes (model length, block size, window, chunk) may name."""
MAX_GROUPS = 16
"""The most KV cache groups (specs) a setup may have."""


def _bounded(value: Json, what: str, limit: int) -> int:
    number = _int(value, what)
    if number > limit:
        raise ProtocolError(f"{what} is {number}; the protocol allows at most {limit}")
    return number


def encode_setup(setup: ManagerSetup) -> Json:
    """The ``new_manager`` arguments for a setup."""
    return {
        "num_blocks": setup.num_blocks,
        "specs": [encode_spec(s) for s in setup.specs],
        "max_model_len": setup.max_model_len,
        "hash_block_size": setup.hash_block_size,
        "enable_caching": setup.enable_caching,
        "use_eagle": setup.use_eagle,
        "log_stats": setup.log_stats,
        "enable_events": setup.enable_events,
        "profile": setup.profile.name,
        # written only when on, so that earlier setups encode as they did
        **({"fine_grained_hits": True} if setup.fine_grained_hits else {}),
        **(
            {}
            if setup.max_in_flight_tokens is None
            else {"max_in_flight_tokens": setup.max_in_flight_tokens}
        ),
        **(
            {"num_prefill_lookahead": setup.num_prefill_lookahead}
            if setup.num_prefill_lookahead
            else {}
        ),
        # the block geometry, written only where it is not the default
        **geometry_arguments(setup),
        **retention_arguments(setup),
        **eagle_arguments(setup),
    }


def decode_setup(value: Json) -> ManagerSetup:
    """The inverse of ``encode_setup``."""
    obj = _object(value, "setup")
    profile = obj.get("profile")
    if not isinstance(profile, str) or profile not in PROFILES:
        raise ProtocolError(f"unknown profile {profile!r:.100}; known: {', '.join(PROFILES)}")
    specs = _list(obj.get("specs"), "specs")
    if len(specs) > MAX_GROUPS:
        raise ProtocolError(f"{len(specs)} specs; the protocol allows at most {MAX_GROUPS}")
    return ManagerSetup(
        num_blocks=_bounded(obj.get("num_blocks"), "num_blocks", MAX_NUM_BLOCKS),
        specs=tuple(decode_spec(s) for s in specs),
        max_model_len=_bounded(obj.get("max_model_len"), "max_model_len", MAX_TOKENS),
        hash_block_size=_bounded(
            obj.get("hash_block_size"), "hash_block_size", MAX_HASH_BLOCK_SIZE
        ),
        enable_caching=_bool(obj.get("enable_caching"), "enable_caching"),
        use_eagle=_bool(obj.get("use_eagle"), "use_eagle"),
        log_stats=_bool(obj.get("log_stats"), "log_stats"),
        enable_events=_bool(obj.get("enable_events"), "enable_events"),
        profile=PROFILES[profile],
        fine_grained_hits=_bool(obj.get("fine_grained_hits", False), "fine_grained_hits"),
        max_in_flight_tokens=(
            None
            if obj.get("max_in_flight_tokens") is None
            else _int(obj.get("max_in_flight_tokens"), "max_in_flight_tokens")
        ),
        num_prefill_lookahead=_bounded(
            obj.get("num_prefill_lookahead", 0), "num_prefill_lookahead", MAX_TOKENS
        ),
        scheduler_block_size=(
            _bounded(obj["scheduler_block_size"], "scheduler_block_size", MAX_TOKENS)
            if "scheduler_block_size" in obj
            else None
        ),
        dcp_world_size=_bounded(obj.get("dcp_world_size", 1), "dcp_world_size", MAX_GROUPS),
        pcp_world_size=_bounded(obj.get("pcp_world_size", 1), "pcp_world_size", MAX_GROUPS),
        retention_interval=(
            None
            if obj.get("retention_interval") is None
            else _int(obj.get("retention_interval"), "retention_interval")
        ),
        eagle_groups=_ints(obj.get("eagle_groups", []), "eagle_groups"),
    )


def pool_config(setup: ManagerSetup) -> PoolConfig:
    """The configuration of the pool a manager built from ``setup`` shares among its groups."""
    return PoolConfig(
        setup.num_blocks,
        setup.enable_caching,
        setup.hash_block_size,
        setup.enable_events,
        setup.profile,
    )


def encode_request(request: Request) -> Json:
    """A request as the manager sees it: tokens, extra keys, progress and kvpool's hashes.

    >>> from kvpool.model.request import new_request
    >>> encoded = encode_request(new_request("a", [300, 2], 2, cache_salt="s"))
    >>> encoded["prompt_token_ids"], encoded["cache_salt"], len(encoded["block_hashes"])
    ([300, 2], 's', 1)
    """
    lora = request.lora
    return {
        "request_id": request.request_id,
        "prompt_token_ids": list(request.prompt_token_ids),
        "output_token_ids": list(request.output_token_ids),
        "hash_block_size": request.hash_block_size,
        "lora": None
        if lora is None
        else {"lora_id": lora.lora_id, "name": lora.name, "path": lora.path},
        "mm_inputs": [
            {"identifier": m.identifier, "offset": m.offset, "length": m.length}
            for m in request.mm_inputs
        ],
        "cache_salt": request.cache_salt,
        "prompt_embeds": [e.hex() for e in request.prompt_embeds],
        "num_computed_tokens": request.num_computed_tokens,
        "num_preemptions": request.num_preemptions,
        "skip_reading_prefix_cache": request.skip_reading_prefix_cache,
        "seed_hash": encode_hash(request.seed_hash),
        "block_hashes": [encode_hash(h) for h in request.block_hashes],
        # sparse retention's shared-prefix boundary (feature sparse_retention): written only
        # when the scheduler noted one, so that other requests encode as they did
        **(
            {"shared_prefix_boundary": request.shared_prefix_boundary}
            if request.shared_prefix_boundary
            else {}
        ),
    }


def decode_request(value: Json) -> Request:
    """The inverse of ``encode_request``: the hashes are taken as sent, not recomputed."""
    obj = _object(value, "request")
    raw_lora = obj.get("lora")
    lora = None
    if raw_lora is not None:
        lo = _object(raw_lora, "lora")
        lora = LoraAdapter(
            _int(lo.get("lora_id"), "lora_id"),
            _str(lo.get("name"), "lora name"),
            _str(lo.get("path", ""), "lora path"),
        )
    mm_inputs = []
    for raw in _list(obj.get("mm_inputs", []), "mm_inputs"):
        m = _object(raw, "multimodal input")
        mm_inputs.append(
            MultiModalInput(
                _str(m.get("identifier"), "identifier"),
                _int(m.get("offset"), "offset"),
                _int(m.get("length"), "length"),
            )
        )
    seed = obj.get("seed_hash")
    return Request(
        request_id=_str(obj.get("request_id"), "request_id"),
        prompt_token_ids=_ints(obj.get("prompt_token_ids"), "prompt_token_ids"),
        hash_block_size=_int(obj.get("hash_block_size"), "hash_block_size"),
        output_token_ids=_ints(obj.get("output_token_ids", []), "output_token_ids"),
        lora=lora,
        mm_inputs=tuple(mm_inputs),
        cache_salt=_optional_str(obj.get("cache_salt"), "cache_salt"),
        num_computed_tokens=_int(obj.get("num_computed_tokens", 0), "num_computed_tokens"),
        num_preemptions=_int(obj.get("num_preemptions", 0), "num_preemptions"),
        skip_reading_prefix_cache=_bool(
            obj.get("skip_reading_prefix_cache", False), "skip_reading_prefix_cache"
        ),
        block_hashes=tuple(
            decode_hash(h) for h in _list(obj.get("block_hashes", []), "block_hashes")
        ),
        seed_hash=NONE_HASH if seed is None else decode_hash(seed),
        prompt_embeds=tuple(
            decode_hash(e) for e in _list(obj.get("prompt_embeds", []), "prompt_embeds")
        ),
        shared_prefix_boundary=_bounded(
            obj.get("shared_prefix_boundary", 0), "shared_prefix_boundary", MAX_TOKENS
        ),
    )


def encode_blocks(blocks: Blocks | None) -> Json:
    """Block ids per group (``[[1, 2], [3]]``); None stays null."""
    return None if blocks is None else [[int(b) for b in group] for group in blocks]


def decode_blocks(value: Json, what: str = "blocks") -> Blocks | None:
    """The inverse of ``encode_blocks``."""
    if value is None:
        return None
    return tuple(_ints(group, what) for group in _list(value, what))


def encode_stats(stats: PrefixCacheStats | None) -> Json:
    """Prefix-cache statistics as an object of vLLM's field names; None stays null."""
    if stats is None:
        return None
    return {
        "reset": stats.reset,
        "requests": stats.requests,
        "queries": stats.queries,
        "hits": stats.hits,
        "preempted_requests": stats.preempted_requests,
        "preempted_queries": stats.preempted_queries,
        "preempted_hits": stats.preempted_hits,
    }


def decode_stats(value: Json) -> PrefixCacheStats | None:
    """The inverse of ``encode_stats``."""
    if value is None:
        return None
    obj = _object(value, "stats")
    return PrefixCacheStats(
        reset=_bool(obj.get("reset"), "reset"),
        **{
            name: _int(obj.get(name), name)
            for name in (
                "requests",
                "queries",
                "hits",
                "preempted_requests",
                "preempted_queries",
                "preempted_hits",
            )
        },
    )


def encode_manager_state(state: KVCacheManagerState) -> Json:
    """A whole manager (its setup aside) in canonical form: the pool, each group's tables, stats.

    Each group's requests are sorted by id. Two managers are in the same
    state exactly when these values are equal.
    """
    return {
        "pool": encode_state(state.managers.pool),
        "groups": [
            [
                {
                    "request_id": rid,
                    "blocks": list(table.req_to_blocks[rid]),
                    "num_cached_blocks": table.num_cached_block.get(rid, 0),
                }
                for rid in sorted(table.req_to_blocks)
            ]
            for table in state.managers.tables
        ],
        "stats": encode_stats(state.stats),
        # vLLM 0.33's fine-grained hits: written only when there, so that earlier
        # states encode as they did
        **({"fine_grained_hits": True} if state.config.fine_grained_hits else {}),
        **(
            {"pending_copies": [[s, d] for s, d in state.pending_copies]}
            if state.pending_copies
            else {}
        ),
        **(
            {"new_block_ids": [[g, b] for g, b in state.new_block_ids]}
            if state.new_block_ids
            else {}
        ),
    }


def decode_manager_state(value: Json, setup: ManagerSetup) -> KVCacheManagerState:
    """The inverse of ``encode_manager_state``, for a manager built from ``setup``."""
    obj = _object(value, "manager state")
    pool = decode_state(obj.get("pool"), pool_config(setup))
    tables = []
    for raw_group in _list(obj.get("groups"), "groups"):
        blocks: dict[str, tuple[int, ...]] = {}
        cached: dict[str, int] = {}
        for raw in _list(raw_group, "group"):
            entry = _object(raw, "table entry")
            rid = _str(entry.get("request_id"), "request_id")
            blocks[rid] = _ints(entry.get("blocks"), "blocks")
            cached[rid] = _int(entry.get("num_cached_blocks"), "num_cached_blocks")
        tables.append(GroupTable(blocks, cached))
    pairs = [_ints(p, "pair") for p in _list(obj.get("pending_copies", []), "pending_copies")]
    zero = [_ints(p, "pair") for p in _list(obj.get("new_block_ids", []), "new_block_ids")]
    if any(len(p) != 2 for p in (*pairs, *zero)):
        raise ProtocolError("pending_copies and new_block_ids hold pairs")
    # the groups as the manager holds them: sharded blocks times the decode world size
    specs = effective_specs(setup.specs, setup.dcp_world_size)
    scheduler = setup.scheduler_block_size or default_scheduler_block_size(specs)
    return KVCacheManagerState(
        # by keyword: the config's fields grew on several branches
        config=ManagerConfig(
            max_model_len=setup.max_model_len,
            use_eagle=setup.use_eagle,
            log_stats=setup.log_stats,
            fine_grained_hits=_bool(obj.get("fine_grained_hits", False), "fine_grained_hits"),
            max_in_flight_tokens=setup.max_in_flight_tokens,
            num_prefill_lookahead=setup.num_prefill_lookahead,
            scheduler_block_size=scheduler,
            dcp_world_size=setup.dcp_world_size,
            pcp_world_size=setup.pcp_world_size,
            retention_interval=setup.retention_interval,
            eagle_groups=setup.eagle_groups,
        ),
        managers=ManagersState(pool, specs, tuple(tables)),
        stats=decode_stats(obj.get("stats")),
        pending_copies=tuple((p[0], p[1]) for p in pairs),
        new_block_ids=tuple((p[0], p[1]) for p in zero),
    )


# --------------------------------------------------------------------------
# Operations: JSON arguments in, JSON result out
# --------------------------------------------------------------------------


def encode_args(op: str, *args: Any) -> dict[str, Json]:
    """The JSON arguments of a call made with ``ManagerTarget``'s Python signature."""
    if op in (
        "get_computed_blocks",
        "free",
        "block_hashes",
        "get_computed_blocks_with_boundary",
        "estimate_cached_tokens",
        "pop_blocks_for_free",
        "get_computed_blocks_for_connector",
        "finalize_partial_tail_offloads",
    ):
        return {"request": encode_request(args[0])}
    if op == "remove_skipped_blocks":
        return {"request_id": args[0], "processed_computed_tokens": args[1]}
    if op == "get_block_ids_for_computed_tokens":
        return {"request_id": args[0], "num_computed_tokens": args[1]}
    if op == "record_blocks_for_zeroing":
        return {"request_id": args[0], "start_token": args[1]}
    if op == "free_blocks":
        return {"block_ids": [int(b) for b in args[0]]}
    if op == "truncate_computed_blocks":
        return {"blocks": encode_blocks(args[0]), "num_computed_tokens": args[1]}
    if op == "allocate_slots":
        request, num_new, *rest = args
        defaults: list[Any] = [0, None, 0, False, False, 0, 0, ()]
        computed, hits, lookahead, delay, whole, external, reserved, skip = [
            *rest,
            *defaults[len(rest) :],
        ]
        return {
            "request": encode_request(request),
            "num_new_tokens": num_new,
            "num_new_computed_tokens": computed,
            "new_computed_blocks": encode_blocks(hits),
            "num_lookahead_tokens": lookahead,
            "delay_cache_blocks": bool(delay),
            # only when set (vLLM 0.33's admission gate): other programs keep their bytes
            **({"full_sequence_must_fit": True} if whole else {}),
            # and so are a KV connector's arguments (kvpool.model.external)
            **({"num_external_computed_tokens": external} if external else {}),
            **({"reserved_blocks": reserved} if reserved else {}),
            **({"skip_zeroing_group_ids": [int(g) for g in skip]} if skip else {}),
        }
    if op == "cache_blocks":
        return {"request": encode_request(args[0]), "num_computed_tokens": args[1]}
    if op == "evict_blocks":
        return {"block_ids": sorted({int(b) for b in args[0]})}
    if op in ("get_num_common_prefix_blocks", "get_block_ids"):
        return {"request_id": args[0]}
    if op == "none_hash":
        return {"seed": args[0]}
    return {}


CONNECTOR_ARGUMENTS = ("num_external_computed_tokens", "reserved_blocks", "skip_zeroing_group_ids")
"""A KV connector's ``allocate_slots`` arguments (feature ``connector_loads``)."""


def _connector_arguments(args: Mapping[str, Json]) -> dict[str, Any]:
    """A KV connector's ``allocate_slots`` arguments in ``args``, those set only."""
    chosen: dict[str, Any] = {}
    for name in CONNECTOR_ARGUMENTS[:2]:
        if name in args:
            chosen[name] = _int(args.get(name), name)
    if "skip_zeroing_group_ids" in args:
        chosen["skip_zeroing_group_ids"] = tuple(
            _ints(args.get("skip_zeroing_group_ids"), "skip_zeroing_group_ids")
        )
    return chosen


def _call(target: ManagerTarget, op: str, args: Mapping[str, Json]) -> Any:
    """Run ``op`` on a Python manager target with decoded arguments; its Python result."""
    if op == "get_computed_blocks":
        return target.get_computed_blocks(decode_request(args.get("request")))
    if op == "allocate_slots":
        whole = _bool(args.get("full_sequence_must_fit", False), "full_sequence_must_fit")
        return target.allocate_slots(
            decode_request(args.get("request")),
            _int(args.get("num_new_tokens"), "num_new_tokens"),
            _int(args.get("num_new_computed_tokens", 0), "num_new_computed_tokens"),
            decode_blocks(args.get("new_computed_blocks"), "new_computed_blocks"),
            _int(args.get("num_lookahead_tokens", 0), "num_lookahead_tokens"),
            _bool(args.get("delay_cache_blocks", False), "delay_cache_blocks"),
            # passed only when set: a target without vLLM 0.33's scheduler calls lacks it
            **({"full_sequence_must_fit": True} if whole else {}),
            **_connector_arguments(args),
        )
    if op == "free":
        return target.free(decode_request(args.get("request")))
    if op == "cache_blocks":
        return target.cache_blocks(
            decode_request(args.get("request")),
            _int(args.get("num_computed_tokens"), "num_computed_tokens"),
        )
    if op == "evict_blocks":
        return target.evict_blocks(set(_ints(args.get("block_ids"), "block_ids")))
    if op == "reset_prefix_cache":
        return target.reset_prefix_cache()
    if op == "get_num_common_prefix_blocks":
        return target.get_num_common_prefix_blocks(_str(args.get("request_id"), "request_id"))
    if op == "get_block_ids":
        return target.get_block_ids(_str(args.get("request_id"), "request_id"))
    if op == "take_events":
        return target.take_events()
    if op == "make_prefix_cache_stats":
        return target.make_prefix_cache_stats()
    if op == "usage":
        return target.usage()
    if op == "num_free_blocks":
        return target.num_free_blocks()
    if op == "snapshot":
        if not isinstance(target, ManagerSnapshottable):
            raise ProtocolError("this target has no snapshot")
        return target.snapshot()
    if op == "block_hashes":
        hasher = getattr(target, "block_hashes", None)
        if hasher is None:
            raise ProtocolError("this target has no hasher of its own")
        return hasher(decode_request(args.get("request")))
    if op == "none_hash":
        return none_hash(_str(args.get("seed"), "seed"))
    if op in OPERATIONS_033:
        return _call_033(target, op, args)
    if op in OPERATIONS_SCHEDULER:
        return _call_scheduler(target, op, args)
    raise ProtocolError(f"unknown operation {op!r}")


def _call_scheduler(target: ManagerTarget, op: str, args: Mapping[str, Json]) -> Any:
    """One of the rest of vLLM 0.33's scheduler calls (``ManagerTargetScheduler``) on a target
    that has them (hello's ``scheduler_calls`` feature)."""
    method = getattr(target, op, None)
    if method is None:
        raise ProtocolError(f"this target has no {op}")
    if op in (
        "pop_blocks_for_free",
        "get_computed_blocks_for_connector",
        "finalize_partial_tail_offloads",
    ):
        return method(decode_request(args.get("request")))
    if op in ("remove_skipped_blocks", "get_block_ids_for_computed_tokens"):
        name = (
            "processed_computed_tokens" if op == "remove_skipped_blocks" else "num_computed_tokens"
        )
        return method(_str(args.get("request_id"), "request_id"), _int(args.get(name), name))
    if op == "record_blocks_for_zeroing":
        return method(
            _str(args.get("request_id"), "request_id"),
            _int(args.get("start_token"), "start_token"),
        )
    return method()


def _call_033(target: ManagerTarget, op: str, args: Mapping[str, Json]) -> Any:
    """One of vLLM 0.33's further calls (``ManagerTarget033``) on a target that has it."""
    method = getattr(target, op, None)
    if method is None:
        raise ProtocolError(f"this target has no {op}")
    if op in ("get_computed_blocks_with_boundary", "estimate_cached_tokens"):
        return method(decode_request(args.get("request")))
    if op == "free_blocks":
        return method(_ints(args.get("block_ids"), "block_ids"))
    if op == "truncate_computed_blocks":
        blocks = decode_blocks(args.get("blocks"), "blocks")
        if blocks is None:
            raise ProtocolError("truncate_computed_blocks takes blocks per group, got null")
        return method(blocks, _int(args.get("num_computed_tokens"), "num_computed_tokens"))
    return method()


def encode_result(op: str, result: Any) -> Json:
    """A Python manager target's result of ``op`` as its JSON value."""
    if op in (
        "free",
        "cache_blocks",
        "evict_blocks",
        "free_blocks",
        "new_step_starts",
        "remove_skipped_blocks",
        "record_blocks_for_zeroing",
    ):
        return None
    if op == "pop_blocks_for_free":
        return [int(b) for b in result]
    if op == "get_block_ids_for_computed_tokens":
        return encode_blocks(result)
    if op == "get_computed_blocks_for_connector":
        blocks, num_tokens, boundary, diverged = result
        return {
            "blocks": encode_blocks(blocks),
            "num_tokens": int(num_tokens),
            "boundary": int(boundary),
            "hit_diverged": bool(diverged),
        }
    if op == "take_boundary_state_offloads":
        return {
            str(rid): [[int(x) for x in entry] for entry in entries]
            for rid, entries in result.items()
        }
    if op == "finalize_partial_tail_offloads":
        return [[int(x) for x in entry] for entry in result]
    if op == "get_computed_blocks_with_boundary":
        blocks, num_tokens, boundary = result
        return {
            "blocks": encode_blocks(blocks),
            "num_tokens": int(num_tokens),
            "boundary": int(boundary),
        }
    if op == "take_kv_cache_block_copies":
        copies, retained = result
        return {
            "copies": [[int(s), int(d)] for s, d in copies],
            "retained": [int(b) for b in retained],
        }
    if op == "truncate_computed_blocks":
        return encode_blocks(result)
    if op == "take_new_block_ids":
        return [int(b) for b in result]
    if op == "estimate_cached_tokens":
        return int(result)
    if op == "get_computed_blocks":
        blocks, num_tokens = result
        return {"blocks": encode_blocks(blocks), "num_tokens": int(num_tokens)}
    if op in ("allocate_slots", "get_block_ids"):
        return encode_blocks(result)
    if op == "get_num_common_prefix_blocks":
        return None if result is None else [int(n) for n in result]
    if op == "reset_prefix_cache":
        return bool(result)
    if op == "take_events":
        return [encode_event(e) for e in result]
    if op == "make_prefix_cache_stats":
        return encode_stats(result)
    if op == "usage":
        return float(result)
    if op == "num_free_blocks":
        return int(result)
    if op == "snapshot":
        return encode_manager_state(result)
    if op == "block_hashes":
        return [encode_hash(bytes(h)) for h in result]
    if op == "none_hash":
        return encode_hash(result)
    raise ProtocolError(f"unknown operation {op!r}")


def apply(target: ManagerTarget, op: str, args: Mapping[str, Json]) -> Json:
    """Run one request-layer operation on a Python manager target: the JSON result.

    A rejection propagates as the model's exception (a ``PoolError``).
    """
    return encode_result(op, _call(target, op, args))


def check_result(op: str, value: Json) -> None:
    """Raise ProtocolError unless ``value`` has the shape of ``op``'s JSON result."""
    if op in (
        "free",
        "cache_blocks",
        "evict_blocks",
        "free_blocks",
        "new_step_starts",
        "remove_skipped_blocks",
        "record_blocks_for_zeroing",
    ):
        if value is not None:
            raise ProtocolError(f"{op} returns null, got {value!r:.100}")
    elif op in OPERATIONS_SCHEDULER:
        _check_scheduler_result(op, value)
    elif op == "get_computed_blocks_with_boundary":
        obj = _object(value, f"{op}'s result")
        if decode_blocks(obj.get("blocks")) is None:
            raise ProtocolError(f"{op} returns blocks per group, got null")
        _int(obj.get("num_tokens"), "num_tokens")
        _int(obj.get("boundary"), "boundary")
    elif op == "take_kv_cache_block_copies":
        obj = _object(value, f"{op}'s result")
        for pair in _list(obj.get("copies"), "copies"):
            if len(_ints(pair, "copy")) != 2:
                raise ProtocolError(f"a copy is [source, destination], got {pair!r:.100}")
        _ints(obj.get("retained"), "retained")
    elif op == "truncate_computed_blocks":
        if decode_blocks(value) is None:
            raise ProtocolError(f"{op} returns blocks per group, got null")
    elif op == "take_new_block_ids":
        _ints(value, f"{op}'s result")
    elif op == "estimate_cached_tokens":
        _int(value, f"{op}'s result")
    elif op == "get_computed_blocks":
        obj = _object(value, "get_computed_blocks's result")
        if decode_blocks(obj.get("blocks")) is None:
            raise ProtocolError("get_computed_blocks returns blocks per group, got null")
        _int(obj.get("num_tokens"), "num_tokens")
    elif op == "allocate_slots":
        decode_blocks(value)
    elif op == "get_block_ids":
        if decode_blocks(value) is None:
            raise ProtocolError("get_block_ids returns blocks per group, got null")
    elif op == "get_num_common_prefix_blocks":
        if value is not None:
            _ints(value, "get_num_common_prefix_blocks's result")
    elif op == "reset_prefix_cache":
        _bool(value, "reset_prefix_cache's result")
    elif op == "take_events":
        for e in _list(value, "take_events's result"):
            decode_event(e)
    elif op == "make_prefix_cache_stats":
        decode_stats(value)
    elif op == "usage":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtocolError(f"usage returns a number, got {value!r}")
    elif op == "num_free_blocks":
        _int(value, "num_free_blocks's result")
    elif op == "block_hashes":
        for h in _list(value, "block_hashes's result"):
            decode_hash(h)
    elif op == "none_hash":
        decode_hash(value)


def _check_scheduler_result(op: str, value: Json) -> None:
    """``check_result`` for the rest of vLLM 0.33's scheduler calls (``OPERATIONS_SCHEDULER``)."""
    if op == "pop_blocks_for_free":
        _ints(value, f"{op}'s result")
    elif op == "get_block_ids_for_computed_tokens":
        if decode_blocks(value) is None:
            raise ProtocolError(f"{op} returns blocks per group, got null")
    elif op == "get_computed_blocks_for_connector":
        obj = _object(value, f"{op}'s result")
        if decode_blocks(obj.get("blocks")) is None:
            raise ProtocolError(f"{op} returns blocks per group, got null")
        _int(obj.get("num_tokens"), "num_tokens")
        _int(obj.get("boundary"), "boundary")
        _bool(obj.get("hit_diverged"), "hit_diverged")
    elif op == "take_boundary_state_offloads":
        for request_id, entries in _object(value, f"{op}'s result").items():
            _offload_entries(entries, f"{op}'s entries of {request_id[:100]!r}")
    elif op == "finalize_partial_tail_offloads":
        _offload_entries(value, f"{op}'s result")


def _offload_entries(value: Json, what: str) -> tuple[tuple[int, int, int], ...]:
    """Offloaded states as ``[group, block, tokens]`` triples."""
    entries = []
    for entry in _list(value, what):
        numbers = _ints(entry, what)
        if len(numbers) != 3:
            raise ProtocolError(f"{what}: an offload is [group, block, tokens], got {entry!r:.100}")
        entries.append((numbers[0], numbers[1], numbers[2]))
    return tuple(entries)


def decode_result(op: str, value: Json) -> Any:
    """A JSON result as the Python value ``ManagerTarget`` returns (shape checked first)."""
    check_result(op, value)
    if op == "pop_blocks_for_free":
        return tuple(value)
    if op == "get_block_ids_for_computed_tokens":
        return decode_blocks(value)
    if op == "get_computed_blocks_for_connector":
        hit = decode_blocks(value["blocks"]), value["num_tokens"], value["boundary"]
        return (*hit, value["hit_diverged"])
    if op == "take_boundary_state_offloads":
        return {rid: _offload_entries(entries, op) for rid, entries in value.items()}
    if op == "finalize_partial_tail_offloads":
        return _offload_entries(value, op)
    if op == "get_computed_blocks":
        return decode_blocks(value["blocks"]), value["num_tokens"]
    if op == "get_computed_blocks_with_boundary":
        return decode_blocks(value["blocks"]), value["num_tokens"], value["boundary"]
    if op == "take_kv_cache_block_copies":
        copies = tuple((int(s), int(d)) for s, d in value["copies"])
        return copies, tuple(value["retained"])
    if op == "truncate_computed_blocks":
        return decode_blocks(value)
    if op == "take_new_block_ids":
        return tuple(value)
    if op in ("allocate_slots", "get_block_ids"):
        return decode_blocks(value)
    if op == "get_num_common_prefix_blocks":
        return None if value is None else tuple(value)
    if op == "take_events":
        return tuple(decode_event(e) for e in value)
    if op == "make_prefix_cache_stats":
        return decode_stats(value)
    if op == "usage":
        return float(value)
    if op == "block_hashes":
        return tuple(decode_hash(h) for h in value)
    if op == "none_hash":
        return decode_hash(value)
    return value


def request_error_class(name: Json) -> type[PoolError] | None:
    """The model's exception class a request-layer rejection names, or None."""
    return REQUEST_ERROR_NAMES.get(name) if isinstance(name, str) else None


# --------------------------------------------------------------------------
# Shape checks
# --------------------------------------------------------------------------


def _str(value: Json, what: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"{what} must be a string, got {value!r}")
    return value


def _ints(value: Json, what: str) -> tuple[int, ...]:
    return tuple(_int(v, what) for v in _list(value, what))
