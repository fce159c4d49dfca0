"""Claims the docs make about the model's behaviour, held to the model.

Where a claim can be checked mechanically it is: every row of the
preconditions table in docs/semantics.md ("call | model | vLLM") names a
situation and the model's answer; each row has a scenario here that puts the
model in that situation, and the test fails if the model answers otherwise,
or if a row has no scenario (a new claim must come with its check). The
sentence on a ``cache_full_blocks`` that caches nothing is checked the same
way: it once claimed the call "still validates its arguments", which misled
a user into a real bug.
"""

import re
from collections.abc import Callable
from typing import Protocol

import pytest

from kvpool import model
from kvpool.model import CacheRequest, PoolError, PoolState
from tests.docs.helpers import DOCS

SEMANTICS = DOCS / "semantics.md"
REQUEST = CacheRequest(block_hashes=(b"a", b"ab"), all_token_ids=(1, 2))


def _held(
    num_blocks: int = 5, count: int = 2, **config: object
) -> tuple[PoolState, tuple[int, ...]]:
    pool = model.new_pool(num_blocks, **config)  # type: ignore[arg-type]
    return model.get_new_blocks(pool, count)


def _cached() -> PoolState:
    pool, (a, b) = _held()
    pool, _ = model.cache_full_blocks(pool, REQUEST, [a, b], 0, 2, 1, 0)
    return pool


SCENARIOS: dict[str, Callable[[], object]] = {
    "`new_pool(0)`": lambda: model.new_pool(0),
    "`hash_block_size < 1`": lambda: model.new_pool(4, hash_block_size=0),
    "`get_new_blocks(-1)`": lambda: model.get_new_blocks(model.new_pool(4), -1),
    "`get_new_blocks(n > free)`": lambda: model.get_new_blocks(model.new_pool(4), 4),
    "free a free block": lambda: model.free_blocks(model.new_pool(4), [1]),
    "the same held-once block twice in one `free_blocks`": lambda: model.free_blocks(
        _held()[0], [1, 1]
    ),
    "a block held twice, listed twice": lambda: model.free_blocks(
        model.touch(_held()[0], [1])[0], [1, 1]
    ),
    "unknown id (negative or `>= N`) in `touch`, `free_blocks`, `evict_blocks`, cache calls": (
        lambda: [
            _outcome(lambda op=op, bad=bad: op(bad))
            for bad in (-1, 5)
            for op in (
                lambda b: model.touch(_held()[0], [b]),
                lambda b: model.free_blocks(_held()[0], [b]),
                lambda b: model.evict_blocks(_held()[0], {b}),
                lambda b: model.cache_full_blocks(_held()[0], REQUEST, [1, b], 0, 2, 1, 0),
                lambda b: model.cache_partial_block(_held()[0], REQUEST, b, 1, 0, 2),
            )
        ]
    ),
    "`cache_full_blocks` with `num_full_blocks` beyond the request's hashes": lambda: (
        model.cache_full_blocks(_held(count=3)[0], REQUEST, [1, 2, 3], 0, 3, 1, 0)
    ),
    "`cache_full_blocks` on a free (ref 0) block": lambda: model.cache_full_blocks(
        _held()[0], REQUEST, [3], 0, 1, 1, 0
    ),
    "`cache_full_blocks` on a block already holding a full hash": lambda: model.cache_full_blocks(
        _cached(), REQUEST, [1, 2], 1, 2, 1, 0
    ),
    "the same block twice in the range being cached": lambda: model.cache_full_blocks(
        _held()[0], REQUEST, [1, 1], 0, 2, 1, 0
    ),
    "`block_mask` of the wrong length": lambda: model.cache_full_blocks(
        _held()[0], REQUEST, [1, 2], 0, 2, 1, 0, [True]
    ),
    "`block_size` not a multiple of `hash_block_size`": lambda: model.cache_full_blocks(
        _held(hash_block_size=2)[0], REQUEST, [1, 2], 0, 1, 3, 0
    ),
    "negative KV cache group id": lambda: model.cache_full_blocks(
        _held()[0], REQUEST, [1, 2], 0, 2, 1, -1
    ),
    "caching calls with `enable_caching=False`": lambda: [
        _outcome(
            lambda: model.cache_full_blocks(
                _held(enable_caching=False)[0], REQUEST, [1, 2], 0, 2, 1, 0
            )
        ),
        _outcome(
            lambda: model.cache_partial_block(_held(enable_caching=False)[0], REQUEST, 1, 1, 0, 2)
        ),
    ],
}
"""Per row of the table: a call in that situation (a list: several calls that must agree)."""


