"""With events on, a ``cache_full_blocks`` that cannot build its event changes nothing.

The event's fields (the tokens, the LoRA) were read after the blocks were
cached: a request without ``all_token_ids`` left the blocks cached and the
``BlockStored`` event lost. They are now read first.
"""

from types import SimpleNamespace

import pytest

from kvpool.impl import BlockPool
from kvpool.model import BlockStored, CacheRequest


class NoLora:
    """A request whose LoRA cannot be read."""

    block_hashes = (b"a", b"b")
    all_token_ids = (1, 2)

    @property
    def lora_request(self) -> object:
        raise RuntimeError("the LoRA registry is gone")


@pytest.mark.parametrize(
    "request_",
    [SimpleNamespace(block_hashes=(b"a", b"b")), NoLora()],
    ids=["without-token-ids", "lora-unreadable"],
)
@pytest.mark.parametrize("count", [1, 2])
def test_a_request_the_event_cannot_be_built_from_leaves_the_pool_as_it_was(
    request_: object, count: int
) -> None:
    pool = BlockPool(4, True, 1, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(2)
    before = pool.snapshot()
    with pytest.raises((AttributeError, TypeError, RuntimeError)):
        pool.cache_full_blocks(request_, blocks, 2 - count, 2, 1, 0)
    assert pool.snapshot() == before
    pool.check_invariants()
    # The same call with a whole request caches and reports every block.
    pool.cache_full_blocks(CacheRequest((b"a", b"b"), (1, 2)), blocks, 2 - count, 2, 1, 0)
    (stored,) = pool.take_events()
    assert isinstance(stored, BlockStored)
    assert len(stored.block_hashes) == count
