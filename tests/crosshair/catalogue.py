"""A catalogue of deliberately broken operations, one per CrossHair contract.

Each entry re-binds one contract of ``kvpool.specs.pool.contracts`` to a model in
which one operation is broken, and names the postcondition that must catch
it. CrossHair is run on the re-bound contract; the counterexample it reports
is then replayed in plain Python before it is believed (CrossHair can report
false counterexamples, for example after slice deletion with a symbolic
index).
"""

import types
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvpool import model
from kvpool.impl import BlockPool
from kvpool.impl.free_queue import FreeKVCacheBlockQueue
from kvpool.specs.pool import contracts
from tests.specs.planted_bugs import AppendsHashlessBlocks


@dataclass(frozen=True)
class BrokenVariant:
    contract: str
    story: str
    operation: str
    broken: Callable[..., Any]
    catching_post: str
    """The text of the postcondition that must fail, exactly as in the docstring."""
    replaces: str = "model"
    """The global of the contracts module the broken version stands in for."""


def _takes_from_the_back(state: model.PoolState, n: int) -> Any:
    after, _ = model.get_new_blocks(state, n)
    back = state.free_queue[len(state.free_queue) - n :]
    rest = state.free_queue[: len(state.free_queue) - n]
    if n == 0:
        return after, ()
    return replace(after, free_queue=rest), back


def _never_dequeues(state: model.PoolState, n: int) -> Any:
    after, ids = model.get_new_blocks(state, n)
    return replace(after, free_queue=state.free_queue), ids


def _leaks_last(state: model.PoolState, ids: list[int]) -> Any:
    after, _ = model.free_blocks(state, ids)
    if not ids:
        return after, None
    return replace(after, free_queue=tuple(b for b in after.free_queue if b != ids[-1])), None


def _appends_everything(state: model.PoolState, ids: list[int]) -> Any:
    after, _ = model.free_blocks(state, ids)
    joined = tuple(b for b in after.free_queue if b not in state.free_queue)
    return replace(after, free_queue=state.free_queue + joined), None


def _touch_keeps_in_queue(state: model.PoolState, ids: list[int]) -> Any:
    after, _ = model.touch(state, ids)
    return replace(after, free_queue=state.free_queue), None


def _caches_one_block_short(
    state: model.PoolState, request: Any, ids: Any, lo: int, hi: int, *rest: Any
) -> Any:
    return model.cache_full_blocks(state, request, ids, min(lo + 1, hi), hi, *rest)


def _evict_moves_to_front(state: model.PoolState, ids: list[int]) -> Any:
    after, _ = model.evict_blocks(state, ids)
    moved = tuple(b for b in ids if b in after.free_queue)
    rest = tuple(b for b in after.free_queue if b not in moved)
    return replace(after, free_queue=moved + rest), None


def _reset_while_busy(state: model.PoolState) -> Any:
    idle = replace(state, free_queue=tuple(range(1, state.config.num_blocks)))
    after, _ = model.reset_prefix_cache(idle)
    return replace(after, free_queue=state.free_queue), True


class _PrependsReversed(FreeKVCacheBlockQueue):
    def prepend_n(self, blocks: Any) -> None:
        super().prepend_n(list(reversed(blocks)))


class _AppendForgetsBackLink(FreeKVCacheBlockQueue):
    def append_n(self, blocks: Any) -> None:
        tail_prev = self.fake_free_list_tail.prev_free_block
        super().append_n(blocks)
        if blocks:
            self.fake_free_list_tail.prev_free_block = tail_prev


class _RemoveKeepsCount(FreeKVCacheBlockQueue):
    def remove(self, block: Any) -> None:
        super().remove(block)
        self.num_free_blocks += 1


class _PopsFromTheBack(FreeKVCacheBlockQueue):
    def popleft_n(self, n: int) -> Any:
        blocks = self.get_all_free_blocks()[len(self.get_all_free_blocks()) - n :] if n else []
        for block in blocks:
            self.remove(block)
        return blocks


