"""Planted bugs in subclasses of vLLM's BlockPool, for `kvpool check --target vllm:...`.

Importing this module imports vLLM. Each class changes one behaviour, in code
written here, and keeps vLLM's constructor.
"""

from collections.abc import Iterable
from typing import Any

from vllm.v1.core.block_pool import BlockPool


class HashlessToBackPool(BlockPool):
    """Frees every block to the back of the free queue, hash-less ones too.

    Since 0.24 a hash-less block goes to the front: it can never be a cache
    hit, so it should be reused first. This pool keeps it alive instead and
    evicts cached prefixes earlier than needed.
    """

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        released = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
        self.free_block_queue.append_n(released)


class StaleHashPool(BlockPool):
    """Hands out free blocks without evicting their hashes.

    A reused block keeps its old key in the prefix cache, so a later lookup
    of that prefix returns a block that now holds another request's KV data.
    """

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} free blocks")
        blocks: list[Any] = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            block.ref_cnt += 1
        return blocks


class WrappedPool(BlockPool):
    """Wraps the constructor the usual way (``*args, **kwargs``); behaves like vLLM's pool."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wrapped = True


class LeakyWrappedPool(WrappedPool):
    """A wrapped constructor, and ``free_blocks`` never returns a request's last block.

    The scheduler frees a request's blocks in eviction order, its last block
    first; this pool keeps a reference to that one, so it never becomes free.
    """

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        blocks = list(ordered_blocks)
        real = [b for b in blocks if not b.is_null]
        if real:
            real[0].ref_cnt += 1
        super().free_blocks(blocks)


class SilentWatcherPool(BlockPool):
    """Registers reuse watchers but never calls them (vLLM 0.33's unpin_blocks).

    A reader that unpinned a block keeps reading it after the pool has handed
    it to another request: it reads someone else's KV data.
    """

    def _notify_reuse(self, blocks: Iterable[Any]) -> None:
        for block in blocks:
            self._reuse_watchers.pop(block.block_id, None)


class NoisyMovePool(BlockPool):
    """move_block_hashes that announces the moved keys as newly stored.

    A KV-event consumer then counts each key twice: the router believes the
    engine holds a prefix in two blocks, and keeps believing it after both go.
    """

    def move_block_hashes(self, src_block: Any, dst_block: Any) -> None:
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

        key = src_block.block_hash
        super().move_block_hashes(src_block, dst_block)
        if key is not None and self.enable_kv_cache_events:
            self.kv_event_queue.append(
                BlockStored(
                    block_hashes=[maybe_convert_block_hash(get_block_hash(key))],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=self.hash_block_size,
                    lora_id=None,
                    medium=self.medium,
                    lora_name=None,
                    group_idx=int.from_bytes(bytes(key)[-4:], "big"),
                )
            )


class SourceStillReachablePool(BlockPool):
    """move_block_hashes that keys the copy but leaves the source under the key too.

    A lookup can still return the source, which its owner goes on writing:
    another request reads KV data that is changing under it.
    """

    def move_block_hashes(self, src_block: Any, dst_block: Any) -> None:
        key = src_block.block_hash
        super().move_block_hashes(src_block, dst_block)
        if key is not None:
            self.cached_block_hash_to_block.insert(key, src_block)
