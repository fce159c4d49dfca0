"""vLLM's own ``KVCacheManager`` (or a subclass or fork of it) as a manager target (vLLM 0.33 API).

The adapter builds the manager the way vLLM's CPU recipe does (no tensors
allocated) and hands it requests in one of two ways (``hasher``):

* ``vllm`` (the default): vLLM's own ``Request`` objects, hashed by vLLM's
  own request block hasher (``kvpool.specs.targets.vllm.hasher``), so the
  hasher is under test too. Its hashes are not kvpool's; the machine asks
  for them (``block_hashes``) and checks that equal prefixes hash equal and
  different ones differently (the token ground truth). The pool treats
  hashes as opaque, so block ids still agree call by call with the model;
* ``kvpool``: duck-typed requests carrying kvpool's block hashes, for a
  release whose hasher cannot run here (``KVPOOL_VLLM_HASHER=kvpool``).

``manager_class`` replaces vLLM's ``KVCacheManager``: a subclass, or a fork's
class with its constructor (``kvpool check --layer request --target
vllm:package.module:Class``). Which constructor arguments it takes is read
from its class hierarchy (``kvpool.specs.targets.vllm.eras``), so a
subclass whose ``__init__`` is ``(self, *args, **kwargs)`` is built like
the class it wraps.

What is compared, and what is not (docs/semantics.md, "The request layer"):

* every attention type 0.33 runs on a CPU (full, sliding window, chunked
  local, Mamba) and hybrids of them, blocks of one or two hash blocks, events
  on and off, the hashless-first profile (``VLLM_SCOPE``); Mamba with prefix
  caching off, and a single group's blocks of one hash block when caching is
  on: vLLM refuses the rest (``vllm_refuses``). Mamba's "align" mode, alone
  and beside full attention or a sliding window, is compared apart
  (``mamba_align_scope()``), and hits inside a Mamba block too
  (``mamba_fine_scope()``), and EAGLE beside it most densely
  (``mamba_align_eagle_scope()``);
* ``get_computed_blocks`` returns a 3-tuple in 0.33; the protocol's
  ``get_computed_blocks`` drops the third element (the shared-prefix boundary)
  and ``get_computed_blocks_with_boundary`` compares it;
* the rest of 0.33's scheduler calls (``OPERATIONS_SCHEDULER``: the deferred
  free, the connector-facing calls, zeroing records, the whole-sequence
  admission gate with ``max_in_flight_tokens``), on ``scope()`` (the impl runs
  them with fine-grained hits against the model); a full-attention group beside
  a Mamba one (caching off) makes vLLM record new blocks for zeroing, which the
  machine compares. 0.33 records hit
  statistics from the scheduler, at admission; the adapter records them
  right after the lookup, where seed 004 does;
* ``get_num_common_prefix_blocks`` is deprecated in 0.33 (always 0): the
  adapter answers None and the machine does not compare it;
* events: the manager's msgspec events become the model's
  (``manager_event``); their integer hashes are mapped back to the model's
  through the pairs of hashes the adapter sees on each request (vLLM's
  hasher's and the model's name the same prefixes, which the machine checks);
* fine-grained hits with copy-on-write on ``fine_grained_scope()``, with the
  coordinator's switch set by the adapter (``enable_fine_grained_hits``);
* no snapshot: vLLM registers requests in its tables at other moments than
  the model (without any observable effect), so whole states are not
  compared; the safety checks use vLLM's block tables and the model's map.
"""

import importlib
import logging
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.model.errors import NoNewTokens, PoolError
from kvpool.model.events import KVCacheEvent
from kvpool.model.manager import Blocks, PrefixCacheStats
from kvpool.model.request import Request
from kvpool.model.single_type import AttentionType, KVCacheSpec
from kvpool.specs.errors import TargetError
from kvpool.specs.request.target import ManagerSetup, ManagerTargetSpec
from kvpool.specs.targets.importing import import_from_here
from kvpool.specs.targets.manager_api import (
    SchedulerCalls,
    block_ids,
    connector_arguments,
    copy_ids,
)
from kvpool.specs.targets.vllm import eras
from kvpool.specs.targets.vllm.event_shape import UnmappedEvent, model_event
from kvpool.specs.targets.vllm.hasher import VllmRequests, find_hasher
from kvpool.specs.targets.vllm.pool import VllmRejection, rejection

HASHER_ENV = "KVPOOL_VLLM_HASHER"
"""``vllm`` (default): vLLM's own request block hasher; ``kvpool``: kvpool's hashes."""
HASHERS = ("vllm", "kvpool")


class VllmRequest:
    """The attributes of ``vllm.v1.request.Request`` that the KV cache manager reads."""

    def __init__(self, request: Request, status: Any, lora_class: Any = None) -> None:
        self.request_id = request.request_id
        self.block_hashes = list(request.block_hashes)
        self.all_token_ids = list(request.all_token_ids)
        self.num_tokens = request.num_tokens
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = request.num_computed_tokens
        self.num_preemptions = request.num_preemptions
        self.skip_reading_prefix_cache = request.skip_reading_prefix_cache
        self.num_in_flight_tokens = 0
        self.shared_prefix_boundary = request.shared_prefix_boundary
        self.status = status
        # The pool stamps each BlockStored with the request's LoRA (``lora_request``
        # read as ``adapter_id``/``name`` in 0.24, ``lora_int_id``/``lora_name`` in
        # others): vLLM's own LoRARequest answers every era's names.
        lora = request.lora
        self.lora_request = (
            None
            if lora is None
            else lora_class(lora_name=lora.name, lora_int_id=lora.lora_id, lora_path=lora.path)
        )
        self.mm_features: list[Any] = []
        self.cache_salt = request.cache_salt
        self.prompt_embeds = None
        self.session_id = None


