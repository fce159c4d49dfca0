"""vLLM 0.33's fine-grained hits with copy-on-write, and its further scheduler calls.

Model and impl: the partial hit, the copy, its retained ends, the
shared-prefix boundary, truncation, the blocks to zero, the cached-token
estimate; each precondition has a ``test_invalid_*`` (the impl's with a
snapshot before and after). The machine: the impl conforms with
fine-grained hits, the programs do copy, and a copy served before it is
written is found.
"""

from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvpool.impl.manager import KVCacheBlocks, KVCacheConfig, KVCacheManager
from kvpool.model import manager as M
from kvpool.model.errors import InvalidHit, InvalidTokenCount
from kvpool.model.request import Request, new_request
from kvpool.model.single_type import full_attention, sliding_window
from kvpool.specs.errors import Divergence
from kvpool.specs.request.check import run_request_conformance
from kvpool.specs.request.invariants import RequestInvariantViolation
from kvpool.specs.request.machine import manager_machine
from kvpool.specs.targets.impl.request import ImplManagerTarget
from tests.request.planted_cow import SCOPE, CopyServedBeforeWrittenTarget

FULL = [full_attention(2)]


def shared_prompt_state() -> tuple[M.KVCacheManagerState, Request]:
    """Request a (prompt 1 2 3 4) is cached; b shares its first 3 tokens."""
    s = M.new_kv_cache_manager(8, FULL, 16, hash_block_size=1, fine_grained_hits=True)
    a = new_request("a", [1, 2, 3, 4], 1)
    s, _ = M.allocate_slots(s, a, 4)
    return s, new_request("b", [1, 2, 3, 9, 9], 1)


def test_fine_grained_hits_need_full_attention_only_vllm_51843() -> None:
    on = M.new_kv_cache_manager(8, FULL, 16, hash_block_size=1, fine_grained_hits=True)
    hybrid = M.new_kv_cache_manager(
        8, [full_attention(2), sliding_window(2, 2)], 16, hash_block_size=1, fine_grained_hits=True
    )
    same_size = M.new_kv_cache_manager(8, FULL, 16, hash_block_size=2, fine_grained_hits=True)
    assert on.config.fine_grained_hits
    assert not hybrid.config.fine_grained_hits
    assert not same_size.config.fine_grained_hits


def test_a_hit_ends_inside_the_block_holding_the_prompts_partial_tail() -> None:
    s, b = shared_prompt_state()
    s, (hit, num_hit, boundary) = M.get_computed_blocks_with_boundary(s, b)
    assert (hit, num_hit, boundary) == (((1, 2),), 3, 0)


def test_without_fine_grained_hits_the_hit_stops_at_whole_blocks() -> None:
    s = M.new_kv_cache_manager(8, FULL, 16, hash_block_size=1)
    s, _ = M.allocate_slots(s, new_request("a", [1, 2, 3, 4], 1), 4)
    _, (hit, num_hit) = M.get_computed_blocks(s, new_request("b", [1, 2, 3, 9, 9], 1))
    assert (hit, num_hit) == (((1,),), 2)


def test_copy_on_write_gives_a_private_block_and_retains_both_ends() -> None:
    s, b = shared_prompt_state()
    s, (hit, num_hit) = M.get_computed_blocks(s, b)
    s, new = M.allocate_slots(s, b, 2, num_hit, hit)
    assert new == ((3, 4),)  # the copy, then the new block
    assert M.get_block_ids(s, "b") == ((1, 3, 4),)
    assert s.pending_copies == ((2, 3),)
    blocks = s.managers.pool.blocks
    assert (blocks[2].ref_cnt, blocks[3].ref_cnt) == (2, 2)  # a + retention; b + retention
    s, (copies, retained) = M.take_kv_cache_block_copies(s)
    assert (copies, retained, s.pending_copies) == (((2, 3),), (2, 3), ())
    s, _ = M.free_blocks(s, retained)
    assert (s.managers.pool.blocks[2].ref_cnt, s.managers.pool.blocks[3].ref_cnt) == (1, 1)
    s, zero = M.take_new_block_ids(s)
    assert zero == (3,) and M.take_new_block_ids(s)[1] == ()


def test_invalid_partial_hit_not_in_its_last_block() -> None:
    s, b = shared_prompt_state()
    with pytest.raises(InvalidHit):
        M.allocate_slots(s, b, 2, 1, ((1, 2),))


def test_invalid_truncation_inside_a_block() -> None:
    s, _ = shared_prompt_state()
    with pytest.raises(InvalidTokenCount):
        M.truncate_computed_blocks(s, ((1, 2),), 3)


def test_invalid_truncation_past_the_hit() -> None:
    s, _ = shared_prompt_state()
    with pytest.raises(InvalidHit):
        M.truncate_computed_blocks(s, ((1,),), 4)


def test_invalid_truncation_of_another_number_of_groups() -> None:
    s, _ = shared_prompt_state()
    with pytest.raises(InvalidHit):
        M.truncate_computed_blocks(s, ((1,), ()), 2)


def test_truncation_cuts_to_whole_blocks() -> None:
    s, _ = shared_prompt_state()
    assert M.truncate_computed_blocks(s, ((1, 2),), 2) == ((1,),)


def test_estimate_counts_the_tokens_the_blocks_are_cached_for() -> None:
    s, _ = shared_prompt_state()
    assert M.estimate_cached_tokens(s, "a") == 4
    assert M.estimate_cached_tokens(s, "nobody") == 0
    assert M.new_step_starts(s)[0] == s


