"""Every claim docs/ makes about what vLLM does is run here against the installed vLLM.

Each claim names the page, quotes the sentence (which must still be on the page,
so a reworded claim comes back here) and runs what it says on vLLM's own
``BlockPool``. docs/vllm-conformance.md ("Claims checked against vLLM") lists the
claims with the release they were checked on; a test keeps that table and this
list equal. issue 16 item 5: the docs said a double free re-queues the block,
which no release does.
"""

import hashlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("require_vllm")

DOCS = Path(__file__).resolve().parents[2] / "docs"
CHECKED_ON = "0.33.0"


def h(tag: str) -> bytes:
    return hashlib.sha256(tag.encode()).digest()


def req(hashes: list[bytes], tokens: list[int] | None = None) -> Any:
    tokens = tokens or []
    return SimpleNamespace(
        block_hashes=list(hashes),
        all_token_ids=list(tokens),
        num_tokens=len(tokens),
        lora_request=None,
        mm_features=[],
        cache_salt=None,
        session_id=None,
        prompt_embeds=None,
    )


def vllm_pool(n: int = 6, caching: bool = True, hbs: int = 1, **kwargs: Any) -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.block_pool import BlockPool

    kv_cache_utils.init_none_hash(sha256)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    return BlockPool(n, caching, hbs, **kwargs)


def queue(pool: Any) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def hash_map(pool: Any) -> dict[Any, list[int]]:
    out = {}
    for key, entry in pool.cached_block_hash_to_block._cache.items():
        out[key] = list(entry) if isinstance(entry, dict) else [entry.block_id]
    return out


def key(block_hash: bytes, group: int = 0) -> Any:
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    return make_block_hash_with_group_id(block_hash, group)


# --------------------------------------------------------------------------
# The claims
# --------------------------------------------------------------------------


def double_free_is_not_queued_again() -> None:
    pool = vllm_pool(5)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    free = pool.get_num_free_blocks()
    pool.free_blocks([block])
    assert block.ref_cnt == -1
    assert pool.get_num_free_blocks() == free
    assert queue(pool).count(1) == 1


def over_free_in_one_call_is_queued_once() -> None:
    pool = vllm_pool(4)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block, block])
    assert block.ref_cnt == -1
    assert queue(pool).count(1) == 1


def negative_get_raises_the_free_count() -> None:
    pool = vllm_pool(5)
    assert pool.get_new_blocks(-1) == []
    assert pool.get_num_free_blocks() == 5


def get_beyond_free_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        vllm_pool(3).get_new_blocks(3)


def negative_evict_id_evicts_another_block() -> None:
    pool = vllm_pool(4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req([h("a"), h("b"), h("c")]), blocks, 0, 3, 1, 0)
    pool.evict_blocks({-1})
    assert pool.blocks[3].block_hash is None


def too_few_hashes_caches_the_first_blocks_then_raises() -> None:
    pool = vllm_pool(4)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(IndexError):
        pool.cache_full_blocks(req([h("a")]), blocks, 0, 2, 1, 0)
    assert blocks[0].block_hash is not None


def caching_a_free_block_is_accepted() -> None:
    pool = vllm_pool(4)
    pool.cache_full_blocks(req([h("a")]), [pool.blocks[2]], 0, 1, 1, 0)
    assert pool.blocks[2].block_hash is not None and 2 in queue(pool)


def negative_group_is_an_overflow_error() -> None:
    with pytest.raises(OverflowError):
        vllm_pool(3).get_cached_block(h("a"), [-1])


def unpinned_blocks_join_the_back_hashed_or_not() -> None:
    pool = vllm_pool(6)
    a, b, _ = pool.get_new_blocks(3)
    pool.cache_full_blocks(req([h("x")]), [a], 0, 1, 1, 0)
    pool.unpin_blocks([b, a], lambda block: None)
    assert queue(pool) == [4, 5, 2, 1]


def watcher_fires_on_hand_out_before_eviction_not_on_touch() -> None:
    pool = vllm_pool(3)
    seen: list[tuple[int, int, bool]] = []
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(req([h("x")]), [a], 0, 1, 1, 0)
    pool.unpin_blocks([a], lambda b: seen.append((b.block_id, b.ref_cnt, b.block_hash is not None)))
    pool.touch([a])
    pool.free_blocks([a])
    assert seen == []
    pool.get_new_blocks(2)
    assert seen == [(1, 0, True)]


def reset_fires_watchers_while_blocks_keep_their_keys() -> None:
    pool = vllm_pool(3)
    seen: list[bool] = []
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(req([h("x")]), [a], 0, 1, 1, 0)
    pool.unpin_blocks([a], lambda b: seen.append(b.block_hash is not None))
    assert pool.reset_prefix_cache()
    assert seen == [True] and a.block_hash is None


def move_lists_the_destination_last_without_events() -> None:
    pool = vllm_pool(5, enable_kv_cache_events=True)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks(req([h("k")]), [a], 0, 1, 1, 0)
    pool.cache_full_blocks(req([h("k")]), [b], 0, 1, 1, 0)
    pool.take_events()
    pool.move_block_hashes(a, c)
    assert hash_map(pool) == {key(h("k")): [2, 3]}
    assert pool.take_events() == [] and a.block_hash is None


def replacing_the_same_key_removes_and_stores_it() -> None:
    pool = vllm_pool(3, hbs=2, enable_kv_cache_events=True)
    (a,) = pool.get_new_blocks(1)
    request = req([h("p2"), h("p4")], [1, 2, 3, 4])
    pool.cache_partial_block(request, a, 2, 0, 4)
    pool.take_events()
    pool.cache_partial_block(request, a, 2, 0, 4, replace_existing_hashes=True)
    assert [type(e).__name__ for e in pool.take_events()] == ["BlockRemoved", "BlockStored"]


