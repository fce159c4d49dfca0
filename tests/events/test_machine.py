"""The event machine: broken consumers are target errors, producers are checked the other way.

A consumer that raises, answers garbage or hangs cannot be scored: the check
ends with a target error (exit 2), naming the step, never a traceback.
"""

from typing import Any, cast

import pytest

from kvpool.model import BlockStored, EventSemantics
from kvpool.specs.checking import check
from kvpool.specs.events.check import check_events
from kvpool.specs.events.engine import PoolEngineFactory, model_engines, query_for
from kvpool.specs.events.machine import ENGINE_STEPS, events_machine, scores_problem, show_event
from kvpool.specs.events.model_target import ReferenceConsumer
from kvpool.specs.events.target import EngineConfig
from kvpool.specs.targets import TargetSpecError, resolve
from kvpool.specs.targets.impl.pool import ImplTarget
from tests.events.consumers import (
    AnswersAList,
    AnswersNegativeScores,
    HangsOnClear,
    NamesUnknownWorkers,
    RejectsDuplicateStores,
)
from tests.kit.helpers import assert_no_traceback, run_kvpool
from tests.specs.planted_bugs import RemovesEveryCopy, target_of


@pytest.mark.parametrize(
    ("consumer", "evidence"),
    [
        (RejectsDuplicateStores, "stored twice"),
        (AnswersNegativeScores, "answers garbage"),
        (AnswersAList, "not a mapping"),
        (NamesUnknownWorkers, "worker 99 is not one of"),
    ],
    ids=["raises", "negative", "a-list", "unknown-worker"],
)
def test_a_consumer_that_raises_or_answers_garbage_is_a_target_error(
    consumer: Any, evidence: str
) -> None:
    report = check_events(consumer, semantics=["multiset"], max_examples=60)
    assert report.failure_kind == "target-error", report.failure
    assert report.verdicts == {"multiset": "target error"}
    assert evidence in (report.failure or "")


