"""HiSparse's layout: which group plays which role, and the numbers derived from it.

vLLM 0.33.0 names a group's role in its ``KVCacheGroupSpec`` (``role``,
``host_resident``) and in two spec classes of its own (``HiSparseResidentSpec``,
``HiSparseHotSpec``). kvpool's model keeps its specs as they are (every HiSparse
group is a full-attention ``KVCacheSpec`` of one block size: the source and the
indexer are full attention in vLLM too, and the resident and hot groups only ever
use their block size) and names the roles beside them, in a ``HiSparseConfig``
given to ``new_hisparse_manager``: the source group, the indexer groups, the
resident groups, the hot groups with their ``blocks_per_request``, and the host
pool's size. ``derive_layout`` checks it as ``HiSparseCoordinator.__init__``
(``vllm/v1/hisparse/coordinator.py``, 0.33.0) and ``get_hisparse_coordinator``
(same file) do, and fixes the coordinator's numbers once (docs/hisparse.md,
"The groups", "Modelled in slice 1").
"""

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.model.errors import HiSparseNotModelled, InvalidHiSparseLayout
from kvpool.model.single_type import AttentionType, KVCacheSpec


@dataclass(frozen=True)
class HiSparseConfig:
    """The roles of a HiSparse manager's groups (group indices) and the host pool's size.

    Every group of the manager has exactly one role. vLLM's tests lay them out
    source, indexer, resident, hot (``make_hisparse_kv_cache_config``).
    """

    source_groups: tuple[int, ...]
    """The host-resident groups; vLLM takes at most one, and needs one."""
    host_num_blocks: int | None
    """vLLM's ``KVCacheConfig.hisparse_host_num_blocks`` (the null block included)."""
    indexer_groups: tuple[int, ...] = ()
    resident_groups: tuple[int, ...] = ()
    hot_groups: tuple[tuple[int, int], ...] = ()
    """(group, blocks_per_request) per hot group."""


@dataclass(frozen=True)
class HiSparseLayout:
    """The verified roles and the coordinator's numbers, fixed at construction."""

    source: int
    indexers: tuple[int, ...]
    residents: tuple[int, ...]
    hots: tuple[int, ...]
    blocks_per_request: tuple[int, ...]
    """One per hot group, in the order of ``hots``."""
    host_num_blocks: int
    block_size: int
    max_spill_pages: int
    """``max_model_len // block_size``: spills queued and not yet sent, at most."""
    transition_watermark: int
    """``max(sum of blocks_per_request, num_blocks // 10)``: below this many free device
    blocks a scheduled request is asked to read from host."""
    max_admission_pages: int
    """The resident groups' ``max_admission_blocks_per_request``."""
    num_reprefillable_tokens: int


