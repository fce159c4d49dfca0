"""vLLM subclasses and forks as targets: the pool and the request layer, every constructor shape.

The acceptance of issue #15: a user's ``KVCacheManager`` subclass that leaks
is found from the command line with a short program while unmodified vLLM
conforms; the same for a ``BlockPool`` subclass whose ``__init__`` takes
``*args, **kwargs``; a subclass whose request block hasher drops the cache
salt, or leaves the LoRA key untagged, is found through vLLM's own hasher.
"""

import os
from typing import Any

import pytest
from typer.testing import CliRunner

from kvpool.model.hashing import LoraAdapter, MultiModalInput
from kvpool.model.request import append_tokens, new_request
from kvpool.model.single_type import full_attention
from kvpool.specs.request.check import run_request_conformance
from kvpool.specs.request.invariants import KVTruth, target_hashes_name_prefixes
from kvpool.specs.request.target import ManagerSetup
from kvpool.specs.targets.vllm import eras
from kvpool.specs.targets.vllm.releases import release_dir

pytestmark = pytest.mark.usefixtures("require_vllm")


def check(*args: str, regression_dir: str = "/nonexistent") -> tuple[int, str]:
    result = CliRunner().invoke(
        app(), ["check", *args, "--hypothesis-profile", "ci", "--regression-dir", regression_dir]
    )
    return result.exit_code, result.output


def app() -> Any:
    from kvpool.specs.cli import app

    return app


def program_of(output: str) -> list[str]:
    """The calls of the minimal failing program the report prints."""
    program = output.split("Minimal failing program")[1].split("Where they part")[0]
    return [line for line in program.splitlines() if line.startswith("step ")]


# --------------------------------------------------------------------------
# The request layer: vllm:module:Class
# --------------------------------------------------------------------------


def test_unmodified_vllm_manager_conforms_from_the_command_line() -> None:
    """In every part (the scopes of each part are drawn densely by their own tests)."""
    from kvpool.specs.request.target import PARTS_033_HISPARSE

    code, output = check("--layer", "request", "--target", "vllm", "--examples", "40")
    assert code == 0, output
    for name in ["main", *(name for name, _ in PARTS_033_HISPARSE)]:
        assert f"part: {name}" in output and "not run" not in output, output


def test_a_leaky_manager_subclass_exits_1_with_a_short_program(tmp_path: Any) -> None:
    code, output = check(
        "--layer",
        "request",
        "--target",
        "vllm:tests.vllm.user_managers:LeakyManager",
        regression_dir=str(tmp_path),
    )
    assert code == 1, output
    # The leak shows as a free count one short (``num_free_blocks`` or a
    # refused allocation, whichever the shrunk program ends on).
    assert "num_free_blocks" in output or "allocate_slots" in output, output
    program = program_of(output)
    assert 0 < len(program) <= 12, output
    assert "Traceback" not in output


def test_a_subclass_wrapping_the_constructor_conforms() -> None:
    code, output = check(
        "--layer",
        "request",
        "--target",
        "vllm:tests.vllm.user_managers:WrappedManager",
        "--examples",
        "30",
    )
    assert code == 0, output


@pytest.mark.parametrize(
    ("manager", "left_out"),
    [("SaltlessHasherManager", "salt='a'"), ("UntaggedLoraHasherManager", "lora=('a', '/a')")],
)
def test_a_hasher_that_drops_a_key_is_found_through_vllms_hasher(
    manager: str, left_out: str
) -> None:
    code, output = check(
        "--layer", "request", "--target", f"vllm:tests.vllm.user_managers:{manager}", "--no-shrink"
    )
    assert code == 1, output
    assert "target_hashes_name_prefixes" in output
    assert "different prefixes hash equal" in output
    assert left_out in " ".join(output.split())


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("vllm:tests.vllm.user_managers:NotAManager", "is not a KVCacheManager"),
        ("vllm:tests.vllm.user_managers:BrokenConstructorManager", "needs a GPU"),
        ("vllm:tests.vllm.user_managers:NoSuchClass", "has no class"),
        ("vllm:tests.vllm.no_such_module:Class", "cannot import"),
        ("vllm:tests.vllm.user_managers", "not a vLLM target string"),
        ("vllm:tests.vllm.user_managers:", "not a vLLM target string"),
    ],
)
def test_a_manager_that_cannot_be_checked_exits_2_naming_why(target: str, says: str) -> None:
    code, output = check("--layer", "request", "--target", target, "--examples", "5")
    assert code == 2, output
    assert says in " ".join(output.split())
    assert "Traceback" not in output


def test_kvpools_own_hashes_remain_an_option() -> None:
    from kvpool.specs.targets.vllm.request import VllmManagerFactory, scope

    factory = VllmManagerFactory(hasher="kvpool")
    target = factory(ManagerSetup(4, (full_attention(1),), 16, 1))
    assert not hasattr(target, "block_hashes")
    report = run_request_conformance(scope(factory), max_examples=40)
    assert report.conforms, report.failure


