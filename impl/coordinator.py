"""The manager's groups under the names vLLM 0.33's callers read from its ``coordinator``.

vLLM's manager keeps its groups in a coordinator object, and its callers reach into it:
at start-up the scheduler sums a speculative step's blocks over
``coordinator.single_type_managers`` (their ``block_size`` and ``kv_cache_spec``) and
reads ``coordinator.enable_partial_hash_hits``, and the engine core derives the
attention block size it reports from the same list (``vllm/v1/core/sched/scheduler.py``
and ``vllm/v1/engine/core.py``, 0.33.0). ``kvpool.impl.KVCacheManager`` has no
coordinator; :class:`CoordinatorView` answers those reads from the manager's own
state, and nothing through it changes that state.

Not answered: the coordinator's computations (``get_num_blocks_to_allocate``,
``find_longest_cache_hit_per_group``), which are vLLM's internal steps, not the
manager's contract (docs/vllm-conformance.md lists the tests that call them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.impl.block import KVCacheBlock
from kvpool.impl.single_type import SingleTypeKVCacheManager


class GroupView:
    """One group as vLLM's single-type manager shows it: sizes, spec and block tables.

    ``req_to_blocks`` is a copy taken when read (each request's blocks in a new list),
    so a caller that edits it edits nothing of the manager's.
    """

    __slots__ = ("_manager", "kv_cache_spec")

    def __init__(self, manager: SingleTypeKVCacheManager, kv_cache_spec: object) -> None:
        self._manager = manager
        self.kv_cache_spec = kv_cache_spec
        """The spec the caller configured the group with (vLLM's object, when it gave one)."""

    @property
    def block_size(self) -> int:
        """The group's block size in tokens (a sharded group's times the decode world size)."""
        return self._manager.block_size

    @property
    def kv_cache_group_id(self) -> int:
        return self._manager.kv_cache_group_id

    @property
    def dcp_world_size(self) -> int:
        """The decode world size the group is sharded over (1: a replicated group)."""
        return self._manager.dcp_world_size

    @property
    def block_pool(self) -> Any:
        return self._manager.block_pool

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        return {rid: list(blocks) for rid, blocks in self._manager.req_to_blocks.items()}

    def __repr__(self) -> str:
        return f"GroupView({type(self._manager).__name__}, block_size={self.block_size})"


class CoordinatorView:
    """What vLLM's callers read from ``KVCacheManager.coordinator``, read-only.

    >>> from kvpool.impl.manager import KVCacheConfig, KVCacheManager
    >>> from kvpool.model.single_type import full_attention, sliding_window
    >>> config = KVCacheConfig(8, (full_attention(2), sliding_window(2, 2)))
    >>> coordinator = KVCacheManager(config, max_model_len=16).coordinator
    >>> coordinator.group_block_sizes, coordinator.enable_partial_hash_hits
    ((2, 2), False)
    """

    __slots__ = (
        "_enable_partial_hash_hits",
        "num_reprefillable_tokens",
        "retention_interval",
        "single_type_managers",
    )

    def __init__(
        self,
        managers: Sequence[SingleTypeKVCacheManager],
        kv_cache_config: Any,
        enable_partial_hash_hits: bool,
        num_reprefillable_tokens: int,
    ) -> None:
        groups = getattr(kv_cache_config, "kv_cache_groups", ())
        specs: list[object] = [getattr(group, "kv_cache_spec", group) for group in groups] or [
            m.kv_cache_spec for m in managers
        ]
        self.single_type_managers = tuple(
            GroupView(m, spec) for m, spec in zip(managers, specs, strict=True)
        )
        self._enable_partial_hash_hits = enable_partial_hash_hits
        self.num_reprefillable_tokens = num_reprefillable_tokens
        """The last tokens of a prefill held back from caching (``num_prefill_lookahead - 1``)."""
        self.retention_interval: int | None = getattr(
            kv_cache_config, "prefix_cache_retention_interval", None
        )

    @property
    def enable_partial_hash_hits(self) -> bool:
        """Whether hits may end inside a block (kvpool's ``fine_grained_hits``)."""
        return self._enable_partial_hash_hits

    @property
    def group_block_sizes(self) -> tuple[int, ...]:
        return tuple(group.block_size for group in self.single_type_managers)
