"""KV cache events: what a pool tells the outside world about its hash map.

A KV-aware router rebuilds which hashes each engine holds from this stream
alone, so the stream must describe every insertion into and removal from the
hash map. The field names are vLLM's; the hash values are the pool's own
opaque ``bytes`` (vLLM converts them to ints on the wire, which is a matter of
the adapter, not of the semantics).
"""

from dataclasses import dataclass

MEDIUM_GPU = "GPU"


@dataclass(frozen=True)
class BlockStored:
    """Hashes were inserted into the map, one per stored block, in block order."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: tuple[object, ...] | None
    group_idx: int


@dataclass(frozen=True)
class BlockRemoved:
    """One hash key stopped pointing at one block."""

    block_hashes: tuple[bytes, ...]
    medium: str | None
    group_idx: int


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole map was emptied by reset_prefix_cache."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