def test_vllms_hasher_names_prefixes_with_every_kind_of_extra_key() -> None:
    """vLLM 0.33's hasher keys LoRA, images, the salt and prompt embeddings like the model."""
    from kvpool.specs.targets.vllm.request import VllmManagerFactory

    target = VllmManagerFactory(hasher="vllm")(ManagerSetup(8, (full_attention(2),), 16, 2))
    truth = KVTruth()
    stem = [1, 2, 300, 4, 5, 6]
    requests = [
        new_request("plain", stem, 2),
        new_request("again", stem, 2),
        new_request("lora", stem, 2, lora=LoraAdapter(1, "a", "/a")),
        new_request("lora-path", stem, 2, lora=LoraAdapter(1, "a", "/b")),
        new_request("salt", stem, 2, cache_salt="a"),
        new_request("image", stem, 2, mm_inputs=[MultiModalInput("x", 1, 2)]),
        new_request("image-later", stem, 2, mm_inputs=[MultiModalInput("x", 2, 2)]),
        new_request("embeds", stem, 2, prompt_embeds=[b"e"] * 6),
        new_request("embeds-2", stem, 2, prompt_embeds=[b"e"] * 5 + [b"f"]),
    ]
    requests.append(append_tokens(requests[0], [7, 8]))
    for request in requests:
        hashes = target.block_hashes(request)
        assert target_hashes_name_prefixes(truth, request, hashes) is None, request.request_id
    assert len(truth.target_oracle) == len(truth.target_hash_of) > len(requests)


# --------------------------------------------------------------------------
# The pool layer: a BlockPool subclass whose __init__ takes *args, **kwargs
# --------------------------------------------------------------------------


def test_a_leaky_pool_with_a_wrapped_constructor_exits_1(tmp_path: Any) -> None:
    code, output = check(
        "--target", "vllm:tests.vllm.buggy_pools:LeakyWrappedPool", regression_dir=str(tmp_path)
    )
    assert code == 1, output
    assert "Where they part" in output
    assert 0 < len(program_of(output)) < 12, output


def test_a_pool_with_a_wrapped_constructor_conforms() -> None:
    code, output = check("--target", "vllm:tests.vllm.buggy_pools:WrappedPool", "--examples", "80")
    assert code == 0, output


# --------------------------------------------------------------------------
# API eras from the class hierarchy, for each constructor shape
# --------------------------------------------------------------------------


class Explicit:
    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int) -> None:
        pass


class OldEra:
    def __init__(self, num_gpu_blocks: int, enable_caching: bool) -> None:
        pass


class ArgsKwargs(Explicit):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)


class KwargsOnly(Explicit):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)


class NamedThenRest(Explicit):
    def __init__(self, num_gpu_blocks: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(num_gpu_blocks, *args, **kwargs)


class WrapsOldEra(OldEra):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)


class TwiceWrapped(ArgsKwargs):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)


class InheritsInit(Explicit):
    pass


class ForkWithoutBase:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (Explicit, True),
        (OldEra, False),
        (ArgsKwargs, True),
        (KwargsOnly, True),
        (NamedThenRest, True),
        (WrapsOldEra, False),
        (TwiceWrapped, True),
        (InheritsInit, True),
    ],
)
def test_the_era_is_read_from_the_class_hierarchy(cls: type, expected: bool) -> None:
    assert eras.takes(cls, "__init__", "hash_block_size", base=OldEra) is expected


def test_a_fork_that_decides_nothing_is_read_like_the_installed_release() -> None:
    assert eras.decides(ForkWithoutBase, "__init__", "hash_block_size") is None
    assert eras.takes(ForkWithoutBase, "__init__", "hash_block_size", base=Explicit)
    assert not eras.takes(ForkWithoutBase, "__init__", "hash_block_size", base=OldEra)


@pytest.mark.parametrize(
    "pool", ["WrappedPool", "LeakyWrappedPool", "HashlessToBackPool", "StaleHashPool"]
)
def test_the_pool_adapter_reads_vllm_033s_era_through_any_wrapper(pool: str) -> None:
    from kvpool.specs.targets.vllm.pool import VllmTargetFactory, load_vllm

    api = load_vllm(VllmTargetFactory(f"tests.vllm.buggy_pools:{pool}").pool_class())
    assert api.hash_block_size_arg and api.block_mask and api.cache_partial_block


@pytest.mark.parametrize("manager", ["WrappedManager", "LeakyManager", "SaltlessHasherManager"])
def test_the_manager_adapter_reads_vllm_033s_era_through_any_wrapper(manager: str) -> None:
    from kvpool.specs.targets.vllm.request import VllmManagerFactory, load_manager_api

    cls = VllmManagerFactory(f"tests.vllm.user_managers:{manager}").manager_class()
    api = load_manager_api(cls)
    assert api.hash_block_size_arg and api.scheduler_block_size_arg


def test_a_cached_release_is_checked_at_the_request_layer_in_a_child(tmp_path: Any) -> None:
    import json

    if not (release_dir("0.33.0") / ".kvpool-complete").is_file():
        reason = "vLLM 0.33.0 is not in the kvpool cache (ci/fetch_vllm_releases.py 0.33.0)"
        if os.environ.get("KVPOOL_REQUIRE_VLLM") == "1":
            pytest.fail(f"KVPOOL_REQUIRE_VLLM=1 but {reason}", pytrace=False)
        pytest.skip(reason)

    report = tmp_path / "report.json"
    code, output = check(
        "--layer",
        "request",
        "--target",
        "vllm==0.33.0",
        "--examples",
        "30",
        "--format",
        "json",
        "--output",
        str(report),
    )
    assert code == 0, output
    data = json.loads(report.read_text())
    assert data["conforms"] and data["target"] == "vllm==0.33.0"
    assert data["profiles"] == ["hashless-first"]


def test_the_request_layer_vectors_replay_on_vllm_in_its_scope() -> None:
    result = CliRunner().invoke(app(), ["vectors", "run", "--layer", "request", "--target", "vllm"])
    output = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    passed = int(output.split(" passed,")[0].rsplit(" ", 1)[-1])
    assert passed >= 15 and " 0 failed" in output
    assert "hash vectors: the target does not hash with kvpool's function" in output