def derive_layout(
    config: HiSparseConfig,
    specs: Sequence[KVCacheSpec],
    num_blocks: int,
    max_model_len: int,
    max_in_flight_tokens: int | None,
    num_reprefillable_tokens: int,
) -> HiSparseLayout:
    """The layout of ``config`` over ``specs``, or the named refusal.

    ``InvalidHiSparseLayout`` for what vLLM 0.33.0 refuses (``HiSparseCoordinator.__init__``:
    two source groups, a source without host capacity, a source after a resident group,
    resident groups of two block sizes or of another size than the source's;
    ``get_hisparse_coordinator``: no source group), and for roles kvpool's config cannot
    express (a group index out of range or given two roles, a role group that is not
    full attention, a hot region of no block). ``HiSparseNotModelled`` for layouts vLLM
    takes that slice 1 does not model: a group with no HiSparse role, no resident group,
    groups of several block sizes.

    >>> from kvpool.model.single_type import full_attention
    >>> c = HiSparseConfig((0,), 16, (1,), (2,), ((3, 2),))
    >>> derive_layout(c, [full_attention(16)] * 4, 32, 128, None, 0).transition_watermark
    3
    """
    n = len(specs)
    hot_ids = tuple(g for g, _ in config.hot_groups)
    roles = (*config.source_groups, *config.indexer_groups, *config.resident_groups, *hot_ids)
    # Verify that every role names a group, and no group has two roles
    for g in roles:
        if not isinstance(g, int) or isinstance(g, bool) or not 0 <= g < n:
            raise InvalidHiSparseLayout(f"HiSparse role group {g!r} is not in 0..{n - 1}")
    if len(set(roles)) != len(roles):
        raise InvalidHiSparseLayout(f"a group has two HiSparse roles: {roles}")
    # Verify that there is one source group (get_hisparse_coordinator; __init__)
    if not config.source_groups:
        raise InvalidHiSparseLayout("No HiSparse cache group is configured")
    if len(config.source_groups) > 1:
        raise InvalidHiSparseLayout("Only one HiSparse host group is supported")
    # Verify that the source has host capacity
    host = config.host_num_blocks
    if host is None:
        raise InvalidHiSparseLayout("HiSparse host group needs host capacity")
    if not isinstance(host, int) or isinstance(host, bool) or host < 1:
        raise InvalidHiSparseLayout(f"host_num_blocks={host!r} must be a positive int")
    (source,) = config.source_groups
    # Verify that every role group is a full-attention spec (kvpool's way to name them)
    for g in roles:
        if specs[g].attention is not AttentionType.FULL:
            raise InvalidHiSparseLayout(
                f"group {g} has a HiSparse role but is {specs[g].attention.value}"
            )
    # Verify that every hot region has at least one block
    for g, region in config.hot_groups:
        if not isinstance(region, int) or isinstance(region, bool) or region < 1:
            raise InvalidHiSparseLayout(f"hot group {g}: blocks_per_request={region!r}")
    # Verify that the source precedes the resident groups
    residents = tuple(config.resident_groups)
    if residents and source > min(residents):
        raise InvalidHiSparseLayout("HiSparse host group must precede resident groups")
    # Verify that the resident groups share one block size, the source's
    resident_sizes = {specs[g].block_size for g in residents}
    if len(resident_sizes) > 1:
        raise InvalidHiSparseLayout("HiSparse resident cache groups must use one block size")
    block_size = specs[source].block_size
    if resident_sizes and resident_sizes != {block_size}:
        raise InvalidHiSparseLayout("HiSparse host and resident block sizes must match")
    # Verify that slice 1 models the layout: every group a role, resident groups, one size
    if len(roles) != n:
        others = sorted(set(range(n)) - set(roles))
        raise HiSparseNotModelled(f"groups {others} beside HiSparse: not modelled yet")
    if not residents:
        raise HiSparseNotModelled("a HiSparse source without resident groups: not modelled yet")
    if {s.block_size for s in specs} != {block_size}:
        raise HiSparseNotModelled("HiSparse groups of several block sizes: not modelled yet")
    in_flight = max_in_flight_tokens or max_model_len
    per_request = tuple(p for _, p in config.hot_groups)
    return HiSparseLayout(
        source=source,
        indexers=tuple(config.indexer_groups),
        residents=residents,
        hots=hot_ids,
        blocks_per_request=per_request,
        host_num_blocks=host,
        block_size=block_size,
        max_spill_pages=max_model_len // block_size,
        transition_watermark=max(sum(per_request), num_blocks // 10),
        max_admission_pages=-(-min(in_flight, max_model_len) // block_size),
        num_reprefillable_tokens=num_reprefillable_tokens,
    )


def verify_features(
    use_eagle: bool,
    eagle_groups: Sequence[int],
    retention_interval: int | None,
    dcp_world_size: int,
    pcp_world_size: int,
    fine_grained_hits: bool,
) -> None:
    """HiSparseNotModelled for a feature beside HiSparse that no slice models yet.

    EAGLE groups, sparse retention and context parallelism (no slice), fine-grained
    hits (slice 5: host copy-on-write). Multi-module MTP's look-ahead is accepted.

    >>> verify_features(False, (), None, 1, 1, False)
    """
    if use_eagle or eagle_groups:
        raise HiSparseNotModelled("EAGLE beside HiSparse: not modelled")
    if retention_interval is not None:
        raise HiSparseNotModelled("sparse retention beside HiSparse: not modelled")
    if dcp_world_size != 1 or pcp_world_size != 1:
        raise HiSparseNotModelled("context parallelism beside HiSparse: not modelled")
    if fine_grained_hits:
        raise HiSparseNotModelled("fine-grained hits beside HiSparse: not modelled yet (slice 5)")