@dataclass(frozen=True)
class ManagerApi:
    """The importable vLLM's KV cache manager, and the constructor arguments its class takes."""

    version: str
    manager_class: Any
    scheduler_block_size_arg: bool
    """0.33: the constructor takes ``scheduler_block_size``."""
    hash_block_size_arg: bool
    """0.12.0+: the constructor takes ``hash_block_size``; before, blocks are hashed
    at the block size (the adapter's scope has ``block_size == hash_block_size``)."""
    scheduler_calls: bool = False
    """0.33: the class has ``pop_blocks_for_free`` and its constructor takes
    ``max_in_flight_tokens`` (the rest of the scheduler calls, ``OPERATIONS_SCHEDULER``)."""
    prefill_lookahead_arg: bool = False
    """0.33: the constructor takes ``num_prefill_lookahead`` (multi-module MTP)."""
    records_stats_apart: bool = True
    """0.28+: hit statistics are recorded by ``record_prefix_cache_stats``, not inside
    ``get_computed_blocks``."""
    calls_033: bool = True
    """0.28+: the manager has ``take_kv_cache_block_copies`` and the other calls of
    ``OPERATIONS_033`` (the machine sends them only then)."""


def load_manager_api(manager_class: Any = None) -> ManagerApi:
    """Import vLLM's KV cache manager; describe the constructor of ``manager_class`` (or vLLM's)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # read when vllm is first imported
    try:
        vllm = importlib.import_module("vllm")
        manager_module = importlib.import_module("vllm.v1.core.kv_cache_manager")
    except Exception as error:  # ImportError, or a dependency failing at import
        raise TargetError(f"vLLM's KVCacheManager cannot be imported: {error!r}") from error
    base = manager_module.KVCacheManager
    cls = base if manager_class is None else manager_class
    return ManagerApi(
        version=str(getattr(vllm, "__version__", "unknown")),
        manager_class=cls,
        scheduler_block_size_arg=eras.takes(cls, "__init__", "scheduler_block_size", base),
        hash_block_size_arg=eras.takes(cls, "__init__", "hash_block_size", base),
        scheduler_calls=callable(getattr(cls, "pop_blocks_for_free", None))
        and eras.takes(cls, "__init__", "max_in_flight_tokens", base),
        prefill_lookahead_arg=eras.takes(cls, "__init__", "num_prefill_lookahead", base),
        records_stats_apart=callable(getattr(cls, "record_prefix_cache_stats", None)),
        calls_033=callable(getattr(cls, "take_kv_cache_block_copies", None)),
    )


class VllmManagerTarget(SchedulerCalls):
    """vLLM's ``KVCacheManager`` (or ``manager_class``) behind the manager protocol."""

    def __init__(
        self, setup: ManagerSetup, manager_class: Any = None, hasher: str | None = None
    ) -> None:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # read when vllm is first imported
        self.api = load_manager_api(manager_class)
        try:
            torch = importlib.import_module("torch")
            hashing = importlib.import_module("vllm.utils.hashing")
            manager_module = importlib.import_module("vllm.v1.core.kv_cache_manager")
            utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
            interface = importlib.import_module("vllm.v1.kv_cache_interface")
            request_module = importlib.import_module("vllm.v1.request")
            self._lora_class = importlib.import_module("vllm.lora.request").LoRARequest
        except Exception as error:  # ImportError, or a dependency failing at import
            raise TargetError(f"vLLM's KVCacheManager cannot be imported: {error!r}") from error
        # reset_prefix_cache logs a warning each time it refuses; the machine asks often.
        logging.getLogger("vllm").setLevel(logging.ERROR)
        specs = setup.specs
        refused = vllm_refuses(setup)
        if refused is not None:
            raise TargetError(f"vLLM {self.api.version} refuses this configuration: {refused}")
        fine = setup.fine_grained_hits
        # the blocks the manager holds: sharded groups' times the decode world size
        sizes = [s.block_size * (setup.dcp_world_size if s.dcp_sharded else 1) for s in specs]
        if fine and (
            len(specs) < 2
            or any(s.attention is not AttentionType.FULL for s in specs)
            or sizes[0] <= setup.hash_block_size
        ):
            raise TargetError(
                "the vLLM adapter runs fine-grained hits on two or more full-attention groups "
                "of blocks larger than a hash block (vLLM's hybrid coordinator)"
            )
        utils.init_none_hash(hashing.sha256)
        self._blocks_class = manager_module.KVCacheBlocks
        self._has_get_blocks = callable(getattr(self.api.manager_class, "get_blocks", None))
        self._status = request_module.RequestStatus.RUNNING
        self.setup = setup
        self.answers_scheduler_calls = self.api.scheduler_calls
        self.answers_033 = self.api.calls_033
        """Whether the machine may send the calls of ``OPERATIONS_033`` (a release before
        them has none)."""
        """Whether the machine may send the rest of 0.33's scheduler calls (a release
        before them has none)."""
        self._to_model: dict[Any, bytes] = {}
        self.hasher = chosen_hasher(hasher)
        self._requests: VllmRequests | None = None
        if self.hasher == "vllm":
            found = find_hasher(self.api.manager_class)
            if found is None:
                raise TargetError(
                    f"vLLM {self.api.version} has no get_request_block_hasher: set "
                    f"{HASHER_ENV}=kvpool to check its manager with kvpool's hashes"
                )
            self._requests = VllmRequests(found, self._status)
        common_shape: dict[str, Any] = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float32}
        groups = []
        for g, spec in enumerate(specs):
            vllm_spec: Any
            shape = common_shape
            if not spec.dcp_sharded and spec.attention is not AttentionType.MAMBA:
                # a replicated attention group (vLLM's default is sharded); this group only
                shape = {**common_shape, "dcp_sharded": False}
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
            elif spec.attention is AttentionType.MAMBA:
                # One state of one float per block; "none" mode: never a hit, never cached;
                # "align" mode: one state per block of tokens (kvpool.model.mamba_align).
                vllm_spec = interface.MambaSpec(
                    block_size=spec.block_size,
                    shapes=((1,),),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align" if spec.mamba_align else "none",
                    # reserved blocks (kvpool.model.mamba_reserve): only when set, so the
                    # releases before them build the spec they always did
                    **_reserved(spec),
                )
            else:
                vllm_spec = interface.FullAttentionSpec(block_size=spec.block_size, **shape)
            # a group flagged as EAGLE's (vLLM 0.33): only then, so older releases build
            flag = {"is_eagle_group": True} if g in setup.eagle_groups else {}
            groups.append(interface.KVCacheGroupSpec([f"layer.{g}"], vllm_spec, **flag))
        retention: dict[str, Any] = {}
        if setup.retention_interval is not None:
            fields = getattr(interface.KVCacheConfig, "__dataclass_fields__", {})
            if "prefix_cache_retention_interval" not in fields:
                raise TargetError(
                    f"vLLM {self.api.version}'s KVCacheConfig has no "
                    "prefix_cache_retention_interval"
                )
            retention["prefix_cache_retention_interval"] = setup.retention_interval
        config = interface.KVCacheConfig(
            num_blocks=setup.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups, **retention
        )
        kwargs: dict[str, Any] = {
            "max_model_len": setup.max_model_len,
            "enable_caching": setup.enable_caching,
            "use_eagle": setup.use_eagle,
            "log_stats": setup.log_stats,
            "enable_kv_cache_events": setup.enable_events,
        }
        if self.api.scheduler_block_size_arg:
            # the scheduler works in the least common multiple of the groups' blocks
            kwargs["scheduler_block_size"] = setup.scheduler_block_size or math.lcm(*sizes)
        if self.api.hash_block_size_arg:
            kwargs["hash_block_size"] = setup.hash_block_size
        if setup.max_in_flight_tokens is not None and self.api.scheduler_calls:
            kwargs["max_in_flight_tokens"] = setup.max_in_flight_tokens
        if setup.num_prefill_lookahead:
            if not self.api.prefill_lookahead_arg:
                raise TargetError(
                    f"vLLM {self.api.version}'s manager takes no num_prefill_lookahead"
                )
            kwargs["num_prefill_lookahead"] = setup.num_prefill_lookahead
        if setup.dcp_world_size != 1:
            kwargs["dcp_world_size"] = setup.dcp_world_size
        if setup.pcp_world_size != 1:
            kwargs["pcp_world_size"] = setup.pcp_world_size
        cls = self.api.manager_class
        try:
            self.manager = Translating(cls(config, **kwargs), self.api.version)
        except Exception as error:
            shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
            raise TargetError(
                f"{cls.__name__}(kv_cache_config, {shown}) failed: {error!r}"
            ) from error
        if fine and setup.enable_caching:  # without caching vLLM's coordinator looks nothing up
            enable_fine_grained_hits(self.manager.coordinator, setup.hash_block_size)

    def _request(self, request: Request) -> Any:
        duck = (
            self._requests.get(request)
            if self._requests is not None
            else VllmRequest(request, self._status, self._lora_class)
        )
        # vLLM's hash of each hash block, as its events carry it, names the model's hash
        # of the same hash block (both hashers name prefixes; the machine checks it).
        for ours, theirs in zip(request.block_hashes, duck.block_hashes, strict=False):
            self._to_model[event_hash(theirs)] = ours
        return duck

    def get_computed_blocks(self, request: Request) -> tuple[Blocks, int]:
        duck = self._request(request)
        blocks, num_tokens, *_ = self.manager.get_computed_blocks(duck)
        # 0.28+ record hit stats from the scheduler, at admission; seed 004 (and the
        # model, and releases before 0.28, inside get_computed_blocks) at the lookup
        # itself: record here, where the seed does.
        if self.api.records_stats_apart:
            self.manager.record_prefix_cache_stats(duck, num_tokens)
        return block_ids(blocks), num_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Blocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
        num_external_computed_tokens: int = 0,
        reserved_blocks: int = 0,
        skip_zeroing_group_ids: Sequence[int] = (),
    ) -> Blocks | None:
        # passed only when asked for: a release before 0.33 has no such argument
        whole: dict[str, Any] = {"full_sequence_must_fit": True} if full_sequence_must_fit else {}
        whole.update(
            connector_arguments(
                num_external_computed_tokens, reserved_blocks, tuple(skip_zeroing_group_ids)
            )
        )
        hits = None
        if new_computed_blocks is not None and any(new_computed_blocks):
            pool_blocks = self.manager.block_pool.blocks
            # an unknown id becomes a block of no pool, as at the pool layer
            stand_in = type(self.manager.block_pool.null_block)
            hits = self._blocks_class(
                tuple(
                    [pool_blocks[b] if 0 <= b < len(pool_blocks) else stand_in(b) for b in group]
                    for group in new_computed_blocks
                )
            )
        try:
            blocks = self.manager.allocate_slots(
                self._request(request),
                num_new_tokens,
                num_new_computed_tokens,
                hits,
                num_lookahead_tokens,
                delay_cache_blocks=delay_cache_blocks,
                **whole,
            )
        except VllmRejection as error:
            # 0.33 signals "no new tokens" with a ValueError, which NoNewTokens is too
            if isinstance(error.original, ValueError):
                raise NoNewTokens(str(error.original)) from error
            raise
        return None if blocks is None else block_ids(blocks)

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
        ids = tuple(tuple(group) for group in self.manager.get_block_ids(request_id))
        # The scheduler also reads the blocks themselves (get_blocks); both must agree.
        if self._has_get_blocks and block_ids(self.manager.get_blocks(request_id)) != ids:
            raise TargetError(f"vLLM's get_blocks and get_block_ids disagree on {request_id!r}")
        return ids

    def take_events(self) -> Sequence[KVCacheEvent]:
        return tuple(self.event(e) for e in self.manager.take_events())

    def model_hash(self, value: Any) -> bytes:
        """The model's hash for a hash in one of vLLM's events (an int, or bytes)."""
        found = self._to_model.get(event_hash(value))
        return found if found is not None else f"<unknown hash {value!r}>".encode()

    def event(self, event: Any) -> KVCacheEvent:
        """One of the manager's events as the model's (see ``manager_event``)."""
        return manager_event(event, self.setup.specs, self.model_hash)

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

    # vLLM 0.33's further scheduler calls

    def get_computed_blocks_with_boundary(self, request: Request) -> tuple[Blocks, int, int]:
        duck = self._request(request)
        blocks, num_tokens, boundary = self.manager.get_computed_blocks(duck)
        self.manager.record_prefix_cache_stats(duck, num_tokens)
        return block_ids(blocks), num_tokens, int(boundary)

    def take_kv_cache_block_copies(self) -> tuple[Sequence[tuple[int, int]], Sequence[int]]:
        return copy_ids(*self.manager.take_kv_cache_block_copies())

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        # the scheduler's _free_cow_retained_blocks, when no step is in flight
        pool = self.manager.block_pool
        pool.free_blocks([pool.blocks[b] for b in block_ids])

    def truncate_computed_blocks(self, blocks: Blocks, num_computed_tokens: int) -> Blocks:
        pool_blocks = self.manager.block_pool.blocks
        hit = self._blocks_class(tuple([pool_blocks[b] for b in group] for group in blocks))
        return block_ids(self.manager.truncate_computed_blocks(hit, num_computed_tokens))

    def take_new_block_ids(self) -> Sequence[int]:
        return tuple(self.manager.take_new_block_ids())

    def estimate_cached_tokens(self, request: Request) -> int:
        return int(self.manager.estimate_cached_tokens(self._request(request)))

    def new_step_starts(self) -> None:
        self.manager.new_step_starts()

    # the rest of vLLM 0.33's scheduler calls (``SchedulerCalls``), on vLLM's requests

    def caller_request(self, request: Request) -> Any:
        return self._request(request)

    def looked_up(self, request: Any, num_tokens: int) -> None:
        # stats at the lookup, as for get_computed_blocks
        if self.api.records_stats_apart:
            self.manager.record_prefix_cache_stats(request, num_tokens)


