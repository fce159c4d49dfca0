"""The any-language target protocol's codec: JSON values for every pool operation.

A pool written in any language is checked by running it as a program that
reads one JSON request per line on stdin and writes one JSON response per
line on stdout (docs/formats.md has a full session). This module is the
codec between the model's Python values and those JSON values, shared by
the ``cmd:`` adapter (the kit's side), the conformance vectors and the
protocol server (``kvpool.specs.protocol.server``). Its JSON Schema sits
beside it, in ``schemas/protocol-v1.json``.

Hashes are lowercase hex strings; a hash key is ``{"hash": hex, "group": n}``;
events are objects with a ``"type"`` and vLLM's field names; rejections are
named by the model's exception class names (``kvpool.model.errors``).
"""

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any, cast

from kvpool import model
from kvpool.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockState,
    BlockStored,
    CacheRequest,
    HashKey,
    InvalidConfig,
    KVCacheEvent,
    PoolConfig,
    PoolError,
    PoolState,
    Reuse,
)
from kvpool.model import errors as model_errors
from kvpool.model.profiles import profile_named
from kvpool.specs.pool.target import EXTENSIONS, PoolTarget, PoolTargetExtensions, Snapshottable

PROTOCOL_VERSION = 1
"""The version ``hello`` announces. docs/formats.md says when it changes."""

Json = Any
"""A value ``json.loads`` can return."""


class ProtocolError(ValueError):
    """A JSON value does not have the shape the protocol requires."""


MAX_NUM_BLOCKS = 4096
"""The most blocks a ``new_pool`` may ask for (the kit's pools have at most 9)."""
MAX_HASH_BLOCK_SIZE = 1024
MAX_INT = 2**53
"""Every integer of the protocol lies in [-MAX_INT, MAX_INT] (JSON's exact integers)."""
MAX_ITEMS = 65536
"""The most items one array of the protocol may hold."""
MAX_STRING = 1024
"""The longest string value (a LoRA name, a medium); hashes: ``MAX_HASH_BYTES`` bytes."""
MAX_HASH_BYTES = 256

MAX_DEPTH = 32
"""How deeply a protocol message or vector may nest arrays and objects (they need under 10)."""


def loads(text: str | bytes, max_depth: int = MAX_DEPTH) -> Json:
    """One JSON value from untrusted text, bounded: ProtocolError if it is not one.

    Nesting deeper than ``max_depth``, ``NaN``, ``Infinity`` and numbers too
    large for a float are refused, as is anything ``json`` cannot read.

    >>> loads('{"a": [1, 2.5]}')
    {'a': [1, 2.5]}
    >>> try:
    ...     loads("[" * 40 + "]" * 40)
    ... except ProtocolError as error:
    ...     print(error)
    nested deeper than 32 levels
    """
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise ProtocolError(f"nested deeper than {max_depth} levels") from None
    except ProtocolError:
        raise
    except ValueError as error:
        raise ProtocolError(f"not JSON: {error}") from None
    if _depth_exceeds(value, max_depth):
        raise ProtocolError(f"nested deeper than {max_depth} levels")
    return value


MAX_REQUEST_LINE = 16 * 1024 * 1024
"""Characters one request line a protocol server reads may have."""


def read_requests(stdin: IO[str]) -> Iterator[Json | ProtocolError]:
    """The requests on ``stdin`` until it closes, each read as bounded data (``loads``).

    A line that is not one (garbage, too deep, longer than ``MAX_REQUEST_LINE``)
    comes as the ProtocolError saying why, so a server answers it and goes on.
    Blank lines are skipped.
    """
    while True:
        line = stdin.readline(MAX_REQUEST_LINE + 1)
        if not line:
            return
        if len(line) > MAX_REQUEST_LINE and not line.endswith("\n"):
            while (rest := stdin.readline(MAX_REQUEST_LINE)) and not rest.endswith("\n"):
                pass
            yield ProtocolError(f"a request line is longer than {MAX_REQUEST_LINE} characters")
        elif line.strip():
            try:
                yield loads(line)
            except ProtocolError as error:
                yield ProtocolError(f"the request is not JSON the protocol reads: {error}")


