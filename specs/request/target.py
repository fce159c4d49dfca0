"""The request layer's target protocol: what a KV cache manager must offer to be checked.

A manager under test speaks block ids per KV cache group and takes the
model's ``Request`` values (``kvpool.model.request``). Rejections are the
model's exception classes; conformance compares their types only.
``snapshot()`` is optional: with it, the whole state is compared with the
model after every call.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvpool.model import DEFAULT_PROFILE, PROFILES, KVCacheEvent, Profile
from kvpool.model.manager import Blocks, KVCacheManagerState, PrefixCacheStats
from kvpool.model.request import Request
from kvpool.model.single_type import KVCacheSpec

OPERATIONS = (
    "get_computed_blocks",
    "allocate_slots",
    "free",
    "cache_blocks",
    "evict_blocks",
    "reset_prefix_cache",
    "get_num_common_prefix_blocks",
    "get_block_ids",
    "take_events",
    "make_prefix_cache_stats",
    "usage",
    "num_free_blocks",
    "snapshot",
)
"""The operations of ``ManagerTarget`` (and the optional ``snapshot``)."""

OPERATIONS_033 = (
    "get_computed_blocks_with_boundary",
    "take_kv_cache_block_copies",
    "free_blocks",
    "truncate_computed_blocks",
    "take_new_block_ids",
    "estimate_cached_tokens",
    "new_step_starts",
)
"""vLLM 0.33's further scheduler calls (``ManagerTarget033``): the machine sends them
to a target that has them, and programs ask for fine-grained hits only where
``ManagerTargetSpec.fine_grained`` allows. Optional in the JSON request protocol
(hello's ``fine_grained``); ``OPERATIONS`` keeps the calls every target answers."""

LAYOUTS = ("full", "sliding_window", "chunked_local", "mamba", "full+sliding_window")
"""The KV cache layouts: one group of each attention type, and a hybrid of two."""

HYBRID_LAYOUTS = (
    "full+full+sliding_window",
    "sliding_window+full",
    "full+sliding_window+sliding_window",
    "full+chunked_local",
    "wide_full+sliding_window",
    "full+wide_sliding_window",
)
"""Level 2's extra hybrids: two groups of one spec searched together, the
sliding-window group listed first, two windows that shorten each other's hit
in turns, chunked local attention beside full attention, and groups of two
block sizes (full attention's blocks twice the window's, or half)."""


@dataclass(frozen=True)
class ManagerSetup:
    """The parameters a manager under test is built with."""

    num_blocks: int
    specs: tuple[KVCacheSpec, ...]
    max_model_len: int
    hash_block_size: int
    enable_caching: bool = True
    use_eagle: bool = False
    log_stats: bool = False
    enable_events: bool = False
    profile: Profile = DEFAULT_PROFILE
    fine_grained_hits: bool = False
    """Ask for vLLM 0.33's fine-grained hits (``kvpool.model.copy_on_write``); the
    target also answers ``ManagerTarget033``'s calls."""
    scheduler_block_size: int | None = None
    """What hits of several groups are a multiple of (None: the least common multiple of
    the groups' block sizes; ``kvpool.model.geometry``)."""
    dcp_world_size: int = 1
    """Decode context parallelism: a sharded group's blocks hold this many times its
    ``block_size`` tokens."""
    pcp_world_size: int = 1
    """Prefill context parallelism (full attention and replicated groups only)."""


def geometry_arguments(setup: ManagerSetup) -> dict[str, int]:
    """The constructor keywords of ``setup``'s block geometry that differ from the defaults
    (the model's ``new_kv_cache_manager`` and vLLM's ``KVCacheManager`` take the same names).

    >>> from kvpool.model.single_type import full_attention
    >>> geometry_arguments(ManagerSetup(4, (full_attention(2),), 8, 2, dcp_world_size=2))
    {'dcp_world_size': 2}
    """
    chosen: dict[str, int] = {}
    if setup.scheduler_block_size is not None:
        chosen["scheduler_block_size"] = setup.scheduler_block_size
    if setup.dcp_world_size != 1:
        chosen["dcp_world_size"] = setup.dcp_world_size
    if setup.pcp_world_size != 1:
        chosen["pcp_world_size"] = setup.pcp_world_size
    return chosen


class ManagerTarget(Protocol):
    """A KV cache manager under test. Semantics: see ``kvpool.model.manager``."""

    def get_computed_blocks(self, request: Request) -> tuple[Blocks, int]: ...

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Blocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> Blocks | None: ...

    def free(self, request: Request) -> None: ...

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None: ...

    def evict_blocks(self, block_ids: Iterable[int]) -> None: ...

    def reset_prefix_cache(self) -> bool: ...

    def get_num_common_prefix_blocks(self, request_id: str) -> Sequence[int] | None:
        """Per group; None if the target does not support it (then it is not compared)."""

    def get_block_ids(self, request_id: str) -> Blocks: ...

    def take_events(self) -> Sequence[KVCacheEvent]: ...

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None: ...

    def usage(self) -> float: ...

    def num_free_blocks(self) -> int: ...


class ManagerTarget033(ManagerTarget, Protocol):
    """A manager target with vLLM 0.33's further scheduler calls (block ids, not blocks)."""

    def get_computed_blocks_with_boundary(self, request: Request) -> tuple[Blocks, int, int]: ...

    def take_kv_cache_block_copies(
        self,
    ) -> tuple[Sequence[tuple[int, int]], Sequence[int]]:
        """The copies as (source, destination) ids, and the retained block ids."""

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        """The pool's free_blocks, as the scheduler releases a copy's retained blocks."""

    def truncate_computed_blocks(self, blocks: Blocks, num_computed_tokens: int) -> Blocks: ...

    def take_new_block_ids(self) -> Sequence[int]: ...

    def estimate_cached_tokens(self, request: Request) -> int: ...

    def new_step_starts(self) -> None: ...


@runtime_checkable
class ManagerSnapshottable(Protocol):
    """A manager target that can show its whole state as the model's."""

    def snapshot(self) -> KVCacheManagerState: ...


ManagerFactory = Callable[[ManagerSetup], ManagerTarget]
"""Builds a fresh manager target; called once per test case."""


@dataclass(frozen=True)
class ManagerTargetSpec:
    """A manager target and the part of the machine's space it can be checked on."""

    factory: ManagerFactory
    layouts: tuple[str, ...] = LAYOUTS
    profiles: tuple[Profile, ...] = tuple(PROFILES.values())
    events: tuple[bool, ...] = (False, True)
    block_factors: tuple[int, ...] = (1, 2)
    min_window: int = 1
    uncached_layouts: tuple[str, ...] = ()
    """Layouts the target runs with prefix caching off only (drawn so)."""
    hash_sized_layouts: tuple[str, ...] = ()
    """Layouts whose blocks are one hash block long when prefix caching is on (drawn
    so; with caching off they take every block factor)."""
    fine_grained: tuple[bool, ...] = (False,)
    """Whether programs ask for fine-grained hits (True needs ``ManagerTarget033``)."""
    context_parallel: tuple[tuple[int, int], ...] = ((1, 1),)
    """The (decode, prefill) context-parallel world sizes programs draw (full-attention
    layouts only; the others run with (1, 1))."""