def enable_fine_grained_hits(coordinator: Any, hash_block_size: int) -> None:
    """Turn on 0.33's partial hash hits in a hybrid coordinator of full-attention groups.

    vLLM sets the switch itself only when a Mamba "align" group is present
    (vllm/v1/core/kv_cache_utils.py, ``partial_hash_hits_enabled``); kvpool
    models no such group, so the adapter sets what the coordinator's
    constructor would have: the switch, and every manager's hit alignment
    (vllm/v1/core/kv_cache_coordinator.py, ``HybridKVCacheCoordinator.__init__``).
    The full-attention code that then runs is vLLM's own, unchanged.
    """
    if not hasattr(coordinator, "attention_groups"):
        raise TargetError("fine-grained hits need vLLM's HybridKVCacheCoordinator")
    coordinator.enable_partial_hash_hits = True
    for manager in coordinator.single_type_managers:
        manager.cache_hit_alignment_tokens = hash_block_size


def _reserved(spec: KVCacheSpec) -> dict[str, Any]:
    """vLLM 0.33's ``MambaSpec`` arguments for the spec's speculative and checkpoint blocks
    (one checkpoint block: how many only sizes vLLM's memory)."""
    reserved: dict[str, Any] = {}
    if spec.num_speculative_blocks:
        reserved["num_speculative_blocks"] = spec.num_speculative_blocks
    if spec.prefill_checkpoint_alignment:
        reserved["num_prefill_checkpoint_blocks"] = 1
        reserved["prefill_checkpoint_alignment"] = spec.prefill_checkpoint_alignment
    return reserved


