"""The NamedTuple-era shim (vLLM 0.8.5-0.10.1) and the concatenated keys of 0.12-0.23.

The mapping tests need no vLLM: they give the adapter stand-ins for the era's
hash tuples and pool. The end-to-end test checks a cached NamedTuple-era release
in a child interpreter, as ``kvpool check --target vllm==X`` and the matrix do.
"""

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.model import PoolConfig
from kvpool.specs.pool.check import run_conformance
from kvpool.specs.pool.machine import pool_machine, request_for
from kvpool.specs.targets.impl.pool import ImplTarget
from kvpool.specs.targets.vllm.pool import WORKAROUNDS, VllmApi, VllmTarget
from kvpool.specs.targets.vllm.releases import release_environment
from tests.vllm.helpers import require_cached_release

OLD_RELEASE = "0.9.2"
"""The NamedTuple-era release CI fetches (.ci/run): groups, hashes as an argument."""


class BlockHash(NamedTuple):
    """The shape of ``vllm.v1.core.kv_cache_utils.BlockHash`` in 0.9.1-0.10.1."""

    hash_value: int
    token_ids: tuple[int, ...]
    extra_keys: Any = None


class BlockHashWithGroupId(NamedTuple):
    block_hash: BlockHash
    group_id: int


def _api(**changes: Any) -> VllmApi:
    fields: dict[str, Any] = {
        "version": "test",
        "pool_class": object,
        "kv_cache_utils": None,
        "hash_block_size_arg": False,
        "touch_per_group": True,
        "evict_blocks": False,
        "block_mask": False,
        "cache_partial_block": False,
        "hash_num_tokens": False,
        "events_with_group": False,
        "map_is_object": False,
    }
    fields.update(changes)
    return VllmApi(**fields)


def _target(api: VllmApi, hash_block_size: int = 1, pool: Any = None) -> VllmTarget:
    """The adapter's hash mapping without a vLLM pool behind it."""
    target = VllmTarget.__new__(VllmTarget)
    target.api = api
    target.config = PoolConfig(4, True, hash_block_size)
    target.workarounds = frozenset()
    target._to_model = {}
    target._int_to_model = {}
    target._concatenated = {}
    target._group_block_size = {}
    target._suppressed = set()
    target.pool = pool
    return target


MACHINE_HASHES = st.binary(min_size=1, max_size=8)


@given(first=MACHINE_HASHES, second=MACHINE_HASHES)
def test_namedtuple_hashes_encode_the_machine_hash_injectively(first: bytes, second: bytes) -> None:
    target = _target(_api(hash_tuple=BlockHash, group_tuple=BlockHashWithGroupId))
    encoded = target.vllm_block_hash(first)
    assert isinstance(encoded, BlockHash)
    digest = hashlib.sha256(b"kvpool:" + first).digest()
    assert encoded == BlockHash(int.from_bytes(digest, "big"), (), None)
    assert target.vllm_block_hash(first) == encoded  # the same every time
    assert (target.vllm_block_hash(second) == encoded) == (first == second)
    assert target.model_hash(encoded) == first


def test_namedtuple_keys_read_back_as_hash_and_group() -> None:
    grouped = _target(_api(hash_tuple=BlockHash, group_tuple=BlockHashWithGroupId))
    key = BlockHashWithGroupId(grouped.vllm_block_hash(b"\x01\x02"), 2)
    assert grouped.hash_key(key) == (b"\x01\x02", 2)
    assert grouped.hash_key(None) is None
    # 0.8.x-0.9.0: the key is the hash itself, in the one group there is
    groupless = _target(_api(hash_tuple=BlockHash))
    assert not groupless.api.groups
    assert groupless.hash_key(groupless.vllm_block_hash(b"\x01")) == (b"\x01", 0)


def test_a_hash_vllm_made_itself_is_unknown() -> None:
    """0.8.5-0.10.0 hash the blocks past their hash list themselves (level 2's
    ``too-few-hashes``); such a tuple must never pass for a machine hash."""
    target = _target(_api(hash_tuple=BlockHash, group_tuple=BlockHashWithGroupId))
    known = target.vllm_block_hash(b"\x01")
    with_tokens = known._replace(token_ids=(1,))
    assert target.model_hash(with_tokens).startswith(b"<unknown hash")
    assert target.model_hash(BlockHash(12345, (1,), None)).startswith(b"<unknown hash")
    assert target.model_hash(known._replace(extra_keys=("lora",))).startswith(b"<unknown hash")


def test_what_each_era_leaves_out() -> None:
    assert "groups" in _api(hash_tuple=BlockHash).unsupported_operations()
    grouped = _api(hash_tuple=BlockHash, group_tuple=BlockHashWithGroupId)
    assert "groups" not in grouped.unsupported_operations()
    concatenating = _api(hash_block_size_arg=True, last_hash_names_block=False)
    assert "mixed_block_sizes" in concatenating.unsupported_operations()
    assert "block_size_multiple" not in concatenating.unsupported_operations()
    assert "mixed_block_sizes" not in _api().unsupported_operations()


