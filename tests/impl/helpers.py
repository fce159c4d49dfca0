"""Shared helpers for the impl tests."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from kvpool.impl import BlockPool, KVCacheBlock
from kvpool.model import CacheRequest, PoolState

REQ = CacheRequest(block_hashes=(b"h0", b"h1", b"h2", b"h3"), all_token_ids=(10, 11, 12, 13))


def ids(blocks: list[KVCacheBlock] | None) -> list[int] | None:
    return None if blocks is None else [b.block_id for b in blocks]


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def assert_rejected(
    pool: BlockPool, error: type[Exception], op: Callable[..., Any], *args: Any
) -> None:
    """``op(*args)`` raises exactly ``error`` and the pool's whole state is unchanged."""
    before: PoolState = pool.snapshot()
    with pytest.raises(error) as info:
        op(*args)
    assert type(info.value) is error
    assert pool.snapshot() == before
    pool.check_invariants()


@dataclass
class LoraRequest:
    """vLLM's LoRARequest, as far as the pool reads it."""

    adapter_id: int
    name: str


@dataclass
class VllmStyleRequest:
    """A request shaped like vLLM's: lists, and the LoRA as an object."""

    block_hashes: list[bytes]
    all_token_ids: list[int]
    lora_request: LoraRequest | None = None