def _no_constant(name: str) -> Json:
    raise ProtocolError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ProtocolError(f"{text[:40]} is too large for a number")
    return value


def _depth_exceeds(value: Json, limit: int) -> bool:
    """Whether ``value`` nests arrays and objects more than ``limit`` deep (without recursing)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


# --------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------


def encode_hash(block_hash: bytes) -> str:
    """A hash as lowercase hex.

    >>> encode_hash(b"\\x01\\xab")
    '01ab'
    """
    return block_hash.hex()


def decode_hash(text: Json) -> bytes:
    """A lowercase hex string back to bytes.

    >>> decode_hash("01ab")
    b'\\x01\\xab'
    """
    if not isinstance(text, str) or text != text.lower():
        raise ProtocolError(f"a hash must be a lowercase hex string, got {_short(text)}")
    if len(text) > 2 * MAX_HASH_BYTES:
        raise ProtocolError(f"a hash is longer than {MAX_HASH_BYTES} bytes")
    try:
        return bytes.fromhex(text)
    except ValueError as error:
        raise ProtocolError(f"a hash must be a lowercase hex string, got {_short(text)}") from error


def encode_key(key: HashKey | None) -> Json:
    """A (hash, group) key as ``{"hash": hex, "group": n}``; None stays null."""
    return None if key is None else {"hash": encode_hash(key[0]), "group": key[1]}


def decode_key(value: Json) -> HashKey | None:
    """The inverse of ``encode_key``."""
    if value is None:
        return None
    obj = _object(value, "hash key")
    return (decode_hash(obj.get("hash")), _int(obj.get("group"), "hash key group"))


def encode_request(request: CacheRequest) -> Json:
    """The part of a request the pool reads."""
    return {
        "block_hashes": [encode_hash(h) for h in request.block_hashes],
        "all_token_ids": list(request.all_token_ids),
        "lora_id": request.lora_id,
        "lora_name": request.lora_name,
    }


def decode_request(value: Json) -> CacheRequest:
    """The inverse of ``encode_request``."""
    obj = _object(value, "request")
    return CacheRequest(
        block_hashes=tuple(decode_hash(h) for h in _list(obj.get("block_hashes"), "block_hashes")),
        all_token_ids=tuple(
            _int(t, "all_token_ids") for t in _list(obj.get("all_token_ids", []), "all_token_ids")
        ),
        lora_id=_optional_int(obj.get("lora_id"), "lora_id"),
        lora_name=_optional_str(obj.get("lora_name"), "lora_name"),
    )


def encode_event(event: KVCacheEvent) -> Json:
    """One event as an object with a ``type`` and vLLM's field names."""
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": [encode_hash(h) for h in event.block_hashes],
            "parent_block_hash": (
                None if event.parent_block_hash is None else encode_hash(event.parent_block_hash)
            ),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
            "extra_keys": None if event.extra_keys is None else list(event.extra_keys),
            "group_idx": event.group_idx,
            # Only when set, so the committed vectors keep their bytes.
            **(
                {}
                if event.lookahead_token_ids is None
                else {"lookahead_token_ids": [list(t) for t in event.lookahead_token_ids]}
            ),
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [encode_hash(h) for h in event.block_hashes],
            "medium": event.medium,
            "group_idx": event.group_idx,
        }
    return {"type": "AllBlocksCleared"}


def encode_reuse(reuse: Reuse) -> Json:
    """A fired watcher: which watcher, which block, the key it still carried."""
    return {
        "watcher": reuse.watcher,
        "block_id": reuse.block_id,
        "block_hash": encode_key(reuse.block_hash),
    }


