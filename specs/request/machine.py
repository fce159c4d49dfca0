"""The request-level machine: a scheduler's life of requests, against the model and a target.

Hypothesis plays a scheduler on a tiny KV cache (2 to 12 blocks, so
eviction happens all the time): requests arrive with shared and diverging
prompts (a two-token alphabet), some with a LoRA adapter, a cache salt or a
multimodal input; they are admitted with their cache hits, prefilled in
chunks, decoded with draft tokens that are partly rejected, preempted and
re-admitted, and finished, in any interleaving. Every call runs on the model
first (``kvpool.model.manager``), then on the target; results, block tables,
free counts, usage, events, stats and (for targets with ``snapshot()``) the
whole state must agree after every step.

The machine also *runs the model* in the sense of a GPU: after each
successful allocation it writes the KV of every scheduled position into the
target's blocks, in a ground-truth record (``KVTruth``). The safety
invariants of ``kvpool.specs.request.invariants`` then check that the cache
never serves wrong KV: every block reachable through the hash map holds the
prefix its hash names, every hit and every running request's computed
positions hold the request's own KV, and no request writes into a block
another request holds.

The target protocol is ``kvpool.specs.request.target``; the lock-step calls
are ``kvpool.specs.runner.lockstep``. Every program is also kept as data in
``script``, in the steps of a request-layer scenario file
(``kvpool.specs.teaching.request_scenarios``), so that it can be told step by
step (``kvpool explain``) or turned into a vector.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar, TypeVar, cast

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool.model import PROFILES, KVCacheEvent, PoolState, Profile, scheduler_calls
from kvpool.model import manager as model_manager
from kvpool.model.errors import PoolError
from kvpool.model.geometry import default_scheduler_block_size, effective_specs
from kvpool.model.hashing import LoraAdapter, MultiModalInput
from kvpool.model.mamba_reserve import checkpoint_position, checkpoint_valid
from kvpool.model.manager import Blocks, KVCacheManagerState
from kvpool.model.profiles import profile_named
from kvpool.model.request import Request, append_tokens, new_request, preempted, with_computed
from kvpool.model.single_type import (
    AttentionType,
    KVCacheSpec,
    chunked_local,
    full_attention,
    mamba,
    mamba_align,
    sliding_window,
)
from kvpool.model.state import NULL_BLOCK_ID
from kvpool.specs.errors import Divergence, TargetError
from kvpool.specs.pool.invariants import check_all
from kvpool.specs.request.invariants import (
    STATE,
    KVTruth,
    cached_blocks_hold_their_prefix,
    check,
    copy_serves_source_prefix,
    copy_serves_source_state,
    hit_matches_request,
    ref_counts_match_tables,
    request_content,
    requests_read_their_own_kv,
    target_hashes_name_prefixes,
    write_is_exclusive,
)
from kvpool.specs.request.target import (
    HYBRID_LAYOUTS,
    LAYOUTS,
    MAMBA_ALIGN_DCP_LAYOUTS,
    MAMBA_FINE_LAYOUTS,
    ManagerFactory,
    ManagerSetup,
    ManagerSnapshottable,
    ManagerTarget,
    ManagerTarget033,
    ManagerTargetScheduler,
    geometry_arguments,
    retention_arguments,
)
from kvpool.specs.runner.lockstep import LockStep
from kvpool.specs.runner.swarm import gentle_swarm

T = TypeVar("T")

# --------------------------------------------------------------------------
# What the machine draws
# --------------------------------------------------------------------------

MAX_MODEL_LEN = 16
MAX_PROMPT = 12
TOKEN = st.integers(1, 2)
STEM = (1, 2, 2, 1, 1, 2, 1, 2, 2, 2, 1, 1)
"""Prompts start with a prefix of this stem, so requests share long prefixes."""
PROMPT = st.builds(
    lambda shared, tail: (STEM[:shared] + tuple(tail))[:MAX_PROMPT] or (1,),
    st.sampled_from([12, 10, 8, 6, 4, 3, 0]),
    st.lists(TOKEN, max_size=3),
)

VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "lora-a": {"lora": LoraAdapter(1, "a", "/a")},
    "lora-b": {"lora": LoraAdapter(2, "b", "/b")},
    "salt-a": {"cache_salt": "a"},
    "salt-t": {"cache_salt": "t"},
    "image-x@1": {"mm_inputs": (MultiModalInput("x", 1, 2),)},
    "image-x@2": {"mm_inputs": (MultiModalInput("x", 2, 2),)},
    "image-y@1": {"mm_inputs": (MultiModalInput("y", 1, 3),)},
}
"""Request flavours. An image's identifier fixes its length, as a content hash would. A
salt equals a LoRA adapter's name: a hasher that leaves its keys untagged confuses them."""


