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

from kvpool.impl.block import KVCacheBlock
from kvpool.impl.pool import BlockPool, Unchecked
from kvpool.impl.single_type import (
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
    verify_hash_block_size,
)
from kvpool.model.errors import (
    CachingDisabled,
    HitOnRunningRequest,
    InvalidArgument,
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
    ) -> None:
        """vLLM 0.33's constructor. ``kv_cache_config`` is this module's ``KVCacheConfig`` or
        vLLM's (its groups' specs are read by class name: full attention, MLA and hidden
        states, sliding window, chunked local attention, Mamba). Arguments kvpool does not
        model must keep vLLM's defaults (``InvalidManagerConfig`` otherwise):
        ``max_in_flight_tokens``, ``num_prefill_lookahead``, context parallelism,
        ``watermark`` and the Mamba shared-prefix checkpoint.
        """
        # Verify that the arguments kvpool does not model keep vLLM's defaults
        unmodelled = {
            "max_in_flight_tokens": (max_in_flight_tokens, None),
            "num_prefill_lookahead": (num_prefill_lookahead, 0),
            "dcp_world_size": (dcp_world_size, 1),
            "pcp_world_size": (pcp_world_size, 1),
            "watermark": (watermark, 0.0),
            "enable_mamba_shared_prefix_checkpoint": (enable_mamba_shared_prefix_checkpoint, False),
        }
        for name, (value, default) in unmodelled.items():
            if value != default:
                raise InvalidManagerConfig(f"{name}={value!r}: kvpool models only {default!r}")
        specs = _specs_of(kv_cache_config)
        # Verify that every group's block size divides the scheduler's
        if scheduler_block_size is not None and any(
            scheduler_block_size % s.block_size for s in specs
        ):
            raise InvalidManagerConfig(
                f"scheduler_block_size={scheduler_block_size} is not a multiple of every "
                "group's block size"
            )
        # Verify that requests can hold at least one token
        if max_model_len < 1:
            raise InvalidManagerConfig(f"max_model_len={max_model_len} must be positive")
        # Verify that there is at least one group, all with one block size
        if not specs or len({s.block_size for s in specs}) != 1:
            raise InvalidManagerConfig("the groups must be at least one and share one block size")
        hbs = specs[0].block_size if hash_block_size is None else hash_block_size
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
        self.num_kv_cache_groups = len(specs)
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in specs))
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
            return hit, len(hit[0]) * manager.block_size

        hits: dict[int, list[KVCacheBlock]] = {}
        length = max_length
        while True:
            candidate = length
            for spec, ids in self._kinds:
                cls = type(managers[ids[0]])
                if spec.attention is AttentionType.FULL and ids[0] in hits:
                    candidate = min(candidate, len(hits[ids[0]]) * spec.block_size)
                    continue
                found = cls.find_longest_cache_hit(
                    block_hashes, candidate, ids, self.block_pool, spec, False
                )
                for g, blocks in zip(ids, found, strict=True):
                    hits[g] = blocks
                candidate = len(found[0]) * spec.block_size
            if candidate >= length:
                break
            length = candidate
        keep = -(-length // self.specs[0].block_size)
        return tuple(hits[g][:keep] for g in range(len(managers))), length

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
        blocks, num_tokens = self.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats = record(
                self.prefix_cache_stats,
                request.num_tokens,
                num_tokens,
                request.num_preemptions > 0,
            )
        return self.create_kv_cache_blocks(blocks), num_tokens

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
        if self.enable_caching and not delay_cache_blocks:
            # Verify that the hashes the caching step will read are bytes (read before
            # anything changes, so a bad request is rejected whole)
            self._verify_hashes_to_cache(
                request, hits, min(num_computed + num_new_tokens, request.num_tokens)
            )

        for manager in managers:
            manager.remove_skipped_blocks(rid, request.num_computed_tokens)
        num_slots = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        needed = 0
        for manager, group_hits in zip(managers, hits, strict=True):
            needed += manager.get_num_blocks_to_allocate(rid, num_slots, group_hits)
        if needed > self.block_pool.get_num_free_blocks():
            return None

        if self.enable_caching and has_hits:
            for group_hits in hits:
                self.block_pool.touch(group_hits)
        for manager, group_hits in zip(managers, hits, strict=True):
            manager.save_new_computed_blocks(rid, group_hits)
        new_blocks = tuple(manager.allocate_new_blocks(rid, num_slots) for manager in managers)
        if self.enable_caching and not delay_cache_blocks:
            num_to_cache = min(num_computed + num_new_tokens, request.num_tokens)
            for manager in managers:
                manager.cache_blocks(request, num_to_cache)
        return self.create_kv_cache_blocks(new_blocks)

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
            for manager in self.managers:
                manager.cache_blocks(request, num_computed_tokens)

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
            config=ManagerConfig(self.max_model_len, self.use_eagle, self.log_stats),
            managers=ManagersState(
                pool=self.block_pool.snapshot(),
                specs=self.specs,
                tables=tuple(m.table() for m in self.managers),
            ),
            stats=self.prefix_cache_stats,
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
            )
        )
    return tuple(specs)
