"""vLLM's own ``BlockPool`` behind the target protocol, with its abstraction function.

``VllmTarget`` drives ``vllm.v1.core.block_pool.BlockPool`` (or a subclass or
fork with the same constructor) through kvpool's lock-step machine. vLLM is
imported when the first target is built, never when this module is imported:
kvpool does not depend on vLLM.

What the adapter translates, and nothing more (docs/vllm-conformance.md
justifies each point):

* **Hashes.** The machine's hashes are short byte strings. The adapter hands
  vLLM ``sha256(b"kvpool:" + h)`` instead, a 32-byte digest like vLLM's own,
  and maps every hash that comes back (block keys, map keys, event hashes) to
  the machine's bytes through a dictionary. vLLM reports event hashes as the
  last 8 bytes of the hash read as a big-endian int; distinct short hashes
  can share those 8 bytes, distinct digests practically cannot.
* **Keys.** vLLM's ``BlockHashWithGroupId`` is the hash followed by the group
  id as 4 big-endian bytes; the model's key is the pair ``(hash, group)``.
* **Events.** vLLM's msgspec events become the model's dataclasses. Fields
  the model does not have (``kv_cache_spec_kind``, ``locality``,
  ``session_id``, ...) must be None at the pool layer; an event where one
  is not comes back as an ``UnmappedEvent`` and so never compares equal.
* **Errors.** ``get_new_blocks`` signals a shortage with ``ValueError``,
  which becomes the model's ``NotEnoughFreeBlocks``. Any other exception
  vLLM raises becomes a ``VllmRejection`` (a ``PoolError`` named after the
  original, e.g. ``VllmAssertionError``) so that the machine reports it as a
  divergence; ``AttributeError`` and ``TypeError`` mean the adapter and the
  release disagree on the API, and become ``TargetError``.
* **Releases.** One small shim per API change, listed in ``VllmApi``.
"""

import functools
import hashlib
import importlib
import logging
import os
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from kvpool import model
from kvpool.model import (
    NULL_BLOCK_ID,
    BlockRemoved,
    BlockState,
    CacheRequest,
    HashKey,
    KVCacheEvent,
    NotEnoughFreeBlocks,
    PoolConfig,
    PoolError,
    PoolState,
)
from kvpool.specs.errors import TargetError
from kvpool.specs.pool.target import OPERATIONS
from kvpool.specs.targets.block_pool_api import BlockPoolApiTarget
from kvpool.specs.targets.importing import import_from_here
from kvpool.specs.targets.vllm import eras
from kvpool.specs.targets.vllm.event_shape import model_event
from kvpool.specs.targets.vllm.findings import KNOWN_FINDINGS

T = TypeVar("T")


# --------------------------------------------------------------------------
# What the loaded vLLM offers
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmApi:
    """The shape of the importable vLLM's block pool API, found by introspection.

    Each flag is one API era; the adapter has one shim per flag.
    """

    version: str
    pool_class: Any
    kv_cache_utils: Any
    hash_block_size_arg: bool
    """0.12.0+: the constructor takes ``hash_block_size``. Before, a request's
    hashes are per block, so the adapter hands the pool the hashes at the
    call's ``block_size``."""
    touch_per_group: bool
    """0.9.1-0.13.x: ``touch`` takes one list of blocks per KV cache group."""
    evict_blocks: bool
    """0.13.0+: ``evict_blocks(ids)``. Before, the adapter calls the pool's own
    ``_maybe_evict_cached_block`` per id, the primitive ``evict_blocks`` wraps."""
    block_mask: bool
    """0.22.0+: ``cache_full_blocks(..., block_mask)``."""
    cache_partial_block: bool
    """0.24.0+: ``cache_partial_block``."""
    hash_num_tokens: bool
    """0.24.0+: blocks record how many tokens their key covers."""
    events_with_group: bool
    """0.20.0+: events carry ``group_idx``, ``lora_name`` and ``extra_keys``."""
    map_is_object: bool
    """0.11.0+: the hash map is a ``BlockHashToBlockMap`` (its ``_cache``
    dict); before, a dict of dicts."""
    unpin_blocks: bool = False
    """0.33.0+: ``unpin_blocks`` with reuse watchers (and ``_reuse_watchers``)."""
    move_block_hashes: bool = False
    """0.33.0+: ``move_block_hashes``."""
    is_block_writable: bool = False
    """0.33.0+: ``is_block_writable``."""
    emit_cached_block_events: bool = False
    """0.33.0+: ``emit_cached_block_events``."""
    replace_existing_hashes: bool = False
    """0.33.0+: ``cache_partial_block(..., replace_existing_hashes)``."""
    medium_arg: bool = False
    """The constructor takes ``medium``."""
    lookahead_arg: bool = False
    """The constructor takes ``num_hash_lookahead_tokens`` and events carry
    ``lookahead_token_ids``."""
    last_hash_names_block: bool = True
    """A block of k hash blocks is keyed by the last of its k hashes (0.24.0+,
    and before 0.12 through the per-block-size shim). 0.12-0.23 key it by the
    concatenation of the k hashes: the adapter maps each concatenation back to
    the last hash, and those releases are checked with one block size per KV
    cache group (as a real group has), so every key of a group is cut alike."""
    hash_tuple: Any = None
    """0.8.0-0.10.1: block hashes are this ``NamedTuple`` (``BlockHashType``,
    then ``BlockHash``): an int ``hash_value``, the block's ``token_ids`` and
    optional ``extra_keys``. None from 0.10.2 on (bytes)."""
    group_tuple: Any = None
    """0.9.1-0.10.1: ``BlockHashWithGroupId(block_hash, group_id)``, a
    ``NamedTuple``; before 0.9.1 (with ``hash_tuple``) there are no groups."""
    hashes_as_argument: bool = False
    """Before 0.10.1: ``cache_full_blocks`` takes the hashes as a list
    (``block_hashes``) and a ``hash_fn``, hashing itself the blocks past the
    list's end; from 0.10.1 the pool reads ``request.block_hashes``."""
    has_events: bool = True
    """0.9.0+: a ``kv_event_queue`` and ``take_events``."""

    @property
    def groups(self) -> bool:
        """Whether keys name a KV cache group (0.9.1+)."""
        return self.hash_tuple is None or self.group_tuple is not None

    def unsupported_operations(self) -> frozenset[str]:
        """Operations and features this release lacks (``kvpool.specs.pool.target``)."""
        missing = set()
        if not self.cache_partial_block:
            missing.add("cache_partial_block")
        if not self.block_mask:
            missing.add("block_mask")
        if not self.events_with_group:
            missing.add("events")
        if not self.last_hash_names_block:
            missing.add("mixed_block_sizes")
        if not self.groups:
            missing.add("groups")
        for operation in ("unpin_blocks", "move_block_hashes", "is_block_writable"):
            if not getattr(self, operation):
                missing.add(operation)
        if not self.unpin_blocks:
            missing.add("take_reuses")
        if not self.emit_cached_block_events:
            missing.add("emit_cached_block_events")
        if not self.replace_existing_hashes:
            missing.add("replace_existing_hashes")
        if not self.medium_arg:
            missing.add("medium")
        if not self.lookahead_arg:
            missing.add("lookahead")
        return frozenset(missing)


