"""The pool layer's target protocol: what a block pool must offer to be checked.

Targets speak block *ids*, not objects, so any implementation fits behind a
thin adapter: a Python class, vLLM's own pool, or a program in another
language. Rejections are reported by raising the model's exception classes
(``kvpool.model.errors``); conformance compares their types only.

``snapshot()`` is optional. Without it the kit checks what callers can
observe (block ids handed out, cache hits, counts, usage, events); with it,
the whole state is compared with the model after every operation.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

from kvpool.model import CacheRequest, HashKey, KVCacheEvent, PoolConfig, PoolState, Reuse
from kvpool.specs.errors import TargetError

__all__ = [
    "EXTENSIONS",
    "FEATURES",
    "OPERATIONS",
    "OPT_IN_FEATURES",
    "PROTOCOL_OPERATIONS",
    "Normalizing",
    "PoolTarget",
    "PoolTargetExtensions",
    "Snapshottable",
    "TargetError",
    "TargetFactory",
]

PROTOCOL_OPERATIONS = (
    "get_new_blocks",
    "touch",
    "free_blocks",
    "cache_full_blocks",
    "cache_partial_block",
    "get_cached_block",
    "evict_blocks",
    "reset_prefix_cache",
    "get_num_free_blocks",
    "get_usage",
    "take_events",
    "snapshot",
)
"""The operations the JSON-lines protocol and the committed vectors carry (and the
optional ``snapshot``), named as in ``kvpool.model``."""

EXTENSIONS = (
    "unpin_blocks",
    "take_reuses",
    "move_block_hashes",
    "is_block_writable",
    "emit_cached_block_events",
)
"""vLLM 0.33's additions (``PoolTargetExtensions``). Optional: a target without the
method is checked without it, and so is one whose factory declares it unsupported."""

OPERATIONS = (*PROTOCOL_OPERATIONS[:-1], *EXTENSIONS, "snapshot")
"""Every operation the machine may call: the one list machine, registry and adapters share."""

FEATURES = (
    "block_mask",
    "block_size_multiple",
    "mixed_block_sizes",
    "groups",
    "events",
    "replace_existing_hashes",
    "medium",
    "lookahead",
)
"""What a pool may lack beside whole operations: ``cache_full_blocks``'s
``block_mask`` argument, blocks several hash blocks long, full blocks of
different sizes in one KV cache group (vLLM 0.12-0.23 key a block by its hash
blocks' concatenation, so only one size per group is consistent), several KV
cache groups (vLLM before 0.9.1), KV events,
``cache_partial_block``'s ``replace_existing_hashes``, a ``medium`` and
``num_hash_lookahead_tokens`` at construction (vLLM 0.33). A target that lacks one
(an old vLLM release) is checked on programs that never use it."""

OPT_IN_FEATURES = ("replace_existing_hashes", "medium", "lookahead")
"""Features a target written before vLLM 0.33 cannot know about: ``run_conformance``
leaves them out unless the factory says what it lacks (``unsupported_operations()``,
possibly empty). The ``EXTENSIONS`` need no claim: a target without the method is
checked without it."""


class PoolTarget(Protocol):
    """A v1 block pool under test. Method semantics: see ``kvpool.model.pool``."""

    def get_new_blocks(self, num_blocks: int) -> Sequence[int]: ...

    def touch(self, block_ids: Sequence[int]) -> None: ...

    def free_blocks(self, block_ids: Sequence[int]) -> None: ...

    def cache_full_blocks(
        self,
        request: CacheRequest,
        block_ids: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None: ...

    def cache_partial_block(
        self,
        request: CacheRequest,
        block_id: int,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
    ) -> HashKey | None: ...

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> Sequence[int] | None: ...

    def evict_blocks(self, block_ids: Iterable[int]) -> None: ...

    def reset_prefix_cache(self) -> bool: ...

    def get_num_free_blocks(self) -> int: ...

    def get_usage(self) -> float: ...

    def take_events(self) -> Sequence[KVCacheEvent]: ...


class PoolTargetExtensions(Protocol):
    """vLLM 0.33's operations, each optional (``EXTENSIONS``); semantics: ``kvpool.model``.

    ``watcher`` is an int naming the reader; the adapter registers a callback
    that records ``Reuse(watcher, block_id, key the block still carried)`` and
    ``take_reuses`` hands those records out, oldest first. ``cache_partial_block``
    then also takes ``replace_existing_hashes`` (feature ``replace_existing_hashes``).
    """

    def unpin_blocks(self, block_ids: Sequence[int], watcher: int) -> None: ...

    def take_reuses(self) -> Sequence[Reuse]: ...

    def move_block_hashes(self, src: int, dst: int) -> None: ...

    def is_block_writable(self, block_id: int) -> bool: ...

    def emit_cached_block_events(
        self,
        request: CacheRequest,
        num_cached_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None: ...


@runtime_checkable
class Snapshottable(Protocol):
    """A target that can show its whole state as the model's ``PoolState``."""

    def snapshot(self) -> PoolState: ...


class Normalizing(Protocol):
    """Optional hooks for targets that are right but order some things differently.

    ``normalize_state`` and ``normalize_events`` are applied to *both* sides
    before comparing: use them only for orders the specification leaves open
    (for example vLLM keeps a block's partial keys in a set). Each use must be
    justified in docs/semantics.md.
    """

    def normalize_state(self, state: PoolState) -> PoolState: ...

    def normalize_events(self, events: Sequence[KVCacheEvent]) -> Sequence[KVCacheEvent]: ...


TargetFactory = Callable[[PoolConfig], PoolTarget]
"""Builds a fresh target for a pool configuration; called once per test case."""