def _joins_hashes(hashes: Any, hash_block_size: int, block_size: int) -> Any:
    factor = block_size // hash_block_size
    return tuple(
        b"".join(hashes[i * factor : (i + 1) * factor]) for i in range(len(hashes) // factor)
    )


CATALOGUE = [
    BrokenVariant(
        "pool_with_held",
        "get_new_blocks forgets to dequeue the blocks: a block is held and free.",
        "get_new_blocks",
        _never_dequeues,
        "len(__return__.free_queue) == num_blocks - 1 - held",
    ),
    BrokenVariant(
        "get_new_blocks_takes_from_the_front",
        "get_new_blocks takes the most recently freed blocks (MRU) instead of the LRU ones.",
        "get_new_blocks",
        _takes_from_the_back,
        "__return__[2] == __return__[0].free_queue[:n]",
    ),
    BrokenVariant(
        "free_blocks_conserves_blocks",
        "free_blocks loses the last block of the list: a leak that shrinks capacity forever.",
        "free_blocks",
        _leaks_last,
        "len(__return__[1].free_queue) == len(__return__[0].free_queue) + count",
    ),
    BrokenVariant(
        "free_blocks_puts_hashless_first",
        "free_blocks appends hash-less blocks: the pre-0.24 order under the new profile.",
        "free_blocks",
        _appends_everything,
        "__return__[1].free_queue[: held - cached] == tuple(range(held, cached, -1))",
    ),
    BrokenVariant(
        "touch_takes_a_reference",
        "touch leaves a touched free block in the queue: it can be handed out twice.",
        "touch",
        _touch_keeps_in_queue,
        "block_id not in __return__[1].free_queue",
    ),
    BrokenVariant(
        "cache_full_blocks_makes_blocks_hit",
        "cache_full_blocks starts one block late: the first new full block never hits.",
        "cache_full_blocks",
        _caches_one_block_short,
        "all(_hits(__return__[0], i) for i in range(num_cached, num_full))",
    ),
    BrokenVariant(
        "evict_blocks_drops_hashes_only",
        "evict_blocks also moves an evicted free block to the front of the queue.",
        "evict_blocks",
        _evict_moves_to_front,
        "__return__[1].free_queue == __return__[0].free_queue",
    ),
    BrokenVariant(
        "reset_prefix_cache_only_when_idle",
        "reset_prefix_cache forgets the hashes even while requests still hold blocks.",
        "reset_prefix_cache",
        _reset_while_busy,
        "__return__[2] == (len(__return__[0].free_queue) == num_blocks - 1)",
    ),
    BrokenVariant(
        "hashes_at_block_size_picks_every_kth",
        "Hashes of a big block joined from its hash blocks, instead of taking the last chained one"
        " (kvpool's own first draft, before vLLM 0.33 was read).",
        "hashes_at_block_size",
        _joins_hashes,
        "all(__return__[i] == hashes[(i + 1) * factor - 1] for i in range(len(__return__)))",
    ),
    BrokenVariant(
        "free_queue_prepend_n_keeps_order",
        "prepend_n reverses the blocks: a request freed in reverse order is reused head first.",
        "prepend_n",
        _PrependsReversed,
        "_ids(__return__[0]) == __return__[1]",
        replaces="FreeKVCacheBlockQueue",
    ),
    BrokenVariant(
        "free_queue_append_n_keeps_order",
        "append_n forgets to move the tail's back link: walking backwards skips the new blocks.",
        "append_n",
        _AppendForgetsBackLink,
        "_linked_both_ways(__return__[0])",
        replaces="FreeKVCacheBlockQueue",
    ),
    BrokenVariant(
        "free_queue_remove_unlinks_one",
        "remove unlinks the block but does not count it: the free count drifts from the list.",
        "remove",
        _RemoveKeepsCount,
        "_linked_both_ways(__return__[0])",
        replaces="FreeKVCacheBlockQueue",
    ),
    BrokenVariant(
        "free_queue_popleft_n_takes_the_front",
        "popleft_n takes from the back: most recently freed first.",
        "popleft_n",
        _PopsFromTheBack,
        "__return__[1] == list(range(n))",
        replaces="FreeKVCacheBlockQueue",
    ),
]


def rebind(variant: BrokenVariant) -> types.FunctionType:
    """The contract function, running against a model with the variant's broken operation."""
    original = getattr(contracts, variant.contract)
    if variant.replaces == "model":
        broken_model = types.SimpleNamespace(**{n: getattr(model, n) for n in model.__all__})
        setattr(broken_model, variant.operation, variant.broken)
        namespace = dict(vars(contracts), model=broken_model)
    else:
        namespace = dict(vars(contracts), **{variant.replaces: variant.broken})
    clone = types.FunctionType(original.__code__, namespace, f"broken_{original.__name__}")
    clone.__doc__ = original.__doc__
    clone.__annotations__ = original.__annotations__
    clone.__module__ = __name__
    clone.__qualname__ = clone.__name__
    # the helpers the contract calls must see the broken model too
    for name in ("pool_with_held", "_hits"):
        helper = getattr(contracts, name)
        namespace[name] = types.FunctionType(helper.__code__, namespace, helper.__name__)
    return clone


for _variant in CATALOGUE:
    globals()[f"broken_{_variant.contract}"] = rebind(_variant)


def _with_pool(function: Any, pool_class: type[BlockPool]) -> Any:
    namespace = dict(vars(contracts), BlockPool=pool_class)
    clone = types.FunctionType(function.__code__, namespace, f"{function.__name__}_broken")
    clone.__module__ = __name__
    clone.__qualname__ = clone.__name__
    clone.__annotations__ = function.__annotations__
    return clone


scenario_on_broken_impl = _with_pool(contracts.scenario_on_impl, AppendsHashlessBlocks)
