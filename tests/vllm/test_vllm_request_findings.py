"""vLLM 0.33's KVCacheManager at level 2: each known finding of ``REQUEST_FINDINGS`` by its
smallest reproducer (the model rejects the call, vLLM reacts as the catalogue says), the
survey's stepping over, and the adapter's translations of invalid calls."""

from collections.abc import Callable
from typing import Any

import pytest

from kvpool.model.errors import PoolError
from kvpool.model.request import new_request, with_computed
from kvpool.model.single_type import full_attention
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import ManagerSetup
from kvpool.specs.targets.vllm.findings import (
    REQUEST_FINDINGS,
    classify_divergence,
    vllm_reaction,
)

pytestmark = pytest.mark.usefixtures("require_vllm")

SETUP = ManagerSetup(6, (full_attention(1),), 16, 1)
PROMPT = (1, 2, 2, 1)


def _hit(target: Any) -> tuple[Any, Any, int]:
    """A prompt cached by a finished request, and a second request's hit on it."""
    first = new_request("a", PROMPT, 1)
    target.allocate_slots(first, 4)
    target.free(first)
    second = new_request("b", PROMPT, 1)
    hit, num = target.get_computed_blocks(second)
    return second, hit, num


def _no_new_tokens(t: Any) -> object:
    second, hit, num = _hit(t)
    return t.allocate_slots(second, 0, num, hit)


def _negative_lookahead(t: Any) -> object:
    return t.allocate_slots(new_request("a", PROMPT, 1), 1, 0, None, -1)


def _stranger(t: Any) -> object:
    return t.allocate_slots(new_request("s", PROMPT, 2), 4)


def _two_hit_lists(t: Any) -> object:
    second, hit, num = _hit(t)
    return t.allocate_slots(second, 1, num, (hit[0], ()))


def _unknown_hit_block(t: Any) -> object:
    return t.allocate_slots(new_request("a", PROMPT, 1), 1, 1, ((17,),))


def _cache_past_the_blocks(t: Any) -> object:
    request = new_request("a", PROMPT, 1)
    t.allocate_slots(request, 2)
    return t.cache_blocks(with_computed(request, 2), 17)


def _evict_past_the_pool(t: Any) -> object:
    return t.evict_blocks({6})


REPRODUCERS: dict[str, tuple[str, Callable[[Any], object]]] = {
    "manager-no-new-tokens": ("allocate_slots", _no_new_tokens),
    "manager-negative-count": ("allocate_slots", _negative_lookahead),
    "manager-hash-block-size": ("allocate_slots", _stranger),
    "manager-hit-groups": ("allocate_slots", _two_hit_lists),
    "manager-unknown-hit-block": ("allocate_slots", _unknown_hit_block),
    "manager-cache-range": ("cache_blocks", _cache_past_the_blocks),
    "manager-evict-unknown-id": ("evict_blocks", _evict_past_the_pool),
}


def test_every_request_finding_has_a_reproducer() -> None:
    assert sorted(REPRODUCERS) == sorted(REQUEST_FINDINGS)


@pytest.mark.parametrize("key", sorted(REPRODUCERS))
def test_the_smallest_reproducer_of_each_request_finding(key: str) -> None:
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    finding = REQUEST_FINDINGS[key]
    operation, program = REPRODUCERS[key]
    with pytest.raises(PoolError) as rejected:
        program(ModelManagerTarget(SETUP))
    assert type(rejected.value).__name__ == finding.model_error
    try:
        program(VllmManagerTarget(SETUP))
        reaction = "accepts"
    except PoolError as error:
        reaction = vllm_reaction(type(error).__name__)
    assert reaction in finding.vllm_reactions, reaction
    message = f"{operation}(...): the model rejects it with {finding.model_error}, the target " + (
        "accepts it" if reaction == "accepts" else f"with Vllm{reaction}"
    )
    assert classify_divergence(message, REQUEST_FINDINGS).finding == finding  # type: ignore[union-attr]


def test_zero_new_tokens_and_nothing_to_adopt_is_no_new_tokens_on_both() -> None:
    """vLLM's ValueError for a call with nothing to do is the model's NoNewTokens."""
    from kvpool.model.errors import NoNewTokens
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    for target in (ModelManagerTarget(SETUP), VllmManagerTarget(SETUP)):
        with pytest.raises(NoNewTokens):
            target.allocate_slots(new_request("a", PROMPT, 1), 0)


def test_stepping_over_a_finding_rejects_it_without_reaching_vllm() -> None:
    """The survey's wrapper: the shadow model's rejection, for a suppressed pair only."""
    from kvpool.model.errors import InvalidTokenCount
    from kvpool.specs.targets.vllm.request import VllmManagerFactory

    stepping = VllmManagerFactory(suppress=[("allocate_slots", "InvalidTokenCount")])(SETUP)
    with pytest.raises(InvalidTokenCount, match="known vLLM finding"):
        _negative_lookahead(stepping)
    assert stepping.num_free_blocks() == 5  # vLLM never saw the call
    plain = VllmManagerFactory()(SETUP)
    _negative_lookahead(plain)  # without the pair, vLLM accepts it
