"""The request layer's target protocol: what a KV cache manager must offer to be checked.

A manager under test speaks block ids per KV cache group and takes the
model's ``Request`` values (``kvpool.model.request``). Rejections are the
model's exception classes; conformance compares their types only.
``snapshot()`` is optional: with it, the whole state is compared with the
model after every call.
"""

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvpool.model import DEFAULT_PROFILE, PROFILES, KVCacheEvent, Profile
from kvpool.model.hisparse_layout import HiSparseConfig
from kvpool.model.hisparse_types import PageTransfer, ResidencyUpdate, RowMirror
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
(the feature ``fine_grained``); ``OPERATIONS`` keeps the calls every target answers."""

OPERATIONS_SCHEDULER = (
    "pop_blocks_for_free",
    "remove_skipped_blocks",
    "get_block_ids_for_computed_tokens",
    "get_computed_blocks_for_connector",
    "record_blocks_for_zeroing",
    "take_boundary_state_offloads",
    "finalize_partial_tail_offloads",
)
"""The rest of vLLM 0.33's scheduler calls (``ManagerTargetScheduler``): the deferred free
and a KV connector's calls, and ``allocate_slots(..., full_sequence_must_fit=True)``. The
machine sends them to a target (kvpool's model and impl, vLLM's manager) where
``ManagerTargetSpec.scheduler_calls`` says so. In the JSON request protocol they are
the feature ``scheduler_calls`` (``free_blocks`` with them), asked of a program that
announces it."""

OPERATIONS_HISPARSE = (
    "free_request",
    "pop_pool_blocks_for_free",
    "free_pool_blocks",
    "advance_scheduled",
    "build_offload_command",
    "update_spills",
    "build_row_mirrors",
    "all_context_pages_resident",
    "take_residency_updates",
    "require_hot",
    "press_pool",
    "release_pool",
    "hisparse_view",
)
"""vLLM 0.33's HiSparse coordinator calls (``ManagerTargetHiSparse``), sent only to a target
whose ``ManagerTargetSpec.hisparse`` says so, on a manager built with
``ManagerSetup.hisparse`` (docs/hisparse.md, "How the vLLM side is driven")."""

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

MAMBA_ALIGN_LAYOUTS = ("mamba_align", "full+mamba_align", "sliding_window+mamba_align")
"""Mamba in vLLM's "align" mode (``kvpool.model.mamba_align``), alone and beside full
attention or a sliding window. Drawn only for targets whose scope lists them (blocks of
one hash block when caching is on): not every target has the mode."""

MAMBA_FINE_LAYOUTS = ("hash_full+mamba_align", "pair_full+mamba_align")
"""Full attention of one or two hash blocks beside a Mamba "align" block of several: with
caching on hits may end inside the Mamba block (``kvpool.model.mamba_fine``). Drawn only where
a scope lists them, with blocks of two or more hash blocks."""

MAMBA_ALIGN_DCP_LAYOUTS = (
    "dcp_full+mamba_align",
    "dcp_full+full+mamba_align",
    "full+dcp_full+mamba_align",
)
"""Mamba "align" blocks of one hash block beside sharded full attention under decode context
parallelism (and a replicated full-attention group, as a draft model's may be, after it or
before it: the first full-attention group answers the connector's lookup): vLLM turns
hash-block hits on, so full attention's hits may end inside its sharded blocks
(``kvpool.model.align_dcp``). Drawn only where a scope lists them, with caching on and a
decode world size of at least 2."""

MAMBA_ALIGN_GEOMETRY_LAYOUTS = ("wide_full+mamba_align", "wide_sliding_window+mamba_align")
"""Mamba "align" blocks of one hash block beside full attention or a sliding window of
blocks two or four times larger (the scheduler block): hits end on the larger blocks
(``kvpool.model.manager.verify_align_geometry``). Drawn only where a scope lists them."""


FINE_GRAINED_PART: Mapping[str, Any] = {
    "layouts": ("full+full",),
    "events": (False, True),
    "block_factors": (2,),
    "min_window": 2,
    "fine_grained": (True,),
}
"""Fine-grained hits with copy-on-write, drawn densely: two full-attention groups (a hybrid
coordinator) of blocks two hash blocks long, every program asking for them."""

MAMBA_ALIGN_PART: Mapping[str, Any] = {
    "layouts": MAMBA_ALIGN_LAYOUTS + MAMBA_ALIGN_GEOMETRY_LAYOUTS + MAMBA_ALIGN_DCP_LAYOUTS,
    "events": (False, True),
    "block_factors": (1, 2),
    "min_window": 2,
    "hash_sized_layouts": MAMBA_ALIGN_LAYOUTS,
    # the connector's per-group lookup among the scheduler's calls
    "scheduler_calls": True,
    # bare, and with checkpoint blocks 1 or 2 blocks apart, speculative blocks, or both
    "mamba_reserves": ((0, 0), (0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (1, 1)),
    # decode world sizes for MAMBA_ALIGN_DCP_LAYOUTS (at least 2 there; the other layouts
    # have a Mamba group and run without context parallelism)
    "context_parallel": ((2, 1), (4, 1)),
    # dense, latest-only, one to three scheduler blocks; drawn where kvpool models sparse
    # retention of "align" states (no checkpoint blocks, blocks of one hash block, no
    # context parallelism: kvpool.specs.request.machine)
    "retentions": (None, None, 0, 0, 1, 2, 3),
    # EAGLE where kvpool models it beside "align" (the machine leaves it off elsewhere)
    "eagle_hybrids": True,
}
"""Mamba in vLLM's "align" mode: alone, beside full attention or a sliding window, beside
larger blocks, beside sharded full attention under decode context parallelism, with
speculative and prefill checkpoint blocks, sparse retention and EAGLE where modelled. The
machine drives these layouts with the scheduler's block-aligned chunks and no drafts."""

MAMBA_FINE_PART: Mapping[str, Any] = {
    "layouts": MAMBA_FINE_LAYOUTS,
    "events": (False, True),
    "block_factors": (2, 3, 4),
    "min_window": 2,
    "scheduler_calls": True,
    # checkpoints 1 or 2 hash blocks apart on these layouts, 1 or 2 speculative blocks, both
    "mamba_reserves": ((0, 0), (0, 0), (0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (1, 1)),
}
"""Hits inside a Mamba "align" block of two to four hash blocks beside full attention, with
and without prefill checkpoint and speculative blocks. Driven with the scheduler's chunks
(stopping at the prompt's partial boundary) and no drafts."""

HISPARSE_PART: Mapping[str, Any] = {"events": (False, True), "hisparse": True}
"""HiSparse, slices 1 and 2 (two pools, write-back, publication, hot regions, unpinning and
losing pages; docs/hisparse.md): its own machine
(``kvpool.specs.request.hisparse_machine``) draws the managers, in vLLM 0.33.0's tests'
layout."""

PARTS_033: tuple[tuple[str, Mapping[str, Any]], ...] = (
    ("fine-grained hits", FINE_GRAINED_PART),
    ('Mamba "align"', MAMBA_ALIGN_PART),
    ("hits inside a Mamba block", MAMBA_FINE_PART),
)
"""The parts of the request layer's space checked apart from a target's main scope: what
vLLM 0.33 added that the main scope does not draw (each asks a contract of the machine the
main scope's programs do not keep). ``kvpool check --layer request`` checks a target that
has them (kvpool's model and impl, vLLM 0.33) on each in turn (``TargetDescriptor.parts``)."""

PARTS_033_HISPARSE: tuple[tuple[str, Mapping[str, Any]], ...] = (
    *PARTS_033,
    ("HiSparse", HISPARSE_PART),
)
"""``PARTS_033`` and HiSparse (``HISPARSE_PART``): the parts of kvpool's model, its
impl and vLLM 0.33."""


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
    max_in_flight_tokens: int | None = None
    """vLLM 0.33's cap on tokens scheduled and not yet processed (None: max_model_len); it
    matters to ``allocate_slots(..., full_sequence_must_fit=True)``."""
    num_prefill_lookahead: int = 0
    """Multi-module MTP's speculative tokens (vLLM 0.33's constructor argument;
    ``kvpool.model.eagle``)."""
    scheduler_block_size: int | None = None
    """What hits of several groups are a multiple of (None: the least common multiple of
    the groups' block sizes; ``kvpool.model.geometry``)."""
    dcp_world_size: int = 1
    """Decode context parallelism: a sharded group's blocks hold this many times its
    ``block_size`` tokens."""
    pcp_world_size: int = 1
    """Prefill context parallelism (full attention and replicated groups only)."""
    retention_interval: int | None = None
    """vLLM 0.33's ``prefix_cache_retention_interval`` (a field of its ``KVCacheConfig``):
    None caches densely; 0 or a multiple of the scheduler block size thins the
    sliding-window groups' caching (``kvpool.model.retention``)."""
    eagle_groups: tuple[int, ...] = ()
    """The groups flagged as EAGLE's (vLLM 0.33's ``is_eagle_group``; none: with
    ``use_eagle`` every group is; ``kvpool.model.eagle.group_flags``)."""
    hisparse: HiSparseConfig | None = None
    """HiSparse's roles of the groups and the host pool's size (the model's
    ``new_hisparse_manager``); None: no HiSparse. Every group is then full attention."""


def eagle_arguments(setup: ManagerSetup) -> dict[str, list[int]]:
    """``eagle_groups`` as the model's ``new_kv_cache_manager`` keyword, if any are flagged
    (so that setups without flags build and encode as they did).

    >>> from kvpool.model.single_type import full_attention
    >>> eagle_arguments(ManagerSetup(4, (full_attention(2),), 8, 2, eagle_groups=(0,)))
    {'eagle_groups': [0]}
    """
    return {"eagle_groups": list(setup.eagle_groups)} if setup.eagle_groups else {}


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


def retention_arguments(setup: ManagerSetup) -> dict[str, int]:
    """The model constructor's ``retention_interval`` keyword, where ``setup`` asks for sparse
    retention (vLLM takes it in its ``KVCacheConfig``, not as a keyword).

    >>> from kvpool.model.single_type import sliding_window
    >>> retention_arguments(ManagerSetup(4, (sliding_window(2, 2),), 8, 2, retention_interval=0))
    {'retention_interval': 0}
    """
    if setup.retention_interval is None:
        return {}
    return {"retention_interval": setup.retention_interval}


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


class ManagerTargetScheduler(ManagerTarget033, Protocol):
    """A manager target with the rest of vLLM 0.33's scheduler calls (``OPERATIONS_SCHEDULER``)."""

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Blocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
        num_external_computed_tokens: int = 0,
        reserved_blocks: int = 0,
        skip_zeroing_group_ids: Sequence[int] = (),
    ) -> Blocks | None:
        """The KV connector's arguments after ``full_sequence_must_fit`` are sent only where
        ``ManagerTargetSpec.connector_loads`` says so (``kvpool.model.external``)."""

    def pop_blocks_for_free(self, request: Request) -> Sequence[int]:
        """The request's blocks, taken out of its tables and still held (freed later)."""

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int) -> None: ...

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> Blocks: ...

    def get_computed_blocks_for_connector(
        self, request: Request
    ) -> tuple[Blocks, int, int, bool]: ...

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None: ...

    def take_boundary_state_offloads(
        self,
    ) -> Mapping[str, Sequence[tuple[int, int, int]]]: ...

    def finalize_partial_tail_offloads(
        self, request: Request
    ) -> Sequence[tuple[int, int, int]]: ...