def decode_event(value: Json) -> KVCacheEvent:
    """The inverse of ``encode_event``."""
    obj = _object(value, "event")
    kind = obj.get("type")
    if kind == "BlockStored":
        parent = obj.get("parent_block_hash")
        extra = obj.get("extra_keys")
        return BlockStored(
            block_hashes=tuple(decode_hash(h) for h in _list(obj.get("block_hashes"), "hashes")),
            parent_block_hash=None if parent is None else decode_hash(parent),
            token_ids=tuple(_int(t, "token_ids") for t in _list(obj.get("token_ids"), "token_ids")),
            block_size=_int(obj.get("block_size"), "block_size"),
            lora_id=_optional_int(obj.get("lora_id"), "lora_id"),
            medium=_optional_str(obj.get("medium"), "medium"),
            lora_name=_optional_str(obj.get("lora_name"), "lora_name"),
            extra_keys=None if extra is None else tuple(_list(extra, "extra_keys")),
            group_idx=_int(obj.get("group_idx"), "group_idx"),
            lookahead_token_ids=_lookahead_ids(obj.get("lookahead_token_ids")),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=tuple(decode_hash(h) for h in _list(obj.get("block_hashes"), "hashes")),
            medium=_optional_str(obj.get("medium"), "medium"),
            group_idx=_int(obj.get("group_idx"), "group_idx"),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ProtocolError(f"unknown event type {_short(kind)}")


def _lookahead_ids(value: Json) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    return tuple(
        tuple(_int(t, "lookahead_token_ids") for t in _list(ids, "lookahead_token_ids"))
        for ids in _list(value, "lookahead_token_ids")
    )


def encode_config(config: PoolConfig) -> Json:
    """The ``new_pool`` arguments for a configuration."""
    return {
        "num_blocks": config.num_blocks,
        "enable_caching": config.enable_caching,
        "hash_block_size": config.hash_block_size,
        "enable_events": config.enable_events,
        "profile": config.profile.name,
    }


def decode_config(value: Json) -> PoolConfig:
    """The inverse of ``encode_config``; sizes beyond the protocol's bounds are refused."""
    obj = _object(value, "config")
    try:
        profile = profile_named(obj.get("profile", model.DEFAULT_PROFILE.name))
    except InvalidConfig as error:
        raise ProtocolError(str(error)) from None
    num_blocks = _int(obj.get("num_blocks"), "num_blocks")
    hash_block_size = _int(obj.get("hash_block_size", 1), "hash_block_size")
    if num_blocks > MAX_NUM_BLOCKS:
        raise ProtocolError(
            f"num_blocks is {num_blocks}; the protocol allows at most {MAX_NUM_BLOCKS}"
        )
    if hash_block_size > MAX_HASH_BLOCK_SIZE:
        raise ProtocolError(
            f"hash_block_size is {hash_block_size}; the protocol allows at most "
            f"{MAX_HASH_BLOCK_SIZE}"
        )
    return PoolConfig(
        num_blocks=num_blocks,
        enable_caching=_bool(obj.get("enable_caching", True), "enable_caching"),
        hash_block_size=hash_block_size,
        enable_events=_bool(obj.get("enable_events", False), "enable_events"),
        profile=profile,
    )


def encode_state(state: PoolState) -> Json:
    """The whole state (without its config), in canonical form.

    Blocks in id order; the hash map as a list sorted by (hash, group), each
    entry's blocks oldest insertion first; pending events oldest first. Two
    pools are in the same state exactly when these values are equal.
    """
    return {
        "blocks": [
            {
                "ref_cnt": b.ref_cnt,
                "block_hash": encode_key(b.block_hash),
                "hash_num_tokens": b.hash_num_tokens,
                "partial_keys": [encode_key(k) for k in b.partial_keys],
            }
            for b in state.blocks
        ],
        "free_queue": list(state.free_queue),
        "cached": [
            {"hash": encode_hash(h), "group": g, "blocks": list(state.cached[(h, g)])}
            for h, g in sorted(state.cached)
        ],
        "pending_events": [encode_event(e) for e in state.pending_events],
    }


STATE_FIELDS = ("blocks", "free_queue", "cached", "pending_events")
BLOCK_FIELDS = ("ref_cnt", "block_hash", "hash_num_tokens", "partial_keys")


def decode_state(value: Json, config: PoolConfig) -> PoolState:
    """The inverse of ``encode_state``, for a pool built with ``config``.

    A state that breaks the protocol (docs/formats.md) raises ProtocolError
    naming the field: a field missing or unknown, a value of the wrong type,
    the ``cached`` list not sorted by (hash, group) or naming a key twice.
    """
    obj = _fields(value, "state", STATE_FIELDS)
    blocks = []
    for index, raw in enumerate(_list(obj["blocks"], "state field blocks")):
        block = _fields(raw, f"state field blocks[{index}]", BLOCK_FIELDS)
        primary = decode_key(block["block_hash"])
        blocks.append(
            BlockState(
                ref_cnt=_int(block["ref_cnt"], f"blocks[{index}].ref_cnt"),
                block_hash=primary,
                hash_num_tokens=_optional_int(
                    block["hash_num_tokens"], f"blocks[{index}].hash_num_tokens"
                ),
                partial_keys=tuple(
                    k
                    for k in (
                        decode_key(p)
                        for p in _list(block["partial_keys"], f"blocks[{index}].partial_keys")
                    )
                    if k is not None
                ),
            )
        )
    cached: dict[HashKey, tuple[int, ...]] = {}
    previous: HashKey | None = None
    for index, raw in enumerate(_list(obj["cached"], "state field cached")):
        entry = _fields(raw, f"state field cached[{index}]", ("hash", "group", "blocks"))
        key = (decode_hash(entry["hash"]), _int(entry["group"], f"cached[{index}].group"))
        if previous is not None and key <= previous:
            raise ProtocolError(
                f"state field cached: entry {index} ({key[0].hex()}, group {key[1]}) "
                f"{'repeats' if key == previous else 'comes after'} entry {index - 1} "
                f"({previous[0].hex()}, group {previous[1]}): the list must be sorted by "
                "(hash, group) with each key once (docs/formats.md)"
            )
        previous = key
        cached[key] = tuple(
            _int(b, f"cached[{index}].blocks") for b in _list(entry["blocks"], "blocks")
        )
    return PoolState(
        config=config,
        blocks=tuple(blocks),
        free_queue=tuple(
            _int(b, "state field free_queue")
            for b in _list(obj["free_queue"], "state field free_queue")
        ),
        cached=cached,
        pending_events=tuple(
            decode_event(e) for e in _list(obj["pending_events"], "state field pending_events")
        ),
    )


def _fields(value: Json, what: str, names: Sequence[str]) -> dict[str, Json]:
    """``value`` as an object with exactly the fields ``names``, else ProtocolError naming one."""
    obj = _object(value, what)
    missing = [n for n in names if n not in obj]
    if missing:
        raise ProtocolError(f"{what}: missing field {missing[0]!r}")
    unknown = [n for n in obj if n not in names]
    if unknown:
        raise ProtocolError(f"{what}: unknown field {_short(unknown[0])}")
    return obj


# --------------------------------------------------------------------------
# Operations: JSON arguments in, JSON result out
# --------------------------------------------------------------------------


ERROR_NAMES: dict[str, type[PoolError]] = {cls.__name__: cls for cls in model_errors.POOL_ERRORS}
"""The rejections a pool target may answer with, by class name."""


def _ids(args: Mapping[str, Json], name: str = "block_ids") -> list[int]:
    return [_int(b, name) for b in _list(args.get(name), name)]


def _call(target: PoolTarget, op: str, args: Mapping[str, Json]) -> Any:
    """Run ``op`` on a Python target with decoded arguments; return its Python result."""
    if op == "get_new_blocks":
        return target.get_new_blocks(_int(args.get("num_blocks"), "num_blocks"))
    if op == "touch":
        return target.touch(_ids(args))
    if op == "free_blocks":
        return target.free_blocks(_ids(args))
    if op == "cache_full_blocks":
        mask = args.get("block_mask")
        return target.cache_full_blocks(
            decode_request(args.get("request")),
            _ids(args),
            _int(args.get("num_cached_blocks"), "num_cached_blocks"),
            _int(args.get("num_full_blocks"), "num_full_blocks"),
            _int(args.get("block_size"), "block_size"),
            _int(args.get("kv_cache_group_id"), "kv_cache_group_id"),
            None if mask is None else [_bool(m, "block_mask") for m in _list(mask, "block_mask")],
        )
    if op == "cache_partial_block":
        replace = _bool(args.get("replace_existing_hashes", False), "replace_existing_hashes")
        return target.cache_partial_block(
            decode_request(args.get("request")),
            _int(args.get("block_id"), "block_id"),
            _int(args.get("num_tokens"), "num_tokens"),
            _int(args.get("kv_cache_group_id"), "kv_cache_group_id"),
            _int(args.get("block_size"), "block_size"),
            *((True,) if replace else ()),
        )
    if op in EXTENSIONS:
        return _call_extension(cast(PoolTargetExtensions, target), op, args)
    if op == "get_cached_block":
        return target.get_cached_block(
            decode_hash(args.get("block_hash")), _ids(args, "kv_cache_group_ids")
        )
    if op == "evict_blocks":
        return target.evict_blocks(set(_ids(args)))
    if op == "reset_prefix_cache":
        return target.reset_prefix_cache()
    if op == "get_num_free_blocks":
        return target.get_num_free_blocks()
    if op == "get_usage":
        return target.get_usage()
    if op == "take_events":
        return target.take_events()
    if op == "snapshot":
        if not isinstance(target, Snapshottable):
            raise ProtocolError("this target has no snapshot")
        return target.snapshot()
    raise ProtocolError(f"unknown operation {_short(op)}")


def _call_extension(target: PoolTargetExtensions, op: str, args: Mapping[str, Json]) -> Any:
    """Run one of vLLM 0.33's operations (``EXTENSIONS``) with decoded arguments."""
    if op == "unpin_blocks":
        return target.unpin_blocks(_ids(args), _int(args.get("watcher"), "watcher"))
    if op == "take_reuses":
        return target.take_reuses()
    if op == "move_block_hashes":
        return target.move_block_hashes(_int(args.get("src"), "src"), _int(args.get("dst"), "dst"))
    if op == "is_block_writable":
        return target.is_block_writable(_int(args.get("block_id"), "block_id"))
    return target.emit_cached_block_events(
        decode_request(args.get("request")),
        _int(args.get("num_cached_blocks"), "num_cached_blocks"),
        _int(args.get("block_size"), "block_size"),
        _int(args.get("kv_cache_group_id"), "kv_cache_group_id"),
    )


def encode_result(op: str, result: Any) -> Json:
    """A Python target's result of ``op`` as its JSON value."""
    if op in (
        "touch",
        "free_blocks",
        "cache_full_blocks",
        "evict_blocks",
        "unpin_blocks",
        "move_block_hashes",
        "emit_cached_block_events",
    ):
        return None
    if op == "is_block_writable":
        return bool(result)
    if op == "take_reuses":
        return [encode_reuse(r) for r in result]
    if op in ("get_new_blocks", "get_cached_block"):
        return None if result is None else [int(b) for b in result]
    if op == "cache_partial_block":
        return encode_key(result)
    if op == "reset_prefix_cache":
        return bool(result)
    if op == "get_num_free_blocks":
        return int(result)
    if op == "get_usage":
        return float(result)
    if op == "take_events":
        return [encode_event(e) for e in result]
    if op == "snapshot":
        return encode_state(result)
    raise ProtocolError(f"unknown operation {_short(op)}")


def apply(target: PoolTarget, op: str, args: Mapping[str, Json]) -> Json:
    """Run one protocol operation on a Python target: the JSON result.

    A rejection propagates as the model's exception (a ``PoolError``).
    """
    return encode_result(op, _call(target, op, args))


def encode_args(op: str, *args: Any) -> dict[str, Json]:
    """The JSON arguments of a call made with the target protocol's Python signature."""
    if op == "get_new_blocks":
        return {"num_blocks": args[0]}
    if op in ("touch", "free_blocks"):
        return {"block_ids": [int(b) for b in args[0]]}
    if op == "evict_blocks":
        return {"block_ids": sorted({int(b) for b in args[0]})}
    if op == "cache_full_blocks":
        request, block_ids, num_cached, num_full, block_size, group, *rest = args
        mask = rest[0] if rest else None
        return {
            "request": encode_request(request),
            "block_ids": [int(b) for b in block_ids],
            "num_cached_blocks": num_cached,
            "num_full_blocks": num_full,
            "block_size": block_size,
            "kv_cache_group_id": group,
            "block_mask": None if mask is None else [bool(m) for m in mask],
        }
    if op == "cache_partial_block":
        request, block_id, num_tokens, group, block_size, *flag = args
        encoded: dict[str, Json] = {
            "request": encode_request(request),
            "block_id": block_id,
            "num_tokens": num_tokens,
            "kv_cache_group_id": group,
            "block_size": block_size,
        }
        if flag and flag[0]:
            encoded["replace_existing_hashes"] = True
        return encoded
    # vLLM 0.33's operations (kvpool.specs.pool.target.EXTENSIONS): recorded in a
    # program's trace; the protocol's schema and the vectors do not carry them yet.
    if op == "unpin_blocks":
        return {"block_ids": [int(b) for b in args[0]], "watcher": args[1]}
    if op == "move_block_hashes":
        return {"src": args[0], "dst": args[1]}
    if op == "is_block_writable":
        return {"block_id": args[0]}
    if op == "emit_cached_block_events":
        request, num_cached, block_size, group = args
        return {
            "request": encode_request(request),
            "num_cached_blocks": num_cached,
            "block_size": block_size,
            "kv_cache_group_id": group,
        }
    if op == "get_cached_block":
        return {"block_hash": encode_hash(args[0]), "kv_cache_group_ids": list(args[1])}
    return {}


# --------------------------------------------------------------------------
# Shape checks
# --------------------------------------------------------------------------


def _short(value: Json) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _object(value: Json, what: str) -> dict[str, Json]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} must be a JSON object, got {_short(value)}")
    return value