def free_routes_another_pools_blocks_to_it() -> None:
    gpu, host = vllm_pool(5), vllm_pool(4, medium="CPU")
    (g,) = gpu.get_new_blocks(1)
    (c,) = host.get_new_blocks(1)
    gpu.free_blocks([g, c])
    assert g.ref_cnt == 0 and c.ref_cnt == 0
    assert 1 in queue(host) and queue(gpu).count(1) == 1


def medium_and_lookahead_reach_the_events() -> None:
    pool = vllm_pool(4, medium="CPU", num_hash_lookahead_tokens=2, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req([h("a"), h("b")], [10, 11, 12, 13]), blocks, 0, 2, 1, 0)
    (event,) = pool.take_events()
    assert event.medium == "CPU" and event.lookahead_token_ids == [[11, 12], [12, 13]]


def emit_checks_nothing_is_cached() -> None:
    pool = vllm_pool(3, enable_kv_cache_events=True)
    pool.emit_cached_block_events(req([h("a")], [7]), 1, 1, 0)
    assert len(pool.take_events()) == 1 and hash_map(pool) == {}


def usage_excludes_the_null_block() -> None:
    pool = vllm_pool(5)
    pool.get_new_blocks(2)
    assert pool.get_usage() == pytest.approx(0.5)


@dataclass(frozen=True)
class Claim:
    key: str
    page: str
    quote: str
    """Words of the page that make the claim (whitespace-insensitive)."""
    check: Callable[[], None]


CLAIMS = (
    Claim(
        "double-free",
        "semantics.md",
        "the block is **not** queued a second time and the free count does not change",
        double_free_is_not_queued_again,
    ),
    Claim(
        "over-free-one-call",
        "semantics.md",
        "`ref_cnt` -1, queued once",
        over_free_in_one_call_is_queued_once,
    ),
    Claim(
        "negative-get",
        "semantics.md",
        "returns `[]` but *raises* the free count by 1",
        negative_get_raises_the_free_count,
    ),
    Claim(
        "get-beyond-free",
        "semantics.md",
        "`NotEnoughFreeBlocks` (a `ValueError`) | `ValueError`",
        get_beyond_free_is_a_value_error,
    ),
    Claim(
        "negative-evict-id",
        "semantics.md",
        "**Python negative indexing** for `-N..-1` (evicts the wrong block)",
        negative_evict_id_evicts_another_block,
    ),
    Claim(
        "too-few-hashes",
        "semantics.md",
        "`IndexError` *after* caching the first blocks",
        too_few_hashes_caches_the_first_blocks_then_raises,
    ),
    Claim(
        "cache-free-block",
        "semantics.md",
        "accepted: a hashed block sits in the free queue at a hash-less position",
        caching_a_free_block_is_accepted,
    ),
    Claim(
        "negative-group",
        "semantics.md",
        "`OverflowError` when packing the group id",
        negative_group_is_an_overflow_error,
    ),
    Claim(
        "unpin-to-back",
        "semantics.md",
        "The blocks that reach 0 join the **back** of the free queue in listed order",
        unpinned_blocks_join_the_back_hashed_or_not,
    ),
    Claim(
        "watcher-on-hand-out",
        "semantics.md",
        "before dropping their keys: the callback sees count 0 and the old key",
        watcher_fires_on_hand_out_before_eviction_not_on_touch,
    ),
    Claim(
        "watcher-on-reset",
        "semantics.md",
        "in registration order, while the blocks still carry their keys",
        reset_fires_watchers_while_blocks_keep_their_keys,
    ),
    Claim(
        "move-destination-last",
        "semantics.md",
        "Under each key `dst` is listed **last**",
        move_lists_the_destination_last_without_events,
    ),
    Claim(
        "replace-same-key",
        "semantics.md",
        "`BlockRemoved(K)`, `BlockStored(K)`",
        replacing_the_same_key_removes_and_stores_it,
    ),
    Claim(
        "free-routing",
        "semantics.md",
        "are handed to their own pool (`block.pool`), after this pool's own blocks",
        free_routes_another_pools_blocks_to_it,
    ),
    Claim(
        "medium-and-lookahead",
        "semantics.md",
        "each stored block's entry of `lookahead_token_ids` is the (up to) L tokens after it",
        medium_and_lookahead_reach_the_events,
    ),
    Claim(
        "emit-unchecked",
        "semantics.md",
        "**no check that the blocks are cached**",
        emit_checks_nothing_is_cached,
    ),
    Claim(
        "usage-without-null",
        "semantics.md",
        "`get_usage` excludes the null block",
        usage_excludes_the_null_block,
    ),
)


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("claim", CLAIMS, ids=[c.key for c in CLAIMS])
def test_the_claim_holds_on_the_installed_vllm(claim: Claim) -> None:
    claim.check()


@pytest.mark.parametrize("claim", CLAIMS, ids=[c.key for c in CLAIMS])
def test_the_claim_is_still_on_its_page(claim: Claim) -> None:
    assert _flat(claim.quote) in _flat((DOCS / claim.page).read_text()), claim.key


def test_the_claims_table_lists_every_claim_with_its_release() -> None:
    page = (DOCS / "vllm-conformance.md").read_text()
    section = page.split("## Claims checked against vLLM", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w-]+)` \| (\S+) \| (\S+) \|", section, re.MULTILINE)
    assert [r[0] for r in rows] == [c.key for c in CLAIMS]
    assert all(
        page_ == c.page and release == CHECKED_ON
        for (_, page_, release), c in zip(rows, CLAIMS, strict=True)
    )
