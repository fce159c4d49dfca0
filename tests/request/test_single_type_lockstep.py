"""The impl's single-type managers in lock-step with the model's, call by call.

The request-level machine reaches the single-type managers only the way
``KVCacheManager`` calls them: always valid arguments, one group per spec
except in level 2's hybrids. This machine calls them directly, as vLLM's
coordinator and its tests do: two groups of one spec searched together or
alone, windows and chunks of every size, raw token counts, unknown requests
and groups. Each call runs on the model (``kvpool.model.single_type``) and on
the impl; results, exception types and the whole state (pool and tables)
must agree, and a rejected call must change nothing.
"""

from collections.abc import Callable
from typing import Any, Protocol, cast

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool.impl import BlockPool
from kvpool.impl.single_type import SingleTypeKVCacheManager, get_manager_for_kv_cache_spec
from kvpool.model import PoolError
from kvpool.model import single_type as model
from kvpool.model.pool import evict_blocks, new_pool, touch
from kvpool.model.request import Request, new_request

STEM = (1, 2, 2, 1, 1, 2, 1, 2)
PROMPTS = [STEM[:n] for n in (8, 6, 5, 3, 2)] + [(2, 2, 1, 1, 2, 2)]
RIDS = ("a", "b", "c")
GROUP_IDS = st.sampled_from([(0,), (1,), (0, 1), (1, 0), (), (-1,), (0, -1)])
TOKENS = st.integers(-1, 10)


# Protocols rather than Callables: a rule's lambdas bind the loop's group through a
# defaulted parameter (`lambda s, g=g: ...`), which mypy cannot match to a Callable.
class OnModel(Protocol):
    def __call__(self, state: model.ManagersState, /) -> tuple[model.ManagersState, Any]: ...


class OnImpl(Protocol):
    def __call__(self) -> Any: ...


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", call()
    except PoolError as error:
        return "raises", type(error)


