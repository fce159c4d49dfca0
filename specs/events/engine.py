"""A serving engine over any block pool: the producer the event machine drives.

``PoolEngine`` plays the part of vLLM's scheduler and KV cache manager for
one KV cache group of full attention, calling nothing but the pool target
protocol (``kvpool.specs.pool.target``). So the same engine runs on the
model (``kvpool.specs.pool.model_target``: the events a consumer is checked
against), on kvpool's impl, on vLLM's ``BlockPool`` through its adapter, or
on a pool in another language (``cmd:``).

What it does is what vLLM 0.33 does with a pool (``vllm/v1/core/``
``kv_cache_manager.py`` and ``single_type_kv_cache_manager.py``):

* a prompt's hit is its leading cached blocks, found with
  ``get_cached_block``, but at most all blocks but the last: vLLM always
  computes the last prompt token, so a fully cached prompt recomputes its last
  block into a new block, which is cached again beside the old one (the
  duplicate copies vllm-project/vllm#55092 is about);
* the hit blocks are touched, the others allocated, and every new full block
  cached by one ``cache_full_blocks`` call;
* a decode step that fills a block caches it (its parent is the block before);
* a finished request frees its blocks last block first;
* ``evict`` drops a cached block's hashes with ``evict_blocks``, as a KV
  connector does when loading it failed, whether or not a request holds it.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.model import KVCacheEvent, PoolConfig, PoolState
from kvpool.model.profiles import DEFAULT_PROFILE, with_event_semantics
from kvpool.specs.events.target import MAIN_GROUP, EngineConfig, Query
from kvpool.specs.pool.machine import request_for
from kvpool.specs.pool.target import PoolTarget, Snapshottable, TargetFactory


def query_for(token_ids: Sequence[int], block_size: int) -> Query:
    """The query for a request of ``token_ids``: the engines' hash of each full block.

    >>> query_for([1, 2, 1], 2).block_hashes
    (b'\\x01\\x02',)
    """
    request = request_for(token_ids, block_size)
    return Query(tuple(token_ids), request.block_hashes)


def pool_config(config: EngineConfig) -> PoolConfig:
    """The pool an engine runs on: caching and events on, the config's event semantics."""
    return PoolConfig(
        num_blocks=config.num_blocks,
        enable_caching=True,
        hash_block_size=config.block_size,
        enable_events=True,
        profile=with_event_semantics(DEFAULT_PROFILE, config.event_semantics),
    )


@dataclass
class _Running:
    token_ids: list[int]
    block_ids: list[int]


class PoolEngine:
    """One engine over a pool target; requests are numbered from 0 in arrival order."""

    def __init__(self, pool: PoolTarget, config: EngineConfig) -> None:
        self.pool = pool
        self.config = config
        self.requests: dict[int, _Running] = {}
        self.next_request = 0
        self.cached_ids: set[int] = set()
        """Every block id this engine ever cached (what ``evict`` picks from)."""

    # The engine protocol ------------------------------------------------------

    def serve(self, token_ids: Sequence[int]) -> int | None:
        size = self.config.block_size
        request = request_for(token_ids, size)
        hashes = request.block_hashes
        if not hashes:
            return None
        hits: list[int] = []
        for block_hash in hashes[: len(hashes) - 1]:
            found = self.pool.get_cached_block(block_hash, [MAIN_GROUP])
            if found is None:
                break
            hits.append(found[0])
        held = {b for r in self.requests.values() for b in r.block_ids}
        # A free block that is hit leaves the free queue before the others are allocated.
        evictable_hits = sum(1 for b in hits if b not in held)
        needed = len(hashes) - len(hits)
        if needed > self.pool.get_num_free_blocks() - evictable_hits:
            return None
        self.pool.touch(hits)
        new = list(self.pool.get_new_blocks(needed))
        blocks = hits + new
        self.pool.cache_full_blocks(request, blocks, len(hits), len(hashes), size, MAIN_GROUP)
        self.cached_ids.update(new)
        handle = self.next_request
        self.next_request += 1
        self.requests[handle] = _Running(list(token_ids[: len(hashes) * size]), blocks)
        return handle

    def extend(self, request: int, token_ids: Sequence[int]) -> bool:
        running = self.requests[request]
        size = self.config.block_size
        if len(token_ids) != size:
            raise ValueError(f"a decode step fills one block of {size} tokens")
        if self.pool.get_num_free_blocks() == 0:
            return False
        (block,) = self.pool.get_new_blocks(1)
        running.block_ids.append(block)
        running.token_ids.extend(token_ids)
        n = len(running.block_ids)
        self.pool.cache_full_blocks(
            request_for(running.token_ids, size), running.block_ids, n - 1, n, size, MAIN_GROUP
        )
        self.cached_ids.add(block)
        return True

    def finish(self, request: int) -> None:
        running = self.requests.pop(request)
        self.pool.free_blocks(list(reversed(running.block_ids)))

    def evict(self, pick: int) -> int | None:
        if not self.cached_ids:
            return None
        candidates = sorted(self.cached_ids)
        block = candidates[pick % len(candidates)]
        self.pool.evict_blocks({block})
        return block

    def evict_held(self, request: int, position: int) -> int:
        """Evict the block at ``position`` of a running request: a KV load that failed.

        vLLM's connectors report such blocks (``kv_cache_manager.py``); the
        request keeps running, so its next block is stored under a parent the
        engine no longer caches, and a block in the middle of a chain leaves
        the blocks after it cached behind a gap.
        """
        blocks = self.requests[request].block_ids
        block = blocks[position % len(blocks)]
        self.pool.evict_blocks({block})
        return block

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def take_events(self) -> Sequence[KVCacheEvent]:
        return self.pool.take_events()

    def cached_prefix(self, query: Query) -> int:
        hit = 0
        for block_hash in query.block_hashes:
            if self.pool.get_cached_block(block_hash, [MAIN_GROUP]) is None:
                break
            hit += 1
        return hit

    def running(self) -> Sequence[int]:
        return sorted(self.requests)

    def snapshot(self) -> PoolState | None:
        """The pool's whole state, if its target can show it."""
        return self.pool.snapshot() if isinstance(self.pool, Snapshottable) else None

    # For people reading a failure ---------------------------------------------

    def tokens_of(self, request: int) -> list[int]:
        """The tokens ``request`` has so far."""
        return list(self.requests[request].token_ids)

    def blocks_of(self, request: int) -> list[int]:
        """The block ids ``request`` holds, in order."""
        return list(self.requests[request].block_ids)


class PoolEngineFactory:
    """Builds ``PoolEngine``s over the pools ``make_pool`` builds (a pool target factory)."""

    def __init__(self, make_pool: TargetFactory, name: str = "pool") -> None:
        self.make_pool = make_pool
        self.name = name

    def __call__(self, config: EngineConfig) -> PoolEngine:
        return PoolEngine(self.make_pool(pool_config(config)), config)


def model_engines() -> PoolEngineFactory:
    """Engines over the model's pool: the engines a consumer is checked against."""
    from kvpool.specs.pool.model_target import ModelTarget

    return PoolEngineFactory(ModelTarget, "model")
