"""vLLM's shapes of kvpool's events and hash map, for running kvpool.impl inside vLLM.

kvpool does not import vLLM. A caller that wants vLLM's objects hands vLLM's
classes in:

* ``CallerEvents(BlockStored, BlockRemoved, AllBlocksCleared, external_hash)``
  is a pool's ``event_hook``: every event the pool queues is built as the
  caller's class, with each hash passed through ``external_hash`` (vLLM 0.33
  publishes ``maybe_convert_block_hash(h)``: by default the low 64 bits of
  the hash as an int, ``int64_hash`` here; vllm/v1/core/kv_cache_utils.py and
  vllm/v1/core/block_pool.py in vLLM 0.33.0);
* ``VllmHashMap`` is what ``BlockPool.cached_block_hash_to_block`` returns
  in a pool built with ``strict=False``: the pool's own map under vLLM's
  name and with vLLM's methods, keyed as vLLM keys it (``hash + 4 group-id
  bytes``).

The map here holds a bare block under a key one block has, a
``{block_id: block}`` dict under a key several blocks share, as vLLM's does;
unlike vLLM's, a dict left with one block collapses back to the bare block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

from kvpool.impl.block import KVCacheBlock, vllm_key
from kvpool.model.errors import InvalidArgument
from kvpool.model.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvpool.model.state import HashKey

if TYPE_CHECKING:
    from kvpool.impl.pool import BlockPool

Entry = KVCacheBlock | dict[int, KVCacheBlock]


def int64_hash(block_hash: bytes) -> int:
    """vLLM 0.33's default hash in events: the hash's low 64 bits, big-endian, as an int.

    >>> int64_hash(b"\\x01" * 9) == int.from_bytes(b"\\x01" * 8, "big")
    True
    """
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


class CallerEvents:
    """An ``event_hook`` building the caller's event classes from kvpool's events.

    Each class is called with the keyword arguments of kvpool's event of that
    name (lists where kvpool has tuples; hashes through ``external_hash``).
    A ``BlockStored`` also gets ``session_id`` when the request that caused
    it has one (vLLM 0.33 reports it).

    >>> hook = CallerEvents(dict, dict, dict, external_hash=int64_hash)
    >>> hook(BlockRemoved((b"\\x07",), "GPU", 1), None)
    {'block_hashes': [7], 'medium': 'GPU', 'group_idx': 1}
    """

    __slots__ = ("all_blocks_cleared", "block_removed", "block_stored", "external_hash")

    def __init__(
        self,
        block_stored: Callable[..., object],
        block_removed: Callable[..., object],
        all_blocks_cleared: Callable[[], object],
        external_hash: Callable[[Any], object] | None = None,
    ) -> None:
        for name, value in (
            ("block_stored", block_stored),
            ("block_removed", block_removed),
            ("all_blocks_cleared", all_blocks_cleared),
            ("external_hash", external_hash if external_hash is not None else _same),
        ):
            if not callable(value):
                raise InvalidArgument(f"{name} must be callable")
        self.block_stored = block_stored
        self.block_removed = block_removed
        self.all_blocks_cleared = all_blocks_cleared
        self.external_hash: Callable[[Any], object] = (
            external_hash if external_hash is not None else _same
        )

    def __call__(self, event: KVCacheEvent, request: object) -> object:
        convert = self.external_hash
        if isinstance(event, BlockRemoved):
            return self.block_removed(
                block_hashes=[convert(h) for h in event.block_hashes],
                medium=event.medium,
                group_idx=event.group_idx,
            )
        if isinstance(event, AllBlocksCleared):
            return self.all_blocks_cleared()
        assert isinstance(event, BlockStored)
        extra: dict[str, object] = {}
        session_id = getattr(request, "session_id", None)
        if session_id is not None:
            extra["session_id"] = session_id
        parent = event.parent_block_hash
        lookahead = event.lookahead_token_ids
        return self.block_stored(
            block_hashes=[convert(h) for h in event.block_hashes],
            parent_block_hash=None if parent is None else convert(parent),
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=None if event.extra_keys is None else list(event.extra_keys),
            group_idx=event.group_idx,
            lookahead_token_ids=None if lookahead is None else [list(t) for t in lookahead],
            **extra,
        )


def _same(block_hash: bytes) -> object:
    return block_hash


def pool_key(key: object) -> HashKey:
    """vLLM's key ``hash + 4 group-id bytes`` as kvpool's ``(hash, group id)``."""
    if type(key) is not bytes or len(key) < 4:
        raise InvalidArgument(f"a vLLM hash key is bytes of at least 4, not {key!r}")
    return (key[:-4], int.from_bytes(key[-4:], "big"))


class VllmHashMap:
    """A pool's hash map with vLLM's ``BlockHashToBlockMap`` methods and vLLM's keys.

    Writes go to the pool's map directly (as writes to vLLM's map do): they
    neither record the key on the block nor emit events.
    """

    __slots__ = ("_pool",)

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    @property
    def _cache(self) -> VllmKeyedEntries:
        """The entries by vLLM key, as vLLM's map's ``_cache`` dict (a live view)."""
        return VllmKeyedEntries(self._pool)

    def __len__(self) -> int:
        return self._pool._num_cached()

    def get_one_block(self, key: object) -> KVCacheBlock | None:
        entry = self._pool._lookup(pool_key(key))
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    def contain(self, key: object, block_id: int) -> bool:
        entry = self._pool._lookup(pool_key(key))
        if entry is None:
            return False
        if isinstance(entry, KVCacheBlock):
            return entry.block_id == block_id
        return block_id in entry

    def insert(self, key: object, block: object) -> None:
        own = self._pool._own_block(block)
        self._pool._insert(pool_key(key), own)

    def pop(self, key: object, block_id: int) -> KVCacheBlock | None:
        block_hash, group_id = pool_key(key)
        cached = self._pool._maps.get(group_id)
        entry = None if cached is None else cached.get(block_hash)
        if cached is None or entry is None:
            return None
        if isinstance(entry, KVCacheBlock):
            if entry.block_id != block_id:
                return None
            del cached[block_hash]
            return entry
        block = entry.get(block_id)
        if block is not None:
            del cached[block_hash]
            self._pool._put_back(cached, block_hash, entry, block)
        return block


class VllmKeyedEntries(MutableMapping[bytes, Entry]):
    """The pool's map entries by vLLM key (what vLLM's tests read as ``map._cache``)."""

    __slots__ = ("_pool",)

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def __getitem__(self, key: bytes) -> Entry:
        entry = self._pool._lookup(pool_key(key))
        if entry is None:
            raise KeyError(key)
        return entry

    def __setitem__(self, key: bytes, entry: Entry) -> None:
        block_hash, group_id = pool_key(key)
        if isinstance(entry, dict):
            for block in entry.values():
                self._pool._own_block(block)
            if len(entry) < 2:
                raise InvalidArgument("a shared entry holds at least two blocks")
        else:
            self._pool._own_block(entry)
        self._pool._map(group_id)[block_hash] = entry

    def __delitem__(self, key: bytes) -> None:
        block_hash, group_id = pool_key(key)
        cached = self._pool._maps.get(group_id)
        if cached is None or block_hash not in cached:
            raise KeyError(key)
        del cached[block_hash]

    def __iter__(self) -> Iterator[bytes]:
        return (vllm_key(key) for key, _ in self._pool._cached_items())

    def __len__(self) -> int:
        return self._pool._num_cached()

    def __copy__(self) -> dict[bytes, Entry]:
        """A plain dict of the entries now (``copy.copy`` of vLLM's ``_cache`` is one)."""
        return dict(self.items())

    def __repr__(self) -> str:
        return repr(dict(self.items()))
