"""Sparse retention of Mamba "align" states: vLLM 0.33's ``prefix_cache_retention_interval``.

The scenarios are vLLM 0.33.0's own (tests/v1/core/test_prefix_caching.py:
test_hybrid_mamba_retention_lookahead_keeps_last_prompt_boundary,
test_mamba_shared_prefix_reuse_under_zero_retention), told again on the model and on the
impl, which must agree call by call (``tests.request.test_retention.Both``); then the
machine draws retention intervals on the "align" layouts. The semantics:
``kvpool.model.retention.mamba_align_retention_mask``.
"""

from dataclasses import replace

import pytest

from kvpool.model import manager as mm
from kvpool.model.request import with_computed
from kvpool.model.retention import mamba_align_retention_mask
from kvpool.model.single_type import full_attention, mamba_align, mamba_reserving
from kvpool.specs.request.machine import manager_machine
from kvpool.specs.request.target import MAMBA_ALIGN_LAYOUTS
from kvpool.specs.targets.impl.request import ImplManagerTarget
from tests.request.test_retention import Both, _run, tokens

HYBRID = [full_attention(16), mamba_align(16)]


def _chunked(both: Both, token_ids: list[int], chunk: int, rid: str = "0") -> None:
    """Prefill ``token_ids`` in chunks of ``chunk`` tokens (the scheduler's, block-aligned)."""
    request = both.request(rid, token_ids)
    both.allocate(request, min(chunk, len(token_ids)))
    done = min(chunk, len(token_ids))
    while done < len(token_ids):
        request = with_computed(request, done)
        step = min(chunk, len(token_ids) - done)
        both.model, _ = mm.new_step_starts(both.model)
        both.impl.new_step_starts()
        both.model, new = mm.allocate_slots(both.model, request, step)
        answer = both.impl.allocate_slots(request, step)
        assert new is not None and answer is not None
        assert tuple(tuple(g) for g in answer.get_block_ids()) == new
        assert both.impl.snapshot() == both.model
        done += step


@pytest.mark.parametrize(
    ("interval", "kept"),
    [(0, {7}), (64, {3, 7}), (32, {1, 3, 5, 7}), (16, set(range(8))), (None, set(range(8)))],
)
def test_the_states_kept_are_the_segments_last_and_the_replay_boundarys(
    interval: int | None, kept: set[int]
) -> None:
    """129 tokens in chunks of 16 (a state every block): the replay boundary is 128 (state
    block 7); 64 tokens keep every fourth state too, 32 every second, 16 (one block a
    segment) or dense every one. A resend of the prompt hits 128 tokens either way."""
    both = Both(HYBRID, interval, hash_block_size=16)
    _chunked(both, [*tokens(8, 16), 8], 16)
    assert both.cached(both.request("0", [*tokens(8, 16), 8]), 1) == kept
    assert both.cached(both.request("0", [*tokens(8, 16), 8]), 0) == set(range(8))
    both.free(both.request("0", [*tokens(8, 16), 8]))
    assert both.lookup(both.request("1", [*tokens(8, 16), 8]))[1] == 128


def test_latest_only_with_a_speculative_block_keeps_the_last_prompt_boundary() -> None:
    """test_hybrid_mamba_retention_lookahead_keeps_last_prompt_boundary (without the hash
    look-ahead): a speculative block beside the "align" group; only the state at 128 is
    kept, and a resend hits 128 tokens in both groups."""
    both = Both([full_attention(32), mamba_reserving(32, 1)], 0, hash_block_size=32)
    prompt = [*tokens(4, 32), 4]
    _chunked(both, prompt, 32)
    assert both.cached(both.request("0", prompt), 1) == {3}
    both.free(both.request("0", prompt))
    hit, length, _ = both.lookup(both.request("1", prompt))
    assert (length, [len(g) for g in hit]) == (128, [4, 4])


@pytest.mark.parametrize(
    ("interval", "pin", "expected"), [(None, False, 32), (0, False, 0), (0, True, 32)]
)
def test_the_shared_prefix_junction_is_kept_when_noted(
    interval: int | None, pin: bool, expected: int
) -> None:
    """test_mamba_shared_prefix_reuse_under_zero_retention: the second request's chunk up to
    the junction the scheduler noted keeps the state there under latest-only retention, so
    a third request sharing the prefix reuses it; unnoted, the junction is not kept."""
    both = Both(HYBRID, interval, hash_block_size=16, num_blocks=200)
    shared = [7] * 32
    both.allocate(both.request("0", shared + [50] * 32))
    second = both.request("1", shared + [60] * 32)
    _, hit, boundary = both.lookup(second)
    assert (hit, boundary) == (0, 32)
    if pin:
        second = replace(second, shared_prefix_boundary=boundary)
    both.allocate(second, boundary - hit)
    assert both.lookup(both.request("2", shared + [70] * 32))[1] == expected


def test_the_mask() -> None:
    # segments of four blocks end at blocks 3, 7; the boundary at 95 rounds to block 4
    mask = mamba_align_retention_mask(2, 9, 16, 16, 64, (95,))
    assert mask is not None
    assert [2 + i for i, kept in enumerate(mask) if kept] == [3, 4, 7]
    # a boundary rounds down to the alignment (the scheduler block), and one below a block
    # keeps nothing
    mask = mamba_align_retention_mask(0, 8, 32, 16, 0, (95, 8))
    assert mask is not None
    assert [i for i, kept in enumerate(mask) if kept] == [3]
    assert mamba_align_retention_mask(0, 8, 16, 16, 16, (95,)) is None


def test_impl_conforms_in_lock_step_under_align_retention() -> None:
    machine = manager_machine(
        ImplManagerTarget,
        layouts=MAMBA_ALIGN_LAYOUTS,
        hash_sized_layouts=MAMBA_ALIGN_LAYOUTS,
        min_window=2,
        scheduler_calls=True,
        retentions=(None, 0, 0, 1, 2, 3),
        mamba_reserves=((0, 0), (0, 0), (1, 0), (2, 0), (0, 1)),
    )
    _run(machine, max_examples=60)