PoolBlock = tuple[str, int]
"""A block named with its pool: ("CPU" for HiSparse's host pool, or "GPU"; its id)."""


@dataclass(frozen=True)
class HiSparseView:
    """What the machine compares of a HiSparse manager after every call: both pools' blocks
    (reference count, hashed) and free queues, the hot region's requests, the host copies,
    the pending-work queries and each request's page book (vLLM 0.33.0's
    ``HiSparseRequestState``: valid, ready prefix, pending, pinned clean, synced pages)."""

    device_blocks: tuple[tuple[int, bool], ...]
    device_free: tuple[int, ...]
    host_blocks: tuple[tuple[int, bool], ...]
    host_free: tuple[int, ...]
    hot_required: frozenset[str]
    copies: tuple[tuple[int, ...], ...]
    """The host copies' device block ids, sorted."""
    pending_work: bool
    pending_reclamation: bool
    books: Mapping[str, tuple[object, ...]]
    """Per request: (valid pages, ready prefix pages, pending pages, pinned clean, synced)."""


class ManagerTargetHiSparse(ManagerTarget, Protocol):
    """A manager target built with HiSparse's roles (``ManagerSetup.hisparse``) and the
    coordinator's calls, as vLLM 0.33.0's ``HiSparseCoordinator`` answers them; block ids of
    the source group are the host pool's. The base protocol's calls keep their meaning."""

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Blocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
    ) -> Blocks | None: ...

    def free_request(self, request: Request, finished: bool) -> None:
        """``free`` with the request finished (its publication waits for its spills) or
        preempted (dropped)."""

    def pop_pool_blocks_for_free(self, request: Request, finished: bool) -> Sequence[PoolBlock]:
        """``pop_blocks_for_free``: the request's blocks, still held, named by pool."""

    def free_pool_blocks(self, blocks: Sequence[PoolBlock]) -> None:
        """One reference per listed block released, each in its own pool, in order."""

    def advance_scheduled(self, scheduled: Sequence[tuple[str, int]]) -> None: ...

    def build_offload_command(self) -> Sequence[PageTransfer]: ...

    def update_spills(self, enqueued: Mapping[int, int], completed: Mapping[int, int]) -> None: ...

    def build_row_mirrors(self, spans: Sequence[tuple[str, int, int]]) -> Sequence[RowMirror]: ...

    def all_context_pages_resident(self, spans: Sequence[tuple[str, int, int]]) -> bool: ...

    def take_residency_updates(
        self, request_ids: Sequence[str]
    ) -> Mapping[str, ResidencyUpdate]: ...

    def require_hot(self, request_id: str) -> None: ...

    def press_pool(self, pool: str, count: int) -> Sequence[int]:
        """``get_new_blocks(count)`` on one pool directly, as vLLM's tests press it."""

    def release_pool(self, pool: str, block_ids: Sequence[int]) -> None:
        """``free_blocks`` on one pool of blocks ``press_pool`` took."""

    def hisparse_view(self) -> HiSparseView: ...


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
    in_flight: tuple[int | None, ...] = (None,)
    """The ``max_in_flight_tokens`` programs build managers with (drawn only if one is set)."""
    scheduler_calls: bool = False
    """Whether programs send the rest of vLLM 0.33's scheduler calls
    (``OPERATIONS_SCHEDULER``; True needs ``ManagerTargetScheduler``)."""
    prefill_lookaheads: tuple[int, ...] = (0,)
    """The ``num_prefill_lookahead`` values programs draw (the target takes the argument)."""
    eagle_hybrids: bool = False
    """EAGLE is drawn on every layout vLLM 0.33 runs it on, hybrids included (else on one
    full-attention or sliding-window group only, as before EAGLE on several groups was
    modelled: a ``cmd:`` program has it when it announces the feature ``eagle_hybrids``)."""
    context_parallel: tuple[tuple[int, int], ...] = ((1, 1),)
    """The (decode, prefill) context-parallel world sizes programs draw (full-attention
    layouts only; the others run with (1, 1))."""
    retentions: tuple[int | None, ...] = (None,)
    """The retention intervals programs draw, in scheduler blocks: None dense, 0 only the
    replay boundaries, k one segment tail every k scheduler blocks (vLLM 0.33's
    ``prefix_cache_retention_interval``; drawn on layouts with a sliding-window group and
    no Mamba group, the others run dense)."""
    eagle_flags: bool = False
    """Whether programs flag some groups as EAGLE's (``ManagerSetup.eagle_groups``; with
    ``eagle_hybrids``, on layouts of several groups)."""
    connector_loads: bool = False
    """Whether programs admit requests with a KV connector's loads: external tokens,
    reserved blocks, groups whose loaded blocks are not zeroed (``kvpool.model.external``;
    True needs ``ManagerTargetScheduler`` and its ``allocate_slots``' further arguments)."""
    hisparse: bool = False
    """Whether programs build HiSparse managers (``ManagerSetup.hisparse``) and send the
    coordinator's calls (``OPERATIONS_HISPARSE``; True needs ``ManagerTargetHiSparse``): the
    HiSparse machine (``kvpool.specs.request.hisparse_machine``) runs instead of the main one."""
    mamba_reserves: tuple[tuple[int, int], ...] = ((0, 0),)
    """The (speculative blocks, prefill checkpoint alignment in blocks) a Mamba "align"
    group is drawn with (``kvpool.model.mamba_reserve``; (0, 0): neither). On
    ``MAMBA_FINE_LAYOUTS`` with caching on: the alignment in hash blocks
    (``kvpool.model.mamba_fine_reserve``)."""
