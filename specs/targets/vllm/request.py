"""vLLM's own ``KVCacheManager`` as a manager target (vLLM 0.33 API).

The adapter builds a one-group full-attention manager the way vLLM's CPU
recipe does (no tensors allocated) and hands it duck-typed requests that
carry kvpool's block hashes: vLLM's pool treats hashes as opaque bytes, so
both sides key their caches identically and block ids must agree call by
call.

What is compared, and what is not (docs/semantics.md, "The request layer"):

* one full-attention group with ``block_size == hash_block_size`` (vLLM's
  unitary coordinator asserts it), the hashless-first profile;
* ``get_computed_blocks`` returns a 3-tuple in 0.33; its third element (a
  shared-prefix boundary for sparse retention) is dropped. 0.33 records hit
  statistics from the scheduler, at admission; the adapter records them
  right after the lookup, where seed 004 does;
* ``get_num_common_prefix_blocks`` is deprecated in 0.33 (always 0): the
  adapter answers None and the machine does not compare it;
* events carry vLLM's integer hashes and extra fields: runs use events off;
* no snapshot: vLLM registers requests in its tables at other moments than
  the model (without any observable effect), so whole states are not
  compared; the safety checks use vLLM's block tables and the model's map.
"""

import importlib
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

from kvpool.model.events import KVCacheEvent
from kvpool.model.manager import Blocks, PrefixCacheStats
from kvpool.model.request import Request
from kvpool.model.single_type import AttentionType
from kvpool.specs.errors import TargetError
from kvpool.specs.request.target import ManagerSetup, ManagerTargetSpec


class VllmRequest:
    """The attributes of ``vllm.v1.request.Request`` that the KV cache manager reads."""

    def __init__(self, request: Request, status: Any) -> None:
        self.request_id = request.request_id
        self.block_hashes = list(request.block_hashes)
        self.all_token_ids = list(request.all_token_ids)
        self.num_tokens = request.num_tokens
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = request.num_computed_tokens
        self.num_preemptions = request.num_preemptions
        self.skip_reading_prefix_cache = request.skip_reading_prefix_cache
        self.num_in_flight_tokens = 0
        self.shared_prefix_boundary = 0
        self.status = status
        self.lora_request = None
        self.mm_features: list[Any] = []
        self.cache_salt = request.cache_salt
        self.prompt_embeds = None
        self.session_id = None