class _LookupPool:
    """Records get_cached_block calls; answers from a dict of keys to block ids."""

    def __init__(self, entries: dict[tuple[bytes, int], int]) -> None:
        self.entries = entries
        self.calls: list[tuple[bytes, list[int]]] = []

    def get_cached_block(self, key: bytes, group_ids: list[int]) -> list[Any] | None:
        self.calls.append((key, group_ids))
        found = [self.entries.get((key, g)) for g in group_ids]
        if any(b is None for b in found):
            return None
        return [type("Block", (), {"block_id": b})() for b in found]


def test_concatenated_keys_map_back_to_the_last_hash() -> None:
    """0.12-0.23 key a block of k hash blocks by its k hashes concatenated."""
    target = _target(_api(hash_block_size_arg=True, last_hash_names_block=False))
    request = request_for([1, 2, 1, 2, 1], 1)
    target._register_concatenations(request, 2)
    h = request.block_hashes
    first = target.vllm_hash(h[0]) + target.vllm_hash(h[1])
    second = target.vllm_hash(h[2]) + target.vllm_hash(h[3])
    assert target.model_hash(first) == h[1]
    assert target.model_hash(second) == h[3]
    assert target.hash_key(second + (1).to_bytes(4, "big")) == (h[3], 1)
    # the 5th hash block completes no block of 2: nothing registered for it
    assert (h[4], 2) not in target._concatenated
    # a concatenation nobody registered is no machine hash
    assert target.model_hash(second + first).startswith(b"<unknown hash")


def test_a_lookup_across_block_sizes_is_one_call_per_size() -> None:
    request = request_for([1, 2, 1, 2], 1)
    h = request.block_hashes
    pool = _LookupPool({})
    target = _target(_api(hash_block_size_arg=True, last_hash_names_block=False), pool=pool)
    target._register_concatenations(request, 2)
    target._group_block_size.update({0: 2, 1: 1, 2: 2})
    joined = target.vllm_hash(h[0]) + target.vllm_hash(h[1])
    pool.entries = {(joined, 0): 5, (joined, 2): 6, (target.vllm_hash(h[1]), 1): 7}
    assert target.get_cached_block(h[1], [0, 1, 2]) == [5, 7, 6]
    assert pool.calls == [(joined, [0, 2]), (target.vllm_hash(h[1]), [1])]
    # one group missing is a miss, as in one call
    del pool.entries[(joined, 2)]
    assert target.get_cached_block(h[1], [0, 1, 2]) is None
    # a hash no block of the group's size was cached under is a key no block has
    pool.calls.clear()
    assert target.get_cached_block(h[0], [0]) is None
    assert pool.calls[0][0] not in (joined, target.vllm_hash(h[0]))


RECORDED: list[tuple[int, dict[int, set[int]]]] = []
"""Per pool built: its hash block size, and the full-block sizes each group was cached at."""


class _SizeRecorder(ImplTarget):
    """The impl, recording the size of every valid full-block call per group."""

    def __init__(self, config: PoolConfig) -> None:
        super().__init__(config)
        self.hash_block_size = config.hash_block_size
        self.sizes: dict[int, set[int]] = {}
        RECORDED.append((config.hash_block_size, self.sizes))

    def cache_full_blocks(
        self,
        request: Any,
        block_ids: Any,
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Any = None,
    ) -> None:
        if block_size > 0 and block_size % self.hash_block_size == 0:
            self.sizes.setdefault(kv_cache_group_id, set()).add(block_size)
        super().cache_full_blocks(
            request,
            block_ids,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            block_mask,
        )


def test_the_machine_keeps_one_block_size_per_group_and_one_group() -> None:
    machine = pool_machine(ImplTarget, unsupported={"mixed_block_sizes", "groups"})
    assert machine.one_block_size_per_group
    assert not pool_machine(ImplTarget).one_block_size_per_group
    RECORDED.clear()
    for level in (1, 2):
        report = run_conformance(
            _SizeRecorder,
            level=level,
            unsupported={"mixed_block_sizes", "groups"},
            hypothesis_profile="ci",
            max_examples=60,
        )
        assert report.conforms, report.failure
    used = [(hbs, sizes) for hbs, sizes in RECORDED if sizes]
    assert used, "no program cached a full block"
    assert all(set(sizes) == {0} for _, sizes in used)  # group 0 only, never a negative one
    assert all(len(s) == 1 for _, sizes in used for s in sizes.values())
    # and blocks of several hash blocks are still drawn
    assert any(max(s) > hbs for hbs, sizes in used for s in sizes.values())


def test_the_workarounds_are_documented() -> None:
    page = (Path(__file__).parents[2] / "docs" / "vllm-conformance.md").read_text()
    for key in WORKAROUNDS:
        assert f"`{key}`" in page, key