class UnsupportedRelease(TargetError):
    """The importable vLLM predates the API eras this adapter supports."""


_none_hash_ready = False


def load_vllm(pool_class: Any = None) -> VllmApi:
    """Import vLLM's block pool and describe its API; ``pool_class`` overrides the class."""
    global _none_hash_ready
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # read when vllm is first imported
    try:
        vllm = importlib.import_module("vllm")
        block_pool = importlib.import_module("vllm.v1.core.block_pool")
        utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    except ImportError as error:
        raise TargetError(f"vLLM cannot be imported: {error}") from error
    version = str(getattr(vllm, "__version__", "unknown"))
    # reset_prefix_cache logs a warning each time it refuses; the machine asks often.
    logging.getLogger("vllm").setLevel(logging.ERROR)
    hash_tuple = None
    if not hasattr(utils, "make_block_hash_with_group_id"):
        # 0.8.0-0.10.1: NamedTuple hashes (kv_cache_utils.BlockHashType, then BlockHash)
        hash_tuple = getattr(utils, "BlockHash", None) or getattr(utils, "BlockHashType", None)
        if "hash_value" not in getattr(hash_tuple, "_fields", ()):
            raise UnsupportedRelease(
                f"vLLM {version} has neither byte-string block hashes (0.10.2+) nor the "
                "NamedTuple hashes of 0.8.0-0.10.1; kvpool's vLLM adapter cannot read it"
            )
    try:
        kv_events: Any = importlib.import_module("vllm.distributed.kv_events")
    except ImportError:  # 0.8.x: no KV events at all
        kv_events = None
    if not _none_hash_ready and hasattr(utils, "init_none_hash"):
        utils.init_none_hash(_vllm_sha256())
        _none_hash_ready = True
    base = block_pool.BlockPool
    cls = pool_class if pool_class is not None else base
    stored = getattr(getattr(kv_events, "BlockStored", None), "__struct_fields__", ())
    removed = getattr(getattr(kv_events, "BlockRemoved", None), "__struct_fields__", ())
    # Read from the class hierarchy (eras.takes): a subclass's or a fork's
    # ``__init__(self, *args, **kwargs)`` says nothing about its parameters.
    touch_annotation = eras.annotation(cls, "touch", "blocks", base)
    return VllmApi(
        version=version,
        pool_class=cls,
        kv_cache_utils=utils,
        hash_block_size_arg=eras.takes(cls, "__init__", "hash_block_size", base),
        touch_per_group=touch_annotation.startswith("tuple"),
        evict_blocks=hasattr(cls, "evict_blocks"),
        block_mask=eras.takes(cls, "cache_full_blocks", "block_mask", base),
        cache_partial_block=hasattr(cls, "cache_partial_block"),
        hash_num_tokens=hasattr(utils.KVCacheBlock, "block_hash_num_tokens"),
        events_with_group="group_idx" in removed,
        map_is_object=hasattr(block_pool, "BlockHashToBlockMap"),
        unpin_blocks=hasattr(cls, "unpin_blocks"),
        move_block_hashes=hasattr(cls, "move_block_hashes"),
        is_block_writable=hasattr(cls, "is_block_writable"),
        emit_cached_block_events=hasattr(cls, "emit_cached_block_events"),
        replace_existing_hashes=eras.takes(
            cls, "cache_partial_block", "replace_existing_hashes", base
        ),
        medium_arg=eras.takes(cls, "__init__", "medium", base),
        lookahead_arg=eras.takes(cls, "__init__", "num_hash_lookahead_tokens", base)
        and "lookahead_token_ids" in stored,
        last_hash_names_block=_names_block_by_last_hash(utils),
        hash_tuple=hash_tuple,
        group_tuple=getattr(utils, "BlockHashWithGroupId", None) if hash_tuple else None,
        hashes_as_argument=eras.takes(cls, "cache_full_blocks", "block_hashes", base),
        has_events=found_take_events(cls),
    )


