"""Contracts on the model's request-layer operations, for CrossHair (PEP 316 docstring syntax).

Each contract builds a small KV cache manager from symbolic integers, runs
one scheduler call and states what must hold afterwards; CrossHair searches
the integers for a counterexample (``crosshair check
kvpool.specs.request.contracts``). As at the pool layer
(``kvpool.specs.pool.contracts``) the managers are built through the
operations themselves, so every state a contract starts from is reachable,
and the bounds keep the search small: at most 8 blocks, prompts of at most
6 tokens, blocks of at most 3.

The same contracts run against deliberately broken operations in
``tests/crosshair/request_catalogue.py`` to show that none of them is vacuous.
"""

from kvpool.model import manager
from kvpool.model.manager import Blocks, KVCacheManagerState
from kvpool.model.request import Request, new_request, with_computed
from kvpool.model.single_type import full_attention, sliding_window

MAX_MODEL_LEN = 16


def _manager(num_blocks: int, block_size: int) -> KVCacheManagerState:
    return manager.new_kv_cache_manager(num_blocks, [full_attention(block_size)], MAX_MODEL_LEN)


def _prompt(length: int, first: int = 1) -> tuple[int, ...]:
    return tuple(range(first, first + length))


def _held(state: KVCacheManagerState) -> int:
    return state.managers.pool.config.num_blocks - 1 - manager.num_free_blocks(state)


def allocate_slots_fits_or_changes_nothing(
    num_blocks: int, block_size: int, prompt_len: int, chunk: int
) -> tuple[KVCacheManagerState, KVCacheManagerState, Blocks | None, int]:
    """A fresh request's first chunk gets exactly the blocks it needs, or None and no change.

    pre: 1 <= num_blocks <= 8
    pre: 1 <= block_size <= 3
    pre: 1 <= prompt_len <= 6
    pre: 1 <= chunk <= prompt_len
    post: (__return__[2] is None) == (-(-chunk // block_size) > num_blocks - 1)
    post: __return__[2] is not None or __return__[1] == __return__[0]
    post: __return__[2] is None or len(__return__[2][0]) == -(-chunk // block_size)
    post: _held(__return__[1]) == (0 if __return__[2] is None else len(__return__[2][0]))
    """
    before = _manager(num_blocks, block_size)
    request = new_request("r", _prompt(prompt_len), block_size)
    after, blocks = manager.allocate_slots(before, request, chunk)
    return before, after, blocks, chunk


def free_returns_every_block(
    num_blocks: int, block_size: int, prompt_len: int
) -> tuple[KVCacheManagerState, KVCacheManagerState]:
    """Freeing a request returns all its blocks to the pool and forgets its table.

    pre: 2 <= num_blocks <= 8
    pre: 1 <= block_size <= 3
    pre: 1 <= prompt_len <= 6
    pre: -(-prompt_len // block_size) <= num_blocks - 1
    post: manager.num_free_blocks(__return__[1]) == num_blocks - 1
    post: manager.get_block_ids(__return__[1], "r") == ((),)
    post: manager.usage(__return__[1]) == 0.0
    """
    state = _manager(num_blocks, block_size)
    state, _ = manager.allocate_slots(
        state, new_request("r", _prompt(prompt_len), block_size), prompt_len
    )
    after, _ = manager.free(state, "r")
    return state, after


def _cached_then_looked_up(
    num_blocks: int, block_size: int, first: Request, second: Request
) -> tuple[Blocks, int]:
    state = _manager(num_blocks, block_size)
    state, _ = manager.allocate_slots(state, first, first.num_tokens)
    state, _ = manager.free(state, first.request_id)
    _, hit = manager.get_computed_blocks(state, second)
    return hit


def a_hit_never_covers_the_last_token(
    block_size: int, prompt_len: int
) -> tuple[tuple[Blocks, int], int]:
    """The same prompt again hits its full blocks, but never its last token.

    pre: 1 <= block_size <= 3
    pre: 1 <= prompt_len <= 6
    post: __return__[0][1] == (prompt_len - 1) // block_size * block_size
    post: len(__return__[0][0][0]) * block_size == __return__[0][1]
    """
    request = new_request("a", _prompt(prompt_len), block_size)
    again = new_request("b", _prompt(prompt_len), block_size)
    return _cached_then_looked_up(8, block_size, request, again), prompt_len


