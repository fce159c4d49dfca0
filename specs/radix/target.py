"""The radix layer's target protocol: what a radix prefix cache must offer to be checked.

Nodes are named by **path**: the tokens from the root to the node's end
(``()`` is the root). A path outlives splits (the lower part of a split
node keeps it), so a path a target returned stays valid until the node is
evicted or the tree reset; the machine locks only the node the call just
before returned, as SGLang's request layer does. Results are the model's
types (``kvpool.model.radix``); ``snapshot()`` (the tree as
``kvpool.model.radix.tree_view`` draws it) is optional but, when present,
compared after every call.
"""

from collections.abc import Callable, Sequence
from typing import Protocol

from kvpool.model.events import KVCacheEvent
from kvpool.model.radix import EvictResult, InsertResult, MatchResult, Path, RadixConfig

TreeView = tuple[tuple[Path, tuple[int, ...]], ...]
"""Every node as (path, slots), sorted by path."""

OPERATIONS = (
    "insert",
    "match_prefix",
    "lock",
    "unlock",
    "evict",
    "reset",
    "take_events",
    "evictable_size",
    "protected_size",
    "snapshot",
)
"""The operations of ``RadixTarget``, named as in ``kvpool.model.radix``."""


class RadixTarget(Protocol):
    """What a radix cache must offer to be checked: the model's operations, in paths."""

    def insert(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        prev_prefix_len: int,
        priority: int,
        inserted_len: int,
    ) -> InsertResult: ...

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult: ...

    def lock(self, path: Path) -> int: ...

    def unlock(self, path: Path) -> None: ...

    def evict(self, num_tokens: int) -> EvictResult: ...

    def reset(self) -> None: ...

    def take_events(self) -> Sequence[KVCacheEvent]: ...

    def evictable_size(self) -> int: ...

    def protected_size(self) -> int: ...


RadixTargetFactory = Callable[[RadixConfig], RadixTarget]
"""Builds a fresh, empty cache for one program (its events already hold the construction's)."""
