"""The history format, its bounded parser and the checker, on histories made without an engine."""

import json
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from typer.testing import CliRunner

from kvpool.specs.cli import app
from kvpool.specs.history import HistoryError, check_history, minimise, read_history
from kvpool.specs.history import format as history_format
from kvpool.specs.vectors import load_schema
from tests.history.synth import BLOCK_SIZE, header, synthesize, write

runner = CliRunner()


def kvpool(*args: str) -> Any:
    return runner.invoke(app, list(args))


@pytest.fixture
def clean(tmp_path: Path) -> Path:
    head, calls = synthesize()
    return write(tmp_path / "h.jsonl", head, calls)


def lines_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def rewrite(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


# --------------------------------------------------------------------------- format


def test_every_line_of_a_history_validates_against_the_schema(clean: Path) -> None:
    schema = load_schema("history-v1.json")
    Draft202012Validator.check_schema(schema)
    validator = Draft202012Validator(schema)
    for line in lines_of(clean):
        validator.validate(line)


def test_the_format_names_no_engine_class(clean: Path) -> None:
    text = clean.read_text() + json.dumps(load_schema("history-v1.json"))
    for name in ("KVCacheManager", "BlockPool", "Scheduler", "KVCacheBlock", "Spec"):
        assert name not in text


@pytest.mark.parametrize(
    ("damage", "line", "reason"),
    [
        (lambda b: b[: len(b) - 7], 81, "truncated"),
        (lambda b: b.replace(b'"i": 5,', b'"i": 5', 1), 7, "not JSON"),
        (lambda b: b.replace(b'"i": 5,', b'"i": 9,', 1), 7, "call number"),
        (lambda b: b.replace(b'"version": 1', b'"version": 7', 1), 1, "version"),
        (lambda b: b.replace(b'"o": "manager"', b'"o": "router"', 1), 3, "origin"),
        (lambda b: b"", 1, "empty"),
        (lambda b: b.replace(b'"num_blocks": 14', b'"num_blocks": "14"', 1), 1, "num_blocks"),
        (lambda b: b.replace(b'"m": "free"', b'"m": "defragment"', 1), None, "not modelled"),
        (lambda b: b.replace(b'"nh": 3', b'"nh": 4', 1), None, "hashes"),
        (
            lambda b: b.replace(
                b'"new_computed_blocks": [[]]', b'"new_computed_blocks": [[], []]', 1
            ),
            4,
            "for 1 group",
        ),
    ],
)
def test_a_damaged_history_is_exit_2_naming_the_line(
    clean: Path, damage: Any, line: int | None, reason: str
) -> None:
    clean.write_bytes(damage(clean.read_bytes()))
    result = kvpool("history", "check", str(clean))
    assert result.exit_code == 2, result.output
    assert reason in result.output
    assert "line " in result.output
    if line is not None:
        assert f"line {line}:" in result.output
    assert "Traceback" not in result.output


def test_an_oversized_line_is_refused_before_it_is_read_whole(
    clean: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(history_format, "MAX_LINE_BYTES", 200)
    with pytest.raises(HistoryError, match="longer than 200 bytes") as error:
        read_history(clean)
    assert error.value.line == 1


def test_too_many_calls_are_refused(clean: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history_format, "MAX_CALLS", 10)
    with pytest.raises(HistoryError, match="more than 10 calls"):
        read_history(clean)


def test_nothing_in_a_history_is_evaluated(clean: Path) -> None:
    lines = lines_of(clean)
    lines[1]["a"]["request"]["salt"] = "__import__('os').system('false')"
    lines[0]["workload"] = {"python": "__import__('os')"}
    verdict = check_history(read_history(rewrite(clean, lines)))
    assert verdict.conforms  # strings stay strings


@pytest.mark.parametrize(
    ("cache", "reason"),
    [
        (
            {
                "retention": "sparse",
                "groups": [{"attention": "sliding_window", "block_size": 4, "sliding_window": 8}],
            },
            "sparse retention",
        ),
        ({"partial_hash_hits": True}, "partial_hash_hits"),
        ({"watermark_blocks": 2}, "watermark"),
        ({"groups": [{"attention": "mamba", "block_size": 4}]}, "not modelled"),
    ],
)
def test_a_configuration_the_model_cannot_express_is_exit_2(
    tmp_path: Path, cache: dict[str, Any], reason: str
) -> None:
    path = write(tmp_path / "h.jsonl", header(8, **cache), [])
    result = kvpool("history", "check", str(path))
    assert result.exit_code == 2
    assert reason in result.output


# --------------------------------------------------------------------------- checker


def test_a_history_the_model_made_conforms(clean: Path) -> None:
    result = kvpool("history", "check", str(clean))
    assert result.exit_code == 0, result.output
    assert "CONFORMS" in result.output


def hit_lines(lines: list[dict[str, Any]]) -> list[int]:
    return [n for n, c in enumerate(lines) if c.get("m") == "get_computed_blocks" and c["r"][1] > 0]


def test_a_stale_hit_is_exit_1_with_a_minimised_history_of_at_most_5_requests(clean: Path) -> None:
    """The engine claims one more cached block than the model has: a stale key."""
    lines = lines_of(clean)
    n = hit_lines(lines)[-1]
    lines[n]["r"][0][0].append(1)
    lines[n]["r"][1] += BLOCK_SIZE
    rewrite(clean, lines)
    result = kvpool("history", "check", str(clean))
    assert result.exit_code == 1, result.output
    assert f"DIVERGES at line {n + 1} (manager layer): cache hit" in result.output
    minimised = clean.with_name("h.minimised.jsonl")
    kept = {c["a"]["request"]["id"] for c in lines_of(minimised)[1:] if "request" in c["a"]}
    assert len(kept) <= 5
    again = kvpool("history", "check", "--no-minimise", str(minimised))
    assert again.exit_code == 1
    assert "cache hit" in again.output


def test_a_wrong_block_order_is_exit_1_and_names_the_earlier_calls(clean: Path) -> None:
    """Blocks handed out in the wrong order (what a wrong free order leads to)."""
    lines = lines_of(clean)
    n = next(
        k
        for k, c in enumerate(lines)
        if k > 20 and c.get("m") == "allocate_slots" and c["r"] and len(c["r"][0]) >= 2
    )
    lines[n]["r"][0] = lines[n]["r"][0][::-1]
    rewrite(clean, lines)
    verdict = check_history(read_history(clean))
    assert verdict.divergence is not None
    assert verdict.divergence.line == n + 1
    assert verdict.divergence.what == "new blocks"
    touched = set(lines[n]["r"][0])
    assert verdict.divergence.context, "earlier calls on the same request or blocks"
    for call in verdict.divergence.context:
        assert call["i"] < n - 1
    found = minimise(read_history(clean), verdict.divergence)
    assert len(found.requests) <= 5
    assert found.reproduces
    assert touched


def test_an_engine_refusal_the_model_would_grant_diverges(clean: Path) -> None:
    lines = lines_of(clean)
    n = next(k for k, c in enumerate(lines) if c.get("m") == "allocate_slots" and c["r"])
    lines[n]["r"] = None
    verdict = check_history(read_history(rewrite(clean, lines)))
    assert verdict.divergence is not None and verdict.divergence.line == n + 1


def test_the_whole_sequence_gate_refuses_what_does_not_fit(tmp_path: Path) -> None:
    """vLLM 0.32 admits a request only if its whole sequence fits (full_sequence_must_fit)."""
    request = {
        "id": "a",
        "n": 16,
        "np": 16,
        "nc": 0,
        "npre": 0,
        "nh": 4,
        "tok+": list(range(16)),
        "h+": ["01", "02", "03", "04"],
    }
    call = {
        "i": 0,
        "p": None,
        "d": 0,
        "o": "manager",
        "m": "allocate_slots",
        "a": {"request": request, "num_new_tokens": 8, "full_sequence_must_fit": True},
    }
    granted = write(tmp_path / "g.jsonl", header(4), [dict(call, r=[[1, 2]])])
    refused = write(tmp_path / "r.jsonl", header(4), [dict(call, r=None)])
    assert not check_history(read_history(granted)).conforms  # 4 blocks needed, 3 free
    assert check_history(read_history(refused)).conforms


def test_the_pool_layer_checks_evictions(tmp_path: Path) -> None:
    request = {
        "id": "a",
        "n": 4,
        "np": 4,
        "nc": 0,
        "npre": 0,
        "nh": 1,
        "tok+": [1, 2, 3, 4],
        "h+": ["aa"],
    }

    def call(
        i: int, method: str, args: dict[str, Any], result: Any, parent: int | None = None
    ) -> dict[str, Any]:
        return {
            "i": i,
            "p": parent,
            "d": 0 if parent is None else 1,
            "o": "pool",
            "m": method,
            "a": args,
            "r": result,
        }

    calls = [
        call(0, "get_new_blocks", {"num_blocks": 1}, [1]),
        call(1, "evict_cached_block", {"block": 1, "keys": []}, False, parent=0),
        call(
            2,
            "cache_full_blocks",
            {
                "request": request,
                "blocks": [1],
                "num_cached_blocks": 0,
                "num_full_blocks": 1,
                "block_size": 4,
                "group": 0,
            },
            None,
        ),
        call(3, "free_blocks", {"ordered_blocks": [1]}, None),
        call(4, "get_new_blocks", {"num_blocks": 2}, [2, 1]),
        call(5, "evict_cached_block", {"block": 2, "keys": []}, False, parent=4),
        call(6, "evict_cached_block", {"block": 1, "keys": ["aa:0"]}, True, parent=4),
        call(7, "get_cached_block", {"hash": "aa", "groups": [0]}, None),
    ]
    path = write(tmp_path / "p.jsonl", header(3), calls)
    assert check_history(read_history(path), ["pool"]).conforms
    calls[7]["r"] = [1]  # the stale key: the evicted block still found under its hash
    verdict = check_history(read_history(write(path, header(3), calls)), ["pool"])
    assert verdict.divergence is not None and verdict.divergence.what == "cached block lookup"


def test_the_json_report_carries_the_verdict(clean: Path) -> None:
    result = kvpool("history", "check", "--format", "json", str(clean))
    assert result.exit_code == 0
    report = json.loads(result.output)
    assert report["conforms"] is True and report["checked"]["manager"] == 60


def test_a_history_from_an_unknown_vllm_release_is_exit_2(tmp_path: Path) -> None:
    head = header(8)
    head["engine"] = {"name": "vllm", "version": "0.31.0"}
    result = kvpool("history", "check", str(write(tmp_path / "h.jsonl", head, [])))
    assert result.exit_code == 2
    assert "0.31.0 is not a release the checker knows (0.32.0)" in result.output


def test_the_recorder_refuses_a_release_it_does_not_know(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.specs.targets.vllm import recorder

    monkeypatch.setattr(recorder, "installed_release", lambda: "0.33.0")
    with pytest.raises(recorder.RecorderError, match=r"vLLM 0\.33\.0 is not a release"):
        recorder.Recorder().install()
    monkeypatch.setattr(recorder, "installed_release", lambda: None)
    with pytest.raises(recorder.RecorderError, match="not installed"):
        recorder.Recorder().install()


def test_a_recorder_that_recorded_nothing_writes_nothing(tmp_path: Path) -> None:
    from kvpool.specs.targets.vllm.recorder import Recorder, RecorderError

    with pytest.raises(RecorderError, match="no KV cache manager"):
        Recorder().dump(tmp_path / "h.jsonl")
    assert not (tmp_path / "h.jsonl").exists()


def test_a_call_the_recorder_cannot_encode_stops_it_without_a_half_call(tmp_path: Path) -> None:
    from kvpool.specs.targets.vllm.recorder import Recorder, RecorderError

    class Unknown:
        pass

    class Pool:
        def get_num_free_blocks(self) -> int:
            return 3

        def get_new_blocks(self, num_blocks: int) -> list[Any]:
            return [Unknown() for _ in range(num_blocks)]

    recorder = Recorder()
    recorder._types = {k: type(k, (), {}) for k in ("block", "blocks", "request", "output")}
    for name in ("get_num_free_blocks", "get_new_blocks"):
        recorder._patch(Pool, name, recorder._wrap(Pool.__dict__[name], name, "pool"))
    pool = Pool()
    assert pool.get_num_free_blocks() == 3
    served = pool.get_new_blocks(2)  # the engine still gets its answer
    assert len(served) == 2 and all(isinstance(b, Unknown) for b in served)
    assert [c["m"] for c in recorder.calls] == ["get_num_free_blocks"]
    assert recorder.stopped is not None and "get_new_blocks" in recorder.stopped
    assert pool.get_num_free_blocks() == 3
    assert len(recorder.calls) == 1  # nothing recorded after it stopped
    recorder.header["cache"] = {}
    with pytest.raises(RecorderError, match="recording stopped"):
        recorder.dump(tmp_path / "h.jsonl")
    recorder.uninstall()
    assert "get_new_blocks" in Pool.__dict__ and Pool().get_num_free_blocks() == 3