def a_hit_is_a_shared_prefix(
    block_size: int, prompt_len: int, shared: int
) -> tuple[tuple[Blocks, int], int]:
    """A prompt sharing ``shared`` tokens with a cached one hits the whole blocks they share.

    Its other tokens differ from the cached prompt's by 256: token ids are
    integers, not bytes.

    pre: 1 <= block_size <= 3
    pre: 1 <= prompt_len <= 6
    pre: 0 <= shared < prompt_len
    post: __return__[0][1] == shared // block_size * block_size
    """
    cached = new_request("a", _prompt(prompt_len), block_size)
    other = _prompt(shared) + _prompt(prompt_len - shared, first=256 + shared + 1)
    looked = new_request("b", other, block_size)
    return _cached_then_looked_up(8, block_size, cached, looked), shared


def different_salts_never_share_a_block(
    block_size: int, prompt_len: int, same: bool
) -> tuple[tuple[Blocks, int], int]:
    """A tenant's cached prompt is a hit for the same salt only.

    pre: 1 <= block_size <= 3
    pre: 1 <= prompt_len <= 6
    post: same or __return__[0][1] == 0
    post: (not same) or __return__[0][1] == (prompt_len - 1) // block_size * block_size
    """
    cached = new_request("a", _prompt(prompt_len), block_size, cache_salt="tenant-a")
    salt = "tenant-a" if same else "tenant-b"
    looked = new_request("b", _prompt(prompt_len), block_size, cache_salt=salt)
    return _cached_then_looked_up(8, block_size, cached, looked), prompt_len


def cache_blocks_never_goes_back(
    block_size: int, prompt_len: int, first: int, second: int
) -> tuple[KVCacheManagerState, KVCacheManagerState, int]:
    """cache_blocks with fewer computed tokens than before changes nothing.

    pre: 1 <= block_size <= 3
    pre: 1 <= prompt_len <= 6
    pre: 0 <= second <= first <= prompt_len
    post: __return__[1] == __return__[0]
    """
    state = _manager(8, block_size)
    request = new_request("r", _prompt(prompt_len), block_size)
    state, _ = manager.allocate_slots(state, request, prompt_len, delay_cache_blocks=True)
    state, _ = manager.cache_blocks(state, request, first)
    after, _ = manager.cache_blocks(state, request, second)
    return state, after, second


def sliding_window_releases_what_left_the_window(
    window: int, prompt_len: int
) -> tuple[Blocks | None, int, int]:
    """Once a request has computed its prompt, blocks entirely before the window are null.

    pre: 1 <= window <= 4
    pre: 2 <= prompt_len <= 6
    post: __return__[0] is not None
    post: all(b == 0 for b in __return__[0][0][: max(0, prompt_len - window + 1)])
    post: all(b != 0 for b in __return__[0][0][max(0, prompt_len - window + 1) :])
    """
    state = manager.new_kv_cache_manager(8, [sliding_window(1, window)], MAX_MODEL_LEN)
    request = new_request("r", _prompt(prompt_len), 1)
    state, _ = manager.allocate_slots(state, request, prompt_len)
    state, _ = manager.allocate_slots(state, with_computed(request, prompt_len), 1)
    return manager.get_block_ids(state, "r"), window, prompt_len


def reset_forgets_every_hit(block_size: int, prompt_len: int) -> tuple[Blocks, int]:
    """After a reset with nothing held, nothing hits.

    pre: 1 <= block_size <= 3
    pre: 1 <= prompt_len <= 6
    post: __return__[1] == 0
    """
    state = _manager(8, block_size)
    request = new_request("a", _prompt(prompt_len), block_size)
    state, _ = manager.allocate_slots(state, request, prompt_len)
    state, _ = manager.free(state, "a")
    state, _ = manager.reset_prefix_cache(state)
    _, hit = manager.get_computed_blocks(state, new_request("b", _prompt(prompt_len), block_size))
    return hit