def vllm_refuses(setup: ManagerSetup) -> str | None:
    """Why vLLM 0.33's manager cannot be built for ``setup`` (None: it can).

    * One group with prefix caching on: ``UnitaryKVCacheCoordinator`` asserts
      ``hash_block_size == block_size`` (``vllm/v1/core/kv_cache_coordinator.py``
      in 0.33.0); blocks of several hash blocks need two groups or more, whose
      ``HybridKVCacheCoordinator`` reads them through ``BlockHashListWithBlockSize``.
    * Mamba with prefix caching on: ``MambaManager`` asserts
      ``mamba_cache_mode == "align"`` (``vllm/v1/core/single_type_kv_cache_manager.py``
      in 0.33.0); the model's whole-request Mamba (never a hit, never cached) is
      vLLM's "none" mode, which vLLM runs with caching off only. A ``mamba_align``
      group is the "align" mode (``kvpool.model.mamba_align``).
    """
    specs = setup.specs
    if not setup.enable_caching:
        return None
    if any(s.attention is AttentionType.MAMBA and not s.mamba_align for s in specs):
        return "Mamba with prefix caching needs mamba_cache_mode='align'"
    sharded = specs[0].block_size * (setup.dcp_world_size if specs[0].dcp_sharded else 1)
    if len(specs) == 1 and sharded != setup.hash_block_size:
        return "one group with prefix caching needs block_size == hash_block_size"
    return None


