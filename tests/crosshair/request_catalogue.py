"""Broken request-layer operations, one per contract of ``kvpool.specs.request.contracts``.

Each entry re-binds one contract to a ``manager`` module in which one
operation is broken (or two, where a mistake lives in both halves of a
round trip), and names the postcondition that must catch it. As for the
pool's catalogue (``tests/crosshair/catalogue.py``), CrossHair runs on the
re-bound contracts and each counterexample it reports is replayed in plain
Python before the test believes it.
"""

import types
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvpool.model import manager
from kvpool.model.request import Request, new_request
from kvpool.specs.request import contracts


@dataclass(frozen=True)
class BrokenVariant:
    contract: str
    story: str
    broken: dict[str, Callable[..., Any]] = field(default_factory=dict)
    catching_post: str = ""


def _one_block_too_many(state: Any, request: Request, num_new: int, *rest: Any) -> Any:
    return manager.allocate_slots(state, request, num_new + request.hash_block_size, *rest)


def _free_keeps_the_last_block(state: Any, request_id: str) -> Any:
    table = manager.get_block_ids(state, request_id)[0]
    after, _ = manager.free(state, request_id)
    if not table:
        return after, None
    pool = after.managers.pool
    pool = replace(pool, free_queue=tuple(b for b in pool.free_queue if b != table[-1]))
    return replace(after, managers=replace(after.managers, pool=pool)), None


def _hit_covers_the_whole_prompt(state: Any, request: Request) -> Any:
    blocks, length = manager.find_hit(state, request.block_hashes, request.num_tokens)
    return state, (blocks, length)


def _unsalted(request: Request) -> Request:
    hashes = new_request("x", request.all_token_ids, request.hash_block_size).block_hashes
    return replace(request, block_hashes=hashes)


def _allocate_without_salt(state: Any, request: Request, *rest: Any) -> Any:
    return manager.allocate_slots(state, _unsalted(request), *rest)


def _look_up_without_salt(state: Any, request: Request) -> Any:
    return manager.get_computed_blocks(state, _unsalted(request))


def _as_bytes(request: Request) -> Request:
    """The request hashed with its token ids packed into bytes (``t & 0xff``)."""
    seen = [t & 0xFF for t in request.all_token_ids]
    hashes = new_request("x", seen, request.hash_block_size).block_hashes
    return replace(request, block_hashes=hashes)


def _allocate_hashing_bytes(state: Any, request: Request, *rest: Any) -> Any:
    return manager.allocate_slots(state, _as_bytes(request), *rest)


def _look_up_hashing_bytes(state: Any, request: Request) -> Any:
    return manager.get_computed_blocks(state, _as_bytes(request))


def _cache_blocks_forgets_beyond(state: Any, request: Request, num_computed: int) -> Any:
    after, _ = manager.cache_blocks(state, request, num_computed)
    table = manager.get_block_ids(after, request.request_id)[0]
    beyond = {b for b in table[num_computed // request.hash_block_size :] if b}
    return manager.evict_blocks(after, beyond)


def _allocate_without_skipping(state: Any, request: Request, num_new: int, *rest: Any) -> Any:
    from kvpool.model.request import with_computed

    after, blocks = manager.allocate_slots(state, with_computed(request, 0), num_new, *rest)
    return after, blocks


def _reset_that_keeps_the_cache(state: Any) -> Any:
    return state, True


CATALOGUE = [
    BrokenVariant(
        "allocate_slots_fits_or_changes_nothing",
        "allocate_slots gives a fresh request one block more than its chunk needs.",
        {"allocate_slots": _one_block_too_many},
        "__return__[2] is None or len(__return__[2][0]) == -(-chunk // block_size)",
    ),
    BrokenVariant(
        "free_returns_every_block",
        "free never returns a request's last block to the pool: it leaks.",
        {"free": _free_keeps_the_last_block},
        "manager.num_free_blocks(__return__[1]) == num_blocks - 1",
    ),
    BrokenVariant(
        "a_hit_never_covers_the_last_token",
        "The hit may cover the whole prompt (the last-token rule of vllm#7753 forgotten).",
        {"get_computed_blocks": _hit_covers_the_whole_prompt},
        "__return__[0][1] == (prompt_len - 1) // block_size * block_size",
    ),
    BrokenVariant(
        "a_hit_is_a_shared_prefix",
        "The hasher packs token ids into bytes: ids 256 apart hash alike and share KV.",
        {
            "allocate_slots": _allocate_hashing_bytes,
            "get_computed_blocks": _look_up_hashing_bytes,
        },
        "__return__[0][1] == shared // block_size * block_size",
    ),
    BrokenVariant(
        "different_salts_never_share_a_block",
        "The hasher leaves the cache salt out: another tenant hits a tenant's blocks.",
        {"allocate_slots": _allocate_without_salt, "get_computed_blocks": _look_up_without_salt},
        "same or __return__[0][1] == 0",
    ),
    BrokenVariant(
        "cache_blocks_never_goes_back",
        "cache_blocks with fewer computed tokens uncaches the blocks past them.",
        {"cache_blocks": _cache_blocks_forgets_beyond},
        "__return__[1] == __return__[0]",
    ),
    BrokenVariant(
        "sliding_window_releases_what_left_the_window",
        "allocate_slots never frees the blocks that left the sliding window.",
        {"allocate_slots": _allocate_without_skipping},
        "all(b == 0 for b in __return__[0][0][: max(0, prompt_len - window + 1)])",
    ),
    BrokenVariant(
        "reset_forgets_every_hit",
        "reset_prefix_cache says it reset, and keeps every cached block.",
        {"reset_prefix_cache": _reset_that_keeps_the_cache},
        "__return__[1] == 0",
    ),
]

HELPERS = ("_manager", "_held", "_cached_then_looked_up", "_prompt")


def rebind(variant: BrokenVariant) -> types.FunctionType:
    """The contract function, running against a manager module with the broken operations."""
    original = getattr(contracts, variant.contract)
    public = {n: getattr(manager, n) for n in dir(manager) if not n.startswith("__")}
    broken_manager = types.SimpleNamespace(**{**public, **variant.broken})
    namespace = dict(vars(contracts), manager=broken_manager)
    for name in HELPERS:
        helper = getattr(contracts, name)
        namespace[name] = types.FunctionType(
            helper.__code__, namespace, helper.__name__, helper.__defaults__
        )
    clone = types.FunctionType(original.__code__, namespace, f"broken_{original.__name__}")
    clone.__doc__ = original.__doc__
    clone.__annotations__ = original.__annotations__
    clone.__module__ = __name__
    clone.__qualname__ = clone.__name__
    return clone


for _variant in CATALOGUE:
    globals()[f"broken_{_variant.contract}"] = rebind(_variant)
