"""The v0 model itself as a v0 target: it conforms by construction (a smoke test of the machine)."""

from collections.abc import Sequence
from typing import TypeVar

from kvpool.model import v0 as model
from kvpool.model.v0 import ContentHash, V0Config, V0State

T = TypeVar("T")


class ModelV0Target:
    """The model itself as a target: conforms by construction; a smoke test of the machine."""

    def __init__(self, config: V0Config) -> None:
        self.state = model.new_allocator(config.num_blocks, config.block_size)

    def snapshot(self) -> V0State:
        return self.state

    def _do(self, result: tuple[V0State, T]) -> T:
        self.state, value = result
        return value

    def allocate_mutable_block(self, prev: int | None) -> int:
        return self._do(model.allocate_mutable_block(self.state, prev))

    def allocate_immutable_block(self, prev: int | None, token_ids: Sequence[int]) -> int:
        return self._do(model.allocate_immutable_block(self.state, prev, token_ids))

    def allocate_immutable_blocks(
        self, prev: int | None, block_token_ids: Sequence[Sequence[int]]
    ) -> Sequence[int]:
        return self._do(model.allocate_immutable_blocks(self.state, prev, block_token_ids))

    def append_token_ids(self, handle: int, token_ids: Sequence[int]) -> int:
        return self._do(model.append_token_ids(self.state, handle, token_ids))

    def cow_block_if_not_appendable(self, handle: int) -> int:
        return self._do(model.cow_block_if_not_appendable(self.state, handle))

    def clear_copy_on_writes(self) -> Sequence[tuple[int, int]]:
        return self._do(model.clear_copy_on_writes(self.state))

    def fork(self, last_block: int) -> Sequence[int]:
        return self._do(model.fork(self.state, last_block))

    def free(self, handle: int) -> None:
        self._do(model.free(self.state, handle))

    def mark_blocks_as_accessed(self, block_ids: Sequence[int], now: float) -> None:
        self._do(model.mark_blocks_as_accessed(self.state, block_ids, now))

    def mark_blocks_as_computed(self, block_ids: Sequence[int]) -> None:
        self._do(model.mark_blocks_as_computed(self.state, block_ids))

    def find_cached_blocks_prefix(
        self, block_hashes: Sequence[ContentHash]
    ) -> Sequence[ContentHash]:
        return model.find_cached_blocks_prefix(self.state, block_hashes)

    def get_common_computed_block_ids(
        self, seq_block_ids: Sequence[Sequence[int]]
    ) -> Sequence[int]:
        return model.get_common_computed_block_ids(seq_block_ids)

    def get_num_free_blocks(self) -> int:
        return model.get_num_free_blocks(self.state)

    def reset_prefix_cache(self) -> bool:
        return self._do(model.reset_prefix_cache(self.state))
