"""Request-layer vectors: the committed corpus is current and valid, replays on every target,
and bad files are refused with exit 2; the hash vectors check a hasher alone."""

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvpool.model.hashing import none_hash
from kvpool.specs.protocol import request_codec as codec
from kvpool.specs.request.target import HYBRID_LAYOUTS, LAYOUTS, ManagerFactory
from kvpool.specs.targets import resolve
from kvpool.specs.vectors import VectorFormatError, bundled_corpus, load
from kvpool.specs.vectors.request_generate import (
    REQUEST_GENERATOR_VERSION,
    export_request_corpus,
    generate_request_corpus,
    manager_vector_from_calls,
    model_block_hashes,
)
from kvpool.specs.vectors.request_replay import (
    ModelHasher,
    layout_of,
    run_request_corpus,
)
from tests.kit.helpers import ROOT, assert_no_traceback, node_manager_target, run_kvpool

CORPUS = ROOT / "specs" / "vectors" / "data" / "request"


@pytest.fixture(scope="module")
def corpus() -> list[Any]:
    return load(CORPUS, layer="request")


def test_the_committed_corpus_is_what_the_model_generates_now(tmp_path: Path) -> None:
    export_request_corpus(tmp_path)
    fresh = sorted(p.name for p in tmp_path.iterdir())
    assert fresh == sorted(p.name for p in CORPUS.iterdir())
    stale = [n for n in fresh if (tmp_path / n).read_bytes() != (CORPUS / n).read_bytes()]
    assert not stale, (
        f"specs/vectors/data/request is stale ({stale}): run `kvpool vectors export --layer "
        "request specs/vectors/data/request` and bump REQUEST_GENERATOR_VERSION in "
        "specs/vectors/request_generate.py"
    )
    manifest = json.loads((CORPUS / "manifest.json").read_text())
    assert manifest["generator_version"] == REQUEST_GENERATOR_VERSION
    shipped = bundled_corpus("request") / "manifest.json"
    assert shipped.read_bytes() == (CORPUS / "manifest.json").read_bytes()


def test_generation_is_deterministic() -> None:
    assert generate_request_corpus() == generate_request_corpus()


def test_the_corpus_covers_every_layout_kind_and_rejection(corpus: list[Any]) -> None:
    managers = [v.data for v in corpus if v.data["kind"] == "manager"]
    layouts = {layout_of(codec.decode_setup(v["setup"])) for v in managers}
    assert set(LAYOUTS) | set(HYBRID_LAYOUTS) <= layouts
    walks = {(v["level"], "random-walk" in v["tags"]) for v in managers}
    assert {(1, True), (2, True)} <= walks
    scenarios = [v for v in managers if "random-walk" not in v["tags"]]
    assert {"full", "sliding_window", "chunked_local", "mamba", "hybrid"} <= {
        t for v in scenarios for t in v["tags"]
    }
    ops = {s["op"] for v in managers for s in v["steps"]}
    assert ops == set(codec.OPERATIONS) - {"snapshot", "block_hashes", "none_hash"}
    errors = {s["expect"].get("error") for v in managers for s in v["steps"]} - {None}
    assert {
        "HashBlockSizeMismatch",
        "NoNewTokens",
        "InvalidTokenCount",
        "InvalidHit",
        "UnknownBlock",
        "CachingDisabled",
        "HitOnRunningRequest",
        "UnknownRequest",
    } <= errors
    assert any("common-scope" in v["tags"] for v in managers)


def test_the_hash_vectors_cover_every_kind_of_extra_key(corpus: list[Any]) -> None:
    hashes = [v.data for v in corpus if v.data["kind"] == "hash"]
    tags = {t for v in hashes for t in v["tags"]}
    assert {"root", "large-ids", "lora", "salt", "mm", "prompt-embeds", "tagging"} <= tags
    by_id = {v["id"]: v["steps"][0]["expect"] for v in hashes}
    assert by_id["hash/lora/name-and-path"] == by_id["hash/lora/other-id"]
    assert by_id["hash/lora/name-and-path"] != by_id["hash/lora/other-path"]
    assert by_id["hash/salt/empty"] == by_id["hash/tokens/hbs-2"]
    tagged = [by_id[f"hash/tagging/{k}"] for k in ("lora-name", "salt", "image")]
    assert len({json.dumps(t) for t in tagged}) == 3
    assert by_id["hash/root/kvpool-none-hash"] == {"ok": none_hash().hex()}
    large = next(v for v in hashes if v["id"] == "hash/tokens/large-ids")
    assert max(large["steps"][0]["args"]["request"]["prompt_token_ids"]) >= 2**31
    assert {"InvalidMultiModalInputs", "InvalidHashBlockSize", "InvalidPromptEmbeds"} == {
        e["error"] for e in by_id.values() if "error" in e
    }


def in_process_factory(target: str) -> ManagerFactory:
    """The registry's factory for a target that runs in this interpreter (never None)."""
    factory = resolve("request", target).factory
    assert factory is not None
    return factory


def test_the_hash_vectors_replay_on_the_models_hasher(corpus: list[Any]) -> None:
    hashes = [v for v in corpus if v.data["kind"] == "hash"]
    result = run_request_corpus(in_process_factory("model"), hashes, hasher=ModelHasher())
    assert result.run == len(hashes) and result.passed == len(hashes), result.mismatches


class SaltlessHasher(ModelHasher):
    """A hasher that leaves the cache salt out."""

    def block_hashes(self, request: Any) -> Any:
        from dataclasses import replace

        return model_block_hashes(replace(request, cache_salt=None))