def found_take_events(cls: type) -> bool:
    """Whether the pool has KV events (``take_events``; 0.9.0+)."""
    return eras.found_in_hierarchy(cls, "take_events") is not None


def _names_block_by_last_hash(utils: Any) -> bool:
    """Whether a block of two hash blocks is keyed by its second hash (see ``VllmApi``)."""
    view = getattr(utils, "BlockHashListWithBlockSize", None)
    if view is None:
        return True
    first, second = b"\x01" * 32, b"\x02" * 32
    return bytes(view([first, second], 1, 2)[0]) == second


def _vllm_sha256() -> Callable[[Any], bytes]:
    for module_name in ("vllm.utils.hashing", "vllm.utils"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        function = getattr(module, "sha256", None)
        if callable(function):
            return function  # type: ignore[no-any-return]
    raise TargetError("vLLM's sha256 hash function was not found")


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


class VllmRejection(PoolError):
    """vLLM raised where the model expects something else; named after vLLM's exception."""

    original: BaseException


@functools.cache
def _rejection_class(name: str) -> type[VllmRejection]:
    return type(f"Vllm{name}", (VllmRejection,), {"__module__": __name__})


def rejection(error: BaseException) -> VllmRejection:
    """``error`` as a ``PoolError`` the machine can report: ``VllmAssertionError`` etc."""
    wrapped = _rejection_class(type(error).__name__)(f"{type(error).__name__}: {error}")
    wrapped.original = error
    return wrapped


# --------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------


class DuckRequest:
    """The attributes of ``vllm.v1.request.Request`` the block pool reads, and no others.

    Reading any other attribute raises ``AttributeError`` naming it, which the
    adapter reports as a ``TargetError``: the release reads something new.
    """

    def __init__(self, block_hashes: list[bytes], token_ids: Sequence[int]) -> None:
        self.block_hashes = block_hashes
        self.all_token_ids = list(token_ids)
        self.num_tokens = len(token_ids)
        self.lora_request = None
        self.mm_features: list[Any] = []
        self.cache_salt = None
        self.session_id = None
        self.prompt_embeds = None

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the duck-typed request has no {name!r}: the release reads it")


class LegacyDuckRequest(DuckRequest):
    """The request for 0.8.0-0.10.0, whose ``cache_full_blocks`` hashes the blocks past
    its hash list itself: it reads ``mm_positions`` and ``mm_hashes`` for the extra keys,
    and ``request_id`` in the assert that the block is full."""

    def __init__(self, block_hashes: list[Any], token_ids: Sequence[int]) -> None:
        super().__init__(block_hashes, token_ids)
        self.mm_positions: list[Any] = []
        self.mm_hashes: list[Any] = []
        self.request_id = "kvpool"


# --------------------------------------------------------------------------
# The target
# --------------------------------------------------------------------------


class VllmTarget(BlockPoolApiTarget):
    """A vLLM ``BlockPool`` built for ``config``, speaking block ids.

    ``pool_class`` replaces ``vllm.v1.core.block_pool.BlockPool`` (a subclass
    or a fork with the same constructor). ``suppress`` names known findings
    (``KNOWN_FINDINGS`` keys, or ``operation:ModelError``) to step over at
    level 2: for an operation the
    model rejects with a suppressed finding's exception, the adapter raises
    that exception itself and does not call vLLM, so a run can go on to find
    the next divergence. ``workarounds`` (``WORKAROUNDS`` keys) do the same
    for known level-1 bugs of old releases, by calling vLLM differently with
    the same meaning; the matrix (bench/vllm_matrix.py) uses them to look
    past a release's first bug.
    """

    def __init__(
        self,
        config: PoolConfig,
        pool_class: Any = None,
        suppress: Collection[str] = (),
        workarounds: Collection[str] = (),
    ) -> None:
        self.api = load_vllm(pool_class)
        unknown = set(workarounds) - WORKAROUNDS.keys()
        if unknown:
            raise TargetError(
                f"unknown workaround(s) {sorted(unknown)}; known: {list(WORKAROUNDS)}"
            )
        self.workarounds = frozenset(workarounds)
        self.config = config
        if config.enable_events and not self.api.events_with_group:
            raise TargetError(
                f"vLLM {self.api.version}'s events carry no KV cache group; "
                "check it with events off (kvpool check --target vllm==X does)"
            )
        self._suppressed = {_suppression(item) for item in suppress}
        self._to_model: dict[bytes, bytes] = {}
        self._token_counts: dict[Any, dict[int, int]] = {}
        self._int_to_model: dict[int, bytes] = {}
        self._concatenated: dict[tuple[bytes, int], bytes] = {}
        """0.12-0.23: (the machine's hash, k) -> the key vLLM gives a block of k hash blocks."""
        self._group_block_size: dict[int, int] = {}
        """0.12-0.23: the block size each group's blocks were cached at (one per group)."""
        cls = self.api.pool_class
        kwargs: dict[str, Any] = {}
        if self.api.has_events:  # 0.8.x takes no enable_kv_cache_events
            kwargs["enable_kv_cache_events"] = config.enable_events
        for name, value, default, supported in (
            ("medium", config.medium, model.MEDIUM_GPU, self.api.medium_arg),
            (
                "num_hash_lookahead_tokens",
                config.num_hash_lookahead_tokens,
                0,
                self.api.lookahead_arg,
            ),
        ):
            if value != default:
                if not supported:
                    raise TargetError(f"vLLM {self.api.version}'s BlockPool takes no {name}")
                kwargs[name] = value
        try:
            if self.api.hash_block_size_arg:
                pool = cls(
                    config.num_blocks, config.enable_caching, config.hash_block_size, **kwargs
                )
            else:
                pool = cls(config.num_blocks, config.enable_caching, **kwargs)
        except Exception as error:
            raise TargetError(f"{cls.__name__}({config}) failed: {error!r}") from error
        super().__init__(pool)

    # Hashes -------------------------------------------------------------------

    def vllm_hash(self, block_hash: bytes) -> bytes:
        """The 32-byte hash vLLM is given for the machine's ``block_hash``."""
        digest = hashlib.sha256(b"kvpool:" + block_hash).digest()
        if digest not in self._to_model:
            self._to_model[digest] = block_hash
            self._int_to_model[int.from_bytes(digest[-8:], "big")] = block_hash
        return digest

    def vllm_block_hash(self, block_hash: bytes) -> Any:
        """What vLLM's pool is given as a block's hash for the machine's ``block_hash``.

        The 32-byte digest (``vllm_hash``); for 0.8.0-0.10.1 the era's
        ``NamedTuple`` with the digest as its int ``hash_value``, no token ids and
        no extra keys. The pool compares those tuples for equality and reads only
        ``hash_value`` (a chain's parent, events), never ``token_ids``
        (vllm/v1/core/block_pool.py of 0.8.5-0.10.1), so this is an injective
        encoding like the digest itself.
        """
        digest = self.vllm_hash(block_hash)
        if self.api.hash_tuple is None:
            return digest
        return self.api.hash_tuple(int.from_bytes(digest, "big"), (), None)

    def model_hash(self, value: Any) -> bytes:
        """The machine's hash for a hash vLLM reports (bytes, or the int events carry)."""
        if self.api.hash_tuple is not None and isinstance(value, self.api.hash_tuple):
            digest = value.hash_value.to_bytes(32, "big") if 0 <= value.hash_value < 2**256 else b""
            if value.token_ids == () and value.extra_keys is None and digest in self._to_model:
                return self._to_model[digest]
            return f"<unknown hash {value!r}>".encode()
        if isinstance(value, int):
            found = self._int_to_model.get(value)
            return found if found is not None else f"<unknown int hash {value}>".encode()
        raw = bytes(value)
        found = self._to_model.get(raw)
        return found if found is not None else b"<unknown hash " + raw.hex().encode() + b">"

    def hash_key(self, key: Any) -> HashKey | None:
        """``BlockHashWithGroupId`` (hash + 4 big-endian group bytes) as ``(hash, group)``."""
        if key is None:
            return None
        if self.api.hash_tuple is not None:
            # 0.9.1-0.10.1: BlockHashWithGroupId(block_hash, group_id); before, no groups
            if self.api.group_tuple is not None:
                return self.model_hash(key.block_hash), int(key.group_id)
            return self.model_hash(key), 0
        raw = bytes(key)
        return self.model_hash(raw[:-4]), int.from_bytes(raw[-4:], "big")

    def vllm_request(self, request: CacheRequest, block_size: int | None = None) -> DuckRequest:
        """The request vLLM sees; before 0.12 its hashes are per ``block_size`` tokens."""
        hashes: Sequence[bytes] = request.block_hashes
        hbs = self.config.hash_block_size
        size = block_size or 0
        if not self.api.hash_block_size_arg and size >= hbs and size % hbs == 0:
            hashes = model.hashes_at_block_size(hashes, hbs, size)
        kind = LegacyDuckRequest if self.api.hashes_as_argument else DuckRequest
        return kind([self.vllm_block_hash(h) for h in hashes], request.all_token_ids)

    def _register_concatenations(self, request: CacheRequest, block_size: int) -> None:
        """0.12-0.23: map the key vLLM makes for each block of ``block_size`` back to its hash.

        Those releases key a block of k hash blocks by its k hashes concatenated
        (``BlockHashListWithBlockSize`` in vllm/v1/core/kv_cache_utils.py of
        0.12.0-0.23.x); the model names it by the last of them, which in a
        chained hash covers the whole prefix.
        """
        hbs = self.config.hash_block_size
        if self.api.last_hash_names_block or block_size <= hbs or block_size % hbs:
            return
        k = block_size // hbs
        hashes = request.block_hashes
        for end in range(k, len(hashes) + 1, k):
            joined = b"".join(self.vllm_hash(h) for h in hashes[end - k : end])
            self._to_model.setdefault(joined, hashes[end - 1])
            self._int_to_model.setdefault(int.from_bytes(joined[-8:], "big"), hashes[end - 1])
            self._concatenated.setdefault((hashes[end - 1], k), joined)

    # Events -------------------------------------------------------------------

    def event(self, event: Any) -> KVCacheEvent:
        """One of vLLM's msgspec events as the model's event."""
        return model_event(event, self.model_hash)

    # Calling vLLM -------------------------------------------------------------

    def _vllm(self, call: Callable[[], T]) -> T:
        """Run one call into vLLM, translating its exceptions (see the module docstring)."""
        try:
            return call()
        except (PoolError, TargetError):
            raise
        except (AttributeError, TypeError) as error:
            raise TargetError(
                f"the adapter and vLLM {self.api.version} disagree: {error!r}"
            ) from error
        except Exception as error:
            raise rejection(error) from error

    def _guard(self, operation: str, on_model: Callable[[PoolState], object]) -> None:
        """Raise the model's exception for a suppressed known finding instead of calling vLLM."""
        if not any(op == operation for op, _ in self._suppressed):
            return
        try:
            on_model(self.snapshot())
        except PoolError as error:
            if (operation, type(error).__name__) in self._suppressed:
                raise type(error)(f"known vLLM finding, not sent to vLLM: {error}") from error

    # The target protocol ------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> Sequence[int]:
        self._guard("get_new_blocks", lambda s: model.get_new_blocks(s, num_blocks))
        try:
            blocks = self._vllm(lambda: self.pool.get_new_blocks(num_blocks))
        except VllmRejection as error:
            if isinstance(error.original, ValueError):
                raise NotEnoughFreeBlocks(str(error.original)) from error
            raise
        return [b.block_id for b in blocks]

    def touch(self, block_ids: Sequence[int]) -> None:
        self._guard("touch", lambda s: model.touch(s, block_ids))
        blocks = self._blocks(block_ids)
        argument = (blocks,) if self.api.touch_per_group else blocks
        self._vllm(lambda: self.pool.touch(argument))

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        self._guard("free_blocks", lambda s: model.free_blocks(s, block_ids))
        if "free-listed-twice" in self.workarounds:
            for batch in _batches_of_distinct(block_ids):
                self._vllm(lambda b=batch: super(VllmTarget, self).free_blocks(b))  # type: ignore[misc]
            return
        self._vllm(lambda: super(VllmTarget, self).free_blocks(block_ids))

    def cache_full_blocks(
        self,
        request: CacheRequest,
        block_ids: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        self._guard(
            "cache_full_blocks",
            lambda s: model.cache_full_blocks(
                s,
                request,
                block_ids,
                num_cached_blocks,
                num_full_blocks,
                block_size,
                kv_cache_group_id,
                block_mask,
            ),
        )
        blocks = self._blocks(block_ids)
        vllm_request = self.vllm_request(request, block_size)
        hbs = self.config.hash_block_size
        if block_size > hbs and block_size % hbs == 0 and not self.api.last_hash_names_block:
            known = self._group_block_size.setdefault(kv_cache_group_id, block_size)
            if known != block_size:
                raise TargetError(
                    f"vLLM {self.api.version} keys a block of several hash blocks by their "
                    f"concatenation, so one KV cache group has one block size; group "
                    f"{kv_cache_group_id} was cached at {known}, now at {block_size} "
                    "(`kvpool check --target vllm==X` keeps one size per group)"
                )
            self._register_concatenations(request, block_size)
        elif not self.api.last_hash_names_block and block_size == hbs:
            self._group_block_size.setdefault(kv_cache_group_id, block_size)
        if block_mask is not None and not self.api.block_mask:
            raise TargetError(f"vLLM {self.api.version} has no block_mask (0.22.0+)")
        if not self.api.groups and kv_cache_group_id != 0:
            raise TargetError(f"vLLM {self.api.version} has no KV cache groups (0.9.1+)")
        # Before 0.10.1 the hashes are an argument, a list the pool appends to.
        hash_list = list(vllm_request.block_hashes)

        def call(num_cached: int, num_full: int) -> None:
            # Before 0.10.1 the pool asserts that the block before the range has a
            # key (it chains the hashes it computes itself from it). The workarounds
            # hand it the blocks and hashes from the range on instead: the same
            # positions and keys, with no block before them.
            offset = 0
            if self.api.hashes_as_argument and num_cached > 0:
                parent: Any = blocks[num_cached - 1] if num_cached <= len(blocks) else None
                null_parent = "null-in-cache" in self.workarounds and self._is_null(parent)
                uncached = "uncached-parent" in self.workarounds and parent is not None
                if null_parent or (uncached and parent.block_hash is None):
                    offset = num_cached
            args: list[Any] = [vllm_request, blocks[offset:]]
            if self.api.hashes_as_argument:
                args.append(hash_list[offset:])
            args += [num_cached - offset, num_full - offset, block_size]
            if self.api.groups:
                args.append(kv_cache_group_id)
            if self.api.hashes_as_argument:
                args.append(_vllm_sha256())
            if block_mask is not None:
                args.append(list(block_mask))
            self._vllm(lambda: self.pool.cache_full_blocks(*args))

        if "empty-range" in self.workarounds and num_cached_blocks >= num_full_blocks:
            return  # nothing to cache: 0.10.1+ (and the model) read nothing either
        if "promotion" in self.workarounds:
            self._evict_before_promotion(
                blocks, num_cached_blocks, num_full_blocks, block_size, block_mask
            )
        unhashed = {b.block_id for b in blocks if b.block_hash is None}
        # With events on, split calls would emit other events than one call; the
        # releases with this bug (0.13 and earlier) have no events the machine reads.
        if (
            "null-in-cache" in self.workarounds
            and not self.config.enable_events
            and any(self._is_null(b) for b in blocks)
        ):
            self._cache_around_null_blocks(call, blocks, num_cached_blocks, num_full_blocks)
        else:
            call(num_cached_blocks, num_full_blocks)
        if not self.api.hash_num_tokens:
            self._record_token_counts(
                blocks, unhashed, num_cached_blocks, num_full_blocks, block_size
            )

    def _is_null(self, block: Any) -> bool:
        """Whether ``block`` is the null block (0.8.x-0.9.0 blocks have no ``is_null``)."""
        return block is self.pool.null_block

    def _cache_around_null_blocks(
        self,
        call: Callable[[int, int], None],
        blocks: Sequence[Any],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """The ``null-in-cache`` workaround: one call per run of positions without a null block.

        With events off (the only way those releases are checked) the runs
        together cache exactly what one call that skips null blocks caches.
        """
        start = max(0, num_cached_blocks)
        end = min(num_full_blocks, len(blocks))
        run_start = start
        for i in range(start, end + 1):
            if i == end or self._is_null(blocks[i]):
                if run_start < i:
                    call(run_start, i)
                run_start = i + 1

    def _evict_before_promotion(
        self,
        blocks: Sequence[Any],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        block_mask: Sequence[bool] | None,
    ) -> None:
        """The ``promotion`` workaround: drop the keys of blocks about to be cached again.

        Only a block whose key covers fewer tokens than its new position: the
        pool's own ``_maybe_evict_cached_block`` drops it, which is what 0.24
        and later do inside ``cache_full_blocks``.
        """
        state = self.snapshot()
        for i in range(max(0, num_cached_blocks), min(num_full_blocks, len(blocks))):
            masked = block_mask is not None and not block_mask[i - num_cached_blocks]
            covered = state.blocks[blocks[i].block_id].hash_num_tokens
            longer = covered is not None and covered < (i + 1) * block_size
            if longer and not self._is_null(blocks[i]) and not masked:
                self._vllm(lambda b=blocks[i]: self.pool._maybe_evict_cached_block(b))  # type: ignore[misc]

    def _record_token_counts(
        self,
        blocks: Sequence[Any],
        unhashed: set[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
    ) -> None:
        """Before 0.24 vLLM does not keep how many tokens a block's key covers: note it here.

        Position i of the call caches ``(i + 1) * block_size`` tokens. A block
        of the range that had no key before the call (``unhashed``) and has
        one after it got it from this call (skipped and masked blocks keep
        theirs). The note is read only while the block still has that key.
        """
        for i in range(max(0, num_cached_blocks), min(num_full_blocks, len(blocks))):
            key = blocks[i].block_hash
            if key is not None and blocks[i].block_id in unhashed:
                self._token_counts.setdefault(key, {})[blocks[i].block_id] = (i + 1) * block_size

    def cache_partial_block(
        self,
        request: CacheRequest,
        block_id: int,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> HashKey | None:
        if replace_existing_hashes and not self.api.replace_existing_hashes:
            raise TargetError(f"vLLM {self.api.version} has no replace_existing_hashes (0.33.0+)")
        if not self.api.cache_partial_block:
            raise TargetError(
                f"vLLM {self.api.version} has no cache_partial_block (0.24.0+); "
                f"`kvpool check --target vllm=={self.api.version}` leaves it out"
            )
        self._guard(
            "cache_partial_block",
            lambda s: model.cache_partial_block(
                s,
                request,
                block_id,
                num_tokens,
                kv_cache_group_id,
                block_size,
                replace_existing_hashes,
            ),
        )
        (block,) = self._blocks([block_id])
        flag = (True,) if replace_existing_hashes else ()
        key = self._vllm(
            lambda: self.pool.cache_partial_block(
                self.vllm_request(request), block, num_tokens, kv_cache_group_id, block_size, *flag
            )
        )
        return self.hash_key(key)

    def unpin_blocks(self, block_ids: Sequence[int], watcher: int) -> None:
        self._guard("unpin_blocks", lambda s: model.unpin_blocks(s, block_ids, watcher))
        self._vllm(lambda: super(VllmTarget, self).unpin_blocks(block_ids, watcher))

    def move_block_hashes(self, src: int, dst: int) -> None:
        self._guard("move_block_hashes", lambda s: model.move_block_hashes(s, src, dst))
        self._vllm(lambda: super(VllmTarget, self).move_block_hashes(src, dst))

    def is_block_writable(self, block_id: int) -> bool:
        self._guard("is_block_writable", lambda s: model.is_block_writable(s, block_id))
        return self._vllm(lambda: super(VllmTarget, self).is_block_writable(block_id))

    def emit_cached_block_events(
        self,
        request: CacheRequest,
        num_cached_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        self._guard(
            "emit_cached_block_events",
            lambda s: model.emit_cached_block_events(
                s, request, num_cached_blocks, block_size, kv_cache_group_id
            ),
        )
        self._vllm(
            lambda: self.pool.emit_cached_block_events(
                self.vllm_request(request), num_cached_blocks, block_size, kv_cache_group_id
            )
        )

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> Sequence[int] | None:
        self._guard(
            "get_cached_block", lambda s: model.get_cached_block(s, block_hash, kv_cache_group_ids)
        )
        group_ids = list(kv_cache_group_ids)
        if not self.api.groups:
            # 0.8.x-0.9.0: one group, and get_cached_block(hash) returns one block or None
            if any(g != 0 for g in group_ids):
                raise TargetError(f"vLLM {self.api.version} has no KV cache groups (0.9.1+)")
            key = self.vllm_block_hash(block_hash)
            found = [self._vllm(lambda: self.pool.get_cached_block(key)) for _ in group_ids]
            return None if any(b is None for b in found) else [b.block_id for b in found]
        if self.api.last_hash_names_block:
            key = self.vllm_block_hash(block_hash)
            blocks = self._vllm(lambda: self.pool.get_cached_block(key, group_ids))
            return None if blocks is None else [b.block_id for b in blocks]
        return self._get_cached_block_per_block_size(block_hash, group_ids)

    def _get_cached_block_per_block_size(
        self, block_hash: bytes, group_ids: list[int]
    ) -> Sequence[int] | None:
        """0.12-0.23: one lookup per group block size, as those releases' managers make it.

        A group's key for ``block_hash`` depends on the group's block size (the
        concatenation ``_register_concatenations`` recorded); vLLM's coordinator
        looks up each manager's groups, which share a block size, with that
        manager's key. A hash no block of that size was cached under is looked
        up as a key no block can have. The answers are put back in
        ``group_ids``' order; one miss is a miss, as in one call.
        """
        hbs = self.config.hash_block_size
        by_key: dict[bytes, list[int]] = {}
        for group in group_ids:
            k = self._group_block_size.get(group, hbs) // hbs
            key = self.vllm_hash(block_hash) if k == 1 else self._concatenated.get((block_hash, k))
            if key is None:
                key = hashlib.sha256(b"kvpool:never cached:" + block_hash).digest() * k
            by_key.setdefault(key, []).append(group)
        found: dict[int, int] = {}
        for key, groups in by_key.items():
            blocks = self._vllm(lambda k=key, g=groups: self.pool.get_cached_block(k, g))  # type: ignore[misc]
            if blocks is None:
                return None
            found.update(zip(groups, (b.block_id for b in blocks), strict=True))
        return [found[g] for g in group_ids]

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        ids = sorted(set(block_ids))
        self._guard("evict_blocks", lambda s: model.evict_blocks(s, ids))

        def evict_each() -> None:
            # One id at a time, ascending: vLLM iterates its set in hash-table
            # order, which docs/semantics.md leaves out of the contract.
            for block_id in ids:
                if self.api.evict_blocks:
                    self.pool.evict_blocks({block_id})
                else:
                    self.pool._maybe_evict_cached_block(self.pool.blocks[block_id])

        self._vllm(evict_each)

    def reset_prefix_cache(self) -> bool:
        return self._vllm(lambda: super(VllmTarget, self).reset_prefix_cache())

    def get_usage(self) -> float:
        if "usage-counts-null" in self.workarounds:
            # The null block is never free: leave it out of the total, as 0.10.2+ do.
            total = self.pool.num_gpu_blocks - 1
            free = self._vllm(lambda: self.pool.get_num_free_blocks())
            return 0.0 if not total else 1.0 - free / total
        return self._vllm(lambda: super(VllmTarget, self).get_usage())

    def take_events(self) -> Sequence[KVCacheEvent]:
        if not self.api.has_events:
            return []  # 0.8.x: no events (and the pool is checked with events off)
        return self._vllm(lambda: super(VllmTarget, self).take_events())

    # The abstraction function -------------------------------------------------

    def snapshot(self) -> PoolState:
        """vLLM's pool as the model's ``PoolState``.

        The free queue is the linked list front to back; the null block's
        ref count is not maintained by vLLM and reads as 0; partial keys come
        from ``cached_block_hashes_by_block`` (a set: in sorted order); the
        map lists a key's blocks in insertion order. Releases before 0.24 do
        not record how many tokens a key covers: the snapshot takes it from
        the adapter's note of the ``cache_full_blocks`` call that set the key.
        """
        pool = self.pool
        partial_keys: dict[int, Any] = getattr(pool, "cached_block_hashes_by_block", {})
        blocks = []
        for block in pool.blocks:
            key = self.hash_key(block.block_hash)
            if key is None:
                num_tokens = None
            elif self.api.hash_num_tokens:
                num_tokens = block.block_hash_num_tokens
            else:
                num_tokens = self._token_counts.get(block.block_hash, {}).get(block.block_id, 0)
            partial = sorted(
                k for k in (self.hash_key(p) for p in partial_keys.get(block.block_id, ())) if k
            )
            blocks.append(
                BlockState(
                    ref_cnt=0 if block.block_id == NULL_BLOCK_ID else block.ref_cnt,
                    block_hash=key,
                    hash_num_tokens=num_tokens,
                    partial_keys=tuple(partial),
                )
            )
        free = tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks())
        state = PoolState(
            config=self.config,
            blocks=tuple(blocks),
            free_queue=free,
            cached=self._hash_map(),
            pending_events=tuple(self.event(e) for e in getattr(pool, "kv_event_queue", ())),
        )
        return self.with_watchers(state, getattr(pool, "_reuse_watchers", {}))

    def _hash_map(self) -> dict[HashKey, tuple[int, ...]]:
        table = self.pool.cached_block_hash_to_block
        entries = table._cache if self.api.map_is_object else table
        cached: dict[HashKey, tuple[int, ...]] = {}
        for raw_key, entry in entries.items():
            key = self.hash_key(raw_key)
            assert key is not None
            if isinstance(entry, dict):
                cached[key] = tuple(block.block_id for block in entry.values())
            else:
                cached[key] = (entry.block_id,)
        return cached

    # Normalization (docs/vllm-conformance.md) ---------------------------------

    def normalize_state(self, state: PoolState) -> PoolState:
        """Each block's partial keys in sorted order, and the events normalized."""
        blocks = tuple(replace(b, partial_keys=tuple(sorted(b.partial_keys))) for b in state.blocks)
        return replace(
            state, blocks=blocks, pending_events=tuple(self.normalize_events(state.pending_events))
        )

    def normalize_events(self, events: Sequence[KVCacheEvent]) -> Sequence[KVCacheEvent]:
        """Each run of consecutive ``BlockRemoved`` events in sorted order.

        vLLM removes a block's keys primary first, then its partial keys in
        the iteration order of a set of bytes, which depends on
        ``PYTHONHASHSEED``. Order inside a run of removals is therefore not
        compared; which keys are removed, and everything else, still is.
        """
        result: list[KVCacheEvent] = []
        run: list[BlockRemoved] = []
        for event in [*events, None]:
            if isinstance(event, BlockRemoved):
                run.append(event)
                continue
            run.sort(key=_removed_order)
            result.extend(run)
            run = []
            if event is not None:
                result.append(event)
        return result


def _batches_of_distinct(block_ids: Sequence[int]) -> list[list[int]]:
    """``block_ids`` cut, in order, into runs in which no id repeats."""
    batches: list[list[int]] = [[]]
    for block_id in block_ids:
        if block_id in batches[-1]:
            batches.append([])
        batches[-1].append(block_id)
    return [b for b in batches if b]


WORKAROUNDS: dict[str, str] = {
    "promotion": (
        "vLLM 0.23 and earlier assert that a block they cache has no key yet; 0.24 "
        "and later (and the model) let a key covering more tokens replace the old "
        "one. The workaround evicts the old key first with the pool's own "
        "_maybe_evict_cached_block, as 0.24 does inside cache_full_blocks"
    ),
    "null-in-cache": (
        "vLLM 0.13 and earlier hash the null block when cache_full_blocks is given "
        "it; the workaround caches the runs of positions between null blocks in "
        "separate calls, which with events off (as those releases are checked) "
        "caches exactly what skipping the null block does"
    ),
    "usage-counts-null": (
        "vLLM 0.10.1 and earlier count the null block as used in get_usage (one block "
        "of num_gpu_blocks is never free, so usage never reaches 0); 0.10.2 and the "
        "model leave it out. The workaround computes the usage from vLLM's free count "
        "over the blocks other than the null block"
    ),
    "uncached-parent": (
        "vLLM 0.10.0 and earlier assert that the block before a cache_full_blocks "
        "range has a key (they chain the hashes they compute themselves from it); "
        "the model and 0.10.1+ do not need one. The workaround hands the pool the "
        "blocks and hashes from the range on, so there is no block before it"
    ),
    "empty-range": (
        "vLLM 0.10.0 and earlier assert that the hash list covers num_cached_blocks "
        "before looking at the range, so a call with num_cached_blocks beyond "
        "num_full_blocks (nothing to cache, which the model accepts) fails when the "
        "request has fewer hashes. Level 2 only: the workaround does not send a call "
        "whose range is empty"
    ),
    "free-listed-twice": (
        "vLLM 0.23 and earlier queue a block once per time it is listed in one "
        "free_blocks call once its count reaches 0 (vllm-project/vllm#42571); the "
        "workaround frees in consecutive calls without repeats, which under the "
        "append free order of those releases has exactly the meaning of one call"
    ),
}
"""Known level-1 bugs the adapter can step around without changing what is checked."""


def _removed_order(event: BlockRemoved) -> tuple[int, tuple[bytes, ...], str]:
    return (event.group_idx, event.block_hashes, event.medium or "")


def _suppression(item: str) -> tuple[str, str]:
    """A finding key, or ``operation:ModelError``, as the pair the guard matches."""
    if item in KNOWN_FINDINGS:
        return KNOWN_FINDINGS[item].operation, KNOWN_FINDINGS[item].model_error
    operation, _, error = item.partition(":")
    if operation not in OPERATIONS or not error:
        raise ValueError(f"not a known finding or operation:ModelError: {item!r}")
    return operation, error


# --------------------------------------------------------------------------
# Target factories and strings
# --------------------------------------------------------------------------


class VllmTargetFactory:
    """Builds ``VllmTarget``s; ``pool_class`` is a class or a ``module:Class`` string."""

    def __init__(
        self,
        pool_class: Any = None,
        suppress: Collection[str] = (),
        workarounds: Collection[str] = (),
    ) -> None:
        self._pool_class = pool_class
        self.suppress = tuple(suppress)
        self.workarounds = tuple(workarounds)

    def pool_class(self) -> Any:
        """The class to instantiate (None: vLLM's own ``BlockPool``), imported on first use."""
        if isinstance(self._pool_class, str):
            module_name, _, attribute = self._pool_class.partition(":")
            try:
                module = import_from_here(module_name)
            except ImportError as error:
                raise TargetError(f"cannot import {module_name!r}: {error}") from error
            found = getattr(module, attribute, None)
            if not isinstance(found, type):
                raise TargetError(f"{module_name!r} has no class {attribute!r}")
            self._pool_class = found
        return self._pool_class

    def __call__(self, config: PoolConfig) -> VllmTarget:
        return VllmTarget(
            config,
            pool_class=self.pool_class(),
            suppress=self.suppress,
            workarounds=self.workarounds,
        )

    def preflight(self, level: int, profiles: Sequence[str]) -> None:
        """Fail fast, before any program runs, if this vLLM cannot be checked here."""
        load_vllm(self.pool_class())

    def unsupported_operations(self) -> frozenset[str]:
        """What programs must leave out for this vLLM (empty if it cannot be imported).

        ``run_conformance`` asks every factory that has this method.
        """
        try:
            return load_vllm(self.pool_class()).unsupported_operations()
        except TargetError:
            return frozenset()


def vllm_factory(spec: str, suppress: Collection[str] = ()) -> VllmTargetFactory:
    """The factory for ``vllm`` or ``vllm:package.module:Class``."""
    if spec == "vllm":
        return VllmTargetFactory(None, suppress)
    if spec.startswith("vllm:") and spec.count(":") == 2:
        return VllmTargetFactory(spec[len("vllm:") :], suppress)
    raise ValueError(f"not a vLLM target string: {spec!r}")
