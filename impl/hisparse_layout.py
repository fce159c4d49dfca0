"""Which groups of a KV cache configuration are HiSparse's, verified as vLLM 0.33's coordinator
verifies them, and what slice 1 refuses beside them (docs/hisparse.md, "The groups", "Slices").

A HiSparse configuration has four roles of group: the **source** (an attention spec with role
``HISPARSE_SOURCE``: every page in host memory, in a pool of its own), the **indexers** (role
``HISPARSE_INDEXER``: full attention on the device pool), the **resident** groups
(``HiSparseResidentSpec``: GPU copies of some source pages) and the **hot** groups
(``HiSparseHotSpec``: a fixed region per request reading from host). The roles are read from
vLLM's ``KVCacheGroupSpec.role`` and the spec's class name, without importing vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpool.model.errors import InvalidHiSparseLayout, InvalidManagerConfig
from kvpool.model.single_type import AttentionType, KVCacheSpec

SOURCE_ROLE = "hisparse_source"
INDEXER_ROLE = "hisparse_indexer"
RESIDENT_SPEC = "HiSparseResidentSpec"
HOT_SPEC = "HiSparseHotSpec"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class HiSparseLayout:
    """The HiSparse groups of a manager and the numbers vLLM's coordinator fixes at start-up
    (``HiSparseCoordinator.__init__``, vLLM 0.33.0)."""

    source: int
    indexers: tuple[int, ...]
    residents: tuple[int, ...]
    hots: tuple[int, ...]
    blocks_per_request: tuple[int, ...]
    """Per hot group, in group order, the blocks of its region."""
    host_num_blocks: int
    page_size: int
    """The block size of the source and of every resident group (one page)."""
    max_spill_pages: int
    """``max_model_len // page_size``: how many spills may be queued at once."""
    transition_watermark: int
    """``max(sum of blocks_per_request, num_blocks // 10)``: below this many free device
    blocks a request is asked to read from host."""
    max_admission_pages: int
    """``cdiv(min(max_in_flight_tokens, max_model_len), page_size)``: the resident pages a
    whole-sequence admission counts per request (``HiSparseResidentSpec``)."""


def _role_of(group: Any) -> str:
    role = getattr(group, "role", "default")
    return str(getattr(role, "value", role))


