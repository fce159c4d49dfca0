"""The fast KV cache manager: kvpool.model.manager's semantics with vLLM 0.33's interface.

``KVCacheManager`` takes duck-typed requests (``request_id``,
``num_tokens``, ``num_computed_tokens``, ``block_hashes``,
``all_token_ids``, ``num_preemptions``, ``skip_reading_prefix_cache``;
kvpool.model's ``Request`` has them all) and answers with ``KVCacheBlocks``
of ``KVCacheBlock`` objects, like vLLM's. Every public method raises the
model's exception for the model's first failing precondition.
``snapshot()`` is the abstraction function into the model's
``KVCacheManagerState``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from mypy_extensions import mypyc_attr

import kvpool.impl.external as external
import kvpool.impl.geometry as geometry
from kvpool.impl.align_dcp import check_dcp_config, dcp_fine_hits_on
from kvpool.impl.block import KVCacheBlock
from kvpool.impl.coordinator import CoordinatorView
from kvpool.impl.eagle import (
    cacheable,
    check_eagle_config,
    check_eagle_flags,
    flagged_groups,
    group_flags,
)
from kvpool.impl.hisparse import HiSparseCoordinator
from kvpool.impl.hisparse_groups import (
    HiSparseHotManager,
    HiSparseResidentManager,
    HiSparseSourceManager,
)
from kvpool.impl.hisparse_layout import HiSparseLayout, read_layout
from kvpool.impl.mamba_align import (
    MambaAlignManager,
    check_align_eagle,
    per_group_lookup,
    take_boundary_state_offloads,
)
from kvpool.impl.mamba_fine import MambaFineManager, check_fine_config, fine_hits_on
from kvpool.impl.mamba_fine_reserve import MambaFineReservingManager
from kvpool.impl.mamba_fine_reserve import admission_blocks as fine_admission_blocks
from kvpool.impl.mamba_reserve import (
    MambaReservingManager,
    admission_blocks,
)
from kvpool.impl.pool import BlockPool, Unchecked
from kvpool.impl.retention import check_retention, shared_prefix_boundary
from kvpool.impl.single_type import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
    num_prompt_tokens,
    verify_hash_block_size,
)
from kvpool.model.errors import (
    CachingDisabled,
    HiSparseNotModelled,
    HitOnRunningRequest,
    InvalidArgument,
    InvalidBlockRange,
    InvalidHit,
    InvalidManagerConfig,
    InvalidTokenCount,
    NoNewTokens,
    UnknownBlock,
)
from kvpool.model.events import MEDIUM_CPU, BlockStored, KVCacheEvent
from kvpool.model.manager import (
    KVCacheManagerState,
    ManagerConfig,
    PrefixCacheStats,
    record,
)
from kvpool.model.profiles import DEFAULT_PROFILE, Profile
from kvpool.model.single_type import AttentionType, KVCacheSpec, ManagersState


@dataclass(frozen=True)
class KVCacheConfig:
    """The pool size and the KV cache groups, as vLLM's ``KVCacheConfig`` carries them."""

    num_blocks: int
    kv_cache_groups: tuple[KVCacheSpec, ...]
    # Unchecked: the constructor names a bad interval itself (InvalidManagerConfig)
    prefix_cache_retention_interval: Unchecked = None
    """None: dense caching; 0 or a multiple of the scheduler block size: sparse
    (``kvpool.impl.retention``)."""
    eagle_groups: tuple[int, ...] = ()
    """The groups flagged as EAGLE's (vLLM's ``KVCacheGroupSpec.is_eagle_group``)."""


class KVCacheBlocks:
    """An allocation result: ``blocks[g][i]`` is block i of KV cache group g.

    >>> KVCacheBlocks(([],)).get_block_ids()
    ([],)
    """

    __slots__ = ("blocks",)

    def __init__(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> None:
        self.blocks = blocks

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple([*a, *b] for a, b in zip(self.blocks, other.blocks, strict=True))
        )

    def get_block_ids(self) -> tuple[list[int], ...]:
        """The block ids per group."""
        return tuple([b.block_id for b in group] for group in self.blocks)

    def __repr__(self) -> str:
        # Never raises, whatever a caller put inside: a test framework prints the arguments
        # of a failing call, junk ones included (a repr that raised made Hypothesis report a
        # flaky strategy instead of the failure)
        try:
            ids = tuple([getattr(b, "block_id", b) for b in group] for group in self.blocks)
        except TypeError:  # not groups of blocks at all
            return f"KVCacheBlocks({self.blocks!r})"
        return f"KVCacheBlocks({ids})"


class KVCacheBlockCopy:
    """One pending copy-on-write copy, as vLLM 0.33's ``KVCacheBlockCopy`` names its ends."""

    __slots__ = ("dst_block_id", "src_block_id")

    def __init__(self, src_block_id: int, dst_block_id: int) -> None:
        self.src_block_id = src_block_id
        self.dst_block_id = dst_block_id

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, KVCacheBlockCopy)
            and other.src_block_id == self.src_block_id
            and other.dst_block_id == self.dst_block_id
        )

    def __hash__(self) -> int:
        return hash((self.src_block_id, self.dst_block_id))

    def __repr__(self) -> str:
        return f"KVCacheBlockCopy({self.src_block_id} -> {self.dst_block_id})"


