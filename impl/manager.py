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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mypy_extensions import mypyc_attr

import kvpool.impl.geometry as geometry
from kvpool.impl.block import KVCacheBlock
from kvpool.impl.pool import BlockPool, Unchecked
from kvpool.impl.single_type import (
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
    num_prompt_tokens,
    verify_hash_block_size,
)
from kvpool.model.errors import (
    CachingDisabled,
    HitOnRunningRequest,
    InvalidArgument,
    InvalidBlockRange,
    InvalidHit,
    InvalidManagerConfig,
    InvalidTokenCount,
    NoNewTokens,
    UnknownBlock,
)
from kvpool.model.events import KVCacheEvent
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
        return f"KVCacheBlocks({self.get_block_ids()})"


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

    def __init__(
        self,
        kv_cache_config: Any,
        max_model_len: int,
        scheduler_block_size: int | None = None,
        hash_block_size: int | None = None,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
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
        ``max_in_flight_tokens``, ``num_prefill_lookahead``, ``watermark`` and the Mamba
        shared-prefix checkpoint, and ``prefix_cache_retention_interval`` in the config.
        Groups may have different block sizes, and decode context parallelism multiplies a
        sharded group's (``kvpool.model.geometry``). ``fine_grained_hits`` (not vLLM's:
        there a Mamba "align" group turns it on) lets hits end inside a block when every
        group is full attention with blocks larger than a hash block, all of one size
        (vllm#51843).
        """
        # Verify that the arguments kvpool does not model keep vLLM's defaults
        unmodelled = {
            "max_in_flight_tokens": (max_in_flight_tokens, None),
            "num_prefill_lookahead": (num_prefill_lookahead, 0),
            "watermark": (watermark, 0.0),
            "enable_mamba_shared_prefix_checkpoint": (enable_mamba_shared_prefix_checkpoint, False),
        }
        for name, (value, default) in unmodelled.items():
            if value != default:
                raise InvalidManagerConfig(f"{name}={value!r}: kvpool models only {default!r}")
        specs = _specs_of(kv_cache_config)
        # Verify that the config asks for dense prefix-cache retention (the one kvpool models)
        _verify_retention(kv_cache_config, specs)
        # Verify that requests can hold at least one token
        if max_model_len < 1:
            raise InvalidManagerConfig(f"max_model_len={max_model_len} must be positive")
        # Verify that there is at least one group
        if not specs:
            raise InvalidManagerConfig("a KV cache manager needs at least one group")
        # Verify that context parallelism runs only on the groups vLLM runs it on
        geometry.check_world_sizes(specs, dcp_world_size, pcp_world_size)
        # the managers' block sizes: sharded groups' times the decode world size
        specs = geometry.sharded(specs, dcp_world_size)
        hbs = geometry.common_divisor(specs) if hash_block_size is None else hash_block_size
        # Verify that a Mamba block holds a whole request
        for spec in specs:
            if spec.attention is AttentionType.MAMBA and spec.block_size < max_model_len:
                raise InvalidManagerConfig(
                    f"a Mamba block of {spec.block_size} tokens cannot hold {max_model_len} tokens"
                )
        # Verify that EAGLE runs with a single full-attention or sliding-window group
        if use_eagle and (
            len(specs) != 1
            or specs[0].attention not in (AttentionType.FULL, AttentionType.SLIDING_WINDOW)
        ):
            raise InvalidManagerConfig("EAGLE needs one group of full attention or sliding window")
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
        scheduler = (
            geometry.common_multiple(specs)
            if scheduler_block_size is None
            else scheduler_block_size
        )
        # Verify that the scheduler block size is a multiple of every block size
        geometry.check_scheduler_block_size(specs, hbs, scheduler)
        self.scheduler_block_size: int = scheduler
        self.dcp_world_size = dcp_world_size
        self.pcp_world_size = pcp_world_size
        self.kv_cache_config = kv_cache_config
        self.specs = specs
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.managers: list[SingleTypeKVCacheManager] = [
            get_manager_for_kv_cache_spec(spec, self.block_pool, g) for g, spec in enumerate(specs)
        ]
        for manager in self.managers:
            manager.use_eagle = use_eagle
            # sliding-window groups cache only what hits at these multiples can use
            manager.cache_hit_alignment_tokens = scheduler
            sharded_group = manager.kv_cache_spec.dcp_sharded
            manager.dcp_world_size = dcp_world_size if sharded_group else 1
            manager.pcp_world_size = pcp_world_size if sharded_group else 1
        self.num_kv_cache_groups = len(specs)
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in specs))
        self.fine_grained_hits = (
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
        if len(managers) == 1:
            manager = managers[0]
            hit = type(manager).find_longest_cache_hit(
                block_hashes,
                max_length,
                [0],
                self.block_pool,
                manager.kv_cache_spec,
                self.use_eagle,
            )
            return hit, self._extend(hit, block_hashes, max_length, [0], manager.kv_cache_spec), 0

        hits: dict[int, list[KVCacheBlock]] = {}
        lengths: dict[int, int] = {}
        length = max_length
        longest = 0
        # several groups hit where all can resume: multiples of the scheduler block size
        alignment = 0 if self.fine_grained_hits else self.scheduler_block_size
        while True:
            candidate = length
            for spec, ids in self._kinds:
                cls = type(managers[ids[0]])
                if spec.attention is AttentionType.FULL and ids[0] in hits:
                    candidate = min(candidate, lengths[ids[0]])
                    continue
                found = cls.find_longest_cache_hit(
                    block_hashes, candidate, ids, self.block_pool, spec, False, alignment
                )
                candidate = self._extend(found, block_hashes, candidate, ids, spec)
                for g, blocks in zip(ids, found, strict=True):
                    hits[g] = blocks
                    lengths[g] = candidate
                if candidate > longest:
                    longest = candidate
            if candidate >= length:
                break
            length = candidate
        return (
            tuple(hits[g][: -(-length // managers[g].block_size)] for g in range(len(managers))),
            length,
            longest - length,
        )

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

    def get_computed_blocks(self, request: Any) -> tuple[KVCacheBlocks, int]:
        """The cached blocks the request may reuse (at most num_tokens - 1 tokens) and their tokens.

        Complexity: O(blocks looked up).
        """
        # Verify that the request has the fields the manager reads, of their types
        _verify_request(request, lookup_only=True)
        # Verify that the request is hashed in the pool's hash blocks
        verify_hash_block_size(request, self.block_pool.hash_block_size)
        if not self.enable_caching or getattr(request, "skip_reading_prefix_cache", False):
            return self.empty_kv_cache_blocks, 0
        blocks, num_tokens, _ = self._lookup(request)
        return blocks, num_tokens

    def get_computed_blocks_with_boundary(self, request: Any) -> tuple[KVCacheBlocks, int, int]:
        """vLLM 0.33's ``get_computed_blocks``: the hit, its tokens, and the shared-prefix
        boundary (the hit plus the tokens some group reached beyond it, or 0)."""
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
        delay_cache_blocks: Unchecked = False,
    ) -> KVCacheBlocks | None:
        """New slots for ``num_new_tokens`` (and look-ahead), or None with nothing else changed.

        Order: free blocks outside the window; count (free hits included);
        refuse if short; touch hits; record them; allocate; cache the blocks
        full within min(computed + hits + new, the request's tokens).

        Complexity: O(blocks touched, allocated, released or cached).
        """
        managers = self.managers
        # Verify that the arguments have the operation's types
        _verify_request(request)
        _verify_ints(
            num_new_tokens=num_new_tokens,
            num_new_computed_tokens=num_new_computed_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
        )
        if not isinstance(delay_cache_blocks, bool):
            raise InvalidArgument("delay_cache_blocks must be a bool")
        if new_computed_blocks is not None and not isinstance(new_computed_blocks, KVCacheBlocks):
            raise InvalidArgument("new_computed_blocks must be KVCacheBlocks or None")
        rid = request.request_id
        hits: tuple[Sequence[KVCacheBlock], ...] = (
            self.empty_kv_cache_blocks.blocks
            if new_computed_blocks is None
            else new_computed_blocks.blocks
        )
        if type(hits) is not tuple or not all(isinstance(g, Sequence) for g in hits):
            raise InvalidArgument("new_computed_blocks.blocks must be a tuple of lists")
        # Verify that the request is hashed in the pool's hash blocks
        verify_hash_block_size(request, self.block_pool.hash_block_size)
        # Verify that at least one new token is asked for
        if num_new_tokens <= 0:
            raise NoNewTokens(f"num_new_tokens must be positive, got {num_new_tokens}")
        # Verify that the other counts are not negative
        if num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise InvalidTokenCount("num_new_computed_tokens and num_lookahead_tokens must be >= 0")
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
        if self.enable_caching and not delay_cache_blocks:
            # Verify that the hashes the caching step will read are bytes (read before
            # anything changes, so a bad request is rejected whole)
            self._verify_hashes_to_cache(
                request, hits, min(num_computed + num_new_tokens, request.num_tokens)
            )
            if self._caches_prompt_tail:
                num_prompt_tokens(request)

        for manager in managers:
            manager.remove_skipped_blocks(rid, request.num_computed_tokens)
        num_slots = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        needed = 0
        for manager, group_hits in zip(managers, hits, strict=True):
            needed += manager.get_num_blocks_to_allocate(rid, num_slots, group_hits)
        needed += sum(partial)
        if needed > self.block_pool.get_num_free_blocks():
            return None

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
            if partial[g]:
                copied.append(self._copy_on_write(manager, rid, num_computed, hits[g][-1]))
            new_blocks.append(copied + manager.allocate_new_blocks(rid, num_slots))
        if self.enable_caching and not delay_cache_blocks:
            num_to_cache = min(num_computed + num_new_tokens, request.num_tokens)
            self._cache(request, num_to_cache)
        return self.create_kv_cache_blocks(tuple(new_blocks))

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
        blocks (the managers' ``cache_blocks``, unrounded with fine-grained hits)."""
        if len(self.managers) > 1 and not self.fine_grained_hits:
            # no hit can end past the last multiple of the scheduler block size
            num_tokens -= num_tokens % self.scheduler_block_size
        # Verify that every group holds the blocks it would cache (checked before any group
        # caches: with blocks of several sizes, a group of smaller blocks runs out first)
        hashed = len(request.block_hashes) * self.block_pool.hash_block_size
        for manager in self.managers:
            blocks = manager.req_to_blocks.get(request.request_id)
            if blocks is None or manager.kv_cache_spec.attention is AttentionType.MAMBA:
                continue
            num_full = (num_tokens if num_tokens < hashed else hashed) // manager.block_size
            if num_full > len(blocks) and num_full > manager.num_cached_block[request.request_id]:
                raise InvalidBlockRange(
                    f"cannot cache blocks [{manager.num_cached_block[request.request_id]}:"
                    f"{num_full}] of a request with {len(blocks)} blocks"
                )
        for manager in self.managers:
            manager.cache_blocks(request, num_tokens)

    def _verify_hashes_to_cache(
        self, request: Any, hits: tuple[Sequence[KVCacheBlock], ...], num_tokens: int
    ) -> None:
        """Raise InvalidArgument unless each hash caching up to ``num_tokens`` reads is bytes."""
        hbs = self.block_pool.hash_block_size
        hashes = request.block_hashes
        rid = request.request_id
        start = min(
            m.num_cached_block.get(rid, len(group_hits)) * m.block_size // hbs
            for m, group_hits in zip(self.managers, hits, strict=True)
        )
        for i in range(start, min(num_tokens // hbs, len(hashes))):
            if not isinstance(hashes[i], bytes):
                raise InvalidArgument(f"block hash {i} of the request is not bytes")

    def free(self, request: Any) -> None:
        """Release every block of the request in every group, each group's last block first."""
        # Verify that the request has an id
        _verify_request_id(getattr(request, "request_id", None))
        for manager in self.managers:
            manager.free(request.request_id)

    def cache_blocks(self, request: Any, num_computed_tokens: Unchecked) -> None:
        """Cache the blocks full within ``num_computed_tokens``, if caching is on."""
        # Verify that the arguments have the operation's types
        _verify_request(request)
        _verify_ints(num_computed_tokens=num_computed_tokens)
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
        """Forget every cached hash if no block is held; flag it in the stats."""
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
        """Every pool event since the last call, oldest first."""
        return self.block_pool.take_events()

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
        """The blocks to zero recorded since the last call (copy destinations), group by group."""
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
        """A scheduler step begins; no group kvpool models keeps per-step state."""

    # ------------------------------------------------------------------
    # Queries
    # ------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """The fraction of usable blocks held."""
        return self.block_pool.get_usage()

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
        """
        return KVCacheManagerState(
            config=ManagerConfig(
                self.max_model_len,
                self.use_eagle,
                self.log_stats,
                self.fine_grained_hits,
                self.scheduler_block_size,
                self.dcp_world_size,
                self.pcp_world_size,
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


def _verify_retention(kv_cache_config: Any, specs: Sequence[KVCacheSpec]) -> None:
    """InvalidManagerConfig unless vLLM's ``prefix_cache_retention_interval`` is None (dense),
    or 0 where no group is a sliding window or Mamba (vLLM 0.33 ignores it there).

    Sparse retention (vllm/v1/core/kv_cache_coordinator.py in 0.33.0,
    ``_validate_prefix_cache_retention_interval`` and the managers' ``reachable_block_mask``)
    caches fewer sliding-window and Mamba blocks; kvpool does not model it, so it refuses
    rather than cache what vLLM would not.
    """
    interval = getattr(kv_cache_config, "prefix_cache_retention_interval", None)
    if interval is None:
        return
    sparse = any(s.attention in (AttentionType.SLIDING_WINDOW, AttentionType.MAMBA) for s in specs)
    if interval == 0 and not sparse:
        return
    raise InvalidManagerConfig(
        f"prefix_cache_retention_interval={interval!r}: kvpool models only None (dense)"
    )


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
}
"""vLLM 0.33's spec classes (``vllm/v1/kv_cache_interface.py``) kvpool models, by class name:
each maps to the single-type manager vLLM's ``KVCacheSpecRegistry`` gives it."""


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
                # vLLM 0.33's attention specs are sharded by default, its Mamba spec is not
                dcp_sharded=bool(getattr(spec, "dcp_sharded", kind is not AttentionType.MAMBA)),
            )
        )
    return tuple(specs)