def hisparse_groups(kv_cache_config: Any) -> list[tuple[str, Any]]:
    """Per group, its HiSparse role ('source', 'indexer', 'resident', 'hot', or '' for none)
    and vLLM's group object; empty when no group is HiSparse's."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()))
    out: list[tuple[str, Any]] = []
    for group in groups:
        spec_name = type(getattr(group, "kv_cache_spec", group)).__name__
        role = _role_of(group)
        if spec_name == RESIDENT_SPEC:
            out.append(("resident", group))
        elif spec_name == HOT_SPEC:
            out.append(("hot", group))
        elif role == SOURCE_ROLE:
            out.append(("source", group))
        elif role == INDEXER_ROLE:
            out.append(("indexer", group))
        else:
            out.append(("", group))
    if not any(kind for kind, _ in out):
        return []
    return out


def read_layout(
    kv_cache_config: Any,
    specs: tuple[KVCacheSpec, ...],
    num_blocks: int,
    max_model_len: int,
    max_in_flight_tokens: int,
    hash_block_size: int,
    beside: dict[str, bool],
) -> HiSparseLayout | None:
    """The configuration's HiSparse layout, or None without HiSparse groups.

    Raises InvalidHiSparseLayout for a layout vLLM 0.33.0's ``HiSparseCoordinator.__init__``
    (or ``get_hisparse_coordinator``) refuses, and InvalidManagerConfig for what no slice
    models beside HiSparse yet (``beside``: a name to whether the caller asked for it)."""
    roles = hisparse_groups(kv_cache_config)
    if not roles:
        return None
    groups_of: dict[str, list[int]] = {"source": [], "indexer": [], "resident": [], "hot": []}
    for g, (kind, group) in enumerate(roles):
        # Verify that resident and hot groups live on the device (vLLM asserts it)
        if kind in ("resident", "hot") and getattr(group, "host_resident", False):
            raise InvalidHiSparseLayout(f"the {kind} group {g} cannot be host-resident")
        # Verify that every group beside HiSparse's is one slice 1 models (none)
        if not kind:
            raise InvalidManagerConfig(
                f"group {g} ({type(getattr(group, 'kv_cache_spec', group)).__name__}, role "
                f"{_role_of(group)!r}) beside HiSparse groups: not modelled yet"
            )
        groups_of[kind].append(g)
    sources = groups_of["source"]
    # Verify that there is at most one source group
    if len(sources) > 1:
        raise InvalidHiSparseLayout(f"only one HiSparse source group is supported, got {sources}")
    # Verify that HiSparse groups come with a source (vLLM: "No HiSparse cache group")
    if not sources:
        raise InvalidHiSparseLayout("HiSparse groups without a HiSparse source group")
    source = sources[0]
    host_num_blocks: object = getattr(kv_cache_config, "hisparse_host_num_blocks", None)
    # Verify that the source has host capacity
    if host_num_blocks is None:
        raise InvalidHiSparseLayout("the HiSparse source group needs hisparse_host_num_blocks")
    if type(host_num_blocks) is not int or host_num_blocks < 1:
        raise InvalidHiSparseLayout(
            f"hisparse_host_num_blocks={host_num_blocks!r} must be a positive int"
        )
    residents = groups_of["resident"]
    # Verify that there is a resident group (vLLM accepts none; not modelled)
    if not residents:
        raise InvalidManagerConfig("HiSparse without resident groups: not modelled yet")
    # Verify that the source precedes the resident groups
    if source > min(residents):
        raise InvalidHiSparseLayout("the HiSparse source group must precede the resident groups")
    sizes = {specs[g].block_size for g in residents}
    # Verify that the resident groups share one block size, the source's
    if len(sizes) != 1:
        raise InvalidHiSparseLayout(
            f"HiSparse resident groups must use one block size, got {sorted(sizes)}"
        )
    page_size = sizes.pop()
    if specs[source].block_size != page_size:
        raise InvalidHiSparseLayout(
            f"HiSparse source blocks of {specs[source].block_size} tokens and resident blocks "
            f"of {page_size} must match"
        )
    for g in (source, *groups_of["indexer"]):
        # Verify that the source and the indexers are full attention (not modelled otherwise)
        if specs[g].attention is not AttentionType.FULL:
            raise InvalidManagerConfig(
                f"a HiSparse {roles[g][0]} group of {specs[g].attention.value}: not modelled yet"
            )
        # Verify that a page is one hash block (hits ending inside a page: not modelled)
        if specs[g].block_size != hash_block_size:
            raise InvalidManagerConfig(
                f"HiSparse blocks of {specs[g].block_size} tokens with hash blocks of "
                f"{hash_block_size}: not modelled yet (one hash block per block)"
            )
    per_request: list[int] = []
    for g in groups_of["hot"]:
        value: object = getattr(
            getattr(roles[g][1], "kv_cache_spec", None), "blocks_per_request", 0
        )
        # Verify that a hot region has blocks (an empty one would read from host at once)
        if type(value) is not int or value < 1:
            raise InvalidManagerConfig(
                f"blocks_per_request={value!r} of hot group {g}: kvpool models a positive int"
            )
        per_request.append(value)
    for name, asked in beside.items():
        # Verify that nothing slice 1 does not model is asked for beside HiSparse
        if asked:
            raise InvalidManagerConfig(f"{name} beside HiSparse groups: not modelled yet")
    return HiSparseLayout(
        source=source,
        indexers=tuple(groups_of["indexer"]),
        residents=tuple(residents),
        hots=tuple(groups_of["hot"]),
        blocks_per_request=tuple(per_request),
        host_num_blocks=host_num_blocks,
        page_size=page_size,
        max_spill_pages=max_model_len // page_size,
        transition_watermark=max(sum(per_request), num_blocks // 10),
        max_admission_pages=_cdiv(min(max_in_flight_tokens, max_model_len), page_size),
    )