@mypyc_attr(allow_interpreted_subclasses=True)
class KVCacheManager:
    """A KV cache manager over ``kvpool.impl.BlockPool``, one single-type manager per group.

    >>> from kvpool.model.single_type import full_attention
    >>> from kvpool.model.request import new_request
    >>> m = KVCacheManager(KVCacheConfig(8, (full_attention(4),)), max_model_len=32)
    >>> m.allocate_slots(new_request("r", [1, 2, 3, 4, 5], 4), 5).get_block_ids()
    ([1, 2],)
    """

    logger: ClassVar[logging.Logger] = logging.getLogger(__name__)
    """Where ``take_events`` warns of an event naming no group (a vLLM caller may set
    vLLM's own manager logger here)."""

    def __init__(
        self,
        kv_cache_config: Any,
        max_model_len: int,
        # Unchecked: the constructor names a bad value itself (InvalidManagerConfig); a
        # compiled build would otherwise raise TypeError at the call, or take True for 1
        scheduler_block_size: Unchecked = None,
        hash_block_size: Unchecked = None,
        max_in_flight_tokens: Unchecked = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: Unchecked = 0,
        num_prefill_lookahead: Unchecked = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: Unchecked = 1,
        pcp_world_size: Unchecked = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        *,
        profile: Profile = DEFAULT_PROFILE,
        fine_grained_hits: bool = False,
    ) -> None:
        """vLLM 0.33's constructor. ``kv_cache_config`` is this module's ``KVCacheConfig`` or
        vLLM's (its groups' specs are read by class name: full attention, MLA and hidden
        states, sliding window, chunked local attention, Mamba). Arguments kvpool does not
        model must keep vLLM's defaults (``InvalidManagerConfig`` otherwise):
        ``watermark`` and the Mamba shared-prefix checkpoint. The config's
        ``prefix_cache_retention_interval`` thins sliding-window groups' caching
        (``kvpool.impl.retention``; not beside a Mamba "align" group). Groups may have
        different block sizes, and decode context parallelism multiplies a sharded group's
        (``kvpool.model.geometry``). EAGLE runs on the groups flagged (vLLM's
        ``is_eagle_group``, or this module's ``KVCacheConfig.eagle_groups``), every group
        when none is (``kvpool.model.eagle.group_flags``),
        and ``num_prefill_lookahead`` holds back multi-module MTP's re-prefilled tokens from
        caching (``kvpool.model.eagle``). ``fine_grained_hits`` (not vLLM's: there a Mamba
        "align" group turns it on) lets hits end inside a block when every group is full
        attention with blocks larger than a hash block, all of one size (vllm#51843).
        """
        # Verify that the arguments kvpool does not model keep vLLM's defaults
        unmodelled = {
            "watermark": (watermark, 0.0),
            "enable_mamba_shared_prefix_checkpoint": (enable_mamba_shared_prefix_checkpoint, False),
        }
        for name, (value, default) in unmodelled.items():
            if value != default:
                raise InvalidManagerConfig(f"{name}={value!r}: kvpool models only {default!r}")
        specs = _specs_of(kv_cache_config)
        # Verify that requests can hold at least one token
        if max_model_len < 1:
            raise InvalidManagerConfig(f"max_model_len={max_model_len} must be positive")
        # Verify that at least one token may be in flight
        if max_in_flight_tokens is not None and (
            not isinstance(max_in_flight_tokens, int)
            or isinstance(max_in_flight_tokens, bool)
            or max_in_flight_tokens < 1
        ):
            raise InvalidManagerConfig(
                f"max_in_flight_tokens={max_in_flight_tokens!r} must be a positive int"
            )
        # Verify that there is at least one group
        if not specs:
            raise InvalidManagerConfig("a KV cache manager needs at least one group")
        # Verify that context parallelism runs only on the groups vLLM runs it on
        geometry.check_world_sizes(specs, dcp_world_size, pcp_world_size)
        # the managers' block sizes: sharded groups' times the decode world size
        specs = geometry.sharded(specs, dcp_world_size)
        hbs = geometry.common_divisor(specs) if hash_block_size is None else hash_block_size
        # Verify that a Mamba block holds a whole request, or the group is in "align" mode
        for spec in specs:
            if (
                spec.attention is AttentionType.MAMBA
                and spec.block_size < max_model_len
                and not spec.mamba_align
            ):
                raise InvalidManagerConfig(
                    f"a Mamba block of {spec.block_size} tokens cannot hold {max_model_len} tokens"
                )
        # Verify that EAGLE runs beside Mamba "align" groups only as modelled (no checkpoint
        # blocks)
        check_align_eagle(specs, bool(use_eagle))
        # Verify that hits inside a Mamba "align" block come in a configuration kvpool models
        fine_mamba = fine_hits_on(specs, hbs, enable_caching)
        if fine_mamba:
            check_fine_config(
                specs,
                hbs,
                use_eagle,
                getattr(kv_cache_config, "prefix_cache_retention_interval", None),
                dcp_world_size,
            )
        elif dcp_fine_hits_on(specs, hbs, enable_caching, dcp_world_size):
            # under decode context parallelism hits end on hash blocks (kvpool.impl.align_dcp)
            check_dcp_config(
                specs,
                hbs,
                use_eagle,
                getattr(kv_cache_config, "prefix_cache_retention_interval", None),
            )
            fine_mamba = True
        try:
            self.block_pool = BlockPool(
                kv_cache_config.num_blocks,
                enable_caching,
                hbs,
                enable_kv_cache_events,
                metrics_collector,
                num_hash_lookahead_tokens,
                profile=profile,
            )
        except ValueError as error:
            raise InvalidManagerConfig(str(error)) from error
        # Verify each group's block size, window and chunk (as the model's new_managers does)
        for spec in specs:
            if spec.block_size < hbs or spec.block_size % hbs != 0:
                raise InvalidManagerConfig(
                    f"block_size={spec.block_size} is not a multiple of hash_block_size={hbs}"
                )
            if spec.attention is AttentionType.SLIDING_WINDOW and spec.sliding_window < 1:
                raise InvalidManagerConfig(f"sliding_window={spec.sliding_window} must be positive")
            if spec.attention is AttentionType.CHUNKED_LOCAL and spec.attention_chunk_size < 1:
                raise InvalidManagerConfig(
                    f"attention_chunk_size={spec.attention_chunk_size} must be positive"
                )
            if spec.mamba_align and spec.attention is not AttentionType.MAMBA:
                raise InvalidManagerConfig(f"{spec.attention.value} groups have no align mode")
            _verify_reserved(spec)
        scheduler = (
            geometry.common_multiple(specs)
            if scheduler_block_size is None
            else scheduler_block_size
        )
        # Verify that the scheduler block size is a multiple of every block size
        geometry.check_scheduler_block_size(specs, hbs, scheduler)
        # Verify that a Mamba "align" group's block is every group's and the scheduler's, or
        # one hash block beside larger blocks without decode context parallelism
        if not fine_mamba:
            geometry.check_align_geometry(specs, scheduler, hbs, dcp_world_size)
        # Verify that the retention interval is one vLLM 0.33 takes for these groups
        retention = getattr(kv_cache_config, "prefix_cache_retention_interval", None)
        check_retention(retention, specs, scheduler)
        # Verify that the groups flagged as EAGLE's exist
        flagged = flagged_groups(kv_cache_config)
        eagle_flags = group_flags(specs, use_eagle, flagged)
        # Verify that prefill checkpoints leave the one token vLLM's checkpoint leaves (a
        # look-ahead of L > 1 hashed tokens moves the checkpoint back: not modelled)
        # (hits inside a Mamba block model it: kvpool.impl.mamba_fine_reserve)
        if (
            not fine_mamba
            and self.block_pool.num_hash_lookahead_tokens > 1
            and any(s.prefill_checkpoint_alignment for s in specs)
        ):
            raise InvalidManagerConfig(
                f"prefill checkpoints with num_hash_lookahead_tokens="
                f"{self.block_pool.num_hash_lookahead_tokens} are not modelled (at most 1)"
            )
        # Verify that reserved blocks sit where kvpool models them: hash block = block = scheduler
        # (or checkpoints where hits may end inside a Mamba block, checked above)
        for spec in specs:
            if fine_mamba:
                break
            if (spec.num_speculative_blocks or spec.prefill_checkpoint_alignment) and (
                spec.block_size != scheduler or (enable_caching and spec.block_size != hbs)
            ):
                raise InvalidManagerConfig(
                    f'Mamba "align" with reserved blocks in blocks of {spec.block_size} tokens, '
                    f"hash blocks of {hbs} and scheduler blocks of {scheduler} is not modelled "
                    "(a block of the scheduler's, and of one hash block with caching on)"
                )
        # Verify that EAGLE and the look-ahead are settings vLLM 0.33 runs
        reprefillable = check_eagle_config(
            specs, enable_caching, use_eagle, num_prefill_lookahead, scheduler, eagle_flags
        )
        check_eagle_flags(flagged, enable_caching, num_prefill_lookahead, scheduler)
        self.eagle_groups = flagged
        self._eagle_flags = eagle_flags
        self.scheduler_block_size: int = scheduler
        self.dcp_world_size = dcp_world_size
        self.pcp_world_size = pcp_world_size
        self.kv_cache_config = kv_cache_config
        self.specs = specs
        self.kv_cache_event_metadata = _event_metadata(kv_cache_config, specs)
        """Per group, the spec kind and sliding window ``take_events`` stamps on a
        ``BlockStored`` (vLLM 0.33's ``kv_cache_event_metadata``)."""
        self.max_model_len = max_model_len
        self.max_in_flight_tokens = max_in_flight_tokens
        # Per group, the most blocks a whole-sequence admission counts (None: no cap)
        in_flight = max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
        self._admission_caps = [_admission_cap(s, in_flight, max_model_len) for s in specs]
        # Mamba layers make every attention group's new blocks be zeroed before use
        has_mamba = any(s.attention is AttentionType.MAMBA for s in specs)
        self._records_new_blocks = [
            has_mamba and s.attention is not AttentionType.MAMBA for s in specs
        ]
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.num_prefill_lookahead = num_prefill_lookahead
        self._reprefillable = reprefillable
        self.log_stats = log_stats
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        in_flight_tokens = max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
        layout = read_layout(
            kv_cache_config,
            specs,
            kv_cache_config.num_blocks,
            max_model_len,
            in_flight_tokens,
            hbs,
            {
                "EAGLE": bool(use_eagle) or bool(flagged),
                "sparse retention (prefix_cache_retention_interval)": retention is not None,
                "context parallelism": dcp_world_size != 1 or pcp_world_size != 1,
                "fine-grained hits": bool(fine_grained_hits),
            },
        )
        self.hisparse_layout: HiSparseLayout | None = layout
        self.hisparse: HiSparseCoordinator | None = None
        """HiSparse's coordinator (``kvpool.impl.hisparse``; None without HiSparse groups)."""
        self.host_block_pool: BlockPool | None = None
        """HiSparse's host pool (medium CPU; its events go into ``block_pool``'s queue)."""
        self.hisparse_view: Any = None
        """What ``kvpool.impl.get_hisparse_coordinator`` returns (built on its first call)."""
        self.managers: list[SingleTypeKVCacheManager] = (
            [
                MambaFineReservingManager(spec, self.block_pool, g)
                if fine_mamba
                and spec.mamba_align
                and (spec.prefill_checkpoint_alignment or spec.num_speculative_blocks)
                else MambaFineManager(spec, self.block_pool, g)
                if fine_mamba and spec.mamba_align
                else _align_manager(spec, self.block_pool, g)
                if spec.mamba_align
                else get_manager_for_kv_cache_spec(spec, self.block_pool, g)
                for g, spec in enumerate(specs)
            ]
            if layout is None
            else self._hisparse_managers(layout, specs, enable_caching, profile)
        )
        self.retention_interval: int | None = retention
        self._retains_sparsely = retention is not None
        for manager, eagle_group in zip(self.managers, eagle_flags, strict=True):
            manager.use_eagle = eagle_group
            manager.retention_interval = retention
            manager.replay_eagle = use_eagle  # per-group flags aside (kvpool.impl.retention)
            if isinstance(manager, MambaAlignManager):
                manager.hybrid = len(specs) > 1
                # vLLM 0.33 sets it on every Mamba group under EAGLE, flagged or not
                manager.drop_eagle_checkpoint_block = bool(use_eagle)
            # sliding-window groups cache only what hits at these multiples can use
            manager.cache_hit_alignment_tokens = scheduler
            sharded_group = manager.kv_cache_spec.dcp_sharded
            manager.dcp_world_size = dcp_world_size if sharded_group else 1
            manager.pcp_world_size = pcp_world_size if sharded_group else 1
        self.num_kv_cache_groups = len(specs)
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in specs))
        self._fine_mamba = fine_mamba
        self.fine_grained_hits = fine_mamba or (
            bool(fine_grained_hits)
            and not use_eagle
            and all(s.attention is AttentionType.FULL and s.block_size > hbs for s in specs)
            and all(s.block_size == specs[0].block_size for s in specs)
        )
        for manager in self.managers:
            manager.fine_grained_hits = self.fine_grained_hits
        # Caching reads the prompt's length where a full-attention group's blocks hold several
        # hash blocks (the prompt's tail); it is checked before anything changes
        self._caches_prompt_tail = any(
            s.attention is AttentionType.FULL and s.block_size > hbs for s in specs
        )
        self.pending_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        self._uncached = 0
        self.new_block_ids: list[tuple[int, int]] = []
        """(group, block) to zero, in the order recorded."""
        # Same-spec groups are searched together, full attention first.
        kinds: list[tuple[KVCacheSpec, list[int]]] = []
        for g, spec in enumerate(specs):
            for known, ids in kinds:
                if known == spec:
                    ids.append(g)
                    break
            else:
                kinds.append((spec, [g]))
        kinds.sort(key=lambda k: k[0].attention is not AttentionType.FULL)
        self._kinds = kinds

    def _hisparse_managers(
        self,
        layout: HiSparseLayout,
        specs: tuple[KVCacheSpec, ...],
        enable_caching: bool,
        profile: Profile,
    ) -> list[SingleTypeKVCacheManager]:
        """HiSparse's groups: the source on a host pool of its own (medium CPU, its events in
        the device pool's queue, as vLLM 0.33.0's ``HiSparseSourceManager.bind_host_pool``
        and ``SharedEventQueueBlockPool``; no metrics collector and no look-ahead tokens, as
        vLLM builds it), indexers as full attention, resident and hot groups; and the
        coordinator tying them (vLLM builds it on ``get_hisparse_coordinator``'s first call,
        kvpool with the manager: docs/hisparse.md, "The groups")."""
        device = self.block_pool
        host = BlockPool(
            layout.host_num_blocks,
            enable_caching,
            device.hash_block_size,
            device.enable_kv_cache_events,
            None,
            0,
            MEDIUM_CPU,
            profile=profile,
            event_owner=device,
        )
        self.host_block_pool = host
        managers: list[SingleTypeKVCacheManager] = []
        residents: list[HiSparseResidentManager] = []
        hots: list[HiSparseHotManager] = []
        source: HiSparseSourceManager | None = None
        for g, spec in enumerate(specs):
            if g == layout.source:
                source = HiSparseSourceManager(spec, host, g, device.num_gpu_blocks)
                managers.append(source)
            elif g in layout.residents:
                resident = HiSparseResidentManager(spec, device, g, layout.max_admission_pages)
                residents.append(resident)
                managers.append(resident)
            elif g in layout.hots:
                hot = HiSparseHotManager(
                    spec, device, g, layout.blocks_per_request[layout.hots.index(g)]
                )
                hots.append(hot)
                managers.append(hot)
            else:
                managers.append(get_manager_for_kv_cache_spec(spec, device, g))
        assert source is not None
        self.hisparse = HiSparseCoordinator(
            layout, source, residents, hots, device, self._reprefillable
        )
        return managers

    # ------------------------------------------------------------------
    # Hits
    # ------------------------------------------------------------------

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest prefix every group has cached, and its length in tokens."""
        blocks, length, uncached = self._find(block_hashes, max_length)
        self._uncached = uncached
        return blocks, length

    def _find(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        """The hit, its length, and how far past it some group's own search reached."""
        managers = self.managers
        if self.hisparse_layout is not None:
            return self._hisparse_find(self.hisparse_layout, block_hashes, max_length)
        if len(managers) == 1:
            manager = managers[0]
            hit = type(manager).find_longest_cache_hit(
                block_hashes,
                max_length,
                [0],
                self.block_pool,
                manager.kv_cache_spec,
                self._eagle_flags[0],
            )
            return hit, self._extend(hit, block_hashes, max_length, [0], manager.kv_cache_spec), 0

        hits: dict[int, list[KVCacheBlock]] = {}
        lengths: dict[int, int] = {}
        length = max_length
        longest = 0
        flags = self._eagle_flags
        kinds = self._kinds
        # full attention and one other kind: one round (vLLM's "simple hybrid")
        simple = len(kinds) == 2 and kinds[0][0].attention is AttentionType.FULL
        num_hashed = len(block_hashes) * self.block_pool.hash_block_size
        verified: set[int] = set()  # EAGLE kinds that dropped at this candidate length
        # several groups hit where all can resume: multiples of the scheduler block size
        alignment = 0 if self.fine_grained_hits else self.scheduler_block_size
        while True:
            candidate = length
            for k, (spec, ids) in enumerate(kinds):
                cls = type(managers[ids[0]])
                if spec.attention is AttentionType.FULL and ids[0] in hits:
                    candidate = min(candidate, lengths[ids[0]])
                    continue
                drop = flags[ids[0]] and k not in verified
                reach = candidate
                if drop and spec.attention is not AttentionType.MAMBA:
                    # peek one block past the candidate, then drop back to it
                    reach = min(candidate + spec.block_size, num_hashed)
                first = managers[ids[0]]
                if isinstance(first, MambaFineManager):
                    # hits inside a Mamba block (kvpool.impl.mamba_fine)
                    found, found_length = first.find_fine_hit(block_hashes, reach, ids)
                else:
                    found = cls.find_longest_cache_hit(
                        block_hashes, reach, ids, self.block_pool, spec, drop, alignment
                    )
                    found_length = self._extend(found, block_hashes, reach, ids, spec)
                if drop:
                    verified.add(k)
                elif found_length < candidate:
                    verified.clear()
                candidate = found_length
                for g, blocks in zip(ids, found, strict=True):
                    hits[g] = blocks
                    lengths[g] = candidate
                if candidate > longest:
                    longest = candidate
            if candidate >= length:
                break
            length = candidate
            if simple:
                break
        # every group's hit cut back to the reconciled length, in its own blocks
        return (
            tuple(hits[g][: -(-length // managers[g].block_size)] for g in range(len(managers))),
            length,
            longest - length,
        )

    def _hisparse_find(
        self, layout: HiSparseLayout, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        """HiSparse's hit: the source's on the host pool, then the indexers' on the device pool
        up to it; the resident and hot groups are not prefix-cacheable and take no part. The
        indexers are cut to the common length; the source keeps its longer hit
        (``retains_longer_hit``: vLLM 0.33.0's ``HybridKVCacheCoordinator.find_longest_cache_hit``
        with ``HiSparseSourceManager``)."""
        managers = self.managers
        alignment = self.scheduler_block_size
        hits: list[list[KVCacheBlock]] = [[] for _ in managers]
        # the source alone, indexers of one spec together (as vLLM groups them: same spec,
        # manager class and pool), searched in group order, each up to the length so far
        kinds: list[tuple[KVCacheSpec, list[int]]] = []
        for g in sorted((layout.source, *layout.indexers)):
            for known, ids in kinds:
                if (
                    g != layout.source
                    and ids[0] != layout.source
                    and known == managers[g].kv_cache_spec
                ):
                    ids.append(g)
                    break
            else:
                kinds.append((managers[g].kv_cache_spec, [g]))
        length = max_length
        longest = 0
        for spec, ids in kinds:
            found = FullAttentionManager.find_longest_cache_hit(
                block_hashes, length, ids, managers[ids[0]].block_pool, spec, False, alignment
            )
            length = len(found[0]) * spec.block_size
            longest = length if length > longest else longest
            for g, blocks in zip(ids, found, strict=True):
                hits[g] = blocks
        for g in layout.indexers:
            del hits[g][-(-length // managers[g].block_size) :]
        return tuple(hits), length, longest - length

    def _extend(
        self,
        found: tuple[list[KVCacheBlock], ...],
        block_hashes: Sequence[bytes],
        max_length: int,
        ids: Sequence[int],
        spec: KVCacheSpec,
    ) -> int:
        """With fine-grained hits, extend a full-attention hit (in place) into the next
        block at its highest cached hash boundary; return the hit's length in tokens."""
        block_size = spec.block_size
        if not self.fine_grained_hits or spec.attention is not AttentionType.FULL:
            return len(found[0]) * block_size
        hbs = self.block_pool.hash_block_size
        scale = block_size // hbs
        first = len(found[0]) * scale
        top = min(first + scale - 1, max_length // hbs, len(block_hashes))
        for fine_idx in range(top - 1, first - 1, -1):
            tail = self.block_pool.get_cached_block(block_hashes[fine_idx], ids)
            if tail is None:
                continue
            for blocks, block in zip(found, tail, strict=True):
                blocks.append(block)
            return (fine_idx + 1) * hbs
        return len(found[0]) * block_size

    def get_computed_blocks(self, request: Any) -> tuple[KVCacheBlocks, int, int]:
        """vLLM 0.33's lookup: the cached blocks the request may reuse (at most num_tokens - 1
        tokens), their tokens, and the shared-prefix boundary (the hit plus the tokens some
        group's own search reached beyond it, or 0; always 0 with one group).

        Complexity: O(blocks looked up).
        """
        # Verify that the request has the fields the manager reads, of their types
        _verify_request(request, lookup_only=True)
        # Verify that the request is hashed in the pool's hash blocks
        verify_hash_block_size(request, self.block_pool.hash_block_size)
        if not self.enable_caching or getattr(request, "skip_reading_prefix_cache", False):
            return self.empty_kv_cache_blocks, 0, 0
        return self._lookup(request)

    def _lookup(self, request: Any) -> tuple[KVCacheBlocks, int, int]:
        # through find_longest_cache_hit, which a subclass may override; it leaves the
        # tokens past the hit some group reached in _uncached
        self._uncached = 0
        blocks, num_tokens = self.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        uncached = self._uncached
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats = record(
                self.prefix_cache_stats,
                request.num_tokens,
                num_tokens,
                request.num_preemptions > 0,
            )
        boundary = num_tokens + uncached if uncached else 0
        return self.create_kv_cache_blocks(blocks), num_tokens, boundary

    # ------------------------------------------------------------------
    # Allocation
    # ------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: Unchecked,
        num_new_computed_tokens: Unchecked = 0,
        new_computed_blocks: Unchecked = None,
        num_lookahead_tokens: Unchecked = 0,
        num_external_computed_tokens: Unchecked = 0,
        delay_cache_blocks: Unchecked = False,
        num_encoder_tokens: Unchecked = 0,
        full_sequence_must_fit: Unchecked = False,
        reserved_blocks: Unchecked = 0,
        has_scheduled_reqs: Unchecked = True,
        skip_zeroing_group_ids: Unchecked = (),
    ) -> KVCacheBlocks | None:
        """New slots for ``num_new_tokens`` (and look-ahead), or None with nothing else changed.

        Order: with ``full_sequence_must_fit``, None unless the whole sequence
        (at most max_model_len tokens) fits; free blocks outside the window;
        count (free hits included); refuse if short; touch hits; record them;
        allocate; cache the blocks full within min(computed + hits + new, the
        request's tokens).

        Complexity: O(blocks touched, allocated, released or cached).
        """
        managers = self.managers
        # Verify that the arguments have the operation's types
        _verify_request(request)
        _verify_ints(
            num_new_tokens=num_new_tokens,
            num_new_computed_tokens=num_new_computed_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens,
            reserved_blocks=reserved_blocks,
        )
        if not isinstance(delay_cache_blocks, bool):
            raise InvalidArgument("delay_cache_blocks must be a bool")
        # Verify that the arguments kvpool does not model keep vLLM's defaults (vLLM 0.33's
        # parameters, in its order, so that a caller passing them by position is read right)
        unmodelled = {
            "num_encoder_tokens": (num_encoder_tokens, 0),
        }
        for name, (value, default) in unmodelled.items():
            if type(value) is not int or value != default:
                raise InvalidArgument(f"{name}={value!r:.60}: kvpool models only {default!r}")
        if not isinstance(skip_zeroing_group_ids, (tuple, list)):
            raise InvalidArgument("skip_zeroing_group_ids must be a tuple or list of group ids")
        # has_scheduled_reqs only decides whether vLLM applies its watermark, which is 0 here
        if not isinstance(has_scheduled_reqs, bool):
            raise InvalidArgument("has_scheduled_reqs must be a bool")
        if not isinstance(full_sequence_must_fit, bool):
            raise InvalidArgument("full_sequence_must_fit must be a bool")
        # Verify that a sparse-retention manager can read the request's shared-prefix boundary
        if self._retains_sparsely:
            shared_prefix_boundary(request)
        # Verify that the hits are KVCacheBlocks: kvpool's, or vLLM's holding this pool's
        # blocks (a KV connector's caller may build vLLM's class around them)
        if new_computed_blocks is not None and not (
            isinstance(new_computed_blocks, KVCacheBlocks)
            or type(new_computed_blocks).__name__ == "KVCacheBlocks"
        ):
            raise InvalidArgument("new_computed_blocks must be KVCacheBlocks or None")
        rid = request.request_id
        given: Any = (
            self.empty_kv_cache_blocks.blocks
            if new_computed_blocks is None
            else getattr(new_computed_blocks, "blocks", None)
        )
        # Checked while still untyped: the compiled build checks the typed local below itself,
        # and would raise a bare TypeError for vLLM's class holding a list
        if type(given) is not tuple or not all(isinstance(g, Sequence) for g in given):
            raise InvalidArgument("new_computed_blocks.blocks must be a tuple of lists")
        hits: tuple[Sequence[KVCacheBlock], ...] = given
        # Verify that the request is hashed in the pool's hash blocks
        verify_hash_block_size(request, self.block_pool.hash_block_size)
        ext: int = num_external_computed_tokens
        # Verify that at least one new token is asked for (none while external tokens load)
        if num_new_tokens < 0 or (num_new_tokens == 0 and ext <= 0):
            raise NoNewTokens(f"num_new_tokens must be positive, got {num_new_tokens}")
        # Verify that the other counts are not negative
        if num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise InvalidTokenCount("num_new_computed_tokens and num_lookahead_tokens must be >= 0")
        # Verify that the KV connector's arguments are valid (kvpool.impl.external)
        external.verify_arguments(
            managers,
            request,
            num_new_computed_tokens,
            ext,
            reserved_blocks,
            skip_zeroing_group_ids,
        )
        layout = self.hisparse_layout
        if layout is not None:
            # Verify that no HiSparse path of a later slice is taken (host hits, imports)
            hits = _hisparse_admit(layout, managers, hits, num_new_computed_tokens, ext)
        # Verify that the hits have one entry per group, of known blocks
        if len(hits) != len(managers):
            raise InvalidHit(f"{len(hits)} hit lists for {len(managers)} groups")
        has_hits = False
        for group_hits in hits:
            for block in group_hits:
                if type(block) is not KVCacheBlock or block.pool is not self.block_pool:
                    raise UnknownBlock(f"hit {block!r} is not a block of the pool")
                has_hits = True
        # Verify that hits come only with prefix caching
        if has_hits and not self.enable_caching:
            raise CachingDisabled("cache hits passed to a manager without prefix caching")
        # Verify that only a request holding no blocks takes hits
        if has_hits and any(rid in m.req_to_blocks for m in managers):
            raise HitOnRunningRequest(f"request {rid!r} already holds blocks")

        num_computed = request.num_computed_tokens + num_new_computed_tokens
        # A hit ending inside a block is copied to a private block (copy-on-write)
        partial = [
            len(group_hits) > 0 and num_computed % m.block_size != 0
            for m, group_hits in zip(managers, hits, strict=True)
        ]
        # Verify that a hit ending inside a block ends in its last block
        for g, m in enumerate(managers):
            if partial[g] and num_computed // m.block_size != len(hits[g]) - 1:
                raise InvalidHit(
                    f"a hit of {num_computed} tokens ends in block "
                    f"{num_computed // m.block_size}, not in the last of the "
                    f"{len(hits[g])} hit blocks of group {g}"
                )
        # Verify that external tokens do not follow a hit ending inside a block (not modelled)
        if ext > 0 and any(partial):
            raise InvalidArgument("external tokens after a hit ending inside a block: not modelled")
        total = num_computed + ext
        num_total = total if total < self.max_model_len else self.max_model_len
        if self.enable_caching and not delay_cache_blocks:
            # Verify that the hashes the caching step will read are bytes (read before
            # anything changes, so a bad request is rejected whole)
            self._verify_hashes_to_cache(
                request, hits, min(num_total + num_new_tokens, request.num_tokens)
            )
            if self._caches_prompt_tail:
                num_prompt_tokens(request)

        if full_sequence_must_fit and not self._full_sequence_fits(
            request, hits, partial, num_computed, total if ext > 0 else -1
        ):
            return None
        for manager in managers:
            manager.remove_skipped_blocks(rid, request.num_computed_tokens)
        num_slots = min(num_total + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        # A Mamba "align" group sizes its table by the main model's tokens, not the look-ahead
        slots = [
            num_computed + num_new_tokens if m.kv_cache_spec.mamba_align else num_slots
            for m in managers
        ]
        needed = 0
        for g, (manager, group_hits) in enumerate(zip(managers, hits, strict=True)):
            if ext > 0:
                needed += external.blocks_to_allocate(manager, slots[g], group_hits, total)
                continue
            if isinstance(manager, (MambaReservingManager, MambaFineReservingManager)):
                # a Mamba "align" group with checkpoint blocks records its checkpoint as it counts
                manager.plan_checkpoint(rid, num_computed, slots[g])
            needed += manager.get_num_blocks_to_allocate(rid, slots[g], group_hits)
        needed += sum(partial)
        if needed > self.block_pool.get_num_free_blocks() - reserved_blocks:
            return None
        if ext > 0:
            return self._allocate_with_external(
                request,
                num_computed,
                ext,
                num_new_tokens,
                slots,
                hits,
                delay_cache_blocks,
                skip_zeroing_group_ids,
            )

        if self.enable_caching and has_hits:
            for group_hits in hits:
                self.block_pool.touch(group_hits)
        for g, (manager, group_hits) in enumerate(zip(managers, hits, strict=True)):
            manager.save_new_computed_blocks(rid, group_hits)
            if partial[g]:
                # only the whole blocks count as cached: the copy is cached once full
                manager.num_cached_block[rid] = num_computed // manager.block_size
        new_blocks: list[list[KVCacheBlock]] = []
        for g, manager in enumerate(managers):
            copied: list[KVCacheBlock] = []
            if isinstance(manager, MambaFineManager):
                # the group copies a state a hit ends inside, or one the request keyed inside
                # a block, itself (kvpool.impl.mamba_fine)
                hit = (num_computed // manager.block_size, hits[g][-1]) if partial[g] else None
                new, copy = manager.allocate_with_copy(rid, slots[g], hit)
                if copy is not None:
                    self.pending_copies.append(copy)
                new_blocks.append(new)
                continue
            if partial[g]:
                copied.append(self._copy_on_write(manager, rid, num_computed, hits[g][-1]))
            new = manager.allocate_new_blocks(rid, slots[g])
            if self._records_new_blocks[g]:
                self.new_block_ids.extend((g, b.block_id) for b in new)
            new_blocks.append(copied + new)
        if self.enable_caching and not delay_cache_blocks:
            num_to_cache = min(num_computed + num_new_tokens, request.num_tokens)
            self._cache(request, num_to_cache)
        return self.create_kv_cache_blocks(tuple(new_blocks))

    def _allocate_with_external(
        self,
        request: Any,
        num_local: int,
        num_external: int,
        num_new_tokens: int,
        slots: list[int],
        hits: tuple[Sequence[KVCacheBlock], ...],
        delay_cache_blocks: bool,
        skip_zeroing_group_ids: Sequence[int],
    ) -> KVCacheBlocks:
        """``allocate_slots`` for a request holding nothing that comes with external tokens
        (checked, counted, known to fit): every group takes its hit, then every group gives
        the external tokens their blocks, then the step's (``kvpool.impl.external``)."""
        rid = request.request_id
        managers = self.managers
        total = num_local + num_external
        external.take_hits(managers, rid, hits, total, self.enable_caching)
        for g, manager in enumerate(managers):
            loaded = external.allocate_external(manager, rid, num_local, num_external)
            if self._records_new_blocks[g] and g not in skip_zeroing_group_ids:
                self.new_block_ids.extend((g, b.block_id) for b in loaded)
        new_blocks: list[list[KVCacheBlock]] = []
        for g, manager in enumerate(managers):
            new = manager.allocate_new_blocks(rid, slots[g])
            if self._records_new_blocks[g]:
                self.new_block_ids.extend((g, b.block_id) for b in new)
            new_blocks.append(new)
        if self.enable_caching and not delay_cache_blocks:
            num_total = total if total < self.max_model_len else self.max_model_len
            self._cache(request, min(num_total + num_new_tokens, request.num_tokens))
        return self.create_kv_cache_blocks(tuple(new_blocks))

    def _full_sequence_fits(
        self,
        request: Any,
        hits: tuple[Sequence[KVCacheBlock], ...],
        partial: list[bool],
        num_computed: int,
        num_total_computed: int = -1,
    ) -> bool:
        """Whether the free queue holds the blocks the request's whole sequence needs: per
        group those it lacks beyond its blocks and hits, at most the group's admission cap,
        plus its free hits and a hit's copy. With external tokens (``num_total_computed``
        the computed tokens they end at) as ``kvpool.impl.external.blocks_to_allocate``."""
        num_tokens = min(request.num_tokens, self.max_model_len)
        rid = request.request_id
        if self.hisparse_layout is not None:
            # HiSparse: the source's host count (or the sentinel), the indexers' blocks, the
            # resident pages capped at the admission window, the hot region if required
            needed = 0
            for manager in self.managers:
                if isinstance(manager, HiSparseResidentManager):
                    needed += manager.get_num_blocks_to_allocate_capped(rid, num_tokens)
                else:
                    needed += manager.get_num_blocks_to_allocate(rid, num_tokens, ())
            return needed <= self.block_pool.get_num_free_blocks()
        if num_total_computed >= 0:
            total = min(num_total_computed, self.max_model_len)
            needed = 0
            for g, manager in enumerate(self.managers):
                cap = self._admission_caps[g]
                needed += external.blocks_to_allocate(manager, num_tokens, hits[g], total, cap)
            return needed <= self.block_pool.get_num_free_blocks()
        needed = 0
        for g, manager in enumerate(self.managers):
            if isinstance(manager, MambaAlignManager):
                # counted as an allocation of the whole sequence would be, capped like one
                start = num_computed if num_computed < self.max_model_len else self.max_model_len
                if isinstance(manager, MambaFineReservingManager):
                    needed += fine_admission_blocks(manager, rid, num_tokens, hits[g], start)
                else:
                    needed += admission_blocks(manager, rid, num_tokens, hits[g], start)
                # a hit ending inside a block takes its copy too (kvpool.impl.mamba_fine)
                needed += int(partial[g])
                continue
            required = _cdiv(num_tokens, manager.block_size)
            cap = self._admission_caps[g]
            if cap is not None and cap < required:
                required = cap
            lacking = required - len(manager.req_to_blocks.get(rid, ())) - len(hits[g])
            needed += max(lacking, 0) + int(partial[g])
            for block in hits[g]:
                if block.ref_cnt == 0 and not block.is_null:
                    needed += 1
        return needed <= self.block_pool.get_num_free_blocks()

    def _copy_on_write(
        self, manager: SingleTypeKVCacheManager, rid: str, num_computed: int, source: KVCacheBlock
    ) -> KVCacheBlock:
        """Put a fresh block in place of the shared block the hit ends in; record the copy.

        The fresh block takes a second reference, the copy's; the source keeps
        the request's until the scheduler frees both ends after the copy.
        """
        destination = self.block_pool.get_new_blocks(1)[0]
        self.block_pool.touch([destination])
        manager.req_to_blocks[rid][num_computed // manager.block_size] = destination
        self.pending_copies.append((source, destination))
        self.new_block_ids.append((manager.kv_cache_group_id, destination.block_id))
        return destination

    def _cache(self, request: Any, num_tokens: int) -> None:
        """Cache every group's full blocks, and the prompt's tail where blocks hold several hash
        blocks (the managers' ``cache_blocks``), each of the tokens ``cacheable`` allows
        (with several groups rounded to the scheduler block size, unrounded with fine-grained
        hits)."""
        hybrid = len(self.managers) > 1
        counts = [
            cacheable(
                hybrid,
                manager.block_size,
                self.scheduler_block_size,
                manager.use_eagle,
                self.fine_grained_hits,
                self._reprefillable,
                num_tokens,
            )
            for manager in self.managers
        ]
        # Verify that every group holds the blocks it would cache (checked before any group
        # caches: with blocks of several sizes, a group of smaller blocks runs out first)
        hashed = len(request.block_hashes) * self.block_pool.hash_block_size
        for manager, count in zip(self.managers, counts, strict=True):
            blocks = manager.req_to_blocks.get(request.request_id)
            if isinstance(manager, (MambaReservingManager, MambaFineReservingManager)):
                manager.verify_checkpoint(request.request_id)
            spec = manager.kv_cache_spec
            # a whole-request Mamba group caches nothing; an "align" group caches its states;
            # HiSparse's resident and hot groups cache nothing
            if (
                blocks is None
                or (spec.attention is AttentionType.MAMBA and not spec.mamba_align)
                or isinstance(manager, (HiSparseResidentManager, HiSparseHotManager))
            ):
                continue
            num_full = (count if count < hashed else hashed) // manager.block_size
            if num_full > len(blocks) and num_full > manager.num_cached_block[request.request_id]:
                raise InvalidBlockRange(
                    f"cannot cache blocks [{manager.num_cached_block[request.request_id]}:"
                    f"{num_full}] of a request with {len(blocks)} blocks"
                )
        for manager, count in zip(self.managers, counts, strict=True):
            manager.cache_blocks(request, count)

    def _verify_hashes_to_cache(
        self, request: Any, hits: tuple[Sequence[KVCacheBlock], ...], num_tokens: int
    ) -> None:
        """Raise InvalidArgument unless each hash caching up to ``num_tokens`` reads is bytes."""
        hbs = self.block_pool.hash_block_size
        hashes = request.block_hashes
        rid = request.request_id
        # HiSparse's resident and hot groups never cache: their count stays 0
        start = min(
            m.num_cached_block.get(rid, len(group_hits)) * m.block_size // hbs
            for m, group_hits in zip(self.managers, hits, strict=True)
            if not isinstance(m, (HiSparseResidentManager, HiSparseHotManager))
        )
        for i in range(start, min(num_tokens // hbs, len(hashes))):
            if not isinstance(hashes[i], bytes):
                raise InvalidArgument(f"block hash {i} of the request is not bytes")

    def free(self, request: Any) -> None:
        """Release every block of the request in every group, each group's last block first."""
        # Verify that the request has an id
        _verify_request_id(getattr(request, "request_id", None))
        hisparse = self.hisparse
        if hisparse is not None:
            # HiSparse reads from it whether the request finished (kvpool.impl.hisparse)
            hisparse.freeing = request
        try:
            for manager in self.managers:
                manager.free(request.request_id)
        finally:
            if hisparse is not None:
                hisparse.freeing = None

    def cache_blocks(self, request: Any, num_computed_tokens: Unchecked) -> None:
        """Cache the blocks full within ``num_computed_tokens``, if caching is on."""
        # Verify that the arguments have the operation's types
        _verify_request(request)
        _verify_ints(num_computed_tokens=num_computed_tokens)
        # Verify that a sparse-retention manager can read the request's shared-prefix boundary
        if self._retains_sparsely:
            shared_prefix_boundary(request)
        if self.enable_caching:
            self._verify_hashes_to_cache(
                request, self.empty_kv_cache_blocks.blocks, num_computed_tokens
            )
            if self._caches_prompt_tail:
                num_prompt_tokens(request)
            self._cache(request, num_computed_tokens)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Remove the given blocks from the prefix cache."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash if no block is held; flag it in the stats.

        With HiSparse, in both pools, and only if neither holds a block: vLLM 0.33.0 resets
        each pool that is idle even when the other refuses (``KVCacheCoordinator.
        reset_prefix_cache``), kvpool changes nothing when it answers False
        (docs/hisparse.md, "Surprises": a deliberate difference)."""
        host = self.host_block_pool
        if host is not None:
            if host.get_num_free_blocks() != host.num_gpu_blocks - 1:
                return False
            if self.block_pool.get_num_free_blocks() != self.block_pool.num_gpu_blocks - 1:
                return False
            host.reset_prefix_cache()
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats = replace(self.prefix_cache_stats, reset=True)
        return True

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Take the stats gathered so far (None unless log_stats) and start new ones."""
        if self.prefix_cache_stats is None:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def take_events(self) -> list[KVCacheEvent]:
        """Every pool event since the last call, oldest first, each ``BlockStored`` annotated
        with its group's spec kind and sliding window (vLLM 0.33's manager does so; the pool
        does not). An event of no group (``group_idx`` None) passes as it is; one naming a
        group the manager does not have passes as it is too, with a warning.

        A ``BlockStored`` of the model's (frozen) is replaced by an annotated copy; one of a
        caller's event classes (``BlockPool.event_hook``) is annotated in place, as vLLM's are.
        """
        events = self.block_pool.take_events()
        metadata = self.kv_cache_event_metadata
        for i, event in enumerate(events):
            foreign = not isinstance(event, BlockStored)
            if foreign and type(event).__name__ != "BlockStored":
                continue
            group = getattr(event, "group_idx", None)
            if group is None:
                continue
            if not isinstance(group, int) or not 0 <= group < len(metadata):
                self.logger.warning("Group index `%s` not in KV cache metadata", group)
                continue
            kind, window = metadata[group]
            if foreign:
                target: Any = event
                target.kv_cache_spec_kind = kind
                target.kv_cache_spec_sliding_window = window
            else:
                stored: Any = event
                events[i] = replace(
                    stored, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window
                )
        return events

    # ------------------------------------------------------------------
    # vLLM 0.33's further scheduler calls
    # ------------------------------------------------------------------

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """The pending copies, oldest first, and the blocks they retain (source, destination
        of each); the scheduler frees those with ``block_pool.free_blocks`` after the copy."""
        pending, self.pending_copies = self.pending_copies, []
        copies = [KVCacheBlockCopy(src.block_id, dst.block_id) for src, dst in pending]
        return copies, [block for pair in pending for block in pair]

    def truncate_computed_blocks(
        self, blocks: Unchecked, num_computed_tokens: Unchecked
    ) -> KVCacheBlocks:
        """The hit cut back to ``num_computed_tokens`` (whole blocks of every group); pure."""
        # Verify that the arguments have the operation's types
        if not isinstance(blocks, KVCacheBlocks):
            raise InvalidArgument("blocks must be KVCacheBlocks")
        _verify_ints(num_computed_tokens=num_computed_tokens)
        # Verify that the hit has one entry per group
        if len(blocks.blocks) != len(self.managers):
            raise InvalidHit(f"{len(blocks.blocks)} hit lists for {len(self.managers)} groups")
        out: list[list[KVCacheBlock]] = []
        for manager, group_blocks in zip(self.managers, blocks.blocks, strict=True):
            # Verify that the length is a whole number of blocks
            if num_computed_tokens < 0 or num_computed_tokens % manager.block_size != 0:
                raise InvalidTokenCount(
                    f"num_computed_tokens={num_computed_tokens} is not a whole number of "
                    f"{manager.block_size}-token blocks"
                )
            count = num_computed_tokens // manager.block_size
            if manager.kv_cache_spec.attention is AttentionType.MAMBA:
                count = min(count, len(group_blocks))
            # Verify that the hit covers the length
            elif count > len(group_blocks):
                raise InvalidHit(f"a hit of {len(group_blocks)} blocks cannot cover {count}")
            out.append(list(group_blocks[:count]))
        return self.create_kv_cache_blocks(tuple(out))

    def take_new_block_ids(self) -> list[int]:
        """The blocks to zero recorded since the last call (copy destinations; beside a Mamba
        group, every attention group's new blocks), group by group."""
        ids, self.new_block_ids = self.new_block_ids, []
        ids.sort(key=lambda entry: entry[0])
        return [block for _, block in ids]

    def estimate_cached_tokens(self, request: Any) -> int:
        """The fewest tokens any group's blocks of the request are cached for."""
        # Verify that the request has an id
        _verify_request_id(getattr(request, "request_id", None))
        cached: int | None = None
        for manager in self.managers:
            group = 0
            for block in manager.req_to_blocks.get(request.request_id, ()):
                n = block.block_hash_num_tokens
                if n is not None and n > group:
                    group = n
            cached = group if cached is None or group < cached else cached
        return cached or 0

    def new_step_starts(self) -> None:
        """A scheduler step begins: Mamba "align" groups forget the states cached in the last."""
        for manager in self.managers:
            if isinstance(manager, MambaAlignManager):
                manager.new_step_starts()

    def pop_blocks_for_free(self, request: Any) -> list[KVCacheBlock]:
        """Take the request out of every group's tables; return its blocks, still held, group
        by group in allocation order without leading nulls. The caller frees them later
        through ``block_pool.free_blocks``, last first."""
        # Verify that the request has an id
        _verify_request_id(getattr(request, "request_id", None))
        rid = request.request_id
        popped: list[KVCacheBlock] = []
        hisparse = self.hisparse
        if hisparse is not None:
            hisparse.freeing = request
        try:
            self._pop_into(rid, popped)
        finally:
            if hisparse is not None:
                hisparse.freeing = None
        return popped

    def _pop_into(self, rid: str, popped: list[KVCacheBlock]) -> None:
        for manager in self.managers:
            if isinstance(
                manager, (HiSparseSourceManager, HiSparseResidentManager, HiSparseHotManager)
            ):
                # the coordinator's free first (source), the residency row (resident groups),
                # the host blocks among the rest: each is freed to its own pool later
                popped.extend(manager.pop_blocks_for_free(rid))
                continue
            if isinstance(manager, MambaAlignManager):
                manager.forget(rid)
            blocks = manager.req_to_blocks.pop(rid, None)
            if blocks is None:
                continue
            del manager.num_cached_block[rid]
            head = 0
            while head < len(blocks) and blocks[head].is_null:
                head += 1
            popped.extend(blocks[head:])

    def remove_skipped_blocks(
        self,
        request_id: Unchecked,
        processed_computed_tokens: Unchecked,
        num_prompt_tokens: Unchecked = None,
    ) -> None:
        """Free, in every group, the blocks no token after the first
        ``processed_computed_tokens`` attends to. ``num_prompt_tokens`` is read by vLLM's
        R-SWA groups only, which kvpool does not have."""
        # Verify that the arguments have the operation's types
        _verify_request_id(request_id)
        _verify_ints(processed_computed_tokens=processed_computed_tokens)
        if num_prompt_tokens is not None:
            _verify_ints(num_prompt_tokens=num_prompt_tokens)
        # Verify that the count is not negative
        if processed_computed_tokens < 0:
            raise InvalidTokenCount(
                f"processed_computed_tokens={processed_computed_tokens} is negative"
            )
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, processed_computed_tokens)

    def get_block_ids_for_computed_tokens(
        self, request_id: Unchecked, num_computed_tokens: Unchecked
    ) -> tuple[list[int], ...]:
        """The request's block ids cut, in each attention group, to the blocks of its first
        ``num_computed_tokens`` tokens; a Mamba group's whole."""
        # Verify that the arguments have the operation's types
        _verify_request_id(request_id)
        _verify_ints(num_computed_tokens=num_computed_tokens)
        # Verify that the count is not negative
        if num_computed_tokens < 0:
            raise InvalidTokenCount(f"num_computed_tokens={num_computed_tokens} is negative")
        out: list[list[int]] = []
        for manager in self.managers:
            blocks = manager.req_to_blocks.get(request_id, [])
            if manager.kv_cache_spec.attention is not AttentionType.MAMBA:
                # vLLM 0.33 cuts by the spec's block size: per decode rank when sharded
                size = manager.block_size // manager.dcp_world_size
                blocks = blocks[: _cdiv(num_computed_tokens, size)]
            out.append([b.block_id for b in blocks])
        return tuple(out)

    def get_computed_blocks_for_connector(
        self, request: Any
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        """The lookup for a request with a KV connector: ``get_computed_blocks`` and False,
        or beside a Mamba "align" group and full attention each group's own hit, full
        attention's length, boundary 0 and whether some group lags (``per_group_lookup``)."""
        specs = self.specs
        if (
            self.enable_caching
            and len(specs) > 1
            and any(s.mamba_align for s in specs)
            and any(s.attention is AttentionType.FULL for s in specs)
        ):
            # Verify that the request has the fields the manager reads, of their types
            _verify_request(request, lookup_only=True)
            # Verify that the request is hashed in the pool's hash blocks
            verify_hash_block_size(request, self.block_pool.hash_block_size)
            if getattr(request, "skip_reading_prefix_cache", False):
                return self.empty_kv_cache_blocks, 0, 0, False
            found = per_group_lookup(
                self.managers,
                self._kinds,
                self.block_pool,
                # where hits may end inside a Mamba block: on hash blocks, full attention's
                # extended into its next block
                0 if self._fine_mamba else self.scheduler_block_size,
                request.block_hashes,
                request.num_tokens - 1,
                self._extend if self._fine_mamba else None,
            )
            if found is not None:
                hits, num_local, diverged = found
                if self.prefix_cache_stats is not None:
                    self.prefix_cache_stats = record(
                        self.prefix_cache_stats,
                        request.num_tokens,
                        num_local,
                        request.num_preemptions > 0,
                    )
                return self.create_kv_cache_blocks(hits), num_local, 0, diverged
        blocks, num_tokens, boundary = self.get_computed_blocks(request)
        return blocks, num_tokens, boundary, False

    def record_blocks_for_zeroing(self, request_id: Unchecked, start_token: Unchecked) -> None:
        """Record again for zeroing the request's blocks from ``start_token`` on, in every
        group whose new blocks are zeroed (attention groups beside Mamba ones)."""
        # Verify that the arguments have the operation's types
        _verify_request_id(request_id)
        _verify_ints(start_token=start_token)
        recording = [m for m, r in zip(self.managers, self._records_new_blocks, strict=True) if r]
        for manager in recording:
            # Verify that zeroing starts at a block boundary
            if start_token < 0 or start_token % manager.block_size != 0:
                raise InvalidTokenCount(
                    f"start_token={start_token} is not a block boundary of group "
                    f"{manager.kv_cache_group_id} ({manager.block_size} tokens)"
                )
        for manager in recording:
            blocks = manager.req_to_blocks.get(request_id, [])
            g = manager.kv_cache_group_id
            self.new_block_ids.extend(
                (g, b.block_id) for b in blocks[start_token // manager.block_size :]
            )

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """This step's Mamba "align" boundary states for a connector, per request, drained
        (only "align" groups record any)."""
        return take_boundary_state_offloads(self.managers)

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        """A finished request's partial-tail Mamba "align" states safe to offload: only a
        prompt boundary inside a Mamba block makes one (``kvpool.impl.mamba_fine``)."""
        # Verify that the request has an id
        _verify_request_id(getattr(request, "request_id", None))
        found: list[tuple[int, int, int]] = []
        for manager in self.managers:
            if isinstance(manager, MambaFineManager):
                tail = manager.finalize_partial_tail_offload(
                    request.request_id,
                    request.num_computed_tokens,
                    getattr(request, "num_in_flight_tokens", 0),
                )
                if tail is not None:
                    found.append((tail[0], tail[1].block_id, tail[2]))
        return found

    # ------------------------------------------------------------------
    # Queries
    # ------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """The fraction of usable blocks held."""
        return self.block_pool.get_usage()

    @property
    def coordinator(self) -> CoordinatorView:
        """The groups under the names vLLM's scheduler and engine read from its manager's
        coordinator, read-only (``kvpool.impl.coordinator``)."""
        return CoordinatorView(
            self.managers, self.kv_cache_config, self.fine_grained_hits, self._reprefillable
        )

    def get_num_common_prefix_blocks(self, running_request_id: Unchecked) -> list[int]:
        """Per group, the leading blocks every request holding blocks shares."""
        # Verify that the id is a request id
        _verify_request_id(running_request_id)
        return [
            m.get_num_common_prefix_blocks(running_request_id, len(m.req_to_blocks))
            for m in self.managers
        ]

    def get_blocks(self, request_id: Unchecked) -> KVCacheBlocks:
        """The request's block table in each group."""
        # Verify that the id is a request id
        _verify_request_id(request_id)
        return KVCacheBlocks(tuple(m.req_to_blocks.get(request_id, ()) for m in self.managers))

    def get_block_ids(self, request_id: Unchecked) -> tuple[list[int], ...]:
        """The request's block ids in each group."""
        return self.get_blocks(request_id).get_block_ids()

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        """Wrap per-group block lists; the shared empty instance when there are none."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def snapshot(self) -> KVCacheManagerState:
        """The manager as the model's state (the abstraction function).

        >>> from kvpool.model.single_type import full_attention
        >>> from kvpool.model.manager import new_kv_cache_manager
        >>> cfg = KVCacheConfig(4, (full_attention(2),))
        >>> KVCacheManager(cfg, 8).snapshot() == new_kv_cache_manager(4, cfg.kv_cache_groups, 8)
        True

        HiSparseNotModelled for a manager with HiSparse groups: the model's state for them
        (the host pool, the coordinator) is not defined yet (docs/hisparse.md, "Slices").
        """
        # Verify that the model has a state for this manager
        if self.hisparse is not None:
            raise HiSparseNotModelled("the model's state of a HiSparse manager: not defined yet")
        return KVCacheManagerState(
            config=ManagerConfig(
                self.max_model_len,
                self.use_eagle,
                self.log_stats,
                self.fine_grained_hits,
                self.max_in_flight_tokens,
                self.num_prefill_lookahead,
                self.scheduler_block_size,
                self.dcp_world_size,
                self.pcp_world_size,
                self.retention_interval,
                tuple(self.eagle_groups),
            ),
            managers=ManagersState(
                pool=self.block_pool.snapshot(),
                specs=self.specs,
                tables=tuple(m.table() for m in self.managers),
            ),
            stats=self.prefix_cache_stats,
            pending_copies=tuple((s.block_id, d.block_id) for s, d in self.pending_copies),
            new_block_ids=tuple(self.new_block_ids),
        )


def _hisparse_admit(
    layout: HiSparseLayout,
    managers: Sequence[SingleTypeKVCacheManager],
    hits: tuple[Sequence[KVCacheBlock], ...],
    num_new_computed_tokens: int,
    num_external_computed_tokens: int,
) -> tuple[Sequence[KVCacheBlock], ...]:
    """The hits with the source's cut to the tokens reused (its longer retained hit goes, as
    vLLM 0.33.0's ``allocate_slots`` cuts ``retained_hit_group_ids``); HiSparseNotModelled for
    the paths of later slices: external tokens (slice 4), a prefix hit (slice 3)."""
    # Verify that the hits have one entry per group
    if len(hits) != len(managers):
        raise InvalidHit(f"{len(hits)} hit lists for {len(managers)} groups")
    # Verify that no connector loads into the host tier (slice 4)
    if num_external_computed_tokens > 0:
        raise HiSparseNotModelled("external tokens beside HiSparse groups: not modelled yet")
    reused = num_new_computed_tokens + num_external_computed_tokens
    source_size = managers[layout.source].block_size
    cut = list(hits)
    cut[layout.source] = hits[layout.source][: -(-reused // source_size)]
    # Verify that no prefix hit is admitted (a hit on the host tier: slice 3)
    if num_new_computed_tokens > 0 or any(cut):
        raise HiSparseNotModelled("a prefix hit beside HiSparse groups: not modelled yet")
    return tuple(cut)


def _verify_ints(**values: object) -> None:
    """Raise InvalidArgument naming the first value that is not an int (bool is not)."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidArgument(f"{name} must be an int, got {type(value).__name__}")


def _verify_request_id(request_id: object) -> None:
    if not isinstance(request_id, str):
        raise InvalidArgument(f"a request id is a str, not {type(request_id).__name__}")


def _verify_request(request: Any, lookup_only: bool = False) -> None:
    """Raise InvalidArgument unless ``request`` has the fields the manager reads, typed.

    A lookup (``lookup_only``) reads the id, the token count, the hash block size
    and the hashes; allocating and caching also read the computed tokens, the
    preemptions and the token ids.
    """
    names = ["request_id", "num_tokens", "block_hashes"]
    if not lookup_only:
        names += ["num_computed_tokens", "num_preemptions", "all_token_ids"]
    values = {}
    for name in names:
        try:
            values[name] = getattr(request, name)
        except AttributeError:
            raise InvalidArgument(f"not a request: it has no {name!r}") from None
    _verify_request_id(values.pop("request_id"))
    sequences = {k: values.pop(k) for k in ("block_hashes", "all_token_ids") if k in values}
    _verify_ints(**values)
    for name, value in sequences.items():
        if not isinstance(value, Sequence):
            raise InvalidArgument(f"the request's {name} must be a sequence")


_VLLM_SPECS: dict[str, AttentionType] = {
    "FullAttentionSpec": AttentionType.FULL,
    "MLAAttentionSpec": AttentionType.FULL,
    "HiddenStateCacheSpec": AttentionType.FULL,
    "SlidingWindowSpec": AttentionType.SLIDING_WINDOW,
    "SlidingWindowMLASpec": AttentionType.SLIDING_WINDOW,
    "ChunkedLocalAttentionSpec": AttentionType.CHUNKED_LOCAL,
    "MambaSpec": AttentionType.MAMBA,
    # HiSparse's device groups (kvpool.impl.hisparse_groups); their own managers, not full
    # attention's, are chosen by the layout
    "HiSparseResidentSpec": AttentionType.FULL,
    "HiSparseHotSpec": AttentionType.FULL,
}
"""vLLM 0.33's spec classes (``vllm/v1/kv_cache_interface.py``) kvpool models, by class name:
each maps to the single-type manager vLLM's ``KVCacheSpecRegistry`` gives it."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _admission_cap(spec: KVCacheSpec, max_in_flight_tokens: int, max_model_len: int) -> int | None:
    """The most blocks a recycling group (sliding window, chunked local) counts for one
    request when its whole sequence must fit; None for the others."""
    if spec.attention is AttentionType.SLIDING_WINDOW:
        tokens = min(spec.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return _cdiv(tokens, spec.block_size) + 1
    if spec.attention is AttentionType.CHUNKED_LOCAL:
        tokens = min(spec.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return _cdiv(tokens, spec.block_size)
    return None


_VLLM_SPEC_KINDS: dict[str, str] = {
    "FullAttentionSpec": "full_attention",
    "MLAAttentionSpec": "mla_attention",
    "HiddenStateCacheSpec": "mla_attention",
    "SlidingWindowSpec": "sliding_window",
    "SlidingWindowMLASpec": "sliding_window_mla",
    "ChunkedLocalAttentionSpec": "chunked_local_attention",
    "MambaSpec": "mamba",
}
"""The kind vLLM 0.33 names each of those spec classes by in its events
(``get_kv_cache_spec_kind`` in ``vllm/v1/kv_cache_interface.py``: a subclass takes its
own kind before its base's, so MLA and hidden states are ``mla_attention``)."""


def _event_metadata(
    kv_cache_config: Any, specs: tuple[KVCacheSpec, ...]
) -> tuple[tuple[str, int | None], ...]:
    """Per group, the spec kind and sliding window (None unless a window) events carry.

    kvpool's own specs are named by their attention type, whose values are vLLM's kind
    names; vLLM's by their class (``_VLLM_SPEC_KINDS``), MLA included."""
    out: list[tuple[str, int | None]] = []
    for group, spec in zip(kv_cache_config.kv_cache_groups, specs, strict=True):
        window = spec.sliding_window if spec.attention is AttentionType.SLIDING_WINDOW else None
        kind = spec.attention.value
        if not isinstance(group, KVCacheSpec):
            vllm_spec = getattr(group, "kv_cache_spec", group)
            kind = _VLLM_SPEC_KINDS.get(type(vllm_spec).__name__, kind)
        out.append((kind, window))
    return tuple(out)


def _specs_of(kv_cache_config: Any) -> tuple[KVCacheSpec, ...]:
    """The groups of this module's ``KVCacheConfig``, or of vLLM's (read without importing it)."""
    try:
        groups = tuple(kv_cache_config.kv_cache_groups)
        kv_cache_config.num_blocks  # noqa: B018 (read now: a config without it is no config)
    except (AttributeError, TypeError) as error:
        raise InvalidManagerConfig(f"not a KV cache configuration: {error}") from None
    specs = []
    for group in groups:
        if isinstance(group, KVCacheSpec):
            specs.append(group)
            continue
        spec = getattr(group, "kv_cache_spec", group)
        kind = _VLLM_SPECS.get(type(spec).__name__)
        # Verify that every group is of an attention type kvpool models
        if kind is None:
            raise InvalidManagerConfig(f"kvpool does not model {type(spec).__name__} groups")
        align = kind is AttentionType.MAMBA and _mamba_align_of(spec)
        # Verify that a window keeps no extra trailing tokens (multi-module MTP's, not modelled)
        if getattr(spec, "extra_retained_tokens", 0):
            raise InvalidManagerConfig(
                f"extra_retained_tokens={spec.extra_retained_tokens}: kvpool's windows keep none"
            )
        specs.append(
            KVCacheSpec(
                kind,
                spec.block_size,
                sliding_window=getattr(spec, "sliding_window", 0) or 0
                if kind is AttentionType.SLIDING_WINDOW
                else 0,
                attention_chunk_size=getattr(spec, "attention_chunk_size", 0) or 0
                if kind is AttentionType.CHUNKED_LOCAL
                else 0,
                mamba_align=align,
                **_reserved_fields(spec, align),
                # vLLM 0.33's attention specs are sharded by default, its Mamba spec is not
                dcp_sharded=bool(getattr(spec, "dcp_sharded", kind is not AttentionType.MAMBA)),
            )
        )
    return tuple(specs)


def _mamba_align_of(spec: Any) -> bool:
    """Whether vLLM's ``MambaSpec`` is in "align" mode; InvalidManagerConfig for a mode kvpool
    does not model, and for reserved blocks outside "align" mode."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode not in ("none", "align"):
        raise InvalidManagerConfig(f"mamba_cache_mode={mode!r}: kvpool models 'none' and 'align'")
    if mode != "align":
        for name in ("num_speculative_blocks", "num_prefill_checkpoint_blocks"):
            # Verify that a whole-request Mamba spec reserves no block (not modelled)
            if getattr(spec, name, 0):
                raise InvalidManagerConfig(
                    f"{name}={getattr(spec, name)!r}: kvpool models only 0 outside 'align' mode"
                )
    return bool(mode == "align")


def _reserved_blocks_of(spec: Any) -> tuple[int, int]:
    """A vLLM "align" ``MambaSpec``'s speculative blocks and prefill-checkpoint alignment as
    kvpool's spec holds them: the alignment counts only with checkpoint blocks (vLLM 0.33.0,
    ``MambaManager.__init__`` and ``is_mamba_prefill_checkpoint_valid``: no alignment, no
    checkpoint), and how many checkpoint blocks only sizes vLLM's memory, not its tables."""
    speculative = getattr(spec, "num_speculative_blocks", 0)
    alignment = getattr(spec, "prefill_checkpoint_alignment", None)
    if not getattr(spec, "num_prefill_checkpoint_blocks", 0) or alignment is None:
        alignment = 0
    return speculative, alignment


def _verify_reserved(spec: KVCacheSpec) -> None:
    """InvalidManagerConfig unless the spec's reserved blocks are non-negative ints, and any
    only on a Mamba "align" group (as the model's ``new_managers``)."""
    for name in ("num_speculative_blocks", "prefill_checkpoint_alignment"):
        # read untyped: a compiled build would coerce an int-typed read (True to 1)
        value: object = getattr(spec, name)
        if type(value) is not int or value < 0:
            raise InvalidManagerConfig(f"{name}={value!r} must be a non-negative int")
        if value and not spec.mamba_align:
            raise InvalidManagerConfig(f'{name}={value}: only Mamba "align" groups reserve blocks')


def _reserved_fields(spec: Any, align: bool) -> dict[str, int]:
    """The reserved-block fields of kvpool's spec for vLLM's ``spec`` (none unless "align")."""
    if not align:
        return {}
    speculative, alignment = _reserved_blocks_of(spec)
    return {"num_speculative_blocks": speculative, "prefill_checkpoint_alignment": alignment}


def _align_manager(spec: KVCacheSpec, pool: BlockPool, group: int) -> MambaAlignManager:
    """A Mamba "align" group's manager: the reserving one when its spec reserves blocks."""
    if spec.num_speculative_blocks or spec.prefill_checkpoint_alignment:
        return MambaReservingManager(spec, pool, group)
    return MambaAlignManager(spec, pool, group)
