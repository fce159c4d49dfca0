"""The lock-step state machine: the model and a target, operation by operation.

Hypothesis generates programs of pool operations on tiny pools (2 to 9
blocks, so eviction happens all the time). Every operation runs on the model
first, then on the target; after every step the machine compares return
values, exception types (never messages), the counts, the events and, when
the target has ``snapshot()``, the whole state; then it runs every named
invariant on both sides.

Block handles live in Bundles: ``held`` holds one entry per reference the
program owns (``get_new_blocks`` and ``touch`` add, ``free_blocks`` consumes),
so a printed failing program can be pasted back and re-run.

Level 1 sends only valid operations: a generated call the model rejects is
not sent, and is counted (see ``hypothesis.event``). Level 2 also sends
invalid calls and requires the same rejection with the state unchanged.
"""

import inspect
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any, ClassVar, TypeVar, cast

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RULE_MARKER,
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from kvpool import model
from kvpool.model import (
    PROFILES,
    CacheRequest,
    KVCacheEvent,
    PoolConfig,
    PoolError,
    PoolState,
    Profile,
)
from kvpool.model.profiles import profile_named
from kvpool.specs.errors import Divergence
from kvpool.specs.pool.invariants import FreeHistory, check_all, dump_state
from kvpool.specs.pool.target import (
    EXTENSIONS,
    FEATURES,
    OPERATIONS,
    PoolTarget,
    PoolTargetExtensions,
    Snapshottable,
    TargetFactory,
)
from kvpool.specs.runner.lockstep import LockStep, dump_diff
from kvpool.specs.runner.swarm import gentle_swarm

T = TypeVar("T")

MAX_BLOCKS = 9


def tokens_from_bits(bits: int) -> list[int]:
    """Sixteen tokens from the bits of one integer (token i is 1 or 2)."""
    return [1 + (bits >> i & 1) for i in range(16)]


STEM_BITS = 0b1011_0010_1101_0110
"""The tokens a shared prefix starts with (as bits, see ``tokens_from_bits``)."""


def tokens_sharing(shared: int, bits: int) -> list[int]:
    """Sixteen tokens whose first ``shared`` are the stem's, the rest from ``bits``."""
    mask = (1 << shared) - 1
    return tokens_from_bits(STEM_BITS & mask | bits & ~mask)


TOKENS = st.builds(tokens_sharing, st.sampled_from([0, 2, 4, 8, 16]), st.integers(0, 2**16 - 1))
"""A request's tokens: from a two-letter alphabet, and 16 of them, enough for
every block a rule may cache. Most start with a prefix of one stem, so that
requests share prefixes and two blocks are often cached under one key (with
random bits alone, too rarely for the default profile to find bugs in which
duplicate a lookup returns). The rest is one integer, so the shrinker makes
two choices per request, not sixteen."""


def request_for(tokens: Sequence[int], hash_block_size: int) -> CacheRequest:
    """A request whose hash of block i is its first (i+1)*hash_block_size tokens.

    That is an injective chained hash: equal hashes mean equal prefixes,
    which is what the safety of a prefix cache rests on.
    """
    n = len(tokens) // hash_block_size
    hashes = tuple(bytes(tokens[: (i + 1) * hash_block_size]) for i in range(n))
    return CacheRequest(block_hashes=hashes, all_token_ids=tuple(tokens))


def state_diff(expected: PoolState, actual: PoolState) -> str:
    """The two states side by side, as a unified diff of their dumps."""
    return dump_diff(dump_state(expected), dump_state(actual))


BLOCK_IDS = Bundle("block_ids")


_BLIND_OPERATIONS = (
    "move_block_hashes",
    "is_block_writable",
    "emit_cached_block_events",
    "replace_existing_hashes",
)
"""The vLLM 0.33 operations ``extension_call`` draws from."""

MEDIUMS = (model.MEDIUM_GPU, model.MEDIUM_CPU)
LOOKAHEADS = (0, 0, 1, 2)
"""Look-ahead tokens a pool is built with: none half the time (vLLM's default)."""


def _new_pool_rule(
    profiles: Sequence[Profile],
    caching: Sequence[bool],
    events: Sequence[bool],
    mediums: Sequence[str] = MEDIUMS,
    lookaheads: Sequence[int] = LOOKAHEADS,
    several_groups: bool = True,
) -> Callable[..., Any]:
    """The machine's first step: build a pool from drawn parameters."""

    @initialize(
        target=BLOCK_IDS,
        num_blocks=st.integers(2, MAX_BLOCKS),
        hash_block_size=st.integers(1, 2),
        # caching on three times as often: most rules need it
        enable_caching=st.sampled_from([c for c in caching for _ in range(3 if c else 1)]),
        enable_events=st.sampled_from(events),
        num_groups=st.integers(1, 3) if several_groups else st.just(1),
        profile=st.sampled_from([p.name for p in profiles]),
        medium=st.sampled_from(mediums),
        lookahead=st.sampled_from(lookaheads),
    )
    def new_pool(
        self: "PoolMachine",
        num_blocks: int,
        hash_block_size: int,
        enable_caching: bool,
        enable_events: bool,
        num_groups: int,
        profile: str,
        medium: str,
        lookahead: int,
    ) -> Any:
        config = PoolConfig(
            num_blocks,
            enable_caching,
            hash_block_size,
            enable_events,
            profile_named(profile),
            medium,
            lookahead,
        )
        return self.start(config, num_groups)

    return new_pool