def _list(value: Json, what: str) -> list[Json]:
    if not isinstance(value, list):
        raise ProtocolError(f"{what} must be a JSON array, got {_short(value)}")
    if len(value) > MAX_ITEMS:
        raise ProtocolError(f"{what} has {len(value)} items; the protocol allows {MAX_ITEMS}")
    return value


def _int(value: Json, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{what} must be an integer, got {_short(value)}")
    if not -MAX_INT <= value <= MAX_INT:
        raise ProtocolError(f"{what} is {_short(value)}, beyond the protocol's integers (2**53)")
    return value


def _optional_int(value: Json, what: str) -> int | None:
    return None if value is None else _int(value, what)


def _bool(value: Json, what: str) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"{what} must be true or false, got {_short(value)}")
    return value


def _optional_str(value: Json, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ProtocolError(f"{what} must be a string or null, got {_short(value)}")
    if value is not None and len(value) > MAX_STRING:
        raise ProtocolError(f"{what} is longer than {MAX_STRING} characters")
    return value


def check_result(op: str, value: Json) -> None:
    """Raise ProtocolError unless ``value`` has the shape of ``op``'s JSON result."""
    if op in ("touch", "free_blocks", "cache_full_blocks", "evict_blocks"):
        if value is not None:
            raise ProtocolError(f"{op} returns null, got {_short(value)}")
    elif op == "get_new_blocks":
        _ids({"r": value}, "r")
    elif op == "get_cached_block":
        if value is not None:
            _ids({"r": value}, "r")
    elif op == "cache_partial_block":
        decode_key(value)
    elif op == "reset_prefix_cache":
        _bool(value, "reset_prefix_cache's result")
    elif op == "get_num_free_blocks":
        _int(value, "get_num_free_blocks's result")
    elif op == "get_usage":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtocolError(f"get_usage returns a number, got {_short(value)}")
    elif op == "take_events":
        for e in _list(value, "take_events's result"):
            decode_event(e)


def decode_result(op: str, value: Json) -> Any:
    """A JSON result as the Python value the target protocol returns."""
    check_result(op, value)
    if op in ("get_new_blocks", "get_cached_block"):
        return None if value is None else tuple(value)
    if op == "cache_partial_block":
        return decode_key(value)
    if op == "get_usage":
        return float(value)
    if op == "take_events":
        return tuple(decode_event(e) for e in value)
    return value


def error_class(name: Json) -> type[PoolError] | None:
    """The model's exception class a rejection names, or None if it names none."""
    return ERROR_NAMES.get(name) if isinstance(name, str) else None