def event_hash(value: Any) -> int:
    """A hash as vLLM's events carry it: the int of its last 8 bytes.

    ``maybe_convert_block_hash`` in ``vllm/v1/core/kv_cache_utils.py`` (0.33.0)
    does so unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, when events carry the
    bytes; an int passes through, so either form finds the same entry.
    """
    if isinstance(value, int):
        return value
    return int.from_bytes(bytes(value), "big") & ((1 << 64) - 1)


def manager_event(
    event: Any, specs: Sequence[KVCacheSpec], model_hash: Callable[[Any], bytes]
) -> KVCacheEvent:
    """One of the manager's msgspec events as the model's event.

    * The manager annotates each ``BlockStored`` with its group's kind and window
      (``KVCacheManager.take_events``, 0.33.0): they must be the group's spec (the
      model's ``AttentionType`` values are vLLM's kind names), then are dropped.
    * ``extra_keys`` (LoRA, multimodal, salt and embedding keys of each block) are
      not modelled at the request layer (docs/semantics.md): one None per block, as
      the model's.
    * Any other field the model lacks must be None; an event where one is not, or of
      another kind, comes back as an ``UnmappedEvent`` and so never compares equal.
    """
    kind = type(event).__name__
    annotated: dict[str, Any] = {}
    if kind == "BlockStored":
        group = getattr(event, "group_idx", None)
        if not isinstance(group, int) or not 0 <= group < len(specs):
            return UnmappedEvent(f"{event!r}: no such group")  # type: ignore[return-value]
        spec = specs[group]
        window = spec.sliding_window if spec.attention is AttentionType.SLIDING_WINDOW else None
        annotated = {
            "kv_cache_spec_kind": spec.attention.value,
            "kv_cache_spec_sliding_window": window,
        }
    return model_event(event, model_hash, annotated, extra_key_values=False)


class Translating:
    """The manager, every method call on it translating vLLM's exceptions as the pool adapter does.

    A rejection of the model's stays one; ``AttributeError`` and ``TypeError``
    mean the adapter and the release disagree on the API (``TargetError``);
    anything else vLLM raises (an ``AssertionError``, say) becomes a
    ``VllmRejection`` named after it, which the checks report as a divergence.
    Attributes that are not methods (``block_pool``, ``usage``) pass through.
    """

    def __init__(self, manager: Any, version: str) -> None:
        self._manager = manager
        self._version = version

    def __getattr__(self, name: str) -> Any:
        try:
            value = getattr(self._manager, name)
        except AttributeError as error:
            # A method the release lacks is an API mismatch, never the target's answer
            raise TargetError(
                f"the adapter and vLLM {self._version} disagree ({name}): {error!r}"
            ) from error
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return value(*args, **kwargs)
            except (PoolError, TargetError):
                raise
            except (AttributeError, TypeError) as error:
                raise TargetError(
                    f"the adapter and vLLM {self._version} disagree ({name}): {error!r}"
                ) from error
            except Exception as error:
                raise rejection(error) from error

        return call


class VllmHashingManagerTarget(VllmManagerTarget):
    """The adapter with vLLM's own hasher: the machine asks for its hashes and checks them."""

    def block_hashes(self, request: Request) -> Sequence[bytes]:
        """The hashes vLLM's request block hasher gave the request's full blocks."""
        return [bytes(h) for h in self._request(request).block_hashes]


def chosen_hasher(hasher: str | None) -> str:
    """The hasher mode: ``hasher`` if given, else ``KVPOOL_VLLM_HASHER``, else ``vllm``."""
    chosen = hasher or os.environ.get(HASHER_ENV) or "vllm"
    if chosen not in HASHERS:
        raise TargetError(f"{HASHER_ENV}={chosen!r}: use {' or '.join(HASHERS)}")
    return chosen


