"""vLLM 0.10.2's v0 allocator with one bug planted each, built from vLLM's own classes.

Each factory subclasses or reconfigures vLLM's code at one point and changes
one decision; nothing of vLLM is copied.
"""

import heapq
from typing import Any

from kvpool.model.v0 import V0Config
from kvpool.specs.targets.vllm.v0 import VllmV0Target, load_v0


def deduplication_bug(config: V0Config) -> VllmV0Target:
    """A full block whose content is cached is registered as a second copy instead of moved."""
    base = load_v0().allocator_class

    class NoDeduplication(base):  # type: ignore[misc,valid-type]
        def promote_to_immutable_block(self, block: Any) -> int:
            self._cached_blocks.pop(block.content_hash, None)
            return int(super().promote_to_immutable_block(block))

    return VllmV0Target(config, allocator_class=NoDeduplication)


def tie_break_bug(config: V0Config) -> VllmV0Target:
    """The evictor breaks ties in last access by the *fewest* hashed tokens."""
    lru = load_v0().evictor_module.LRUEvictor

    class FewestTokensFirst(lru):  # type: ignore[misc,valid-type]
        def add(
            self, block_id: int, content_hash: int, num_hashed_tokens: int, last: float
        ) -> None:
            super().add(block_id, content_hash, num_hashed_tokens, last)
            entries = [(t, abs(n), b, h) for t, n, b, h in self.__dict__["priority_queue"]]
            heapq.heapify(entries)
            self.__dict__["priority_queue"] = entries

    def use_buggy_evictor(allocator: Any) -> None:
        allocator.evictor = FewestTokensFirst()

    return VllmV0Target(config, customize=use_buggy_evictor)