class VllmManagerTarget:
    """vLLM's ``KVCacheManager`` behind the manager protocol."""

    def __init__(self, setup: ManagerSetup) -> None:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # read when vllm is first imported
        try:
            torch = importlib.import_module("torch")
            hashing = importlib.import_module("vllm.utils.hashing")
            manager_module = importlib.import_module("vllm.v1.core.kv_cache_manager")
            utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
            interface = importlib.import_module("vllm.v1.kv_cache_interface")
            request_module = importlib.import_module("vllm.v1.request")
        except Exception as error:  # ImportError, or a dependency failing at import
            raise TargetError(f"vLLM's KVCacheManager cannot be imported: {error!r}") from error
        # reset_prefix_cache logs a warning each time it refuses; the machine asks often.
        logging.getLogger("vllm").setLevel(logging.ERROR)
        specs = setup.specs
        for spec in specs:
            if spec.attention is AttentionType.MAMBA or spec.block_size != setup.hash_block_size:
                raise TargetError("the vLLM adapter runs attention groups of hash-block size")
        utils.init_none_hash(hashing.sha256)
        self._blocks_class = manager_module.KVCacheBlocks
        self._status = request_module.RequestStatus.RUNNING
        shape: dict[str, Any] = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float32}
        groups = []
        for g, spec in enumerate(specs):
            vllm_spec: Any
            if spec.attention is AttentionType.SLIDING_WINDOW:
                vllm_spec = interface.SlidingWindowSpec(
                    block_size=spec.block_size, sliding_window=spec.sliding_window, **shape
                )
            elif spec.attention is AttentionType.CHUNKED_LOCAL:
                vllm_spec = interface.ChunkedLocalAttentionSpec(
                    block_size=spec.block_size,
                    attention_chunk_size=spec.attention_chunk_size,
                    **shape,
                )
            else:
                vllm_spec = interface.FullAttentionSpec(block_size=spec.block_size, **shape)
            groups.append(interface.KVCacheGroupSpec([f"layer.{g}"], vllm_spec))
        config = interface.KVCacheConfig(
            num_blocks=setup.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
        )
        spec = specs[0]
        self.manager = manager_module.KVCacheManager(
            config,
            max_model_len=setup.max_model_len,
            scheduler_block_size=spec.block_size,
            hash_block_size=setup.hash_block_size,
            enable_caching=setup.enable_caching,
            use_eagle=setup.use_eagle,
            log_stats=setup.log_stats,
            enable_kv_cache_events=setup.enable_events,
        )

    def _request(self, request: Request) -> VllmRequest:
        return VllmRequest(request, self._status)

    def get_computed_blocks(self, request: Request) -> tuple[Blocks, int]:
        duck = self._request(request)
        blocks, num_tokens, *_ = self.manager.get_computed_blocks(duck)
        # 0.33 records hit stats from the scheduler, at admission; seed 004 (and the
        # model) at the lookup itself: record here, where the seed does.
        self.manager.record_prefix_cache_stats(duck, num_tokens)
        return _ids(blocks), num_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Blocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> Blocks | None:
        hits = None
        if new_computed_blocks is not None and any(new_computed_blocks):
            pool_blocks = self.manager.block_pool.blocks
            hits = self._blocks_class(
                tuple([pool_blocks[b] for b in group] for group in new_computed_blocks)
            )
        blocks = self.manager.allocate_slots(
            self._request(request),
            num_new_tokens,
            num_new_computed_tokens,
            hits,
            num_lookahead_tokens,
            delay_cache_blocks=delay_cache_blocks,
        )
        return None if blocks is None else _ids(blocks)

    def free(self, request: Request) -> None:
        self.manager.free(self._request(request))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self.manager.cache_blocks(self._request(request), num_computed_tokens)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        for block_id in sorted(set(block_ids)):
            self.manager.evict_blocks({block_id})

    def reset_prefix_cache(self) -> bool:
        return bool(self.manager.reset_prefix_cache())

    def get_num_common_prefix_blocks(self, request_id: str) -> Sequence[int] | None:
        return None

    def get_block_ids(self, request_id: str) -> Blocks:
        return tuple(tuple(group) for group in self.manager.get_block_ids(request_id))

    def take_events(self) -> Sequence[KVCacheEvent]:
        events = self.manager.take_events()
        if events:
            raise TargetError("the vLLM manager adapter does not translate events")
        return ()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        stats = self.manager.make_prefix_cache_stats()
        if stats is None:
            return None
        return PrefixCacheStats(
            reset=bool(stats.reset),
            requests=stats.requests,
            queries=stats.queries,
            hits=stats.hits,
            preempted_requests=stats.preempted_requests,
            preempted_queries=stats.preempted_queries,
            preempted_hits=stats.preempted_hits,
        )

    def usage(self) -> float:
        return float(self.manager.usage)

    def num_free_blocks(self) -> int:
        return int(self.manager.block_pool.get_num_free_blocks())


def _ids(blocks: Any) -> Blocks:
    return tuple(tuple(b.block_id for b in group) for group in blocks.blocks)


def _scope() -> ManagerTargetSpec:
    from kvpool.model import DEFAULT_PROFILE

    return ManagerTargetSpec(
        VllmManagerTarget,
        layouts=(
            "full",
            "sliding_window",
            "full+sliding_window",
            "full+full+sliding_window",
            "sliding_window+full",
            "full+sliding_window+sliding_window",
        ),
        profiles=(DEFAULT_PROFILE,),
        events=(False,),
        block_factors=(1,),
        min_window=2,
    )


VLLM_SCOPE = _scope()
"""Where vLLM 0.33's manager is compared: one full-attention or sliding-window group
(window of at least 2), or a hybrid of them (vLLM's HybridKVCacheCoordinator), with
blocks of hash-block size, events off, the hashless-first profile. Chunked local
attention is left out: 0.33 frees a chunked request's last cached block, which the
seeds keep (docs/semantics.md)."""
