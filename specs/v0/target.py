"""The v0 layer's target protocol: what a v0 allocator must offer to be checked.

Blocks are named by handles, numbered in creation order on both sides (the
model's and the target's). ``snapshot()`` is required: the machine compares
the whole state after every call.
"""

from collections.abc import Callable, Sequence
from typing import Protocol

from kvpool.model.v0 import ContentHash, V0Config, V0State

OPERATIONS = (
    "allocate_mutable_block",
    "allocate_immutable_block",
    "allocate_immutable_blocks",
    "append_token_ids",
    "cow_block_if_not_appendable",
    "clear_copy_on_writes",
    "fork",
    "free",
    "mark_blocks_as_accessed",
    "mark_blocks_as_computed",
    "find_cached_blocks_prefix",
    "get_common_computed_block_ids",
    "get_num_free_blocks",
    "reset_prefix_cache",
    "snapshot",
)
"""The operations of ``V0Target``, named as in ``kvpool.model.v0``."""


class V0Target(Protocol):
    """What a v0 allocator must offer to be checked: the model's operations, in handles."""

    def allocate_mutable_block(self, prev: int | None) -> int: ...

    def allocate_immutable_block(self, prev: int | None, token_ids: Sequence[int]) -> int: ...

    def allocate_immutable_blocks(
        self, prev: int | None, block_token_ids: Sequence[Sequence[int]]
    ) -> Sequence[int]: ...

    def append_token_ids(self, handle: int, token_ids: Sequence[int]) -> int: ...

    def cow_block_if_not_appendable(self, handle: int) -> int: ...

    def clear_copy_on_writes(self) -> Sequence[tuple[int, int]]: ...

    def fork(self, last_block: int) -> Sequence[int]: ...

    def free(self, handle: int) -> None: ...

    def mark_blocks_as_accessed(self, block_ids: Sequence[int], now: float) -> None: ...

    def mark_blocks_as_computed(self, block_ids: Sequence[int]) -> None: ...

    def find_cached_blocks_prefix(
        self, block_hashes: Sequence[ContentHash]
    ) -> Sequence[ContentHash]: ...

    def get_common_computed_block_ids(
        self, seq_block_ids: Sequence[Sequence[int]]
    ) -> Sequence[int]: ...

    def get_num_free_blocks(self) -> int: ...

    def reset_prefix_cache(self) -> bool: ...

    def snapshot(self) -> V0State: ...


V0TargetFactory = Callable[[V0Config], V0Target]