# --------------------------------------------------------------------------
# The impl: same answers, bad input rejected with the state unchanged
# --------------------------------------------------------------------------


def impl_with_a_cached() -> tuple[KVCacheManager, Request]:
    m = KVCacheManager(KVCacheConfig(8, tuple(FULL)), 16, hash_block_size=1, fine_grained_hits=True)
    m.allocate_slots(new_request("a", [1, 2, 3, 4], 1), 4)
    return m, new_request("b", [1, 2, 3, 9, 9], 1)


def test_impl_copies_as_the_model_does() -> None:
    m, b = impl_with_a_cached()
    s, _ = shared_prompt_state()
    hit, num_hit, boundary = m.get_computed_blocks(b)
    s, (model_hit, model_num, model_boundary) = M.get_computed_blocks_with_boundary(s, b)
    assert (tuple(tuple(g) for g in hit.get_block_ids()), num_hit, boundary) == (
        model_hit,
        model_num,
        model_boundary,
    )
    m.allocate_slots(b, 2, num_hit, hit)
    s, _ = M.allocate_slots(s, b, 2, model_num, model_hit)
    assert m.snapshot() == s
    copies, retained = m.take_kv_cache_block_copies()
    assert [(c.src_block_id, c.dst_block_id) for c in copies] == [(2, 3)]
    m.block_pool.free_blocks(retained)
    s, (_, ids) = M.take_kv_cache_block_copies(s)
    s, _ = M.free_blocks(s, ids)
    assert m.snapshot() == s
    assert m.take_new_block_ids() == [3]
    assert m.estimate_cached_tokens(b) == M.estimate_cached_tokens(s, "b")


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda m, b, h: m.allocate_slots(b, 2, 1, h), InvalidHit),
        (lambda m, b, h: m.truncate_computed_blocks(h, 3), InvalidTokenCount),
        (lambda m, b, h: m.truncate_computed_blocks(KVCacheBlocks(([],)), 2), InvalidHit),
        (lambda m, b, h: m.truncate_computed_blocks(KVCacheBlocks(([], [])), 2), InvalidHit),
    ],
    ids=["partial-hit-not-last", "truncate-inside", "truncate-past", "truncate-groups"],
)
def test_invalid_impl_call_changes_nothing(call: Any, error: type[Exception]) -> None:
    m, b = impl_with_a_cached()
    hit, _, _ = m.get_computed_blocks(b)
    before = m.snapshot()
    with pytest.raises(error):
        call(m, b, hit)
    assert m.snapshot() == before


# --------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------


def run(machine: type, max_examples: int) -> None:
    chosen = settings(
        settings.get_profile("ci"),
        max_examples=max_examples,
        stateful_step_count=40,
        report_multiple_bugs=False,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
    )
    run_state_machine_as_test(machine, settings=chosen)


class CountingTarget(ImplManagerTarget):
    copies = 0

    def take_kv_cache_block_copies(self) -> Any:
        copies, retained = super().take_kv_cache_block_copies()
        type(self).copies += len(copies)
        return copies, retained


def test_impl_conforms_with_fine_grained_hits_and_programs_do_copy() -> None:
    CountingTarget.copies = 0
    machine = manager_machine(
        CountingTarget, layouts=["full"], block_factors=[2], fine_grained=[True]
    )
    run(machine, max_examples=300)
    assert CountingTarget.copies > 0


def test_a_copy_served_before_it_is_written_is_found_in_lock_step() -> None:
    machine = manager_machine(
        CopyServedBeforeWrittenTarget, layouts=["full"], block_factors=[2], fine_grained=[True]
    )
    with pytest.raises((Divergence, RequestInvariantViolation)):
        run(machine, max_examples=1000)


def test_the_ground_truth_alone_finds_a_copy_served_before_it_is_written() -> None:
    """No model: the private block is read (by its request, or through the hash map it
    was cached in) before the copy wrote it."""
    machine = manager_machine(
        CopyServedBeforeWrittenTarget,
        layouts=["full"],
        block_factors=[2],
        fine_grained=[True],
        lockstep=False,
    )
    with pytest.raises(RequestInvariantViolation) as info:
        run(machine, max_examples=1000)
    assert info.value.name in ("cached_blocks_hold_their_prefix", "requests_read_their_own_kv")


def test_kvpool_check_finds_a_copy_served_before_it_is_written() -> None:
    """What ``kvpool check --layer request --target tests.request.planted_cow:SCOPE`` runs
    (unshrunk: found is what matters)."""
    report = run_request_conformance(SCOPE, max_examples=1000, shrink=False)
    assert not report.conforms
    assert "take_kv_cache_block_copies" in str(report.failure)


def test_invalid_impl_request_without_a_prompt_length_changes_nothing() -> None:
    """With fine-grained hits caching reads the prompt's length: a request without one is
    refused before anything changes."""
    from types import SimpleNamespace

    from kvpool.model.errors import InvalidArgument

    m, b = impl_with_a_cached()
    stranger = SimpleNamespace(
        request_id="c",
        num_tokens=b.num_tokens,
        block_hashes=b.block_hashes,
        num_computed_tokens=0,
        num_preemptions=0,
        all_token_ids=b.all_token_ids,
    )
    before = m.snapshot()
    with pytest.raises(InvalidArgument):
        m.allocate_slots(stranger, 4)
    assert m.snapshot() == before
