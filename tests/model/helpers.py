"""Shared helpers for the model tests: pool builders and an invariant-checking driver."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvpool.model import (
    CacheRequest,
    KVCacheEvent,
    PoolState,
    cache_full_blocks,
    free_blocks,
    get_new_blocks,
    new_pool,
    take_events,
)
from kvpool.specs.pool.invariants import FreeHistory, check_all

H0, H1, H2, H3 = b"h0", b"h1", b"h2", b"h3"
REQ = CacheRequest(block_hashes=(H0, H1, H2, H3), all_token_ids=(10, 11, 12, 13))


def assert_rejected(
    build: Callable[[], PoolState], error: type[Exception], op: Callable[..., Any], *args: Any
) -> None:
    """``op(build(), *args)`` raises exactly ``error`` and leaves the state as it was.

    The expected state is rebuilt independently by a second ``build()`` call, so
    an operation that mutated its input in place would be caught.
    """
    state = build()
    with pytest.raises(error) as info:
        op(state, *args)
    assert type(info.value) is error
    assert state == build()


def held(num_blocks: int, n: int, **pool_args: Any) -> PoolState:
    """A pool of ``num_blocks`` with its first ``n`` free blocks handed out (ids 1..n)."""
    state, _ = get_new_blocks(new_pool(num_blocks, **pool_args), n)
    return state


def cached(
    num_blocks: int,
    n: int,
    request: CacheRequest = REQ,
    group: int = 0,
    **pool_args: Any,
) -> PoolState:
    """Blocks 1..n held and cached as full blocks 0..n-1 of ``request`` (block size 1)."""
    state, ids = get_new_blocks(new_pool(num_blocks, **pool_args), n)
    state, _ = cache_full_blocks(state, request, ids, 0, n, 1, group)
    return state


@dataclass
class Run:
    """A pool being driven step by step; every invariant is checked after each step.

    ``history`` is the FreeHistory that LRU order needs, ``taken`` every event
    returned by take_events so far, oldest first.
    """

    state: PoolState
    history: FreeHistory = field(init=False)
    taken: tuple[KVCacheEvent, ...] = ()

    def __post_init__(self) -> None:
        self.history = FreeHistory.start(self.state)
        self.check()

    def check(self) -> None:
        check_all(self.state, self.history, self.taken)

    def do(self, op: Callable[..., tuple[PoolState, Any]], *args: Any) -> Any:
        """Apply an operation, keep its new state, check every invariant, return its result."""
        before = self.state
        after, result = op(before, *args)
        freed = tuple(args[0]) if op is free_blocks else ()
        self.history = self.history.observe(before, after, freed=freed)
        self.state = after
        if op is take_events:
            self.taken = (*self.taken, *result)
        self.check()
        return result

    def ask(self, query: Callable[..., Any], *args: Any) -> Any:
        """Answer a query that cannot change the pool; invariants are checked again."""
        result = query(self.state, *args)
        self.check()
        return result

    def events(self) -> tuple[KVCacheEvent, ...]:
        """Take the pending events (a step like any other) and return them."""
        result: tuple[KVCacheEvent, ...] = self.do(take_events)
        return result