class PoolMachine(LockStep[PoolState, PoolTarget], RuleBasedStateMachine):
    """Drives ``make_target`` against the model. Subclass via ``pool_machine(...)``."""

    make_target: ClassVar[TargetFactory]
    profiles: ClassVar[tuple[Profile, ...]] = tuple(PROFILES.values())
    one_block_size_per_group: ClassVar[bool] = False
    """Set for a target without ``mixed_block_sizes``: the first full-block size a
    group is cached at is kept for every later full-block call of that group."""

    held = Bundle("held")
    block_ids = BLOCK_IDS

    def __init__(self) -> None:
        super().__init__()
        gentle_swarm(self)
        self.model = None
        self.target = None
        self.trace = []

    # ------------------------------------------------------------------
    # Construction
    # ------------------------------------------------------------------

    def holds_blocks(self) -> bool:
        """Whether the program holds a reference to draw (rules drawing lists of them need one)."""
        return bool(self.bundle("held"))

    def offers(self, operation: str) -> bool:
        """Whether the target has ``operation`` (one of vLLM 0.33's optional ``EXTENSIONS``)."""
        return self.target is not None and hasattr(self.target, operation)

    def start(self, config: PoolConfig, num_groups: int) -> Any:
        """Build the model and the target for ``config``; every block id joins the bundle."""
        self.num_groups = num_groups
        self.group_block_size: dict[int, int] = {}
        self.model = model.new_pool(
            config.num_blocks,
            config.enable_caching,
            config.hash_block_size,
            config.enable_events,
            config.profile,
            config.medium,
            config.num_hash_lookahead_tokens,
        )
        self.target = type(self).make_target(config)
        self.history = FreeHistory.start(self.model)
        self.taken_model: list[KVCacheEvent] = []
        self.taken_target: list[KVCacheEvent] = []
        self.reannounced: set[int] = set()
        """Positions in the event stream of re-announcements (emit_cached_block_events)."""
        return multiple(*range(config.num_blocks))

    new_pool = _new_pool_rule(tuple(PROFILES.values()), caching=(True, False), events=(False, True))

    # ------------------------------------------------------------------
    # The operations
    # ------------------------------------------------------------------

    @precondition(lambda self: self.model is not None and len(self.model.free_queue) > 0)
    @rule(target=held, num_blocks=st.integers(0, 3))
    def get_new_blocks(self, num_blocks: int) -> Any:
        _, ids = self._step(
            f"get_new_blocks({num_blocks})",
            lambda s: model.get_new_blocks(s, num_blocks),
            lambda t: tuple(t.get_new_blocks(num_blocks)),
        )
        return multiple(*(ids or ()))

    @rule(target=held, block_ids=st.lists(block_ids, min_size=1, max_size=3))
    def touch(self, block_ids: list[int]) -> Any:
        done, _ = self._step(
            f"touch({block_ids})",
            lambda s: model.touch(s, block_ids),
            lambda t: t.touch(block_ids),
            returns_none=True,
        )
        return multiple(*(b for b in block_ids if b != 0)) if done else multiple()

    @precondition(lambda self: self.holds_blocks())
    @rule(block_ids=st.lists(consumes(held), max_size=4))
    def free_blocks(self, block_ids: list[int]) -> None:
        self._step(
            f"free_blocks({block_ids})",
            lambda s: model.free_blocks(s, block_ids),
            lambda t: t.free_blocks(block_ids),
            freed=block_ids,
            returns_none=True,
        )

    @precondition(lambda self: self.holds_blocks())
    @rule(
        block_ids=st.lists(held, unique=True, min_size=1, max_size=4),
        tokens=TOKENS,
        skip=st.integers(0, 3),
        full=st.integers(1, 4),
        size_factor=st.integers(1, 2),
        group=st.integers(0, 2),
        use_mask=st.booleans(),
        mask_seed=st.integers(0, 15),
    )
    def cache_full_blocks(
        self,
        block_ids: list[int],
        tokens: list[int],
        skip: int,
        full: int,
        size_factor: int,
        group: int,
        use_mask: bool,
        mask_seed: int,
    ) -> None:
        """Cache blocks [skip:full] of a request holding ``block_ids``, both capped to fit."""
        assert self.model is not None
        hbs = self.model.config.hash_block_size
        num_full_blocks = min(full, len(block_ids))
        num_cached_blocks = min(skip, num_full_blocks)
        n_new = num_full_blocks - num_cached_blocks
        mask = [bool(mask_seed >> i & 1) for i in range(n_new)] if use_mask else None
        self._cache_full_blocks(
            block_ids,
            tokens,
            num_cached_blocks,
            num_full_blocks,
            hbs * size_factor,
            group % self.num_groups,
            mask,
        )

    @precondition(lambda self: self.holds_blocks())
    @rule(
        block_ids=st.lists(held, unique=True, min_size=1, max_size=3),
        tokens=TOKENS,
        nulls=st.integers(1, 2),
        skip=st.integers(0, 2),
        size_factor=st.integers(1, 2),
        group=st.integers(0, 2),
    )
    def cache_full_blocks_after_window(
        self,
        block_ids: list[int],
        tokens: list[int],
        nulls: int,
        skip: int,
        size_factor: int,
        group: int,
    ) -> None:
        """A sliding-window caller's table: its first blocks are the null block.

        The blocks before the window hold no tokens anyone reads, so vLLM's
        sliding-window manager puts the null block there and caches the whole
        table; the null positions are in the cached range.
        """
        assert self.model is not None
        table = [model.NULL_BLOCK_ID] * nulls + block_ids
        self._cache_full_blocks(
            table,
            tokens,
            min(skip, nulls),
            len(table),
            self.model.config.hash_block_size * size_factor,
            group % self.num_groups,
            None,
        )

    def full_block_size(self, group: int, block_size: int) -> int:
        """The block size a full-block call of ``group`` uses: ``block_size``, unless the
        target keeps one size per group (``one_block_size_per_group``) and ``group`` was
        cached at another; sizes that are no positive multiple of the hash block size
        (level 2's invalid calls) are left as drawn."""
        assert self.model is not None
        hbs = self.model.config.hash_block_size
        if not self.one_block_size_per_group or block_size <= 0 or block_size % hbs:
            return block_size
        return self.group_block_size.setdefault(group, block_size)

    def _cache_full_blocks(
        self,
        block_ids: list[int],
        tokens: list[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group: int,
        mask: list[bool] | None,
    ) -> None:
        assert self.model is not None
        block_size = self.full_block_size(group, block_size)
        request = request_for(tokens, self.model.config.hash_block_size)
        self._step(
            f"cache_full_blocks(tokens={tokens}, blocks={block_ids}, "
            f"{num_cached_blocks}, {num_full_blocks}, block_size={block_size}, "
            f"group={group}, mask={mask})",
            lambda s: model.cache_full_blocks(
                s, request, block_ids, num_cached_blocks, num_full_blocks, block_size, group, mask
            ),
            lambda t: t.cache_full_blocks(
                request, block_ids, num_cached_blocks, num_full_blocks, block_size, group, mask
            ),
            returns_none=True,
        )

    @rule(
        block_id=held,
        tokens=TOKENS,
        whole_blocks=st.integers(0, 1),
        hash_blocks_more=st.integers(1, 3),
        size_factor=st.integers(2, 4),
        group=st.integers(0, 2),
    )
    def cache_partial_block(
        self,
        block_id: int,
        tokens: list[int],
        whole_blocks: int,
        hash_blocks_more: int,
        size_factor: int,
        group: int,
        replace: bool = False,
    ) -> None:
        """A partial entry ``whole_blocks`` blocks plus some hash blocks into the request.

        ``replace``: with ``replace_existing_hashes`` (vLLM 0.33), a re-keying
        (``extension_call`` draws that one).
        """
        assert self.model is not None
        hbs = self.model.config.hash_block_size
        into_block = 1 + (hash_blocks_more - 1) % (size_factor - 1)
        num_tokens = hbs * (whole_blocks * size_factor + into_block)
        self._cache_partial_block(
            block_id, tokens, num_tokens, group % self.num_groups, hbs * size_factor, replace
        )

    def _cache_partial_block(
        self,
        block_id: int,
        tokens: list[int],
        num_tokens: int,
        group: int,
        block_size: int,
        replace: bool = False,
    ) -> None:
        assert self.model is not None
        request = request_for(tokens, self.model.config.hash_block_size)
        flag = (True,) if replace else ()
        self._step(
            f"cache_partial_block(tokens={tokens}, block={block_id}, num_tokens={num_tokens}, "
            f"group={group}, block_size={block_size}"
            + (", replace_existing_hashes=True)" if replace else ")"),
            lambda s: model.cache_partial_block(
                s, request, block_id, num_tokens, group, block_size, replace
            ),
            lambda t: t.cache_partial_block(
                request, block_id, num_tokens, group, block_size, *flag
            ),
        )

    @rule(tokens=TOKENS, num_hash_blocks=st.integers(1, 8), groups=st.sets(st.integers(0, 2)))
    def get_cached_block(self, tokens: list[int], num_hash_blocks: int, groups: set[int]) -> None:
        assert self.model is not None
        hbs = self.model.config.hash_block_size
        block_hash = bytes(tokens[: num_hash_blocks * hbs])
        group_ids = sorted(g % self.num_groups for g in groups)
        self._query(
            f"get_cached_block({block_hash.hex()!r}, {group_ids})",
            lambda s: model.get_cached_block(s, block_hash, group_ids),
            lambda t: _tuple_or_none(t.get_cached_block(block_hash, group_ids)),
        )

    @rule(block_ids=st.lists(block_ids, max_size=3))
    def evict_blocks(self, block_ids: list[int]) -> None:
        self._step(
            f"evict_blocks({set(block_ids)})",
            lambda s: model.evict_blocks(s, set(block_ids)),
            lambda t: t.evict_blocks(set(block_ids)),
            returns_none=True,
        )

    # Lookups and evictions aimed at the cache. Drawn blindly, a lookup names a
    # cached prefix with probability 2**-k and an eviction a cached block
    # rarely: bugs in which duplicate a hit returns, or in what evicting a
    # free cached block does to the queue, went unfound by the ci profile
    # (tests/corpus). These pick among what the model's cache holds; the
    # index keeps a printed program replayable.

    @precondition(lambda self: self.model is not None and len(self.model.free_queue) > 0)
    @rule(target=held, num_blocks=st.integers(1, 3), tokens=TOKENS, group=st.integers(0, 2))
    def prefill(self, num_blocks: int, tokens: list[int], group: int) -> Any:
        """A request's prefill: new blocks, then (caching on) all of them cached at once.

        Blind rules rarely line up a free block, a held block and a valid
        cache call: in 186 ci programs caching ran 81 times, two blocks
        never shared a key, and a pool without caching freed a block 5 times.
        """
        assert self.model is not None
        n = min(num_blocks, len(self.model.free_queue))
        _, ids = self._step(
            f"get_new_blocks({n})",
            lambda s: model.get_new_blocks(s, n),
            lambda t: tuple(t.get_new_blocks(n)),
        )
        blocks = list(ids or ())
        if not self.model.config.enable_caching:
            return multiple(*blocks)
        self._cache_full_blocks(
            blocks,
            tokens,
            0,
            len(blocks),
            self.model.config.hash_block_size,
            group % self.num_groups,
            None,
        )
        return multiple(*blocks)

    @precondition(lambda self: self.holds_blocks())
    @rule(block_ids=st.lists(consumes(held), min_size=1, max_size=4))
    def finish(self, block_ids: list[int]) -> None:
        """A request finishing: frees at least one held reference (free_blocks may free none)."""
        self.free_blocks(block_ids)

    @precondition(lambda self: self.model is not None and bool(self.model.cached))
    @rule(index=st.integers(0, 63), more_groups=st.sets(st.integers(0, 2), max_size=2))
    def get_cached_block_hit(self, index: int, more_groups: set[int]) -> None:
        """Look up a key the model's cache holds, in its group and maybe others.

        Even ``index`` values aim at a key two or more blocks share, when
        there is one: which duplicate a hit returns is a bug of its own
        (lookup-newest-duplicate), and among all keys a shared one was picked
        too rarely for the default profile to find it reliably.
        """
        assert self.model is not None
        cached = self.model.cached
        keys = sorted(cached)
        shared = [k for k in keys if len(cached[k]) > 1]
        if shared and index % 2 == 0:
            keys = shared
        block_hash, group = keys[index // 2 % len(keys)]
        group_ids = sorted({group, *(g % self.num_groups for g in more_groups)})
        self._query(
            f"get_cached_block({block_hash.hex()!r}, {group_ids})",
            lambda s: model.get_cached_block(s, block_hash, group_ids),
            lambda t: _tuple_or_none(t.get_cached_block(block_hash, group_ids)),
        )

    @precondition(
        lambda self: (
            self.model is not None and any(b.block_hash is not None for b in self.model.blocks)
        )
    )
    @rule(index=st.integers(0, 63), count=st.integers(1, 2))
    def evict_cached_blocks(self, index: int, count: int) -> None:
        """Evict one or two blocks that carry a hash (free ones included)."""
        assert self.model is not None
        hashed = [i for i, b in enumerate(self.model.blocks) if b.block_hash is not None]
        chosen = {hashed[(index + j) % len(hashed)] for j in range(count)}
        self._step(
            f"evict_blocks({chosen})",
            lambda s: model.evict_blocks(s, chosen),
            lambda t: t.evict_blocks(set(chosen)),
            returns_none=True,
        )

    # Only with something cached: always allowed, and the first rule Hypothesis
    # lists (no arguments), it took 28% of dev's steps and kept emptying the
    # cache that most bugs need.
    @precondition(lambda self: self.model is not None and bool(self.model.cached))
    @rule()
    def reset_prefix_cache(self) -> None:
        self._step(
            "reset_prefix_cache()", model.reset_prefix_cache, lambda t: t.reset_prefix_cache()
        )

    @rule()
    def take_events(self) -> None:
        assert self.model is not None
        events = self.model.pending_events
        self._step(
            "take_events()",
            lambda s: (model.take_events(s)[0], self._normal_events(events)),
            lambda t: self._normal_events(tuple(t.take_events())),
        )
        self.taken_model.extend(events)
        self.taken_target.extend(events)

    # vLLM 0.33's operations (EXTENSIONS): each runs only on a target offering it.

    @precondition(lambda self: self.holds_blocks() and self.offers("unpin_blocks"))
    @rule(block_ids=st.lists(consumes(held), min_size=1, max_size=3), watcher=st.integers(0, 2))
    def unpin_blocks(self, block_ids: list[int], watcher: int) -> None:
        """A reader releases blocks it keeps reading until the pool reuses them."""
        self._step(
            f"unpin_blocks({block_ids}, watcher={watcher})",
            lambda s: model.unpin_blocks(s, block_ids, watcher),
            lambda t: _ext(t).unpin_blocks(block_ids, watcher),
            unpinned=block_ids,
            returns_none=True,
        )

    @precondition(
        lambda self: (
            self.offers("move_block_hashes")
            and self.model is not None
            and len(self.model.free_queue) > 0
            and any(b.ref_cnt > 0 and b.block_hash is not None for b in self.model.blocks)
        )
    )
    @rule(target=held, index=st.integers(0, 63))
    def relocate(self, index: int) -> Any:
        """Copy-on-write as vLLM's Mamba manager does it: a fresh block takes over the keys."""
        assert self.model is not None
        keyed = [
            i for i, b in enumerate(self.model.blocks) if b.ref_cnt > 0 and b.block_hash is not None
        ]
        src = keyed[index % len(keyed)]
        _, ids = self._step(
            "get_new_blocks(1)",
            lambda s: model.get_new_blocks(s, 1),
            lambda t: tuple(t.get_new_blocks(1)),
        )
        (dst,) = ids or (None,)
        if dst is None:
            return multiple()
        self.move_block_hashes(src, dst)
        return multiple(dst)

    @precondition(lambda self: any(self.offers(op) for op in _BLIND_OPERATIONS))
    @rule(
        op=st.sampled_from(_BLIND_OPERATIONS),
        block_id=block_ids,
        other=block_ids,
        tokens=TOKENS,
        num_cached_blocks=st.integers(0, 3),
        size_factor=st.integers(1, 2),
        group=st.integers(0, 2),
    )
    def extension_call(
        self,
        op: str,
        block_id: int,
        other: int,
        tokens: list[int],
        num_cached_blocks: int,
        size_factor: int,
        group: int,
    ) -> None:
        """One of vLLM 0.33's other operations, with drawn arguments (one rule for four:
        every rule added reshuffles the derandomized ``ci`` programs, and more of them
        lost bugs of the corpus at level 1).

        ``move_block_hashes(block_id, other)`` (level 1 sends the valid ones: a held
        keyless ``other``), ``is_block_writable(block_id)``, and
        ``emit_cached_block_events`` (a full report of a cache hit).
        """
        assert self.model is not None
        if not self.offers(op) and op != "replace_existing_hashes":
            return
        if op == "move_block_hashes":
            self.move_block_hashes(block_id, other)
        elif op == "replace_existing_hashes":
            # A re-keying: cache_partial_block(..., replace_existing_hashes=True)
            self.cache_partial_block(
                block_id, tokens, group % 2, num_cached_blocks + 1, size_factor + 1, group, True
            )
        elif op == "is_block_writable":
            self._query(
                f"is_block_writable({block_id})",
                lambda s: model.is_block_writable(s, block_id),
                lambda t: bool(_ext(t).is_block_writable(block_id)),
            )
        else:
            hbs = self.model.config.hash_block_size
            self._emit_cached_block_events(
                tokens, num_cached_blocks, hbs * size_factor, group % self.num_groups
            )

    def move_block_hashes(self, src: int, dst: int) -> None:
        self._step(
            f"move_block_hashes({src}, {dst})",
            lambda s: model.move_block_hashes(s, src, dst),
            lambda t: _ext(t).move_block_hashes(src, dst),
            returns_none=True,
        )

    def _emit_cached_block_events(
        self, tokens: list[int], num_cached_blocks: int, block_size: int, group: int
    ) -> None:
        assert self.model is not None
        request = request_for(tokens, self.model.config.hash_block_size)
        emitted = len(self.taken_model) + len(self.model.pending_events)
        done, _ = self._step(
            f"emit_cached_block_events(tokens={tokens}, {num_cached_blocks}, "
            f"block_size={block_size}, group={group})",
            lambda s: model.emit_cached_block_events(
                s, request, num_cached_blocks, block_size, group
            ),
            lambda t: _ext(t).emit_cached_block_events(
                request, num_cached_blocks, block_size, group
            ),
            returns_none=True,
        )
        if done and len(self.taken_model) + len(self.model.pending_events) > emitted:
            self.reannounced.add(emitted)

    # ------------------------------------------------------------------
    # Invalid operations (level 2)
    # ------------------------------------------------------------------

    @precondition(lambda self: self.level >= 2 and self.model is not None)
    @rule(extra=st.integers(1, 2))
    def get_new_blocks_beyond_free(self, extra: int) -> None:
        assert self.model is not None
        n = len(self.model.free_queue) + extra
        self._step(
            f"get_new_blocks({n})",
            lambda s: model.get_new_blocks(s, n),
            lambda t: tuple(t.get_new_blocks(n)),
        )

    @precondition(lambda self: self.level >= 2 and self.model is not None)
    @rule(num_blocks=st.integers(-2, -1))
    def get_new_blocks_negative(self, num_blocks: int) -> None:
        self._step(
            f"get_new_blocks({num_blocks})",
            lambda s: model.get_new_blocks(s, num_blocks),
            lambda t: tuple(t.get_new_blocks(num_blocks)),
        )

    @precondition(lambda self: self.level >= 2 and self.model is not None)
    @rule(block_ids=st.lists(block_ids, min_size=1, max_size=3))
    def free_blocks_not_held(self, block_ids: list[int]) -> None:
        """Frees that release more references than the program holds."""
        assert self.model is not None
        try:
            model.free_blocks(self.model, block_ids)
        except PoolError:
            self._step(
                f"free_blocks({block_ids})",
                lambda s: model.free_blocks(s, block_ids),
                lambda t: t.free_blocks(block_ids),
                returns_none=True,
            )
        else:
            event("level 2: generated free was valid, not sent")

    @precondition(lambda self: self.level >= 2 and self.model is not None)
    @rule(
        op=st.sampled_from(["touch", "free_blocks", "evict_blocks"]),
        block_id=st.sampled_from([-1, MAX_BLOCKS, 1000]),
    )
    def unknown_block(self, op: str, block_id: int) -> None:
        self._unknown_among(op, [block_id])

    def _unknown_among(self, op: str, ids: list[int]) -> None:
        calls: dict[str, tuple[Callable[[PoolState], Any], Callable[[PoolTarget], Any]]] = {
            "touch": (lambda s: model.touch(s, ids), lambda t: t.touch(ids)),
            "free_blocks": (
                lambda s: model.free_blocks(s, ids),
                lambda t: t.free_blocks(ids),
            ),
            "evict_blocks": (
                lambda s: model.evict_blocks(s, set(ids)),
                lambda t: t.evict_blocks(set(ids)),
            ),
        }
        on_model, on_target = calls[op]
        self._step(f"{op}({ids})", on_model, on_target, returns_none=True)

    @precondition(lambda self: self.level >= 2 and self.model is not None)
    @rule(
        block_ids=st.lists(block_ids, unique=True, min_size=1, max_size=3),
        tokens=TOKENS,
        num_full_blocks=st.integers(1, 3),
    )
    def cache_full_blocks_any_block(
        self, block_ids: list[int], tokens: list[int], num_full_blocks: int
    ) -> None:
        """Caching blocks the program may not hold (free or null ones)."""
        assert self.model is not None
        request = request_for(tokens, self.model.config.hash_block_size)
        size = self.full_block_size(0, self.model.config.hash_block_size)
        self._step(
            f"cache_full_blocks(tokens={tokens}, blocks={block_ids}, 0, {num_full_blocks}, "
            f"block_size={size}, group=0)",
            lambda s: model.cache_full_blocks(s, request, block_ids, 0, num_full_blocks, size, 0),
            lambda t: t.cache_full_blocks(request, block_ids, 0, num_full_blocks, size, 0),
            returns_none=True,
        )

    @precondition(lambda self: self.level >= 2 and self.holds_blocks())
    @rule(
        block_ids=st.lists(held, unique=True, min_size=1, max_size=3),
        tokens=st.lists(st.integers(1, 2), max_size=6),
        num_cached_blocks=st.integers(-1, 4),
        num_full_blocks=st.integers(0, 5),
        block_size=st.integers(1, 5),
        group=st.integers(-1, 2),
        mask=st.none() | st.lists(st.booleans(), max_size=4),
    )
    def cache_full_blocks_raw_arguments(
        self,
        block_ids: list[int],
        tokens: list[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group: int,
        mask: list[bool] | None,
    ) -> None:
        """Arguments drawn with no regard for validity: ranges, sizes, masks, groups."""
        group = group if group < 0 else group % self.num_groups
        self._cache_full_blocks(
            block_ids, tokens, num_cached_blocks, num_full_blocks, block_size, group, mask
        )

    @precondition(lambda self: self.level >= 2 and self.model is not None)
    @rule(
        block_id=block_ids,
        tokens=TOKENS,
        num_tokens=st.integers(-1, 9),
        block_size=st.integers(1, 5),
        group=st.integers(-1, 2),
    )
    def cache_partial_block_raw_arguments(
        self, block_id: int, tokens: list[int], num_tokens: int, block_size: int, group: int
    ) -> None:
        """Partial entries on any block, at any length, for any block size."""
        group = group if group < 0 else group % self.num_groups
        self._cache_partial_block(block_id, tokens, num_tokens, group, block_size)

    @precondition(
        lambda self: self.level >= 2 and self.model is not None and self.offers("unpin_blocks")
    )
    @rule(block_ids=st.lists(block_ids, min_size=1, max_size=3), watcher=st.integers(0, 2))
    def unpin_blocks_not_held(self, block_ids: list[int], watcher: int) -> None:
        """Unpins of free, null or over-listed blocks (vLLM asserts after partial effects)."""
        assert self.model is not None
        try:
            model.unpin_blocks(self.model, block_ids, watcher)
        except PoolError:
            self._step(
                f"unpin_blocks({block_ids}, watcher={watcher})",
                lambda s: model.unpin_blocks(s, block_ids, watcher),
                lambda t: _ext(t).unpin_blocks(block_ids, watcher),
                returns_none=True,
            )
        else:
            event("level 2: generated unpin was valid, not sent")

    @precondition(
        lambda self: (
            self.level >= 2 and self.model is not None and self.offers("emit_cached_block_events")
        )
    )
    @rule(
        tokens=TOKENS,
        num_cached_blocks=st.integers(-1, 9),
        block_size=st.integers(1, 5),
        group=st.integers(-1, 2),
    )
    def emit_cached_block_events_raw_arguments(
        self, tokens: list[int], num_cached_blocks: int, block_size: int, group: int
    ) -> None:
        group = group if group < 0 else group % self.num_groups
        self._emit_cached_block_events(tokens, num_cached_blocks, block_size, group)

    # ------------------------------------------------------------------
    # After every step
    # ------------------------------------------------------------------

    @invariant()
    def target_agrees_with_model(self) -> None:
        if self.model is None or self.target is None:
            return
        self._compare(
            "get_num_free_blocks()",
            model.get_num_free_blocks(self.model),
            self.target.get_num_free_blocks(),
        )
        expected_usage, actual_usage = model.get_usage(self.model), self.target.get_usage()
        if not math.isclose(expected_usage, actual_usage, rel_tol=1e-9, abs_tol=1e-12):
            self._diverge("get_usage()", f"model {expected_usage!r}, target {actual_usage!r}")
        check_all(self.model, self.history, self.taken_model, self.reannounced)
        if isinstance(self.target, Snapshottable):
            snapshot = self.target.snapshot()
            expected = self._normal_state(self.model)
            if self._normal_state(snapshot) != expected:
                raise Divergence(
                    "the target's state differs from the model's:\n"
                    + state_diff(expected, self._normal_state(snapshot))
                )
            check_all(snapshot, self.history, self.taken_target, self.reannounced)
        if self.offers("take_reuses"):
            # Fired watchers are compared after every step: a reader must hear at once.
            self._step("take_reuses()", model.take_reuses, lambda t: tuple(_ext(t).take_reuses()))

    # ------------------------------------------------------------------
    # Lock-step machinery (the rest is kvpool.specs.runner.lockstep)
    # ------------------------------------------------------------------

    def _observe(self, before: PoolState, after: PoolState, **observed: Any) -> None:
        """The free history LRU order is checked against; ``freed``: the ids a free released."""
        self.history = self.history.observe(
            before, after, observed.get("freed", ()), observed.get("unpinned", ())
        )

    def _normal_state(self, state: PoolState) -> PoolState:
        normalize = getattr(self.target, "normalize_state", None)
        if normalize is None:
            return state
        normal: PoolState = normalize(state)
        return normal

    def _normal_events(self, events: Sequence[KVCacheEvent]) -> tuple[KVCacheEvent, ...]:
        normalize = getattr(self.target, "normalize_events", None)
        return tuple(events) if normalize is None else tuple(normalize(events))


@precondition(lambda self: self.level >= 2 and self.model is not None)
@rule(
    op=st.sampled_from(["touch", "free_blocks", "evict_blocks"]),
    before=st.lists(BLOCK_IDS, min_size=1, max_size=2),
    after=st.lists(BLOCK_IDS, max_size=1),
    just_past_end=st.booleans(),
)
def _unknown_block_among_known(
    self: PoolMachine, op: str, before: list[int], after: list[int], just_past_end: bool
) -> None:
    """An unknown id among known ones, whose effects a rejection must undo.

    Mutation testing (docs/verification.md) showed two gaps this closes:
    ``touch`` undoing the wrong entries after an unknown block, and
    ``evict_blocks`` accepting the id just past the end (``>=`` to ``>``).
    Added to level-2 machines only (``pool_machine``): any new rule reshuffles
    the derandomized ``ci`` programs, and at level 1 that lost a corpus bug.
    """
    assert self.model is not None
    unknown = self.model.config.num_blocks if just_past_end else -1
    self._unknown_among(op, [*before, unknown, *after])


_RULE_OPERATIONS: dict[str, tuple[str, ...]] = {
    "unpin_blocks": ("unpin_blocks", "take_reuses"),
    "unpin_blocks_not_held": ("unpin_blocks", "take_reuses"),
    "relocate": ("move_block_hashes",),
    "emit_cached_block_events_raw_arguments": ("emit_cached_block_events",),
}
"""The vLLM 0.33 operations (``EXTENSIONS``) each rule needs: dropped when one is unsupported.
``extension_call`` instead draws only the supported ones (``_without``)."""
assert {op for ops in _RULE_OPERATIONS.values() for op in ops} | set(_BLIND_OPERATIONS) == {
    *EXTENSIONS,
    "replace_existing_hashes",
}


def _ext(target: PoolTarget) -> PoolTargetExtensions:
    """The target as one offering vLLM 0.33's operations (rules check ``offers`` first)."""
    return cast(PoolTargetExtensions, target)


def _tuple_or_none(blocks: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if blocks is None else tuple(blocks)


def pool_machine(
    make_target: TargetFactory,
    level: int = 1,
    profiles: Sequence[Profile] | None = None,
    name: str = "PoolMachine",
    caching: Sequence[bool] = (True, False),
    events: Sequence[bool] = (False, True),
    unsupported: Collection[str] = (),
) -> type[PoolMachine]:
    """A state machine class that checks ``make_target`` at ``level``.

    ``profiles`` restricts the semantics profiles the pools are built with
    (all of them by default): pass the one profile a target claims to
    implement. ``caching`` and ``events`` restrict the pool configurations.
    ``unsupported`` names operations and features (``kvpool.specs.pool.target``)
    the target lacks: no program uses them.
    """
    chosen = tuple(profiles) if profiles else tuple(PROFILES.values())
    if "events" in unsupported:
        events = (False,)
    mediums = (model.MEDIUM_GPU,) if "medium" in unsupported else MEDIUMS
    lookaheads = (0,) if "lookahead" in unsupported else LOOKAHEADS
    attrs = {
        "make_target": staticmethod(make_target),
        "level": level,
        "profiles": chosen,
        "new_pool": _new_pool_rule(
            chosen, caching, events, mediums, lookaheads, "groups" not in unsupported
        ),
        "one_block_size_per_group": "mixed_block_sizes" in unsupported,
    }
    if level >= 2:
        attrs["unknown_block_among_known"] = _unknown_block_among_known
    machine = type(name, (PoolMachine,), attrs)
    return _without(machine, frozenset(unsupported)) if unsupported else machine


def _without(machine: type[PoolMachine], unsupported: frozenset[str]) -> type[PoolMachine]:
    """A subclass of ``machine`` whose programs never use what ``unsupported`` names.

    ``cache_partial_block`` drops every rule that calls it; ``block_mask``
    makes every rule that draws a mask (``use_mask`` or ``mask``) draw none;
    ``block_size_multiple`` makes full blocks one hash block long
    (``size_factor`` 1, raw ``block_size`` 1); ``groups`` draws group 0 only
    (no negative group either: such a pool's calls name no group) and
    ``mixed_block_sizes`` is handled by ``one_block_size_per_group``.
    """
    unknown = unsupported - set(OPERATIONS) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown operations or features {sorted(unknown)}")
    attrs: dict[str, Any] = {}
    for name, member in inspect.getmembers(machine):
        found = getattr(member, RULE_MARKER, None)
        if found is None:
            continue
        if "cache_partial_block" in unsupported and "cache_partial_block" in name:
            attrs[name] = None
            continue
        if any(op in unsupported for op in _RULE_OPERATIONS.get(name, ())):
            attrs[name] = None
            continue
        arguments = dict(found.arguments)
        changes: dict[str, Any] = {}
        if "block_mask" in unsupported:
            changes.update(use_mask=st.just(False), mask=st.none())
        if "block_size_multiple" in unsupported and "partial" not in name:
            changes.update(size_factor=st.just(1), block_size=st.just(1))
        if "groups" in unsupported:
            changes.update(group=st.just(0), groups=st.just({0}), more_groups=st.just(set()))
        blind = [op for op in _BLIND_OPERATIONS if op not in unsupported]
        if name == "extension_call" and len(blind) < len(_BLIND_OPERATIONS):
            if not blind:
                attrs[name] = None
                continue
            changes.update(op=st.sampled_from(blind))
        changed = {k: v for k, v in changes.items() if k in arguments}
        if changed and not found.targets:
            arguments.update(changed)
            replacement = rule(**arguments)(found.function)
            for precondition_function in found.preconditions:
                replacement = precondition(precondition_function)(replacement)
            attrs[name] = replacement
    if not attrs:
        return machine
    return type(machine.__name__, (machine,), attrs)