def test_a_missing_cached_release_skips_or_fails_under_ci(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPOOL_CACHE", str(tmp_path))
    monkeypatch.delenv("KVPOOL_REQUIRE_VLLM", raising=False)
    with pytest.raises(pytest.skip.Exception, match="not in the kvpool cache"):
        require_cached_release("0.9.2")
    monkeypatch.setenv("KVPOOL_REQUIRE_VLLM", "1")
    with pytest.raises(pytest.fail.Exception, match=r"KVPOOL_REQUIRE_VLLM=1 but vLLM 0\.9\.2"):
        require_cached_release("0.9.2")
    (tmp_path / "vllm" / "0.9.2").mkdir(parents=True)
    (tmp_path / "vllm" / "0.9.2" / ".kvpool-complete").write_text("0.9.2\n")
    require_cached_release("0.9.2")  # there: neither


OLD_RELEASE_WORKAROUNDS = "usage-counts-null,promotion,null-in-cache,uncached-parent,empty-range"
"""The known bugs of 0.9.2 stepped around (docs/vllm-conformance.md, the matrix)."""


@pytest.mark.usefixtures("require_vllm")
def test_a_namedtuple_era_release_is_checked_end_to_end() -> None:
    require_cached_release(OLD_RELEASE)
    child = Path(__file__).with_name("release_check_child.py")

    def run(workarounds: str) -> tuple[int, dict[str, Any]]:
        done = subprocess.run(
            [sys.executable, str(child), OLD_RELEASE, workarounds],
            env=release_environment(OLD_RELEASE),
            capture_output=True,
            text=True,
            check=False,
            timeout=600,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        assert lines, done.stderr[-2000:]
        return done.returncode, json.loads(lines[-1])

    code, result = run(OLD_RELEASE_WORKAROUNDS)
    assert result["version"] == OLD_RELEASE
    assert result["hash_tuple"] == "BlockHash"
    assert result["groups"] and result["hashes_as_argument"]
    assert "events" in result["unsupported"]
    assert code == 0, result["runs"]
    # Without the workarounds it diverges, first on the null block counted as used.
    code, result = run("")
    assert code == 1
    first = result["runs"]["level 1 caching=True"]["failure"][0]
    assert first.startswith("get_usage()"), first


UNTAGGED_KEYS_RELEASE = "0.24.0"
"""A release before vLLM tagged its extra hash keys (0.31): a LoRA's name and a cache salt
are both a bare string in a block's extra keys (``generate_block_hash_extra_keys`` in
``vllm/v1/core/kv_cache_utils.py``), vllm-project/vllm#44701."""


def _check_request_layer(release: str, hasher: str, *more: str) -> tuple[int, str]:
    from tests.kit.helpers import run_kvpool

    done = run_kvpool(
        *("check", "--layer", "request", "--target", f"vllm=={release}"),
        *("--hypothesis-profile", "ci", *more),
        env={"KVPOOL_VLLM_HASHER": hasher},
        timeout=600,
    )
    return done.returncode, " ".join((done.stdout + done.stderr).split())


@pytest.mark.usefixtures("require_vllm")
def test_an_old_release_s_manager_gets_a_verdict_and_its_key_collision_is_found() -> None:
    """vLLM 0.24 lacks 0.28's and 0.33's calls: the check still runs, and with kvpool's
    hasher conforms (never the exit 2 of an API mismatch); with vLLM's own hasher it finds
    that a LoRA named like another request's cache salt gets the same block hashes."""
    require_cached_release(UNTAGGED_KEYS_RELEASE)
    # With kvpool's hasher the release conforms: its events carry the LoRA of the
    # request the adapter hands it (the adapter once dropped it, a kit bug).
    code, output = _check_request_layer(UNTAGGED_KEYS_RELEASE, "kvpool")
    assert code == 0 and "conforms" in output, output[-3000:]
    # Unshrunk (the flag crosses into the release's child interpreter): found is what matters.
    code, output = _check_request_layer(UNTAGGED_KEYS_RELEASE, "vllm", "--no-shrink")
    assert code == 1, output[-3000:]
    assert "not shrunk" in output
    assert "target_hashes_name_prefixes" in output and "different prefixes hash equal" in output
    assert "lora=" in output and "salt=" in output, output[-3000:]


@pytest.mark.usefixtures("require_vllm")
def test_the_stand_in_request_carries_the_lora_every_era_reads() -> None:
    """With kvpool's hasher the adapter hands vLLM a stand-in request: the pool stamps each
    BlockStored with its ``lora_request``, read as ``adapter_id``/``name`` (0.24) or
    ``lora_int_id``/``lora_name`` (others), so the stand-in must carry the LoRA."""
    from vllm.lora.request import LoRARequest

    from kvpool.model.hashing import LoraAdapter
    from kvpool.model.request import new_request
    from kvpool.specs.targets.vllm.request import VllmRequest

    adapter = LoraAdapter(lora_id=7, name="a", path="/a")
    with_lora = VllmRequest(new_request("r", [1, 2], 1, lora=adapter), None, LoRARequest)
    lora = with_lora.lora_request
    assert lora is not None
    assert (lora.adapter_id, lora.name, lora.lora_int_id, lora.lora_name) == (7, "a", 7, "a")
    plain = VllmRequest(new_request("s", [1, 2], 1), None, LoRARequest)
    assert plain.lora_request is None