def layout_specs(
    layout: str, block_size: int, window: int, chunk_blocks: int, max_model_len: int, hbs: int
) -> tuple[KVCacheSpec, ...]:
    """The group specs of a layout."""
    if layout == "full":
        return (full_attention(block_size),)
    if layout == "sliding_window":
        return (sliding_window(block_size, window),)
    if layout == "chunked_local":
        return (chunked_local(block_size, block_size * chunk_blocks),)
    if layout == "mamba":
        return (mamba(-(-max_model_len // hbs) * hbs),)
    if layout == "full+sliding_window":
        return (full_attention(block_size), sliding_window(block_size, window))
    if layout in ("hash_full+mamba_align", "pair_full+mamba_align"):
        # full attention of one or two hash blocks beside a Mamba block of several: hits may
        # end inside the Mamba block and the full-attention one (kvpool.model.mamba_fine)
        pair = layout.startswith("pair_")
        return (full_attention(2 * hbs if pair else hbs), mamba_align(block_size))
    if layout in MAMBA_ALIGN_DCP_LAYOUTS:
        # a sharded full-attention group (its blocks times the decode world size), maybe a
        # replicated one of one hash block, and Mamba blocks of one hash block, never sharded
        # (kvpool.model.align_dcp)
        replicated = replace(full_attention(hbs), dcp_sharded=False)
        if layout == "full+dcp_full+mamba_align":
            return (replicated, full_attention(block_size), mamba_align(hbs))
        middle = (replicated,) if layout == "dcp_full+full+mamba_align" else ()
        return (full_attention(block_size), *middle, mamba_align(hbs))
    if layout.startswith("wide_") and layout.endswith("+mamba_align"):
        # a Mamba block of one hash block beside blocks of 2 or 4 (kvpool.model.manager's
        # verify_align_geometry): hits end on the attention group's larger blocks
        wide = {
            "wide_full+": full_attention(2 * block_size),
            "wide_sliding_window+": sliding_window(2 * block_size, window),
        }
        return (wide[layout.removesuffix("mamba_align")], mamba_align(hbs))
    if layout.endswith("mamba_align"):
        first = {
            "full+": full_attention(block_size),
            "sliding_window+": sliding_window(block_size, window),
        }
        other = layout.removesuffix("mamba_align")
        return (*((first[other],) if other else ()), mamba_align(block_size))
    if layout == "full+full+sliding_window":
        full = full_attention(block_size)
        return (full, full, sliding_window(block_size, window))
    if layout == "sliding_window+full":
        return (sliding_window(block_size, window), full_attention(block_size))
    if layout == "full+sliding_window+sliding_window":
        return (
            full_attention(block_size),
            sliding_window(block_size, window),
            sliding_window(block_size, window + block_size + 1),
        )
    if layout == "full+full":
        return (full_attention(block_size), full_attention(block_size))
    if layout == "full+mamba":
        # groups share one block size: full attention's blocks are Mamba's, a whole request
        size = -(-max_model_len // hbs) * hbs
        return (full_attention(size), mamba(size))
    if layout == "full+chunked_local":
        return (full_attention(block_size), chunked_local(block_size, block_size * chunk_blocks))
    if layout == "wide_full+sliding_window":
        # blocks of two sizes (vLLM's test_different_block_size): hits at multiples of both
        return (full_attention(2 * block_size), sliding_window(block_size, window))
    if layout == "full+wide_sliding_window":
        return (full_attention(block_size), sliding_window(2 * block_size, window))
    if layout == "wide_full+sliding_window+sliding_window":
        # two equal windows searched together, hits at multiples of the wider full blocks
        # (vLLM 0.33's test_eagle_grouped_swa_siblings_use_same_cache_mask)
        swa = sliding_window(block_size, window)
        return (full_attention(2 * block_size), swa, swa)
    raise ValueError(f"unknown layout {layout!r}")


def reserving(
    specs: tuple[KVCacheSpec, ...], speculative: int, checkpoint_blocks: int
) -> tuple[KVCacheSpec, ...]:
    """``specs`` with every Mamba "align" group keeping ``speculative`` speculative blocks and
    prefill checkpoints ``checkpoint_blocks`` of its blocks apart (0: none)."""
    if not (speculative or checkpoint_blocks):
        return specs
    return tuple(
        replace(
            s,
            num_speculative_blocks=speculative,
            prefill_checkpoint_alignment=checkpoint_blocks * s.block_size,
        )
        if s.mamba_align
        else s
        for s in specs
    )


# --------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------


def _start_rule(
    layouts: Sequence[str],
    profiles: Sequence[Profile],
    events: Sequence[bool],
    block_factors: Sequence[int],
    min_window: int,
    uncached_layouts: Sequence[str] = (),
    hash_sized_layouts: Sequence[str] = (),
    fine_grained: Sequence[bool] = (False,),
    in_flight: Sequence[int | None] = (None,),
    prefill_lookaheads: Sequence[int] = (0,),
    eagle_hybrids: bool = False,
    context_parallel: Sequence[tuple[int, int]] = ((1, 1),),
    retentions: Sequence[int | None] = (None,),
    eagle_flags: bool = False,
    mamba_reserves: Sequence[tuple[int, int]] = ((0, 0),),
) -> Callable[..., None]:
    """The machine's first step, drawing only from the configurations given.

    A layout in ``uncached_layouts`` is drawn with prefix caching off; one in
    ``hash_sized_layouts`` with blocks of one hash block when caching is on.
    ``context_parallel`` lists the (decode, prefill) world sizes to draw, ``retentions``
    the retention intervals (in scheduler blocks; ``ManagerTargetSpec.retentions``).
    """
    # drawn only when it can be True, so that other programs draw what they always did
    extra: dict[str, st.SearchStrategy[Any]] = (
        {"fine": st.sampled_from(list(fine_grained))} if any(fine_grained) else {}
    )
    if any(n is not None for n in in_flight):
        extra["in_flight"] = st.sampled_from(list(in_flight))
    if any(prefill_lookaheads):  # likewise
        extra["lookahead"] = st.sampled_from(list(prefill_lookaheads))
    if any(cp != (1, 1) for cp in context_parallel):
        extra["cp"] = st.sampled_from(list(context_parallel))
    if any(r is not None for r in retentions):
        extra["retention"] = st.sampled_from(list(retentions))
    eagle = st.sampled_from([False, False, True])
    if eagle_flags:  # likewise: the groups flagged as EAGLE's, of those the layout has
        extra["flags"] = st.sets(st.integers(0, 2), max_size=2)
        eagle = st.sampled_from([False, True])  # the flags matter with EAGLE only
    if any(r != (0, 0) for r in mamba_reserves):
        extra["reserve"] = st.sampled_from(list(mamba_reserves))

    decorate = cast(
        Callable[[Callable[..., None]], Callable[..., None]],
        cast(Any, initialize)(
            **extra,
            layout=st.sampled_from(list(layouts)),
            hbs=st.integers(1, 2),
            factor=st.sampled_from(list(block_factors)),
            num_blocks=st.integers(2, 16),
            caching=st.sampled_from([True, True, True, False]),
            eagle=eagle,
            events=st.sampled_from(list(events)),
            log_stats=st.booleans(),
            window=st.integers(min_window, max(min_window, 6)),
            chunk_blocks=st.integers(1, 3),
            profile=st.sampled_from([p.name for p in profiles]),
            prompts=st.lists(PROMPT, min_size=1, max_size=3),
        ),
    )

    def start(self: "ManagerMachine", **drawn: Any) -> None:
        if drawn["layout"] in uncached_layouts:
            drawn["caching"] = False
        if drawn["layout"] in MAMBA_FINE_LAYOUTS and not drawn["caching"]:
            # blocks of two sizes beside a Mamba "align" group are modelled with caching on
            # (kvpool.model.mamba_fine_config), and a block of one hash block otherwise
            drawn["factor"] = 1
        if drawn["layout"] in MAMBA_ALIGN_DCP_LAYOUTS:
            # modelled with caching on (kvpool.model.align_dcp); off, the geometry is refused
            drawn["caching"] = True
        if drawn["caching"] and drawn["layout"] in hash_sized_layouts:
            drawn["factor"] = 1
        self.start(**drawn, eagle_hybrids=eagle_hybrids)

    return decorate(start)


def _align_eagle_modelled(specs: Sequence[KVCacheSpec], hbs: int, dcp: int, caching: bool) -> bool:
    """Whether kvpool models EAGLE beside these groups' Mamba "align" groups (True without
    one): no prefill checkpoint blocks, and no hits inside a Mamba block (caching on with
    blocks of several hash blocks, or decode context parallelism): the rest is refused
    (``kvpool.model.mamba_align_eagle``)."""
    align = [s for s in specs if s.mamba_align]
    return not align or not (
        any(s.prefill_checkpoint_alignment for s in align)
        or (caching and (dcp > 1 or any(s.block_size > hbs for s in align)))
    )


def _align_retains(specs: Sequence[KVCacheSpec], hbs: int, dcp: int) -> bool:
    """Whether kvpool models sparse retention on these groups with a Mamba group: every
    Mamba group in "align" mode, blocks of one hash block, no prefill checkpoint blocks,
    no context parallelism (``kvpool.model.retention_config``; the rest refused). EAGLE
    beside them is modelled under retention too (``kvpool.model.mamba_align_eagle``)."""
    mamba = [s for s in specs if s.attention is AttentionType.MAMBA]
    return dcp == 1 and all(
        s.mamba_align and s.block_size == hbs and not s.prefill_checkpoint_alignment for s in mamba
    )


def mamba_aligned_chunk(
    request: Request,
    start: int,
    num_new: int,
    block_size: int,
    checkpoint_alignment: int = 0,
    hash_block_size: int = 0,
    partial_hits: bool = False,
) -> int:
    """How many of ``num_new`` tokens from ``start`` vLLM 0.33's scheduler schedules when a
    Mamba "align" group is present (``Scheduler._mamba_block_aligned_split`` in
    ``vllm/v1/core/sched/scheduler.py``, without shared-prefix stops). With ``partial_hits``
    (hits inside a Mamba block: ``kvpool.model.mamba_fine``) a chunk also stops at the
    prompt's partial boundary, the last hash-block boundary before its last token, when it
    lies past the last block boundary before the request's last token.

    The manager caches the block of position ``(i + 1) * block_size`` once that many tokens
    are computed, as the state after them; the state is written where a chunk ends. So a
    prefill chunk ends on a block boundary unless it ends the prefill, never runs past the
    next boundary when it starts inside a block, nor past the last boundary before the last
    token. With prefill checkpoint blocks (``checkpoint_alignment`` > 0: the Mamba group's
    ``prefill_checkpoint_alignment``) a last chunk that can export the prefill's checkpoint
    itself (``kvpool.model.mamba_reserve.checkpoint_valid``, with ``hash_block_size``: 0
    for the block's) runs to the end. Decoding is not split. 0: nothing is scheduled this
    step.

    >>> from kvpool.model.request import new_request
    >>> mamba_aligned_chunk(new_request("r", range(10), 4), 0, 6, 4)
    4
    >>> mamba_aligned_chunk(new_request("r", range(10), 4), 0, 10, 4, 4)
    10
    """
    prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
    if start >= prefill_end:
        return num_new
    end = start + num_new
    # with hits inside a Mamba block the checkpoint is on a hash-block boundary
    position = checkpoint_position(prefill_end, hash_block_size if partial_hits else block_size)
    internal = (
        checkpoint_alignment > 0
        and end >= prefill_end
        and checkpoint_valid(
            start, end, position, block_size, checkpoint_alignment, hash_block_size
        )
    )
    if end < prefill_end:
        end = end // block_size * block_size
    last_cache_position = max((request.num_tokens - 1) // block_size * block_size, 0)
    tail = 0
    if partial_hits and not internal:
        tail = (request.num_prompt_tokens - 1) // hash_block_size * hash_block_size
    stops = (
        (start // block_size + 1) * block_size if start % block_size and not internal else 0,
        0 if internal else last_cache_position,
        tail if last_cache_position < tail < request.num_prompt_tokens else 0,
    )
    end = min((stop for stop in stops if start < stop < end), default=end)
    return max(end - start, 0)


class ManagerDivergence(Divergence):
    """The manager under test and the model parted: the message says where and how."""


class ManagerMachine(LockStep[KVCacheManagerState, ManagerTarget], RuleBasedStateMachine):
    """Drives ``make_target`` against the model. Subclass via ``manager_machine(...)``.

    With ``lockstep`` False the target drives the run alone and only the
    safety properties are checked (no model).
    """

    make_target: ClassVar[ManagerFactory]
    divergence = ManagerDivergence

    def __init__(self) -> None:
        super().__init__()
        gentle_swarm(self)
        self.model = None
        self.target = None
        self.trace = []
        self.requests: dict[str, Request] = {}
        self.running: list[str] = []
        self.waiting: list[str] = []
        self.next_id = 0
        self.truth = KVTruth()
        self.taken: list[KVCacheEvent] = []
        self.deferred: list[list[int]] = []
        """Blocks of finished requests popped (``pop_blocks_for_free``) and not yet freed,
        oldest first: each still holds the request's reference."""
        self.script: list[tuple[str, dict[str, object]]] = []
        """The program so far as (operation, JSON arguments) of a request scenario file."""

    # ------------------------------------------------------------------
    # Construction
    # ------------------------------------------------------------------

    def start(
        self,
        layout: str,
        hbs: int,
        factor: int,
        num_blocks: int,
        caching: bool,
        eagle: bool,
        events: bool,
        log_stats: bool,
        window: int,
        chunk_blocks: int,
        profile: str,
        prompts: list[tuple[int, ...]],
        fine: bool = False,
        in_flight: int | None = None,
        lookahead: int = 0,
        eagle_hybrids: bool = False,
        cp: tuple[int, int] = (1, 1),
        retention: int | None = None,
        flags: frozenset[int] | set[int] = frozenset(),
        reserve: tuple[int, int] = (0, 0),
    ) -> None:
        """Build the model and the target; the first requests arrive.

        ``reserve`` is a Mamba "align" group's (speculative blocks, checkpoint alignment in
        blocks) (``kvpool.model.mamba_reserve``); on ``MAMBA_FINE_LAYOUTS`` with caching on,
        the checkpoint alignment in hash blocks.

        With context parallelism (``cp``: decode and prefill world sizes; full-attention
        layouts only) requests are hashed in blocks of ``hbs`` times the decode world
        size, so that one hash block is a sharded block of ``hbs`` tokens per rank.
        ``retention`` (in scheduler blocks: ``ManagerTargetSpec.retentions``) applies to
        layouts with a sliding-window group, or Mamba "align" groups kvpool models under it
        (``_align_retains``); the others run dense.
        """
        chosen = profile_named(profile)
        dcp, pcp = cp
        if layout in MAMBA_ALIGN_DCP_LAYOUTS:
            # hashed per rank: a Mamba block is one hash block, a sharded block dcp of them
            dcp, pcp = max(dcp, 2), 1
            specs = layout_specs(layout, hbs * factor, window, chunk_blocks, MAX_MODEL_LEN, hbs)
        else:
            if any(
                s.attention is not AttentionType.FULL for s in layout_specs(layout, 1, 1, 1, 1, 1)
            ):
                dcp, pcp = 1, 1
            hbs *= dcp
            specs = layout_specs(
                layout, hbs // dcp * factor, window, chunk_blocks, MAX_MODEL_LEN, hbs
            )
        if (
            not layout.startswith(("wide_", "hash_", "pair_"))
            and layout not in MAMBA_ALIGN_DCP_LAYOUTS
        ):
            specs = reserving(specs, *reserve)  # reserved blocks: one block size only
        elif layout in MAMBA_FINE_LAYOUTS and caching and factor > 1 and reserve != (0, 0):
            # hits inside a Mamba block: checkpoints on hash-block boundaries, ``reserve[1]``
            # hash blocks apart (kvpool.model.mamba_fine_reserve)
            specs = tuple(
                replace(
                    s,
                    num_speculative_blocks=reserve[0],
                    prefill_checkpoint_alignment=reserve[1] * hbs,
                )
                if s.mamba_align
                else s
                for s in specs
            )
        if eagle_hybrids:
            # vLLM 0.33's chunked-local finder cannot drop EAGLE's block (kvpool.model.eagle)
            eagle = eagle and not (caching and "chunked_local" in layout)
            # beside Mamba "align" only as kvpool.model.mamba_align_eagle models it
            eagle = eagle and _align_eagle_modelled(specs, hbs, dcp, caching)
        else:
            eagle = eagle and layout in ("full", "sliding_window")
        # flagged groups (vLLM 0.33's is_eagle_group), with EAGLE on; never a chunked-local one
        flagged = tuple(
            sorted(
                g
                for g in flags
                if eagle
                and g < len(specs)
                and specs[g].attention is not AttentionType.CHUNKED_LOCAL
            )
        )
        if eagle and caching:  # the dropped tail (a scheduler block) holds every re-prefilled token
            lookahead = min(lookahead, default_scheduler_block_size(effective_specs(specs, dcp)))
        kinds = {s.attention for s in specs}
        if (AttentionType.MAMBA in kinds and not _align_retains(specs, hbs, dcp)) or (
            AttentionType.SLIDING_WINDOW not in kinds and AttentionType.MAMBA not in kinds
        ):
            retention = None
        interval = (
            None
            if retention is None
            else retention * default_scheduler_block_size(effective_specs(specs, dcp))
        )
        self.setup = ManagerSetup(
            num_blocks=num_blocks,
            specs=specs,
            max_model_len=MAX_MODEL_LEN,
            hash_block_size=hbs,
            enable_caching=caching,
            use_eagle=eagle,
            log_stats=log_stats,
            enable_events=events,
            profile=chosen,
            fine_grained_hits=fine,
            max_in_flight_tokens=in_flight,
            num_prefill_lookahead=lookahead,
            dcp_world_size=dcp,
            pcp_world_size=pcp,
            retention_interval=interval,
            eagle_groups=flagged,
        )
        self.states = [s.mamba_align for s in specs]
        """Groups holding a recurrent state per block (Mamba "align"), not a token's KV per slot."""
        self.align_block = next((s.block_size for s in specs if s.mamba_align), 0)
        """The Mamba "align" block the scheduler splits prefill chunks on (0: none)."""
        align = [s for s in specs if s.mamba_align]
        self.checkpoint_alignment = align[0].prefill_checkpoint_alignment if align else 0
        """The Mamba "align" group's prefill checkpoint alignment (0: no checkpoint blocks)."""
        self.mamba_fine = caching and (
            any(s.block_size > hbs for s in align) or bool(align and dcp > 1)
        )
        """Hits may end inside a Mamba block (``kvpool.model.mamba_fine``), or inside a sharded
        full-attention block (``kvpool.model.align_dcp``): the scheduler stops a chunk at the
        prompt's partial boundary, and takes the copies of each step."""
        self.model = model_manager.new_kv_cache_manager(
            num_blocks,
            specs,
            MAX_MODEL_LEN,
            hash_block_size=hbs,
            enable_caching=caching,
            use_eagle=eagle,
            log_stats=log_stats,
            enable_events=events,
            profile=chosen,
            fine_grained_hits=fine,
            max_in_flight_tokens=in_flight,
            num_prefill_lookahead=lookahead,
            **geometry_arguments(self.setup),
            **retention_arguments(self.setup),
            eagle_groups=self.setup.eagle_groups,
        )
        # the groups' blocks as the manager holds them (sharded ones times the world size)
        self.block_sizes = [s.block_size for s in self.model.managers.specs]
        self.target = type(self).make_target(self.setup)
        for prompt in prompts:
            self.add_request(prompt, "plain")

    # ------------------------------------------------------------------
    # The scheduler's moves
    # ------------------------------------------------------------------

    @precondition(lambda self: len(self.running) + len(self.waiting) < 5)
    @rule(prompt=PROMPT, variant=st.sampled_from(["plain"] * 4 + sorted(VARIANTS)))
    def add_request(self, prompt: tuple[int, ...], variant: str) -> None:
        """A new request arrives and waits."""
        flavour = dict(VARIANTS[variant])
        for m in flavour.get("mm_inputs", ()):
            if m.offset + m.length > len(prompt):
                flavour.pop("mm_inputs")
        rid = f"r{self.next_id}"
        self.next_id += 1
        request = new_request(rid, prompt, self.setup.hash_block_size, **flavour)
        self._record("new_request", request_id=rid, prompt=list(prompt), **_flavour_json(flavour))
        self.requests[rid] = request
        self.waiting.append(rid)
        self._learn(request)

    @precondition(lambda self: bool(self.waiting))
    @rule(which=st.integers(0, 4), chunk=st.integers(1, MAX_PROMPT), delay=st.booleans())
    def admit(self, which: int, chunk: int, delay: bool) -> None:
        """Admit a waiting request: look up its hits, then allocate its first chunk."""
        self._admit(which, chunk, delay)

    def _admit(
        self, which: int, chunk: int, delay: bool, whole: bool = False, connector: bool = False
    ) -> None:
        """``admit``; ``whole`` admits only if the whole sequence fits, and ``connector``
        looks the hit up as for a request scheduled with a KV connector (vLLM 0.33)."""
        rid = self.waiting[which % len(self.waiting)]
        request = self.requests[rid]
        hit: Blocks | None = None
        num_hit = 0
        diverged = False
        if self.setup.enable_caching and connector:
            self._record("get_computed_blocks_for_connector", request_id=rid)
            hit, num_hit, boundary, diverged = self._do(
                f"get_computed_blocks_for_connector({rid})",
                lambda s: scheduler_calls.get_computed_blocks_for_connector(s, request),
                lambda t: _connector_hit(_sched(t).get_computed_blocks_for_connector(request)),
            )
            if self.setup.retention_interval is not None:
                request = replace(request, shared_prefix_boundary=boundary)
                self.requests[rid] = request
        if (
            self.setup.enable_caching
            and (diverged or not connector)
            and self.setup.retention_interval is not None
        ):
            # vLLM 0.33's scheduler keeps the lookup's shared-prefix boundary on the request,
            # where sparse retention reads it when caching (kvpool.model.retention)
            self._record("get_computed_blocks_with_boundary", request_id=rid)
            hit, num_hit, boundary = self._do(
                f"get_computed_blocks_with_boundary({rid})",
                lambda s: model_manager.get_computed_blocks_with_boundary(s, request),
                lambda t: _with_boundary(_033(t).get_computed_blocks_with_boundary(request)),
            )
            request = replace(request, shared_prefix_boundary=boundary)
            self.requests[rid] = request
        elif self.setup.enable_caching and (diverged or not connector):
            # a diverged per-group hit that no external tokens back is looked up again
            # (vLLM 0.33's Scheduler.schedule after get_computed_blocks_for_connector)
            self._record("get_computed_blocks", request_id=rid)
            hit, num_hit = self._do(
                f"get_computed_blocks({rid})",
                lambda s: model_manager.get_computed_blocks(s, request),
                lambda t: _blocks_and_count(t.get_computed_blocks(request)),
            )
        if hit is not None:
            check(
                (
                    "hit_matches_request",
                    hit_matches_request(
                        self.truth, request, hit, self.block_sizes, num_hit, self.states
                    ),
                )
            )
        num_new = min(chunk, request.num_tokens - num_hit)
        if any(self.states):
            num_new = mamba_aligned_chunk(
                request,
                num_hit,
                num_new,
                self.align_block,
                self.checkpoint_alignment,
                self.setup.hash_block_size,
                self.mamba_fine,
            )
            if num_new == 0:
                return  # the scheduler does not schedule a chunk that would end mid-block
        self._record(
            "allocate_slots",
            request_id=rid,
            num_new_tokens=num_new,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=None if hit is None else [list(g) for g in hit],
            delay_cache_blocks=delay,
            **({"full_sequence_must_fit": True} if whole else {}),
        )
        if whole:
            allocated = self._do(
                f"allocate_slots({rid}, num_new_tokens={num_new}, "
                f"num_new_computed_tokens={num_hit}, new_computed_blocks={hit}, "
                f"delay_cache_blocks={delay}, full_sequence_must_fit=True)",
                lambda s: model_manager.allocate_slots(
                    s, request, num_new, num_hit, hit, 0, delay, full_sequence_must_fit=True
                ),
                lambda t: _blocks_or_none(
                    _sched(t).allocate_slots(
                        request, num_new, num_hit, hit, 0, delay, full_sequence_must_fit=True
                    )
                ),
            )
        else:
            allocated = self._do(
                f"allocate_slots({rid}, num_new_tokens={num_new}, "
                f"num_new_computed_tokens={num_hit}, new_computed_blocks={hit}, "
                f"delay_cache_blocks={delay})",
                lambda s: model_manager.allocate_slots(s, request, num_new, num_hit, hit, 0, delay),
                lambda t: _blocks_or_none(
                    t.allocate_slots(request, num_new, num_hit, hit, 0, delay)
                ),
            )
        if allocated is None:
            return
        self.waiting.remove(rid)
        self.running.append(rid)
        request = with_computed(request, num_hit)
        if self.setup.fine_grained_hits or self.mamba_fine:
            # the scheduler takes the step's copies; the GPU runs them before the forward pass
            self._take_copies(request, num_hit, hit)
        self._compute(request, num_new, ())

    def _has_033(self) -> bool:
        """Whether the target answers vLLM 0.33's further calls (``ManagerTarget033``): it
        has them, and does not say it cannot (``answers_033``: a vLLM release before them)."""
        target = self.target
        return callable(getattr(target, "take_kv_cache_block_copies", None)) and bool(
            getattr(target, "answers_033", True)
        )

    def _take_copies(self, request: Request, num_hit: int, hit: Blocks | None) -> None:
        """Take the pending copy-on-write copies, run them on the ground truth, free their ends."""
        self._record("take_kv_cache_block_copies")
        copies, retained = self._do(
            "take_kv_cache_block_copies()",
            model_manager.take_kv_cache_block_copies,
            lambda t: _copies(_033(t).take_kv_cache_block_copies()),
        )
        for source, destination in copies:
            for group, blocks in enumerate(hit or ()):
                size = self.block_sizes[group]
                if blocks and blocks[-1] == source and num_hit % size and self.states[group]:
                    # a Mamba state a hit ends inside is that of the hit's tokens
                    check(
                        (
                            "copy_serves_source_state",
                            copy_serves_source_state(self.truth, request, source, num_hit, group),
                        )
                    )
                elif blocks and blocks[-1] == source and num_hit % size:
                    check(
                        (
                            "copy_serves_source_prefix",
                            copy_serves_source_prefix(
                                self.truth, request, source, num_hit // size, num_hit, group, size
                            ),
                        )
                    )
            self.truth.copy(source, destination)
        if retained:
            ids = list(retained)
            self._record("free_blocks", block_ids=ids)
            self._do(
                f"free_blocks({ids})",
                lambda s: model_manager.free_blocks(s, ids),
                lambda t: _033(t).free_blocks(ids),
                returns_none=True,
            )

    @precondition(lambda self: self._has_033())
    @rule(
        action=st.sampled_from(
            ["resend", "lookup", "take_new_block_ids", "estimate", "new_step_starts"]
        ),
        which=st.integers(0, 9),
        cut=st.integers(0, 3),
    )
    def scheduler_033(self, action: str, which: int, cut: int) -> None:
        """vLLM 0.33's further scheduler calls: the lookup with its shared-prefix boundary,
        a hit cut back to whole blocks, the blocks to zero, the cached-token estimate, and
        the start of a step."""
        everyone = self.running + self.waiting
        if action == "resend" and everyone and len(everyone) < 5:
            # the same prompt again: its hit ends where the first one's prompt did, often
            # inside a block, which is what fine-grained hits are for
            prompt = self.requests[everyone[which % len(everyone)]].prompt_token_ids
            self.add_request(prompt, "plain")
        elif action == "lookup" and self.waiting and self.setup.enable_caching:
            request = self.requests[self.waiting[which % len(self.waiting)]]
            rid = request.request_id
            self._record("get_computed_blocks_with_boundary", request_id=rid)
            hit, num_hit, boundary = self._do(
                f"get_computed_blocks_with_boundary({rid})",
                lambda s: model_manager.get_computed_blocks_with_boundary(s, request),
                lambda t: _with_boundary(_033(t).get_computed_blocks_with_boundary(request)),
            )
            if self.setup.retention_interval is not None:  # as at admission
                request = replace(request, shared_prefix_boundary=boundary)
                self.requests[rid] = request
            check(
                (
                    "hit_matches_request",
                    hit_matches_request(
                        self.truth, request, hit, self.block_sizes, num_hit, self.states
                    ),
                )
            )
            if self.lockstep and self.model is not None and self.target is not None:
                size = math.lcm(*self.block_sizes)  # a whole number of every group's blocks
                n = num_hit // size * size - cut * size
                if n >= 0:
                    self._record(
                        "truncate_computed_blocks",
                        blocks=[list(g) for g in hit],
                        num_computed_tokens=n,
                    )
                    expected = model_manager.truncate_computed_blocks(self.model, hit, n)
                    answer = self._call(
                        f"truncate_computed_blocks({hit}, {n})",
                        lambda t: _033(t).truncate_computed_blocks(hit, n),
                    )
                    self._compare(
                        f"truncate_computed_blocks({hit}, {n})",
                        expected,
                        tuple(tuple(g) for g in answer),
                    )
        elif action == "take_new_block_ids":
            self._record("take_new_block_ids")
            self._do(
                "take_new_block_ids()",
                model_manager.take_new_block_ids,
                lambda t: tuple(_033(t).take_new_block_ids()),
            )
        elif action == "estimate" and everyone and self.lockstep:
            assert self.model is not None and self.target is not None
            request = self.requests[everyone[which % len(everyone)]]
            self._record("estimate_cached_tokens", request_id=request.request_id)
            estimate = model_manager.estimate_cached_tokens(self.model, request.request_id)
            answer = self._call(
                f"estimate_cached_tokens({request.request_id})",
                lambda t: _033(t).estimate_cached_tokens(request),
            )
            self._compare(f"estimate_cached_tokens({request.request_id})", estimate, answer)
        elif action == "new_step_starts":
            self._record("new_step_starts")
            self._do(
                "new_step_starts()",
                model_manager.new_step_starts,
                lambda t: _033(t).new_step_starts(),
                returns_none=True,
            )

    @precondition(lambda self: bool(self.running))
    @rule(
        which=st.integers(0, 4),
        chunk=st.integers(1, MAX_PROMPT),
        drafts=st.lists(TOKEN, max_size=2),
        accept=st.integers(0, 2),
        bonus=TOKEN,
        lookahead=st.integers(0, 2),
    )
    def step(
        self,
        which: int,
        chunk: int,
        drafts: list[int],
        accept: int,
        bonus: int,
        lookahead: int,
    ) -> None:
        """One scheduler step of a running request: a prefill chunk, or a decode with drafts."""
        rid = self.running[which % len(self.running)]
        request = self.requests[rid]
        num_real = min(chunk, request.num_tokens - request.num_computed_tokens)
        if any(self.states):
            start = request.num_computed_tokens
            num_real = mamba_aligned_chunk(
                request,
                start,
                num_real,
                self.align_block,
                self.checkpoint_alignment,
                self.setup.hash_block_size,
                self.mamba_fine,
            )
            if num_real == 0:
                return  # the scheduler does not schedule a chunk that would end mid-block
        reaches_end = request.num_computed_tokens + num_real == request.num_tokens
        room = MAX_MODEL_LEN - request.num_tokens - 1
        draft = tuple(drafts[: max(0, room)]) if reaches_end else ()
        if any(self.states):
            # a recurrent state cannot take back rejected drafts without speculative blocks,
            # and where the worker keeps the drafts' states in them is not modelled
            draft = ()
        num_new = num_real + len(draft)
        self._record(
            "allocate_slots", request_id=rid, num_new_tokens=num_new, num_lookahead_tokens=lookahead
        )
        allocated = self._do(
            f"allocate_slots({rid}, num_new_tokens={num_new}, "
            f"num_lookahead_tokens={lookahead})  # drafts {list(draft)}",
            lambda s: model_manager.allocate_slots(s, request, num_new, 0, None, lookahead),
            lambda t: _blocks_or_none(t.allocate_slots(request, num_new, 0, None, lookahead)),
        )
        if allocated is None:
            return
        if self.mamba_fine:
            # a producer's next step copies the state it keyed inside a block before the
            # forward pass overwrites it (kvpool.model.mamba_fine)
            self._take_copies(request, 0, None)
        self._compute(request, num_new, draft, accept, bonus)

    @precondition(lambda self: bool(self.running or self.waiting))
    @rule(which=st.integers(0, 9), preempt=st.booleans())
    def leave(self, which: int, preempt: bool) -> None:
        """Preempt a running request (it waits to be admitted again), or finish any request.

        Either way its blocks are freed; a waiting request holds none.
        """
        if preempt and self.running:
            rid = self.running[which % len(self.running)]
            request = self.requests[rid]
            self._record("preempt", request_id=rid)
            self._free(request)
            self.running.remove(rid)
            self.waiting.append(rid)
            self.requests[rid] = preempted(request)
            return
        everyone = self.running + self.waiting
        rid = everyone[which % len(everyone)]
        self._record("free", request_id=rid)
        self._free(self.requests[rid])
        self._forget(rid)

    @rule(
        action=st.sampled_from(
            ["cache_blocks", "common_prefix", "evict", "reset", "take_events", "take_stats"]
        ),
        which=st.integers(0, 4),
        block_ids=st.sets(st.integers(1, 11), max_size=3),
    )
    def maintain(self, action: str, which: int, block_ids: set[int]) -> None:
        """Everything else a scheduler or an operator does between steps."""
        if action == "cache_blocks" and self.running:
            # what a running request has computed, e.g. after a delayed allocation
            rid = self.running[which % len(self.running)]
            request = self.requests[rid]
            n = request.num_computed_tokens
            self._record("cache_blocks", request_id=rid, num_computed_tokens=n)
            self._do(
                f"cache_blocks({rid}, {n})",
                lambda s: model_manager.cache_blocks(s, request, n),
                lambda t: t.cache_blocks(request, n),
                returns_none=True,
            )
        elif action == "common_prefix" and self.running and self.lockstep:
            rid = self.running[which % len(self.running)]
            assert self.model is not None and self.target is not None
            self._record("get_num_common_prefix_blocks", request_id=rid)
            expected = model_manager.get_num_common_prefix_blocks(self.model, rid)
            answer = self.target.get_num_common_prefix_blocks(rid)
            if answer is not None:
                self._compare(f"get_num_common_prefix_blocks({rid})", expected, tuple(answer))
        elif action == "evict":
            ids = {b for b in block_ids if b < self.setup.num_blocks}
            self._record("evict_blocks", block_ids=sorted(ids))
            self._do(
                f"evict_blocks({ids})",
                lambda s: model_manager.evict_blocks(s, ids),
                lambda t: t.evict_blocks(ids),
                returns_none=True,
            )
        elif action == "reset":
            self._record("reset_prefix_cache")
            self._do(
                "reset_prefix_cache()",
                model_manager.reset_prefix_cache,
                lambda t: t.reset_prefix_cache(),
            )
        elif action == "take_events":
            self._record("take_events")
            events = self._do(
                "take_events()", model_manager.take_events, lambda t: tuple(t.take_events())
            )
            self.taken.extend(events)
        elif action == "take_stats":
            self._record("make_prefix_cache_stats")
            self._do(
                "make_prefix_cache_stats()",
                model_manager.make_prefix_cache_stats,
                lambda t: t.make_prefix_cache_stats(),
            )

    # ------------------------------------------------------------------
    # After every step
    # ------------------------------------------------------------------

    @invariant()
    def target_agrees_and_cache_is_safe(self) -> None:
        if self.model is None or self.target is None:
            return
        model, target = self.model, self.target
        tables = {rid: self._table(rid) for rid in self.running}
        pool: PoolState | None = None
        if self.lockstep:
            self._agree(model, target, tables)
            pool = model.managers.pool
        if isinstance(target, ManagerSnapshottable):
            snapshotted = target
            snapshot = self._call("snapshot()", lambda _: snapshotted.snapshot())
            if self.lockstep and snapshot != model:
                raise ManagerDivergence(
                    f"the target's state differs from the model's:\nmodel:  {model}\n"
                    f"target: {snapshot}"
                )
            pool = snapshot.managers.pool
        if pool is None:
            return
        check_all(pool, None, self.taken)
        # the machine takes copies as it admits, so none retains a block here unless the
        # target kept one back (a snapshot shows it; the model never does)
        state = snapshot if isinstance(target, ManagerSnapshottable) else model
        retained = [b for pair in state.pending_copies for b in pair]
        retained += [b for blocks in self.deferred for b in blocks]
        check(("ref_counts_match_tables", ref_counts_match_tables(pool, tables, retained)))
        check(
            (
                "cached_blocks_hold_their_prefix",
                cached_blocks_hold_their_prefix(self.truth, pool, self.block_sizes, self.states),
            )
        )
        running = {rid: self.requests[rid] for rid in self.running}
        check(
            (
                "requests_read_their_own_kv",
                requests_read_their_own_kv(
                    self.truth, running, tables, self.block_sizes, self.states
                ),
            )
        )

    def _agree(
        self, model: KVCacheManagerState, target: ManagerTarget, tables: dict[str, Blocks]
    ) -> None:
        """The counts, the usage and every request's block table agree with the model."""
        self._compare(
            "num_free_blocks()", model_manager.num_free_blocks(model), target.num_free_blocks()
        )
        expected_usage, actual_usage = model_manager.usage(model), target.usage()
        if not math.isclose(expected_usage, actual_usage, rel_tol=1e-9, abs_tol=1e-12):
            self._diverge("usage()", f"model {expected_usage!r}, target {actual_usage!r}")
        for rid in [*self.running, *self.waiting]:
            expected = model_manager.get_block_ids(model, rid)
            actual = tables[rid] if rid in tables else self._table(rid)
            self._compare(f"get_block_ids({rid})", expected, actual)

    # ------------------------------------------------------------------
    # The GPU: writing KV, sampling tokens
    # ------------------------------------------------------------------

    def _write_checkpoint(
        self,
        rid: str,
        group: int,
        blocks: Sequence[int],
        start: int,
        computed: int,
        content: Any,
        tables: Mapping[str, Any],
    ) -> None:
        """With prefill checkpoint blocks, the worker also exports the state at the chunk's
        checkpoint into the block before the one the chunk ends in, when the chunk can
        export it (vLLM 0.33.0, ``compute_mamba_prefill_checkpoints`` in
        ``vllm/model_executor/layers/mamba/checkpoint.py``; a null there is not written)."""
        if not self.checkpoint_alignment:
            return
        size = self.block_sizes[group]
        every, hbs = self.checkpoint_alignment, self.setup.hash_block_size
        # with hits inside a Mamba block the checkpoint is on a hash-block boundary
        position = checkpoint_position(computed, hbs if self.mamba_fine else size)
        if not checkpoint_valid(start, computed, position, size, every, hbs):
            return
        column = -(-computed // size) - 2
        if column >= len(blocks) or blocks[column] == NULL_BLOCK_ID:
            return
        check(("write_is_exclusive", write_is_exclusive(blocks[column], rid, tables)))
        self.truth.write(group, blocks[column], STATE, content.prefix(position))

    def _compute(
        self,
        request: Request,
        num_new: int,
        draft: tuple[int, ...],
        accept: int = 0,
        bonus: int = 1,
    ) -> None:
        """Write the KV of ``num_new`` positions from the request's computed count, then sample."""
        rid = request.request_id
        start = request.num_computed_tokens
        content = request_content(request, draft)
        tables = {r: self._table(r) for r in self.running}
        table = tables[rid]
        for position in range(start, start + num_new):
            for group, blocks in enumerate(table):
                if self.states[group]:
                    continue
                size = self.block_sizes[group]
                index = position // size
                if index >= len(blocks):
                    self._diverge(
                        f"allocate_slots({rid})",
                        f"no block for position {position} in group {group}: table {blocks}",
                    )
                block = blocks[index]
                check(("write_is_exclusive", write_is_exclusive(block, rid, tables)))
                self.truth.write(group, block, position % size, content.prefix(position + 1))
        computed = start + num_new
        for group, blocks in enumerate(table):
            if not self.states[group]:
                continue
            # the state after the chunk goes into the block its last token falls in
            index = (computed - 1) // self.block_sizes[group]
            if index >= len(blocks):
                self._diverge(
                    f"allocate_slots({rid})",
                    f"no block for the state after {computed} tokens in group {group}: "
                    f"table {blocks}",
                )
            check(("write_is_exclusive", write_is_exclusive(blocks[index], rid, tables)))
            self.truth.write(group, blocks[index], STATE, content.prefix(computed))
            self._write_checkpoint(rid, group, blocks, start, computed, content, tables)
        if computed < request.num_tokens:
            self._record("run_model", request_id=rid, num_computed_tokens=computed, sampled=[])
            self.requests[rid] = with_computed(request, computed)
            return
        accepted = draft[: min(accept, len(draft))]
        old_num_tokens = request.num_tokens
        request = append_tokens(request, (*accepted, bonus))
        request = with_computed(request, old_num_tokens + len(accepted))
        self._record(
            "run_model",
            request_id=rid,
            num_computed_tokens=request.num_computed_tokens,
            sampled=[*accepted, bonus],
        )
        self.requests[rid] = request
        self._learn(request)
        if request.num_tokens >= MAX_MODEL_LEN:
            self._record("free", request_id=rid)
            self._free(request)
            self._forget(rid)

    # ------------------------------------------------------------------
    # Lock-step machinery
    # ------------------------------------------------------------------

    def _record(self, op: str, **args: object) -> None:
        self.script.append((op, args))

    def _learn(self, request: Request) -> None:
        """What the request's hashes name; a target with its own hasher is checked against it."""
        self.truth.learn_hashes(request)
        hasher = getattr(self.target, "block_hashes", None)
        if hasher is None:
            return
        try:
            hashes = tuple(hasher(request))
        except TargetError:
            raise
        except Exception as error:
            self._diverge(
                f"block_hashes({request.request_id})", f"the target's hasher raises {error!r}"
            )
        check(
            (
                "target_hashes_name_prefixes",
                target_hashes_name_prefixes(self.truth, request, hashes),
            )
        )

    def _table(self, rid: str) -> Blocks:
        assert self.target is not None
        return tuple(tuple(g) for g in self.target.get_block_ids(rid))

    def _free(self, request: Request) -> None:
        self._do(
            f"free({request.request_id})",
            lambda s: model_manager.free(s, request.request_id),
            lambda t: t.free(request),
            returns_none=True,
        )

    def _forget(self, rid: str) -> None:
        if rid in self.running:
            self.running.remove(rid)
        if rid in self.waiting:
            self.waiting.remove(rid)
        del self.requests[rid]

    def _do(
        self,
        description: str,
        on_model: Callable[[KVCacheManagerState], tuple[KVCacheManagerState, T]],
        on_target: Callable[[ManagerTarget], Any],
        returns_none: bool = False,
    ) -> T:
        """Run one call on both sides (``LockStep._step``) and return the model's result.

        Without lock-step only the target runs, and its result is returned.
        """
        _, result = self._step(description, on_model, on_target, returns_none=returns_none)
        return result  # type: ignore[return-value]


def _flavour_json(flavour: dict[str, Any]) -> dict[str, object]:
    """A request's LoRA adapter, salt and multimodal inputs as scenario-file arguments."""
    out: dict[str, object] = {}
    lora = flavour.get("lora")
    if lora is not None:
        out["lora"] = {"id": lora.lora_id, "name": lora.name, "path": lora.path}
    if flavour.get("cache_salt") is not None:
        out["cache_salt"] = flavour["cache_salt"]
    if flavour.get("mm_inputs"):
        out["mm_inputs"] = [
            {"identifier": m.identifier, "offset": m.offset, "length": m.length}
            for m in flavour["mm_inputs"]
        ]
    return out


def _blocks_and_count(result: tuple[Blocks, int]) -> tuple[Blocks, int]:
    blocks, count = result
    return tuple(tuple(g) for g in blocks), count


def _033(target: ManagerTarget) -> ManagerTarget033:
    """The target, with vLLM 0.33's further calls (asked only of targets checked with them)."""
    return target  # type: ignore[return-value]


def _copies(
    result: tuple[Sequence[tuple[int, int]], Sequence[int]],
) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    copies, retained = result
    return tuple((int(s), int(d)) for s, d in copies), tuple(retained)


def _sched(target: ManagerTarget) -> ManagerTargetScheduler:
    """The target, with the rest of vLLM 0.33's scheduler calls (asked only of targets
    that have them)."""
    return target  # type: ignore[return-value]


def _connector_hit(result: tuple[Blocks, int, int, bool]) -> tuple[Blocks, int, int, bool]:
    blocks, count, boundary, diverged = result
    return tuple(tuple(g) for g in blocks), count, boundary, diverged


def _offloads(
    offloads: Mapping[str, Sequence[tuple[int, int, int]]],
) -> dict[str, tuple[tuple[int, int, int], ...]]:
    return {
        rid: tuple((int(g), int(b), int(n)) for g, b, n in entries)
        for rid, entries in offloads.items()
    }


def _with_boundary(result: tuple[Blocks, int, int]) -> tuple[Blocks, int, int]:
    blocks, count, boundary = result
    return tuple(tuple(g) for g in blocks), count, boundary


def _blocks_or_none(blocks: Blocks | None) -> Blocks | None:
    return None if blocks is None else tuple(tuple(g) for g in blocks)


# --------------------------------------------------------------------------
# The rest of vLLM 0.33's scheduler calls
# --------------------------------------------------------------------------


class SchedulerCallsMachine(ManagerMachine):
    """Also drives the rest of vLLM 0.33's scheduler calls (``OPERATIONS_SCHEDULER``).

    A class of its own, mixed in by ``manager_machine(..., scheduler_calls=True)`` for
    targets that answer them: a new rule changes which programs Hypothesis draws, so
    the machines of other targets keep drawing exactly what they did.
    """

    def _has_scheduler_calls(self) -> bool:
        """Whether the target answers the rest of vLLM 0.33's scheduler calls: it has them,
        and does not say it cannot (``answers_scheduler_calls``: a vLLM release before them)."""
        target = self.target
        return callable(getattr(target, "pop_blocks_for_free", None)) and bool(
            getattr(target, "answers_scheduler_calls", True)
        )

    @precondition(lambda self: self._has_scheduler_calls())
    @rule(
        action=st.sampled_from(
            ["admit_whole", "finish_deferred", "drain", "connector", "zero", "offloads"]
        ),
        which=st.integers(0, 9),
        chunk=st.integers(1, MAX_PROMPT),
        cut=st.integers(0, 3),
    )
    def scheduler_calls_033(self, action: str, which: int, chunk: int, cut: int) -> None:
        """The rest of vLLM 0.33's scheduler calls: admitting a request only if its whole
        sequence fits (its hit looked up as with a KV connector, half the time); finishing a
        request while a step may still write its blocks (popped, freed later, last first);
        what a KV connector asks of a request (its partial Mamba tails, its block table cut
        at the computed tokens, blocks recorded again for zeroing); the boundary states."""
        everyone = self.running + self.waiting
        if action == "admit_whole" and self.waiting:
            self._admit(which, chunk, delay=False, whole=True, connector=which % 2 == 1)
        elif action == "finish_deferred" and everyone:
            request = self.requests[everyone[which % len(everyone)]]
            rid = request.request_id
            self._record("pop_blocks_for_free", request_id=rid)
            popped = self._do(
                f"pop_blocks_for_free({rid})",
                lambda s: scheduler_calls.pop_blocks_for_free(s, rid),
                lambda t: tuple(_sched(t).pop_blocks_for_free(request)),
            )
            self._forget(rid)
            if popped:
                self.deferred.append(list(popped))
        elif action == "drain" and self.deferred:
            # the step that could still write them is done: free them, last first
            ids = self.deferred.pop(0)[::-1]
            self._record("free_blocks", block_ids=ids)
            self._do(
                f"free_blocks({ids})",
                lambda s: model_manager.free_blocks(s, ids),
                lambda t: _sched(t).free_blocks(ids),
                returns_none=True,
            )
        elif action == "connector" and self.running:
            self._connector_finished(self.requests[self.running[which % len(self.running)]], cut)
        elif action == "zero" and self.running:
            request = self.requests[self.running[which % len(self.running)]]
            rid = request.request_id
            size = self.block_sizes[0]
            start = max(0, request.num_computed_tokens // size - cut) * size
            self._record("record_blocks_for_zeroing", request_id=rid, start_token=start)
            self._do(
                f"record_blocks_for_zeroing({rid}, {start})",
                lambda s: scheduler_calls.record_blocks_for_zeroing(s, rid, start),
                lambda t: _sched(t).record_blocks_for_zeroing(rid, start),
                returns_none=True,
            )
        elif action == "offloads":
            self._record("take_boundary_state_offloads")
            self._do(
                "take_boundary_state_offloads()",
                scheduler_calls.take_boundary_state_offloads,
                lambda t: _offloads(_sched(t).take_boundary_state_offloads()),
            )

    def _connector_finished(self, request: Request, cut: int) -> None:
        """What vLLM 0.33's scheduler asks for a request a KV connector hands on: its partial
        Mamba tails, then its skipped blocks freed and its table cut at the computed tokens
        (``cut`` blocks fewer tokens counted as processed)."""
        rid = request.request_id
        computed = request.num_computed_tokens
        processed = max(0, computed - cut * self.block_sizes[0])
        self._record("finalize_partial_tail_offloads", request_id=rid)
        self._do(
            f"finalize_partial_tail_offloads({rid})",
            lambda s: scheduler_calls.finalize_partial_tail_offloads(s, request),
            lambda t: tuple(tuple(x) for x in _sched(t).finalize_partial_tail_offloads(request)),
        )
        self._record("remove_skipped_blocks", request_id=rid, processed_computed_tokens=processed)
        self._do(
            f"remove_skipped_blocks({rid}, {processed})",
            lambda s: scheduler_calls.remove_skipped_blocks(s, rid, processed),
            lambda t: _sched(t).remove_skipped_blocks(rid, processed),
            returns_none=True,
        )
        if self.lockstep and self.model is not None:
            self._record(
                "get_block_ids_for_computed_tokens", request_id=rid, num_computed_tokens=computed
            )
            expected = scheduler_calls.get_block_ids_for_computed_tokens(self.model, rid, computed)
            answer = self._call(
                f"get_block_ids_for_computed_tokens({rid}, {computed})",
                lambda t: _sched(t).get_block_ids_for_computed_tokens(rid, computed),
            )
            self._compare(
                f"get_block_ids_for_computed_tokens({rid}, {computed})",
                expected,
                tuple(tuple(g) for g in answer),
            )


# --------------------------------------------------------------------------
# Level 2: calls no scheduler should make
# --------------------------------------------------------------------------

HITS = st.one_of(
    st.none(),
    st.lists(st.lists(st.integers(0, 17), max_size=2).map(tuple), max_size=3).map(tuple),
)
"""Raw hit lists: any number of groups, any block ids (unknown ones included)."""


class RawManagerMachine(ManagerMachine):
    """Level 2: also sends calls with raw arguments, and requests that skip the cache.

    A raw call the model rejects must be rejected by the target with the
    same exception type, leaving its state (and the model's) unchanged; a
    raw call the model accepts is not sent (level 1 covers valid calls).
    """

    @precondition(lambda self: len(self.running) + len(self.waiting) < 5)
    @rule(prompt=PROMPT)
    def add_request_that_skips_the_cache(self, prompt: tuple[int, ...]) -> None:
        """A request that must not read the prefix cache (it may still fill it)."""
        rid = f"r{self.next_id}"
        self.next_id += 1
        request = new_request(
            rid, prompt, self.setup.hash_block_size, skip_reading_prefix_cache=True
        )
        self._record(
            "new_request", request_id=rid, prompt=list(prompt), skip_reading_prefix_cache=True
        )
        self.requests[rid] = request
        self.waiting.append(rid)
        self._learn(request)

    @precondition(lambda self: bool(self.running or self.waiting))
    @rule(
        which=st.integers(0, 9),
        num_new=st.integers(-1, 2),
        computed=st.integers(-1, 2),
        lookahead=st.integers(-1, 1),
        hits=HITS,
    )
    def allocate_slots_raw_arguments(
        self, which: int, num_new: int, computed: int, lookahead: int, hits: Blocks | None
    ) -> None:
        everyone = self.running + self.waiting
        request = self.requests[everyone[which % len(everyone)]]
        self._rejected(
            f"allocate_slots({request.request_id}, num_new_tokens={num_new}, "
            f"num_new_computed_tokens={computed}, new_computed_blocks={hits}, "
            f"num_lookahead_tokens={lookahead})",
            lambda s: model_manager.allocate_slots(s, request, num_new, computed, hits, lookahead),
            lambda t: t.allocate_slots(request, num_new, computed, hits, lookahead),
            (
                "allocate_slots",
                {
                    "request_id": request.request_id,
                    "num_new_tokens": num_new,
                    "num_new_computed_tokens": computed,
                    "new_computed_blocks": None if hits is None else [list(g) for g in hits],
                    "num_lookahead_tokens": lookahead,
                },
            ),
        )

    @rule(prompt=PROMPT, call=st.sampled_from(["get_computed_blocks", "allocate_slots"]))
    def request_hashed_in_other_blocks(self, prompt: tuple[int, ...], call: str) -> None:
        """A request whose hashes cover hash blocks of another size than the pool's."""
        request = new_request("stranger", prompt, self.setup.hash_block_size + 1)
        stranger: dict[str, object] = {"request_id": f"stranger-{len(self.script)}"}
        self._record(
            "new_request", **stranger, prompt=list(prompt), hash_block_size=request.hash_block_size
        )
        if call == "get_computed_blocks":
            self._rejected(
                "get_computed_blocks(stranger hashed in other blocks)",
                lambda s: model_manager.get_computed_blocks(s, request),
                lambda t: t.get_computed_blocks(request),
                ("get_computed_blocks", stranger),
            )
        else:
            self._rejected(
                "allocate_slots(stranger hashed in other blocks, 1)",
                lambda s: model_manager.allocate_slots(s, request, 1),
                lambda t: t.allocate_slots(request, 1),
                ("allocate_slots", {**stranger, "num_new_tokens": 1}),
            )

    @precondition(lambda self: bool(self.running))
    @rule(which=st.integers(0, 4), num_computed=st.integers(-1, MAX_MODEL_LEN + 1))
    def cache_blocks_raw_count(self, which: int, num_computed: int) -> None:
        request = self.requests[self.running[which % len(self.running)]]
        self._rejected(
            f"cache_blocks({request.request_id}, {num_computed})",
            lambda s: model_manager.cache_blocks(s, request, num_computed),
            lambda t: t.cache_blocks(request, num_computed),
            (
                "cache_blocks",
                {"request_id": request.request_id, "num_computed_tokens": num_computed},
            ),
        )

    @rule(block_ids=st.sets(st.integers(-1, 17), min_size=1, max_size=3))
    def evict_blocks_raw_ids(self, block_ids: set[int]) -> None:
        self._rejected(
            f"evict_blocks({block_ids})",
            lambda s: model_manager.evict_blocks(s, block_ids),
            lambda t: t.evict_blocks(block_ids),
            ("evict_blocks", {"block_ids": sorted(block_ids)}),
        )

    def _rejected(
        self,
        description: str,
        on_model: Callable[[KVCacheManagerState], object],
        on_target: Callable[[ManagerTarget], object],
        step: tuple[str, dict[str, object]],
    ) -> None:
        """Send the call only if the model rejects it; the target must reject it alike.

        ``step`` is the call as a scenario step, recorded when it is sent.
        """
        assert self.model is not None
        try:
            on_model(self.model)
        except PoolError as error:
            self._record(step[0], **step[1])
            self._expect_rejection(description, type(error), on_target)


# --------------------------------------------------------------------------
# A KV connector's loads
# --------------------------------------------------------------------------


class ConnectorLoadsMachine(ManagerMachine):
    """Also admits requests with a KV connector's loads (``kvpool.model.external``).

    A class of its own, mixed in by ``manager_machine(..., connector_loads=True)``, so
    that the machines of other targets keep drawing exactly what they did.
    """

    def _has_connector_loads(self) -> bool:
        """Whether the target takes a KV connector's ``allocate_slots`` arguments: it has
        the rest of vLLM 0.33's scheduler calls and does not say it cannot."""
        target = self.target
        return (
            bool(self.waiting)
            and callable(getattr(target, "pop_blocks_for_free", None))
            and bool(getattr(target, "answers_scheduler_calls", True))
        )

    @precondition(lambda self: self._has_connector_loads())
    @rule(
        which=st.integers(0, 4),
        chunk=st.integers(1, MAX_PROMPT),
        external=st.integers(0, MAX_PROMPT),
        reserved=st.sampled_from([0, 0, 1, 2, 4]),
        load=st.sampled_from(["sync", "async"]),
        skip=st.booleans(),
        whole=st.booleans(),
    )
    def connector_load(
        self,
        which: int,
        chunk: int,
        external: int,
        reserved: int,
        load: str,
        skip: bool,
        whole: bool,
    ) -> None:
        """Admit a waiting request as vLLM 0.33's scheduler does with a KV connector: its
        local hit, then ``external`` tokens past it the connector loads (at least one token
        is left to compute), loaded in this step (``sync``) or before the next one
        (``async``: no new tokens, nothing cached yet), ``reserved`` blocks kept free, the
        first group's loaded blocks not zeroed (``skip``), and maybe only if the whole
        sequence fits. The loaded positions hold the request's KV afterwards."""
        rid = self.waiting[which % len(self.waiting)]
        request = self.requests[rid]
        hit: Blocks | None = None
        num_hit = 0
        if self.setup.enable_caching:
            self._record("get_computed_blocks", request_id=rid)
            hit, num_hit = self._do(
                f"get_computed_blocks({rid})",
                lambda s: model_manager.get_computed_blocks(s, request),
                lambda t: _blocks_and_count(t.get_computed_blocks(request)),
            )
            check(
                (
                    "hit_matches_request",
                    hit_matches_request(
                        self.truth, request, hit, self.block_sizes, num_hit, self.states
                    ),
                )
            )
        mamba_groups = any(s.attention is AttentionType.MAMBA for s in self.setup.specs)
        ext = 0 if mamba_groups else min(external, request.num_tokens - num_hit - 1)
        ext = max(ext, 0)
        delay = load == "async" and ext > 0
        num_new = 0 if delay else min(chunk, request.num_tokens - num_hit - ext)
        if num_new == 0 and ext == 0:
            return
        skip_ids = (0,) if skip else ()
        connector: dict[str, Any] = {}
        if ext:
            connector["num_external_computed_tokens"] = ext
        if reserved:
            connector["reserved_blocks"] = reserved
        if skip_ids:
            connector["skip_zeroing_group_ids"] = list(skip_ids)
        self._record(
            "allocate_slots",
            request_id=rid,
            num_new_tokens=num_new,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=None if hit is None else [list(g) for g in hit],
            delay_cache_blocks=delay,
            **({"full_sequence_must_fit": True} if whole else {}),
            **connector,
        )
        allocated = self._do(
            f"allocate_slots({rid}, num_new_tokens={num_new}, "
            f"num_new_computed_tokens={num_hit}, new_computed_blocks={hit}, "
            f"delay_cache_blocks={delay}, full_sequence_must_fit={whole}, "
            f"num_external_computed_tokens={ext}, reserved_blocks={reserved}, "
            f"skip_zeroing_group_ids={skip_ids})",
            lambda s: model_manager.allocate_slots(
                s,
                request,
                num_new,
                num_hit,
                hit,
                0,
                delay,
                whole,
                num_external_computed_tokens=ext,
                reserved_blocks=reserved,
                skip_zeroing_group_ids=skip_ids,
            ),
            lambda t: _blocks_or_none(
                _sched(t).allocate_slots(
                    request, num_new, num_hit, hit, 0, delay, whole, ext, reserved, skip_ids
                )
            ),
        )
        if allocated is None:
            return
        self.waiting.remove(rid)
        self.running.append(rid)
        request = with_computed(request, num_hit)
        self._load(request, ext)
        request = with_computed(request, num_hit + ext)
        self.requests[rid] = request
        if num_new:
            self._compute(request, num_new, ())
        else:
            self._record("run_model", request_id=rid, num_computed_tokens=num_hit + ext, sampled=[])

    def _load(self, request: Request, num_external: int) -> None:
        """The connector writes the KV of ``num_external`` positions from the request's
        computed count, in the blocks the request holds for them (none where skipped)."""
        rid = request.request_id
        start = request.num_computed_tokens
        content = request_content(request, ())
        tables = {r: self._table(r) for r in self.running}
        for position in range(start, start + num_external):
            for group, blocks in enumerate(tables[rid]):
                index = position // self.block_sizes[group]
                if self.states[group] or index >= len(blocks) or blocks[index] == NULL_BLOCK_ID:
                    continue
                block = blocks[index]
                check(("write_is_exclusive", write_is_exclusive(block, rid, tables)))
                size = self.block_sizes[group]
                self.truth.write(group, block, position % size, content.prefix(position + 1))


def manager_machine(
    make_target: ManagerFactory,
    layouts: Sequence[str] = LAYOUTS,
    profiles: Sequence[Profile] | None = None,
    name: str = "ManagerMachine",
    lockstep: bool = True,
    events: Sequence[bool] = (False, True),
    block_factors: Sequence[int] = (1, 2),
    min_window: int = 1,
    level: int = 1,
    hybrids: bool = True,
    uncached_layouts: Sequence[str] = (),
    hash_sized_layouts: Sequence[str] = (),
    fine_grained: Sequence[bool] = (False,),
    in_flight: Sequence[int | None] = (None,),
    scheduler_calls: bool = False,
    prefill_lookaheads: Sequence[int] = (0,),
    eagle_hybrids: bool = False,
    context_parallel: Sequence[tuple[int, int]] = ((1, 1),),
    retentions: Sequence[int | None] = (None,),
    connector_loads: bool = False,
    eagle_flags: bool = False,
    mamba_reserves: Sequence[tuple[int, int]] = ((0, 0),),
) -> type[ManagerMachine]:
    """A state machine class that checks ``make_target`` on the given layouts and profiles.

    With ``lockstep=False`` the model is not consulted: the target drives
    the run alone and only the safety properties (and, with a snapshot, the
    pool's invariants) are checked. Level 2 adds ``RawManagerMachine``'s
    rules and (unless ``hybrids`` is False: the layouts given are all the
    target supports) the hybrid layouts of ``HYBRID_LAYOUTS``. ``scheduler_calls``
    adds ``SchedulerCallsMachine``'s rule (the target must answer
    ``ManagerTargetScheduler``); ``in_flight`` are the ``max_in_flight_tokens``
    managers are built with; ``retentions`` the retention intervals, in scheduler blocks
    (``ManagerTargetSpec.retentions``). ``connector_loads`` adds ``ConnectorLoadsMachine``'s
    rule (the target must take a KV connector's ``allocate_slots`` arguments);
    ``eagle_flags`` flags some groups as EAGLE's (``ManagerSetup.eagle_groups``).
    """
    if level not in (1, 2):
        raise ValueError(f"level must be 1 or 2, got {level}")
    if level == 2 and not lockstep:
        raise ValueError("level 2 compares rejections with the model: it needs lock-step")
    chosen = tuple(profiles) if profiles else tuple(PROFILES.values())
    if level == 2 and hybrids:
        layouts = (*layouts, *(h for h in HYBRID_LAYOUTS if h not in layouts))
    attrs = {
        "initial": _start_rule(
            layouts,
            chosen,
            events,
            block_factors,
            min_window,
            uncached_layouts,
            hash_sized_layouts,
            fine_grained,
            in_flight,
            prefill_lookaheads,
            eagle_hybrids,
            context_parallel,
            retentions,
            eagle_flags,
            mamba_reserves,
        ),
        "make_target": staticmethod(make_target),
        "lockstep": lockstep,
    }
    base: type[ManagerMachine] = RawManagerMachine if level == 2 else ManagerMachine
    bases = (SchedulerCallsMachine, base) if scheduler_calls else (base,)
    if connector_loads:
        bases = (ConnectorLoadsMachine, *bases)
    return type(name, bases, attrs)