class Call(Protocol):
    """A call with no arguments. Not a Callable: mypy cannot match a lambda that binds
    its loop variables through defaulted parameters (`lambda op=op: ...`) to one."""

    def __call__(self) -> object: ...


def _outcome(call: Call) -> str:
    """The model's answer to ``call``: the rejection's class name, or ``allowed``."""
    try:
        call()
    except PoolError as error:
        return type(error).__name__
    return "allowed"


def _table_rows() -> dict[str, str]:
    """The preconditions table of docs/semantics.md: situation -> what the model does."""
    text = SEMANTICS.read_text()
    section = text.split("## Preconditions", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("call", "---"):
            rows[cells[0]] = cells[1]
    return rows


def _claimed(cell: str) -> str:
    """The model's answer a cell claims: the first `Name`, or ``allowed``."""
    if cell.startswith("allowed"):
        return "allowed"
    found = re.match(r"`([A-Za-z]+)`", cell)
    assert found, f"the table cell {cell!r} names no rejection"
    return found.group(1)


def test_every_row_of_the_preconditions_table_has_a_scenario() -> None:
    rows = _table_rows()
    assert len(rows) >= 14
    assert set(rows) == set(SCENARIOS), set(rows) ^ set(SCENARIOS)


@pytest.mark.parametrize("situation", sorted(SCENARIOS))
def test_the_model_answers_as_the_preconditions_table_says(situation: str) -> None:
    claimed = _claimed(_table_rows()[situation])
    scenario = SCENARIOS[situation]
    found = _outcome(scenario)
    if found == "allowed":  # a list of outcomes of several calls
        answers = scenario()
        if isinstance(answers, list):
            assert set(answers) == {claimed}, answers
            return
    assert found == claimed


def test_an_empty_cache_full_blocks_checks_what_the_docs_say_and_nothing_else() -> None:
    """docs/semantics.md: checks caching, group, block size, range and mask; not the blocks
    or the hashes, which it never reads."""
    text = " ".join(SEMANTICS.read_text().split())
    assert "does **not** check the block ids or the request's hashes" in text
    pool, _ = _held()
    short = CacheRequest(block_hashes=(), all_token_ids=())
    # Not checked: unknown and free blocks, too few hashes; and nothing changes.
    for block_ids in ([99, -1], [3, 4]):
        after, _ = model.cache_full_blocks(pool, short, block_ids, 2, 2, 1, 0)
        assert after == pool
    # Checked: caching, group, block size, range, mask.
    checked = {
        "CachingDisabled": lambda: model.cache_full_blocks(
            _held(enable_caching=False)[0], short, [1], 1, 1, 1, 0
        ),
        "InvalidGroup": lambda: model.cache_full_blocks(pool, short, [1], 1, 1, 1, -1),
        "InvalidBlockSize": lambda: model.cache_full_blocks(pool, short, [1], 1, 1, 0, 0),
        "InvalidBlockRange": lambda: model.cache_full_blocks(pool, short, [1], 1, 2, 1, 0),
        "InvalidBlockMask": lambda: model.cache_full_blocks(pool, short, [1], 1, 1, 1, 0, [True]),
    }
    for name, call in checked.items():
        assert _outcome(call) == name


def test_cache_partial_block_on_the_null_block_checks_the_group_first() -> None:
    """docs/semantics.md: `cache_partial_block(request, null, 99, -1, 1)` is `InvalidGroup`."""
    assert "`cache_partial_block(request, null, 99, -1, 1)` is `InvalidGroup`" in " ".join(
        SEMANTICS.read_text().split()
    )
    pool, _ = _held()
    assert _outcome(lambda: model.cache_partial_block(pool, REQUEST, 0, 99, -1, 1)) == (
        "InvalidGroup"
    )
    assert model.cache_partial_block(pool, REQUEST, 0, 99, 0, 2)[1] is None


def test_every_generated_part_of_a_reference_page_says_where_it_comes_from() -> None:
    """On the repository host a directive shows nothing: the line after it says what to read."""
    directive = re.compile(r"^<!--\s*kvpool(-request)?:[a-z-]+.*-->$")
    for page in sorted((DOCS / "reference").glob("*.md")):
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            if directive.match(line.strip()):
                following = [x for x in lines[number + 1 : number + 3] if x.strip()]
                assert following and following[0].startswith(
                    "> *Built from the code when the site is built.*"
                ), f"{page.name}:{number + 1} has no note for readers on the repository host"