class VllmManagerFactory:
    """Builds manager targets over vLLM's ``KVCacheManager`` or ``manager_class``.

    ``manager_class`` is a class or a ``package.module:Class`` string,
    imported on first use; ``hasher`` is ``vllm``, ``kvpool`` or None (the
    environment's ``KVPOOL_VLLM_HASHER``, else ``vllm``).
    """

    levels = (1,)
    """Level 2 is not claimed: vLLM asserts, or accepts, where the model rejects
    (``REQUEST_FINDINGS``)."""

    def __init__(
        self,
        manager_class: Any = None,
        hasher: str | None = None,
        suppress: Sequence[tuple[str, str]] = (),
    ) -> None:
        self._manager_class = manager_class
        self.hash_mode = hasher
        self.suppress = tuple(suppress)
        """(operation, model exception) pairs stepped over (``SteppingOver``)."""

    def manager_class(self) -> Any:
        """The class to instantiate (None: vLLM's own), imported on first use."""
        if isinstance(self._manager_class, str):
            module_name, _, attribute = self._manager_class.partition(":")
            try:
                module = import_from_here(module_name)
            except Exception as error:  # ImportError, or the module failing as it is imported
                raise TargetError(f"cannot import {module_name!r}: {error!r}") from error
            found = getattr(module, attribute, None)
            if not isinstance(found, type):
                raise TargetError(f"{module_name!r} has no class {attribute!r}")
            self._manager_class = found
        return self._manager_class

    def __call__(self, setup: ManagerSetup) -> Any:
        if setup.hisparse is not None:  # HiSparse's roles: the coordinator's adapter
            from kvpool.specs.targets.vllm.hisparse import VllmHiSparseTarget

            return VllmHiSparseTarget(setup, self.manager_class())
        hasher = chosen_hasher(self.hash_mode)
        cls = VllmHashingManagerTarget if hasher == "vllm" else VllmManagerTarget
        target = cls(setup, self.manager_class(), hasher)
        return SteppingOver(target, setup, self.suppress) if self.suppress else target

    def declared_scope(self) -> dict[str, Any]:
        """Multi-module MTP's look-ahead only where the constructor takes it (vLLM 0.33);
        EAGLE on hybrids, context parallelism and sparse retention only on the release they
        were compared with (0.33: earlier releases size and check sharded blocks otherwise,
        and their ``KVCacheConfig`` has no ``prefix_cache_retention_interval``)."""
        api = load_manager_api(self.manager_class())
        claimed: dict[str, Any] = {}
        if not api.prefill_lookahead_arg:
            claimed["prefill_lookaheads"] = (0,)
        if not api.version.startswith("0.33"):
            claimed["eagle_hybrids"] = False
            claimed["eagle_flags"] = False
            claimed["context_parallel"] = ((1, 1),)
            # 0.33's hybrid coordinator also keys the prompt's last hash-block boundary
            # inside a full-attention block (a partial BlockStored of one hash block);
            # 0.24 does not: before 0.33, blocks of one hash block only
            claimed["block_factors"] = (1,)
            claimed["retentions"] = (None,)
        if not api.version.startswith("0.33"):
            claimed["hisparse"] = False  # HiSparse's coordinator: vLLM 0.33.0's
        if not eras.takes(api.manager_class, "allocate_slots", "reserved_blocks"):
            # a release before a KV connector's reserved blocks (0.33) is not sent its loads
            claimed["connector_loads"] = False
        return claimed

    def preflight(self, level: int, profiles: Sequence[str]) -> None:
        """Fail fast, before any program runs, if this manager cannot be checked here."""
        chosen_hasher(self.hash_mode)
        api = load_manager_api(self.manager_class())
        base = importlib.import_module("vllm.v1.core.kv_cache_manager").KVCacheManager
        cls = api.manager_class
        if not (isinstance(cls, type) and (issubclass(cls, base) or _looks_like(cls, base))):
            raise TargetError(
                f"{cls!r} is not a KVCacheManager: a subclass of vLLM's "
                "vllm.v1.core.kv_cache_manager.KVCacheManager, or a fork's class with its methods"
            )


STEPPED = (
    "get_computed_blocks",
    "allocate_slots",
    "free",
    "cache_blocks",
    "evict_blocks",
    "reset_prefix_cache",
    "take_events",
    "make_prefix_cache_stats",
    "pop_blocks_for_free",
    "remove_skipped_blocks",
    "get_computed_blocks_for_connector",
    "record_blocks_for_zeroing",
    "take_boundary_state_offloads",
    "finalize_partial_tail_offloads",
)
"""The calls that change a manager's state: the shadow model runs each of them."""


class SteppingOver:
    """A manager target with the model run beside it, to step over known level-2 findings.

    Every call that changes state runs on a shadow model first
    (``ModelManagerTarget``); when the model rejects it with an exception
    paired with the operation in ``suppressed``, the call is rejected so and
    never reaches vLLM. For listing findings one after another
    (``kvpool.specs.targets.vllm.survey.survey_request_level2``), never for a
    verdict.
    """

    def __init__(
        self, target: Any, setup: ManagerSetup, suppressed: Sequence[tuple[str, str]]
    ) -> None:
        from kvpool.specs.request.model_target import ModelManagerTarget

        self._target = target
        self._model = ModelManagerTarget(setup)
        self._suppressed = frozenset(suppressed)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if name not in STEPPED:
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                getattr(self._model, name)(*args, **kwargs)
            except PoolError as error:
                if (name, type(error).__name__) in self._suppressed:
                    raise type(error)(f"known vLLM finding, not sent to vLLM: {error}") from error
            return value(*args, **kwargs)

        return call


def _looks_like(cls: type, base: type) -> bool:
    """A fork's class: it has the methods the adapter calls."""
    needed = ("get_computed_blocks", "allocate_slots", "free", "get_block_ids", "cache_blocks")
    return all(callable(getattr(cls, name, None)) for name in needed)


def vllm_manager_factory(spec: str, hasher: str | None = None) -> VllmManagerFactory:
    """The factory for ``vllm`` or ``vllm:package.module:Class`` at the request layer."""
    if spec == "vllm":
        return VllmManagerFactory(None, hasher)
    module_name, _, class_name = spec.removeprefix("vllm:").partition(":")
    if spec.startswith("vllm:") and module_name and class_name.isidentifier():
        return VllmManagerFactory(f"{module_name}:{class_name}", hasher)
    raise ValueError(
        f"not a vLLM target string: {spec!r} (use vllm, vllm:package.module:Class or vllm==X.Y.Z)"
    )


RETENTIONS: tuple[int | None, ...] = (None, None, 0, 1, 2)
"""The retention intervals drawn (in scheduler blocks; ``ManagerTargetSpec.retentions``):
dense most often, latest-only, and one segment tail every one or two scheduler blocks."""


