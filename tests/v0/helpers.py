"""Helpers for the v0 tests: small states built through the model; vLLM's availability."""

import os

import pytest

from kvpool.model import v0
from kvpool.model.v0 import V0State


def shared_prefix_state() -> V0State:
    """Two sequences sharing block 0 (AB), one with a mutable tail, one evictable block.

    Handles: #0 on block 0 (AB), #1 on block 1 (C_), #2 on block 0 (AB);
    #3 held [X, Y] on block 2, then freed: block 2 is evictable.
    """
    state = v0.new_allocator(4, 2)
    state, (a,) = v0.allocate_immutable_blocks(state, None, [[65, 66]])
    state, tail = v0.allocate_mutable_block(state, a)
    state, _ = v0.append_token_ids(state, tail, [67])
    state, _ = v0.allocate_immutable_block(state, None, [65, 66])
    state, other = v0.allocate_immutable_block(state, None, [88, 89])
    state, _ = v0.free(state, other)
    return state


def vllm_or_skip() -> None:
    """Skip (with the reason, shown by ``pytest -rs``) when vLLM's v0 allocator cannot be loaded."""
    from kvpool.specs.targets.vllm.v0 import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get("KVPOOL_REQUIRE_VLLM") == "1":
            pytest.fail(f"KVPOOL_REQUIRE_VLLM=1 but {reason}", pytrace=False)
        pytest.skip(reason)