class SingleTypeLockstep(RuleBasedStateMachine):
    @initialize(
        kind=st.sampled_from(["full", "sliding_window", "chunked_local", "mamba"]),
        hbs=st.integers(1, 2),
        factor=st.integers(1, 2),
        num_blocks=st.integers(2, 16),
        window=st.integers(1, 6),
        chunk_blocks=st.integers(1, 3),
    )
    def start(
        self, kind: str, hbs: int, factor: int, num_blocks: int, window: int, chunk_blocks: int
    ) -> None:
        size = hbs * factor
        spec = {
            "full": model.full_attention(size),
            "sliding_window": model.sliding_window(size, window),
            "chunked_local": model.chunked_local(size, size * chunk_blocks),
            "mamba": model.mamba(size),
        }[kind]
        self.spec = spec
        self.hbs = hbs
        self.model = model.new_managers(new_pool(num_blocks, True, hbs), [spec, spec])
        self.pool = BlockPool(num_blocks, True, hbs)
        self.impl: list[SingleTypeKVCacheManager] = [
            get_manager_for_kv_cache_spec(spec, self.pool, g) for g in (0, 1)
        ]
        self.requests: dict[str, Request] = {}

    # ------------------------------------------------------------------

    def _request(self, rid: str, prompt: int) -> Request:
        if rid not in self.requests:
            self.requests[rid] = new_request(rid, PROMPTS[prompt], self.hbs)
        return self.requests[rid]

    def _both(
        self,
        on_model: OnModel,
        on_impl: OnImpl,
        convert: Callable[[Any], Any] = lambda r: r,
    ) -> tuple[str, Any]:
        """Run one call on both sides; the same outcome, and no change on a rejection."""
        before = self._impl_state()
        expected = _outcome(lambda: on_model(self.model))
        actual = _outcome(on_impl)
        if actual[0] == "ok":
            actual = ("ok", convert(actual[1]))
        if expected[0] == "ok":
            self.model, result = expected[1]
            expected = ("ok", result)
        assert actual == expected, f"model {expected}, impl {actual}"
        if expected[0] == "raises":
            assert self._impl_state() == before, "a rejected call changed the impl"
        return expected

    def _impl_state(self) -> tuple[object, ...]:
        return (self.pool.snapshot(), tuple(m.table() for m in self.impl))

    # ------------------------------------------------------------------

    @rule(
        prompt=st.integers(0, len(PROMPTS) - 1),
        max_length=TOKENS,
        ids=GROUP_IDS,
        eagle=st.booleans(),
    )
    def find_longest_cache_hit(
        self, prompt: int, max_length: int, ids: tuple[int, ...], eagle: bool
    ) -> None:
        hashes = new_request("probe", PROMPTS[prompt], self.hbs).block_hashes
        cls = type(self.impl[0])
        self._both(
            lambda s: (
                s,
                model.find_longest_cache_hit(s.pool, self.spec, hashes, max_length, ids, eagle),
            ),
            lambda: cls.find_longest_cache_hit(
                hashes, max_length, ids, self.pool, self.spec, eagle
            ),
            lambda found: tuple(tuple(b.block_id for b in group) for group in found),
        )

    @rule(
        rid=st.sampled_from(RIDS),
        prompt=st.integers(0, len(PROMPTS) - 1),
        eagle=st.booleans(),
        cap=st.integers(0, 3),
    )
    def admit_with_hits(self, rid: str, prompt: int, eagle: bool, cap: int) -> None:
        """What a coordinator does for a new request: search both groups, count, touch, save.

        The search stops ``cap`` tokens short of the prompt (1 is the manager's rule).
        """
        if any(rid in table.req_to_blocks for table in self.model.tables):
            return
        request = self._request(rid, prompt)
        max_length = max(0, request.num_tokens - cap)
        hit = model.find_longest_cache_hit(
            self.model.pool, self.spec, request.block_hashes, max_length, (0, 1), eagle
        )
        found = type(self.impl[0]).find_longest_cache_hit(
            request.block_hashes, max_length, (0, 1), self.pool, self.spec, eagle
        )
        assert tuple(tuple(b.block_id for b in g) for g in found) == hit
        need = 0
        for g in (0, 1):
            n = model.get_num_blocks_to_allocate(self.model, g, rid, max_length, hit[g])
            assert self.impl[g].get_num_blocks_to_allocate(rid, max_length, found[g]) == n
            need += n
        if need > self.pool.get_num_free_blocks():
            return
        for g in (0, 1):
            real = [b for b in hit[g] if b != 0]
            pool, _ = touch(self.model.pool, real)
            self.model = model.ManagersState(pool, self.model.specs, self.model.tables)
            self.pool.touch([b for b in found[g] if not b.is_null])
            self.model, _ = model.save_new_computed_blocks(self.model, g, rid, hit[g])
            self.impl[g].save_new_computed_blocks(rid, found[g])

    @rule(rid=st.sampled_from(RIDS), prompt=st.integers(0, len(PROMPTS) - 1))
    def prefill(self, rid: str, prompt: int) -> None:
        """A new request in both groups: no hits, blocks for its whole prompt, all cached."""
        if any(rid in table.req_to_blocks for table in self.model.tables):
            return
        request = self._request(rid, prompt)
        n = request.num_tokens
        need = sum(model.get_num_blocks_to_allocate(self.model, g, rid, n, ()) for g in (0, 1))
        if need > self.pool.get_num_free_blocks():
            return
        for g in (0, 1):
            self._both(
                lambda s, g=g: model.save_new_computed_blocks(s, g, rid, ()),
                lambda g=g: self.impl[g].save_new_computed_blocks(rid, []),
            )
            self._both(
                lambda s, g=g: model.allocate_new_blocks(s, g, rid, n),
                lambda g=g: self.impl[g].allocate_new_blocks(rid, n),
                lambda new: tuple(b.block_id for b in new),
            )
            self._both(
                lambda s, g=g: model.cache_blocks(s, g, request, n),
                lambda g=g: self.impl[g].cache_blocks(request, n),
            )

    @rule(rid=st.sampled_from(RIDS), group=st.integers(0, 1), num_tokens=TOKENS)
    def allocate_new_blocks(self, rid: str, group: int, num_tokens: int) -> None:
        if rid in self.model.tables[group].req_to_blocks:
            need = model.get_num_blocks_to_allocate(self.model, group, rid, num_tokens, ())
            assert self.impl[group].get_num_blocks_to_allocate(rid, num_tokens, ()) == need
            if need > self.pool.get_num_free_blocks():
                return
        self._both(
            lambda s: model.allocate_new_blocks(s, group, rid, num_tokens),
            lambda: self.impl[group].allocate_new_blocks(rid, num_tokens),
            lambda new: tuple(b.block_id for b in new),
        )

    @rule(rid=st.sampled_from(RIDS), group=st.integers(0, 1), prompt=st.integers(0, 5))
    def start_empty(self, rid: str, group: int, prompt: int) -> None:
        self._request(rid, prompt)
        self._both(
            lambda s: model.save_new_computed_blocks(s, group, rid, ()),
            lambda: self.impl[group].save_new_computed_blocks(rid, []),
        )

    @precondition(lambda self: bool(self.requests))
    @rule(which=st.integers(0, 2), group=st.integers(0, 1), num_tokens=TOKENS)
    def cache_blocks(self, which: int, group: int, num_tokens: int) -> None:
        request = list(self.requests.values())[which % len(self.requests)]
        self._both(
            lambda s: model.cache_blocks(s, group, request, num_tokens),
            lambda: self.impl[group].cache_blocks(request, num_tokens),
        )

    @rule(
        rid=st.sampled_from(RIDS),
        group=st.integers(0, 1),
        num_computed=TOKENS,
        near_the_end=st.booleans(),
    )
    def remove_skipped_blocks(
        self, rid: str, group: int, num_computed: int, near_the_end: bool
    ) -> None:
        """Raw counts, or counts near the request's length, where a chunk ends past its cache."""
        if near_the_end and rid in self.requests:
            num_computed = self.requests[rid].num_tokens + num_computed % 4
        self._both(
            lambda s: model.remove_skipped_blocks(s, group, rid, num_computed),
            lambda: self.impl[group].remove_skipped_blocks(rid, num_computed),
        )

    @rule(block_ids=st.sets(st.integers(1, 15), min_size=1, max_size=3))
    def evict_blocks(self, block_ids: set[int]) -> None:
        """Holes in the cache: a hit must stop at them (a window needs a contiguous run)."""
        ids = {b for b in block_ids if b < self.pool.num_gpu_blocks}
        pool, _ = evict_blocks(self.model.pool, ids)
        self.model = model.ManagersState(pool, self.model.specs, self.model.tables)
        self.pool.evict_blocks(ids)

    @precondition(lambda self: bool(self.requests))
    @rule(which=st.integers(0, 2), group=st.integers(0, 1))
    def cache_blocks_hashed_in_other_blocks(self, which: int, group: int) -> None:
        request = list(self.requests.values())[which % len(self.requests)]
        stranger = new_request(request.request_id, request.all_token_ids, self.hbs + 1)
        self._both(
            lambda s: model.cache_blocks(s, group, stranger, stranger.num_tokens),
            lambda: self.impl[group].cache_blocks(stranger, stranger.num_tokens),
        )

    @rule(rid=st.sampled_from(RIDS))
    def finish(self, rid: str) -> None:
        """A request leaves: both groups free its blocks, which stay cached."""
        for g in (0, 1):
            self._both(lambda s, g=g: model.free(s, g, rid), lambda g=g: self.impl[g].free(rid))

    @rule(rid=st.sampled_from(RIDS), group=st.integers(0, 1))
    def free(self, rid: str, group: int) -> None:
        self._both(
            lambda s: model.free(s, group, rid),
            lambda: self.impl[group].free(rid),
        )

    @rule(rid=st.sampled_from(RIDS), group=st.integers(0, 1), running=st.integers(0, 3))
    def get_num_common_prefix_blocks(self, rid: str, group: int, running: int) -> None:
        self._both(
            lambda s: (s, model.get_num_common_prefix_blocks(s, group, rid, running)),
            lambda: self.impl[group].get_num_common_prefix_blocks(rid, running),
        )

    @invariant()
    def impl_state_is_the_models(self) -> None:
        if hasattr(self, "model"):
            assert self.pool.snapshot() == self.model.pool
            assert tuple(m.table() for m in self.impl) == self.model.tables


TestSingleTypeLockstep = SingleTypeLockstep.TestCase
# Each program is short and cheap; three times the profile's programs reach
# the rarer shapes (a window over a hole, a chunk past a one-block cache).
TestSingleTypeLockstep.settings = settings(
    max_examples=3 * cast(settings, settings.default).max_examples  # conftest loaded a profile
)