def test_the_hash_vectors_find_a_hasher_that_drops_the_salt(corpus: list[Any]) -> None:
    hashes = [v for v in corpus if v.data["kind"] == "hash"]
    result = run_request_corpus(in_process_factory("model"), hashes, hasher=SaltlessHasher())
    failed = {m.vector for m in result.mismatches}
    assert {"hash/salt/first-block", "hash/tagging/salt", "hash/all-kinds"} <= failed


@pytest.mark.parametrize("target", ["model", "impl"])
def test_the_manager_vectors_replay_on_the_model_and_the_impl(
    corpus: list[Any], target: str
) -> None:
    descriptor = resolve("request", target)
    assert descriptor.factory is not None  # an in-process target: the registry built it
    result = run_request_corpus(descriptor.factory, corpus)
    managers = sum(1 for v in corpus if v.data["kind"] == "manager")
    assert result.target_error is None
    assert result.run == managers and result.passed == managers, [
        m.describe() for m in result.mismatches
    ]


def test_every_vector_replays_on_the_node_manager_from_the_command_line() -> None:
    result = run_kvpool("vectors", "run", "--layer", "request", "--target", node_manager_target())
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    total = json.loads((CORPUS / "manifest.json").read_text())["count"]
    assert f"{total} passed, 0 failed, 0 skipped" in " ".join(output.split())
    assert_no_traceback(result)


def test_validate_and_export_from_the_command_line(tmp_path: Path) -> None:
    result = run_kvpool("vectors", "validate", "--layer", "request", str(CORPUS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "valid request-layer vectors" in result.stdout
    result = run_kvpool("vectors", "export", "--layer", "request", str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "out" / "hashes.jsonl").read_bytes() == (
        CORPUS / "hashes.jsonl"
    ).read_bytes()


def _copy(tmp_path: Path) -> Path:
    target = tmp_path / "corpus"
    shutil.copytree(CORPUS, target)
    return target


def test_a_file_that_fails_its_checksum_is_refused_with_exit_2(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    hashes = copy / "hashes.jsonl"
    hashes.write_text(hashes.read_text().replace('"salt"', '"sald"', 1))
    for command in (["validate", str(copy)], ["run", str(copy), "--target", "model"]):
        result = run_kvpool("vectors", *command, "--layer", "request")
        assert result.returncode == 2, result.stdout + result.stderr
        assert "does not match the manifest" in " ".join((result.stdout + result.stderr).split())
        assert_no_traceback(result)


def test_a_vector_that_fails_its_schema_is_refused_with_exit_2(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    bad = tmp_path / "bad.jsonl"
    line = (copy / "scenarios.jsonl").read_text().splitlines()[0]
    vector = json.loads(line)
    vector["steps"][0]["op"] = "teleport"
    bad.write_text(json.dumps(vector) + "\n" + "not json\n")
    with pytest.raises(VectorFormatError):
        load(bad, layer="request")
    result = run_kvpool("vectors", "run", str(bad), "--layer", "request", "--target", "model")
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output
    assert "bad.jsonl line 1" in output and "bad.jsonl line 2: not JSON" in output
    assert_no_traceback(result)


def test_pool_vectors_are_not_request_vectors(tmp_path: Path) -> None:
    pool_corpus = ROOT / "specs" / "vectors" / "data"
    result = run_kvpool("vectors", "validate", "--layer", "request", str(pool_corpus))
    assert result.returncode == 2, result.stdout + result.stderr
    assert_no_traceback(result)


def test_unknown_layers_and_targets_exit_2() -> None:
    for args in (
        ["validate", "--layer", "scheduler", str(CORPUS)],
        ["run", "--layer", "request", "--target", "nonsense"],
        ["run", "--layer", "request", "--target", "vllm==0.33.0"],
        ["run", "--layer", "request", "--target", "cmd:/nonexistent/manager"],
    ):
        result = run_kvpool("vectors", *args)
        assert result.returncode == 2, (args, result.stdout + result.stderr)
        assert_no_traceback(result)


def test_a_target_that_claims_nothing_of_the_corpus_runs_nothing_and_exits_2(
    tmp_path: Path,
) -> None:
    only_hashes = tmp_path / "hashes.jsonl"
    shutil.copy(CORPUS / "hashes.jsonl", only_hashes)
    result = run_kvpool(
        "vectors", "run", str(only_hashes), "--layer", "request", "--target", "impl"
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no vector ran" in result.stdout


def test_a_vector_with_033_calls_is_valid_and_replays(tmp_path: Path) -> None:
    """A divergence found on a program with vLLM 0.33's calls is saved as a vector of them;
    the format takes those calls, and a target that has them replays it."""
    from kvpool.model.request import new_request
    from kvpool.model.single_type import full_attention
    from kvpool.specs.request.target import ManagerSetup

    setup = ManagerSetup(8, (full_attention(2), full_attention(2)), 32, 1, fine_grained_hits=True)
    request = new_request("r", [1, 2, 3, 4, 5], 1)
    calls = [
        (op, codec.encode_args(op, *args))
        for op, args in [
            ("get_computed_blocks_with_boundary", (request,)),
            ("allocate_slots", (request, 5)),
            ("take_kv_cache_block_copies", ()),
            ("take_new_block_ids", ()),
            ("new_step_starts", ()),
        ]
    ]
    vector = manager_vector_from_calls(setup, calls, "v033/1", "0.33 calls")
    path = tmp_path / "v033.jsonl"
    path.write_text(json.dumps(vector) + "\n")
    (loaded,) = load(path, layer="request")
    for target in ("model", "impl"):
        factory = resolve("request", target).factory
        assert factory is not None
        result = run_request_corpus(factory, [loaded])
        assert result.passed == 1 and not result.mismatches, (target, result)
        assert result.target_error is None, result.target_error
