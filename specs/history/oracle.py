"""What a manager-layer replay asks of the specification, over the model or the impl.

``ModelOracle`` runs ``kvpool.model`` (the specification itself: immutable
states, one pure function per operation). ``ImplOracle`` runs
``kvpool.impl`` (mutable, vLLM-shaped, several times faster), which the
lock-step machines check equal to the model; the checker uses it as the
fast oracle and confirms any divergence it reports on the model.

Both raise the model's exceptions (``kvpool.model.errors``) and leave their
state unchanged when they reject a call.
"""

from collections.abc import Sequence
from typing import Any, Protocol

from kvpool.impl.manager import KVCacheBlocks, KVCacheConfig, KVCacheManager
from kvpool.model import manager as mgr_ops
from kvpool.model import pool as pool_ops
from kvpool.model.errors import UnknownBlock
from kvpool.model.profiles import HASHLESS_FIRST
from kvpool.model.request import Request
from kvpool.model.single_type import KVCacheSpec
from kvpool.model.state import PoolState

Blocks = tuple[tuple[int, ...], ...]


class Oracle(Protocol):
    specs: tuple[KVCacheSpec, ...]

    def get_computed_blocks(self, request: Request) -> tuple[Blocks, int]: ...

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        hits: Blocks | None,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
    ) -> Blocks | None: ...

    def free(self, request_id: str) -> None: ...

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None: ...

    def evict_blocks(self, block_ids: Sequence[int]) -> None: ...

    def reset_prefix_cache(self) -> bool: ...

    def get_block_ids(self, request_id: str) -> Blocks: ...

    def held(self, group: int, request_id: str) -> Sequence[int] | None: ...

    def ref_cnt(self, block_id: int) -> int: ...

    def hash_num_tokens(self, block_id: int) -> int | None: ...

    def num_free_blocks(self) -> int: ...

    def max_model_len(self) -> int: ...

    def pool(self) -> PoolState: ...


class ModelOracle:
    """The specification: ``kvpool.model.manager`` over an immutable state."""

    def __init__(
        self,
        num_blocks: int,
        specs: Sequence[KVCacheSpec],
        max_model_len: int,
        hash_block_size: int,
        enable_caching: bool,
    ) -> None:
        self.state = mgr_ops.new_kv_cache_manager(
            num_blocks,
            specs,
            max_model_len,
            hash_block_size=hash_block_size,
            enable_caching=enable_caching,
            profile=HASHLESS_FIRST,
        )
        self.specs = self.state.managers.specs

    def get_computed_blocks(self, request: Request) -> tuple[Blocks, int]:
        self.state, hit = mgr_ops.get_computed_blocks(self.state, request)
        return hit

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        hits: Blocks | None,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
    ) -> Blocks | None:
        self.state, blocks = mgr_ops.allocate_slots(
            self.state,
            request,
            num_new_tokens,
            num_new_computed_tokens,
            hits,
            num_lookahead_tokens,
            delay_cache_blocks,
        )
        return blocks

    def free(self, request_id: str) -> None:
        self.state, _ = mgr_ops.free(self.state, request_id)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self.state, _ = mgr_ops.cache_blocks(self.state, request, num_computed_tokens)

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        self.state, _ = mgr_ops.evict_blocks(self.state, block_ids)

    def reset_prefix_cache(self) -> bool:
        self.state, done = mgr_ops.reset_prefix_cache(self.state)
        return done

    def get_block_ids(self, request_id: str) -> Blocks:
        return mgr_ops.get_block_ids(self.state, request_id)

    def held(self, group: int, request_id: str) -> Sequence[int] | None:
        return self.state.managers.tables[group].req_to_blocks.get(request_id)

    def ref_cnt(self, block_id: int) -> int:
        return self.state.managers.pool.blocks[block_id].ref_cnt

    def hash_num_tokens(self, block_id: int) -> int | None:
        return self.state.managers.pool.blocks[block_id].hash_num_tokens

    def num_free_blocks(self) -> int:
        return pool_ops.get_num_free_blocks(self.state.managers.pool)

    def max_model_len(self) -> int:
        return self.state.config.max_model_len

    def pool(self) -> PoolState:
        return self.state.managers.pool


def _ids(blocks: KVCacheBlocks | None) -> Blocks | None:
    return None if blocks is None else tuple(tuple(b.block_id for b in g) for g in blocks.blocks)


class ImplOracle:
    """The fast implementation: ``kvpool.impl.KVCacheManager``, equal to the model."""

    def __init__(
        self,
        num_blocks: int,
        specs: Sequence[KVCacheSpec],
        max_model_len: int,
        hash_block_size: int,
        enable_caching: bool,
    ) -> None:
        self.manager = KVCacheManager(
            KVCacheConfig(num_blocks, tuple(specs)),
            max_model_len,
            hash_block_size=hash_block_size,
            enable_caching=enable_caching,
            profile=HASHLESS_FIRST,
        )
        self.specs = tuple(specs)
        self.blocks = self.manager.block_pool.blocks

    def get_computed_blocks(self, request: Request) -> tuple[Blocks, int]:
        blocks, tokens, _ = self.manager.get_computed_blocks(request)
        found = _ids(blocks)
        assert found is not None
        return found, tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        hits: Blocks | None,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
    ) -> Blocks | None:
        computed = None
        if hits is not None:
            # Verify that the hits name blocks of this pool (the model's check, before any change)
            if any(b < 0 or b >= len(self.blocks) for g in hits for b in g):
                raise UnknownBlock(f"a cache hit names a block outside 0..{len(self.blocks) - 1}")
            computed = KVCacheBlocks(tuple([self.blocks[b] for b in g] for g in hits))
        return _ids(
            self.manager.allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                computed,
                num_lookahead_tokens,
                delay_cache_blocks=delay_cache_blocks,
            )
        )

    def free(self, request_id: str) -> None:
        self.manager.free(_Named(request_id))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self.manager.cache_blocks(request, num_computed_tokens)

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        self.manager.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()

    def get_block_ids(self, request_id: str) -> Blocks:
        return tuple(tuple(g) for g in self.manager.get_block_ids(request_id))

    def held(self, group: int, request_id: str) -> Sequence[int] | None:
        held = self.manager.managers[group].req_to_blocks.get(request_id)
        return None if held is None else [b.block_id for b in held]

    def ref_cnt(self, block_id: int) -> int:
        return self.blocks[block_id].ref_cnt

    def hash_num_tokens(self, block_id: int) -> int | None:
        return self.blocks[block_id].block_hash_num_tokens

    def num_free_blocks(self) -> int:
        return self.manager.block_pool.get_num_free_blocks()

    def max_model_len(self) -> int:
        return self.manager.max_model_len

    def pool(self) -> PoolState:
        return self.manager.block_pool.snapshot()


class _Named:
    """Just a request id, for the impl's ``free(request)``."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


ORACLES: dict[str, Any] = {"model": ModelOracle, "impl": ImplOracle}
