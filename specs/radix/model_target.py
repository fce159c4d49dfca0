"""The radix model itself as a radix target: it conforms by construction (a smoke test)."""

from collections.abc import Sequence
from typing import TypeVar

from kvpool.model import radix as model
from kvpool.model.events import KVCacheEvent
from kvpool.model.radix import (
    EvictResult,
    InsertResult,
    MatchResult,
    Path,
    RadixConfig,
    RadixState,
)
from kvpool.specs.radix.target import TreeView

T = TypeVar("T")


class ModelRadixTarget:
    """The model itself as a target: conforms by construction; a smoke test of the machine."""

    def __init__(self, config: RadixConfig) -> None:
        self.state = model.new_radix_cache(
            config.page_size, config.policy, config.enable_events, config.slru_protected_threshold
        )

    def _do(self, result: tuple[RadixState, T]) -> T:
        self.state, value = result
        return value

    def insert(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        prev_prefix_len: int,
        priority: int,
        inserted_len: int,
    ) -> InsertResult:
        return self._do(
            model.insert(
                self.state,
                tokens,
                slots,
                prev_prefix_len=prev_prefix_len,
                priority=priority,
                inserted_len=inserted_len,
            )
        )

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        return self._do(model.match_prefix(self.state, tokens))

    def lock(self, path: Path) -> int:
        return self._do(model.lock(self.state, path))

    def unlock(self, path: Path) -> None:
        self._do(model.unlock(self.state, path))

    def evict(self, num_tokens: int) -> EvictResult:
        return self._do(model.evict(self.state, num_tokens))

    def reset(self) -> None:
        self._do(model.reset(self.state))

    def take_events(self) -> Sequence[KVCacheEvent]:
        return self._do(model.take_events(self.state))

    def evictable_size(self) -> int:
        return model.evictable_size(self.state)

    def protected_size(self) -> int:
        return model.protected_size(self.state)

    def snapshot(self) -> TreeView:
        return model.tree_view(self.state)