def test_a_consumer_that_rejects_an_event_is_a_target_error_under_the_cli() -> None:
    result = run_kvpool(
        "check",
        "--layer",
        "events",
        "--target",
        "tests.events.consumers:RejectsDuplicateStores",
        "--profile",
        "multiset",
        "--hypothesis-profile",
        "ci",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "the consumer raised ValueError" in output
    assert_no_traceback(result)


def test_a_hanging_consumer_is_stopped_as_a_target_error() -> None:
    report = check_events(HangsOnClear, semantics=["last-copy"], program_timeout=1.0)
    assert report.failure_kind == "target-error"
    assert "hangs" in (report.failure or "")


def test_the_cli_gives_a_verdict_per_event_semantics() -> None:
    result = run_kvpool(
        "check", "--layer", "events", "--target", "model", "--hypothesis-profile", "ci",
        "--examples", "20",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verdict under multiset (claimed)" in result.stdout
    assert "verdict under last-copy (claimed)" in result.stdout


def test_unknown_event_semantics_and_levels_are_the_callers_mistake() -> None:
    with pytest.raises(TargetSpecError):
        check("events", "model", profiles=["hashless-first"])
    with pytest.raises(TargetSpecError):
        check("events", "model", level=2)
    result = run_kvpool("check", "--layer", "events", "--profile", "set")
    assert result.returncode == 2
    assert_no_traceback(result)


# --------------------------------------------------------------------------
# Producers: an engine's stream, folded by the reference consumer
# --------------------------------------------------------------------------


def test_the_impl_as_a_producer_conforms_under_both_semantics() -> None:
    report = check("events", "impl", max_examples=60)
    assert report.conforms, report.failure
    assert report.verdicts == {"multiset": "conforms", "last-copy": "conforms"}


def test_a_pool_that_claims_last_copy_but_removes_every_copy_is_found() -> None:
    engines = PoolEngineFactory(target_of(RemovesEveryCopy), "removes-every-copy")
    report = check_events(
        None, engines, semantics=["last-copy"], target_name="planted", shrink=False
    )
    assert not report.conforms
    assert "event_stream_consistency" in (report.failure or ""), report.failure


def test_the_producer_of_a_resolved_pool_string() -> None:
    descriptor = resolve("events", "pool:impl")
    assert descriptor.scope["role"] == "producer"
    assert descriptor.profiles == ("multiset", "last-copy")
    assert resolve("events", "pool:model").profiles == ("multiset",)
    assert resolve("events", "dynamo").profiles == ("multiset",)
    assert resolve("events", "dynamo:raw").profiles == ("last-copy",)
    with pytest.raises(TargetSpecError):
        resolve("events", "pool:nonsense")


# --------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------


def test_the_engine_recomputes_the_last_block_of_a_fully_cached_prompt() -> None:
    engine = PoolEngineFactory(ImplTarget)(EngineConfig(6, 1, EventSemantics.MULTISET))
    engine.serve([1, 2])
    engine.serve([1, 2])
    # the events with a parent_block_hash are the stores
    stored = cast(
        list[BlockStored], [e for e in engine.take_events() if hasattr(e, "parent_block_hash")]
    )
    assert [e.block_hashes for e in stored] == [(b"\x01", b"\x01\x02"), (b"\x01\x02",)]
    assert stored[1].parent_block_hash == b"\x01"
    assert engine.cached_prefix(query_for([1, 2, 2], 1)) == 2


def test_an_engine_with_no_room_does_not_schedule() -> None:
    engine = model_engines()(EngineConfig(3, 1, EventSemantics.MULTISET))
    assert engine.serve([1, 2, 1]) is None
    assert engine.take_events() == ()
    assert engine.serve([1, 2]) == 0


def test_steps_can_be_left_out_of_every_program() -> None:
    machine = events_machine(
        ReferenceConsumer, model_engines(), EventSemantics.MULTISET, without=["evict"]
    )
    assert machine.evict is None
    assert "evict" in ENGINE_STEPS
    with pytest.raises(ValueError):
        events_machine(ReferenceConsumer, model_engines(), EventSemantics.MULTISET, without=["x"])


def test_scores_are_checked_for_shape() -> None:
    assert scores_problem({0: 1, 1: 0}, 2, 1) is None
    assert scores_problem({0: True}, 1, 1) is not None
    assert scores_problem({"0": 1}, 1, 1) is not None
    assert scores_problem({0: -1}, 1, 1) is not None
    assert scores_problem([1], 1, 1) is not None


def test_events_read_as_a_stream() -> None:
    from kvpool.model import AllBlocksCleared, BlockStored

    stored = BlockStored((b"\x01", b"\x01\x02"), None, (1, 2), 1, None, "GPU", None, None, 1)
    assert show_event(stored) == "stored 01 0102 under root (group 1)"
    assert show_event(AllBlocksCleared()) == "cleared"


class OwnHashes:
    """An engine whose events carry hashes of its own (as SGLang's do): it gives the queries."""

    def __init__(self, config: EngineConfig, with_query: bool = True) -> None:
        self.inner = PoolEngineFactory(ImplTarget)(config)
        self.config = config
        if with_query:
            self.query = self._query

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def snapshot(self) -> None:
        """Its state is in the kit's hashes, its events are not: no state check."""

    def cached_prefix(self, query: Any) -> int:
        """Its own lookup, by tokens (SGLang's ``match_prefix``)."""
        return self.inner.cached_prefix(query_for(query.token_ids, self.config.block_size))

    def take_events(self) -> Any:
        from dataclasses import replace

        from kvpool.model import BlockRemoved, BlockStored

        out = []
        for event in self.inner.take_events():
            if isinstance(event, BlockStored | BlockRemoved):
                event = replace(event, block_hashes=tuple(b"own" + h for h in event.block_hashes))
            out.append(event)
        return out

    def _query(self, tokens: Any) -> Any:
        plain = query_for(tokens, self.config.block_size)
        return type(plain)(plain.token_ids, tuple(b"own" + h for h in plain.block_hashes))


def test_an_engine_with_hashes_of_its_own_gives_the_queries() -> None:
    report = check_events(None, OwnHashes, semantics=["multiset"], max_examples=40)
    assert report.conforms, report.failure
    report = check_events(
        None, lambda c: OwnHashes(c, with_query=False), semantics=["multiset"], max_examples=40
    )
    assert not report.conforms