def scope(factory: VllmManagerFactory | None = None) -> ManagerTargetSpec:
    """Where vLLM's manager (or a subclass, through ``factory``) is compared: ``VLLM_SCOPE``."""
    from kvpool.model import DEFAULT_PROFILE

    return ManagerTargetSpec(
        factory or VllmManagerFactory(),
        layouts=(
            "full",
            "sliding_window",
            "chunked_local",
            "mamba",
            "full+sliding_window",
            "full+full+sliding_window",
            "sliding_window+full",
            "full+sliding_window+sliding_window",
            "full+chunked_local",
            "full+mamba",
            "wide_full+sliding_window",
            "full+wide_sliding_window",
        ),
        profiles=(DEFAULT_PROFILE,),
        events=(False, True),
        block_factors=(1, 2),
        min_window=2,
        uncached_layouts=("mamba", "full+mamba"),
        hash_sized_layouts=("full", "sliding_window", "chunked_local"),
        in_flight=(None, 1, 3),
        scheduler_calls=True,
        prefill_lookaheads=(0, 0, 1, 2, 3),
        eagle_hybrids=True,
        # decode and prefill context parallelism on the full-attention layouts
        context_parallel=((1, 1), (2, 1), (1, 2), (2, 2)),
        retentions=RETENTIONS,
        # a KV connector's loads and EAGLE flagged on some groups (kvpool.model.external,
        # kvpool.model.eagle.group_flags); eagle_flags_scope() and connector_scope() draw
        # them more densely
        connector_loads=True,
        eagle_flags=True,
    )


def fine_grained_scope(factory: VllmManagerFactory | None = None) -> ManagerTargetSpec:
    """Where vLLM's fine-grained hits and copy-on-write are compared (``FINE_GRAINED_PART``):
    two full-attention groups (a hybrid coordinator) of blocks two hash blocks long, events
    on and off, the switch turned on by ``enable_fine_grained_hits``."""
    from kvpool.model import DEFAULT_PROFILE
    from kvpool.specs.request.target import FINE_GRAINED_PART

    return ManagerTargetSpec(
        factory or VllmManagerFactory(), profiles=(DEFAULT_PROFILE,), **FINE_GRAINED_PART
    )


def mamba_align_scope(factory: VllmManagerFactory | None = None) -> ManagerTargetSpec:
    """Where vLLM's Mamba "align" mode is compared (``MAMBA_ALIGN_PART``,
    ``kvpool.model.mamba_align``): a Mamba group alone, beside full attention and beside a
    sliding window, blocks of one hash block when caching is on, events on and off; and a
    Mamba block of one hash block beside blocks two or four times larger
    (``MAMBA_ALIGN_GEOMETRY_LAYOUTS``); Mamba blocks of one hash block beside sharded full
    attention under decode context parallelism, hits on hash blocks
    (``MAMBA_ALIGN_DCP_LAYOUTS``, ``kvpool.model.align_dcp``); the scheduler's further calls,
    the connector's per-group lookup among them. Not in ``VLLM_SCOPE``: the machine drives
    these layouts with the scheduler's block-aligned chunks and no drafts. Sparse retention
    of the states is drawn too (``kvpool.model.retention.mamba_align_retention_mask``), and
    EAGLE where kvpool models it beside "align" (``kvpool.model.mamba_align_eagle``: no
    checkpoint blocks, no hits inside a Mamba block; ``mamba_align_eagle_scope()`` draws it
    more densely)."""
    from kvpool.model import DEFAULT_PROFILE
    from kvpool.specs.request.target import MAMBA_ALIGN_PART

    return ManagerTargetSpec(
        factory or VllmManagerFactory(), profiles=(DEFAULT_PROFILE,), **MAMBA_ALIGN_PART
    )


def mamba_align_eagle_scope(factory: VllmManagerFactory | None = None) -> ManagerTargetSpec:
    """Where EAGLE beside a Mamba "align" group is compared most densely
    (``kvpool.model.mamba_align_eagle``): the layouts of ``mamba_align_scope()`` without hits
    inside a block, EAGLE drawn half the time with up to two groups flagged as EAGLE's (an
    unflagged "align" group still moves its prompt boundary), one to three speculative
    blocks, dense and sparse retention, the scheduler's calls (the connector's per-group
    lookup, which peeks and drops as the plain one does), events on and off."""
    from kvpool.model import DEFAULT_PROFILE
    from kvpool.specs.request.target import MAMBA_ALIGN_GEOMETRY_LAYOUTS, MAMBA_ALIGN_LAYOUTS

    return ManagerTargetSpec(
        factory or VllmManagerFactory(),
        layouts=MAMBA_ALIGN_LAYOUTS + MAMBA_ALIGN_GEOMETRY_LAYOUTS,
        profiles=(DEFAULT_PROFILE,),
        events=(False, True),
        block_factors=(1, 2),
        min_window=2,
        hash_sized_layouts=MAMBA_ALIGN_LAYOUTS,
        scheduler_calls=True,
        mamba_reserves=((0, 0), (0, 0), (1, 0), (2, 0), (3, 0)),
        retentions=(None, None, 0, 0, 1, 2, 3),
        eagle_hybrids=True,
        eagle_flags=True,
    )


def mamba_fine_scope(factory: VllmManagerFactory | None = None) -> ManagerTargetSpec:
    """Where hits inside a Mamba "align" block are compared (``MAMBA_FINE_PART``,
    ``kvpool.model.mamba_fine``):
    full attention of one or two hash blocks beside a Mamba block of two to four hash
    blocks, caching on (off: blocks of one hash block), events on and off, the scheduler's
    further calls (the connector's per-group lookup, the copies, the producer's partial tail
    among them), with and without prefill checkpoint blocks one or two hash blocks apart,
    speculative blocks, or both (``kvpool.model.mamba_fine_reserve``). Not in
    ``VLLM_SCOPE``: the machine drives it with the scheduler's chunks (stopping at the
    prompt's partial boundary) and no drafts."""
    from kvpool.model import DEFAULT_PROFILE
    from kvpool.specs.request.target import MAMBA_FINE_PART

    return ManagerTargetSpec(
        factory or VllmManagerFactory(), profiles=(DEFAULT_PROFILE,), **MAMBA_FINE_PART
    )


