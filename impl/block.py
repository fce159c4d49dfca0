"""The physical block record the fast pool hands out.

A ``KVCacheBlock`` is mutable metadata for one block of KV cache memory. The
pool owns every instance; callers hold references and pass them back. The
two link fields make the block a node of the pool's intrusive free list, so
moving a block in or out of that list never allocates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.model.state import HashKey

if TYPE_CHECKING:
    from kvpool.impl.pool import BlockPool


class KVCacheBlock:
    """Metadata of one KV cache block: id, reference count, hashes and free-list links.

    >>> b = KVCacheBlock(3)
    >>> b.block_id, b.ref_cnt, b.block_hash, b.is_null
    (3, 0, None, False)
    """

    # Hot fields first, so the ones a queue operation touches share a cache line.
    __slots__ = (  # noqa: RUF023
        "ref_cnt",
        "next_free_block",
        "prev_free_block",
        "pool",
        "_hash",
        "_group",
        "block_id",
        "is_null",
        "_block_hash_num_tokens",
        "_extra_keys",
        "_mark",
    )

    block_id: int
    ref_cnt: int
    _hash: bytes | None
    """The hash of the primary key ``(_hash, _group)``; None when the block is not cached."""
    _group: int
    """The KV cache group of the primary key (0 when there is none). Kept apart from the
    hash so that caching a block builds no key tuple (docs/performance.md)."""
    _block_hash_num_tokens: int
    """How many tokens the primary key covers; 0 when there is none (a key covers at least
    one). A plain int, so that the compiled build stores it without boxing it."""
    _extra_keys: list[HashKey] | None
    """Further keys pointing at this block (partial entries), oldest first; None when none."""
    _mark: int
    """Scratch stamp the pool uses to spot a block listed twice in one call; not state."""
    prev_free_block: KVCacheBlock | None
    next_free_block: KVCacheBlock | None
    is_null: bool
    pool: BlockPool | None
    """The pool that owns this block (None for a free-standing block or a sentinel)."""

    def __init__(
        self,
        block_id: int,
        ref_cnt: int = 0,
        is_null: bool = False,
        *,
        pool: BlockPool | None = None,
    ) -> None:
        self.block_id = block_id
        self.pool = pool
        self.ref_cnt = ref_cnt
        self._hash = None
        self._group = 0
        self._block_hash_num_tokens = 0
        self._extra_keys = None
        self._mark = 0
        self.prev_free_block = None
        self.next_free_block = None
        self.is_null = is_null

    @property
    def block_hash(self) -> HashKey | bytes | None:
        """The primary hash key ``(hash, group id)``, or None if the block is not cached.

        In a pool built with ``strict=False`` (vLLM's semantics), vLLM's shape
        of the same key: ``hash + group id`` as 4 big-endian bytes.
        """
        key = self._primary_key()
        pool = self.pool
        if key is None or pool is None or pool.strict:
            return key
        return vllm_key(key)

    def _primary_key(self) -> HashKey | None:
        """The primary key ``(hash, group id)``, or None."""
        block_hash = self._hash
        return None if block_hash is None else (block_hash, self._group)

    @property
    def block_hash_num_tokens(self) -> int | None:
        """How many prefix tokens the primary key covers, or None if there is none."""
        num_tokens = self._block_hash_num_tokens
        return None if num_tokens == 0 else num_tokens

    def reset_hash(self) -> None:
        """Forget every key this block records (the pool's map is not touched).

        >>> b = KVCacheBlock(1)
        >>> b.reset_hash(); b.block_hash is None
        True
        """
        self._hash = None
        self._group = 0
        self._block_hash_num_tokens = 0
        self._extra_keys = None

    def __repr__(self) -> str:
        prev_id = None if self.prev_free_block is None else self.prev_free_block.block_id
        next_id = None if self.next_free_block is None else self.next_free_block.block_id
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={self._primary_key()!r}, "
            f"block_hash_num_tokens={self._block_hash_num_tokens}, "
            f"extra_keys={self._extra_keys!r}, "
            f"prev_free_block={prev_id}, next_free_block={next_id}"
            f"{', is_null=True' if self.is_null else ''})"
        )


def vllm_key(key: HashKey) -> bytes:
    """The key ``(hash, group id)`` in vLLM's shape: the hash, then the group id in 4 big-endian
    bytes (``make_block_hash_with_group_id`` in vllm/v1/core/kv_cache_utils.py, vLLM 0.33.0).

    >>> vllm_key((b"h", 2))
    b'h\\x00\\x00\\x00\\x02'
    """
    return key[0] + key[1].to_bytes(4, "big")