def retention_scope(factory: VllmManagerFactory | None = None) -> ManagerTargetSpec:
    """Where vLLM 0.33's sparse retention (``prefix_cache_retention_interval``) is compared
    (``kvpool.model.retention``): the sliding-window layouts of ``VLLM_SCOPE`` under every
    interval drawn sparse (latest-only, one to three scheduler blocks), EAGLE on hybrids,
    the scheduler's calls and multi-module MTP's look-ahead, events on and off."""
    from kvpool.model import DEFAULT_PROFILE

    return ManagerTargetSpec(
        factory or VllmManagerFactory(),
        layouts=RETENTION_LAYOUTS,
        profiles=(DEFAULT_PROFILE,),
        events=(False, True),
        block_factors=(1, 2),
        min_window=2,
        hash_sized_layouts=("sliding_window",),
        in_flight=(None, 3),
        scheduler_calls=True,
        prefill_lookaheads=(0, 0, 1, 2),
        eagle_hybrids=True,
        retentions=(0, 0, 1, 2, 3),
    )


RETENTION_LAYOUTS = (
    "sliding_window",
    "full+sliding_window",
    "full+full+sliding_window",
    "sliding_window+full",
    "full+sliding_window+sliding_window",
    "wide_full+sliding_window",
    "full+wide_sliding_window",
)
"""The layouts of ``VLLM_SCOPE`` with a sliding-window group: where retention thins caching."""


def connector_scope(factory: VllmManagerFactory | None = None) -> ManagerTargetSpec:
    """Where vLLM 0.33's handling of a KV connector's loads is compared
    (``kvpool.model.external``): requests admitted with external tokens, loaded in the step
    or asynchronously, reserved blocks, groups not zeroed, with and without the whole-sequence
    gate, on full attention, sliding windows and chunked local attention alone and in hybrids
    (not Mamba: external tokens beside it are not modelled), events on and off."""
    from kvpool.model import DEFAULT_PROFILE

    return ManagerTargetSpec(
        factory or VllmManagerFactory(),
        layouts=(
            "full",
            "sliding_window",
            "chunked_local",
            "full+sliding_window",
            "full+full+sliding_window",
            "sliding_window+full",
            "full+chunked_local",
            "wide_full+sliding_window",
        ),
        profiles=(DEFAULT_PROFILE,),
        events=(False, True),
        block_factors=(1, 2),
        min_window=2,
        hash_sized_layouts=("full", "sliding_window", "chunked_local"),
        in_flight=(None, 1, 3),
        scheduler_calls=True,
        eagle_hybrids=True,
        connector_loads=True,
    )


def eagle_flags_scope(factory: VllmManagerFactory | None = None) -> ManagerTargetSpec:
    """Where vLLM 0.33's per-group EAGLE flags (``is_eagle_group``) are compared most
    densely (``VLLM_SCOPE`` draws them too): up to two groups flagged, EAGLE drawn half the
    time, on hybrids of full attention and sliding windows (a flagged window beside an
    unflagged one, siblings of one spec, blocks of two sizes), multi-module MTP's
    look-ahead, events on and off."""
    from kvpool.model import DEFAULT_PROFILE

    return ManagerTargetSpec(
        factory or VllmManagerFactory(),
        layouts=(
            "full+sliding_window",
            "full+full+sliding_window",
            "sliding_window+full",
            "full+sliding_window+sliding_window",
            "wide_full+sliding_window",
            "full+wide_sliding_window",
            "wide_full+sliding_window+sliding_window",
        ),
        profiles=(DEFAULT_PROFILE,),
        events=(False, True),
        block_factors=(1, 2),
        min_window=2,
        prefill_lookaheads=(0, 0, 1, 2),
        eagle_hybrids=True,
        eagle_flags=True,
    )


def hisparse_scope(factory: VllmManagerFactory | None = None) -> ManagerTargetSpec:
    """Where vLLM 0.33's HiSparse manager and coordinator are compared (slice 1: two pools,
    write-back and publication; ``kvpool.specs.request.hisparse_machine``), events on and off.
    """
    from kvpool.model import DEFAULT_PROFILE
    from kvpool.specs.request.target import HISPARSE_PART

    return ManagerTargetSpec(
        factory or VllmManagerFactory(), profiles=(DEFAULT_PROFILE,), **HISPARSE_PART
    )


VLLM_SCOPE = scope()
"""Where vLLM 0.33's manager is compared: every attention type it runs on a CPU
(full, sliding window of at least 2 tokens, chunked local, Mamba) and hybrids of
them (vLLM's HybridKVCacheCoordinator), events on and off, blocks of one or two hash
blocks, the hashless-first profile, a KV connector's loads and EAGLE flagged on some
groups. Two limits are vLLM's (``vllm_refuses``): Mamba
runs with prefix caching off, and a single group has blocks of one hash block when
caching is on."""


SCHEDULER_CALLS_NOT_DRIVEN: dict[str, str] = {}
"""Methods of 0.33's ``KVCacheManager`` its scheduler calls that the request machine
does not drive, each with the reason (``tests/vllm/test_vllm_033_operations.py``
fails on a scheduler call that is neither driven nor listed here, and on an entry
here the machine does drive)."""
