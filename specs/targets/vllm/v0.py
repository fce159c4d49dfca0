"""vLLM's own v0 ``PrefixCachingBlockAllocator`` behind the v0 target protocol.

vLLM removed the v0 engine in 0.11.0; the last release with the allocator is
0.10.2 (``V0_RELEASE``). This module finds that release's code in one of two
ways, and never when it is imported:

* **installed**: a ``vllm`` older than 0.11 whose
  ``vllm.core.block.prefix_caching_block`` imports in this interpreter;
* **from the release's sources**: the directory named by
  ``$KVPOOL_VLLM_V0_SRC``, or else kvpool's release cache
  (``kvpool.specs.vllm_releases.release_dir("0.10.2")``, filled by
  ``ensure_release`` or ``python bench/v0_vllm_check.py --fetch``). Only five
  files are loaded, unchanged: ``vllm/core/evictor.py`` and
  ``vllm/core/block/{interfaces,common,naive_block,prefix_caching_block}.py``.
  They are executed as the modules of a private package
  (``_kvpool_vllm_v0``), with their ``vllm.`` imports pointed at it. Besides
  each other they import three names, which the package provides as
  stand-ins: the ``Device`` enum (two members, compared by identity),
  ``init_logger`` (the standard library's ``logging.getLogger``) and the
  ``Sequence`` class (used only in annotations). No torch, no GPU, no other
  vLLM code, so this runs in kvpool's own test environment in milliseconds.

What the adapter translates:

* **Block objects.** vLLM's ``Block`` objects become handles numbered in
  creation order, as the model numbers them; the adapter remembers each
  handle's previous handle (vLLM recycles the objects of freed blocks).
* **Hashes.** vLLM hashes a block with Python's ``hash()`` over the previous
  block's hash and the block's tokens. The model's content hash is the token
  prefix itself; the adapter computes vLLM's number for a prefix with vLLM's
  own ``PrefixCachingBlock.hash_block_tokens`` and maps numbers back. A number
  it never computed comes back as ``(-1, number)``, which never equals a
  model hash (the machine's tokens are positive).
* **Block ids.** vLLM's ``cow_block_if_not_appendable`` and
  ``promote_to_immutable_block`` return the new block id and leave storing
  it to the caller (``Block.append_token_ids`` does); the adapter stores it.
* **Errors.** ``NoFreeBlocksError`` becomes the model's ``NoFreeBlocks``;
  every other exception (vLLM's ``assert`` s above all) propagates, and the
  machine reports it as a divergence.
* **Trackers.** vLLM keeps a tracker for every block and resets it when the
  block is taken; the snapshot reads a tracker only while its block is held
  (the model's free blocks carry the defaults) and fails if vLLM's notion of
  "held" (an active tracker) disagrees with its ref count.

The evictor's priority heap is not part of the snapshot: only what it
decides (which block is evicted) is compared, operation by operation.
"""

import enum
import importlib
import logging
import os
import re
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.model.v0 import (
    NEVER_ACCESSED,
    BlockHandle,
    ContentHash,
    EvictorEntry,
    PhysicalBlock,
    V0Config,
    V0State,
)
from kvpool.model.v0_errors import NoFreeBlocks
from kvpool.specs.errors import TargetError

V0_RELEASE = "0.10.2"
"""The last vLLM release with the v0 block allocator."""

SOURCE_ENV = "KVPOOL_VLLM_V0_SRC"
PACKAGE = "_kvpool_vllm_v0"
MODULES = (
    "core/evictor.py",
    "core/block/interfaces.py",
    "core/block/common.py",
    "core/block/naive_block.py",
    "core/block/prefix_caching_block.py",
)
"""The release's files the allocator needs, in import order, relative to ``vllm/``."""


@dataclass(frozen=True)
class V0Modules:
    """The parts of vLLM's v0 block code the adapter uses, and where they came from."""

    allocator_class: type[Any]
    block_class: type[Any]
    evictor_module: types.ModuleType
    no_free_blocks: type[BaseException]
    origin: str


# --------------------------------------------------------------------------
# Finding and loading the release
# --------------------------------------------------------------------------


def source_dir() -> Path | None:
    """The directory holding ``vllm/core/block/prefix_caching_block.py``, if there is one."""
    candidates: list[Path] = []
    if os.environ.get(SOURCE_ENV):
        candidates.append(Path(os.environ[SOURCE_ENV]))
    from kvpool.specs.targets.vllm.releases import release_dir

    candidates.append(release_dir(V0_RELEASE))
    for candidate in candidates:
        if all((candidate / "vllm" / m).is_file() for m in MODULES):
            return candidate
    return None


def unavailable_reason() -> str | None:
    """Why vLLM's v0 allocator cannot be loaded here, or None if it can."""
    try:
        load_v0()
    except TargetError as error:
        return str(error)
    return None


_LOADED: V0Modules | None = None


def load_v0() -> V0Modules:
    """vLLM's v0 allocator: the installed one if it has it, else the cached release's sources."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    from kvpool.specs.targets.vllm.releases import installed_version, version_tuple

    installed = installed_version()  # read without importing vllm (and torch)
    try:
        if installed is None or version_tuple(installed) >= (0, 11, 0):
            raise ImportError(f"the installed vllm ({installed}) has no v0 engine")
        pcb = importlib.import_module("vllm.core.block.prefix_caching_block")
        evictor = importlib.import_module("vllm.core.evictor")
        origin = f"the installed vllm {installed}"
    except Exception:  # not installed, or a release without the v0 engine
        source = source_dir()
        if source is None:
            raise TargetError(
                f"vLLM's v0 allocator is not available: no vllm<0.11 is installed and the "
                f"vLLM {V0_RELEASE} sources are not cached (set ${SOURCE_ENV}, or run "
                f"`python bench/v0_vllm_check.py --fetch`)"
            ) from None
        pcb, evictor = _load_from_sources(source)
        origin = f"vLLM {V0_RELEASE} sources in {source}"
    interfaces = sys.modules[pcb.__name__.rsplit(".", 1)[0] + ".interfaces"]
    _LOADED = V0Modules(
        allocator_class=pcb.PrefixCachingBlockAllocator,
        block_class=pcb.PrefixCachingBlock,
        evictor_module=evictor,
        no_free_blocks=interfaces.BlockAllocator.NoFreeBlocksError,
        origin=origin,
    )
    return _LOADED


def _load_from_sources(source: Path) -> tuple[types.ModuleType, types.ModuleType]:
    def module(name: str, package: bool = False) -> types.ModuleType:
        created = types.ModuleType(name)
        if package:
            created.__path__ = []
        sys.modules[name] = created
        return created

    for name in (PACKAGE, f"{PACKAGE}.core", f"{PACKAGE}.core.block"):
        module(name, package=True)

    class Device(enum.Enum):
        GPU = enum.auto()
        CPU = enum.auto()

    setattr(module(f"{PACKAGE}.utils"), "Device", Device)  # noqa: B010
    setattr(module(f"{PACKAGE}.logger"), "init_logger", _quiet_logger)  # noqa: B010
    setattr(module(f"{PACKAGE}.sequence"), "Sequence", type("Sequence", (), {}))  # noqa: B010

    for relative in MODULES:
        path = source / "vllm" / relative
        text = re.sub(r"^(\s*)from vllm\.", rf"\1from {PACKAGE}.", path.read_text(), flags=re.M)
        loaded = module(f"{PACKAGE}." + relative.removesuffix(".py").replace("/", "."))
        loaded.__file__ = str(path)
        exec(compile(text, str(path), "exec"), loaded.__dict__)
    return (
        sys.modules[f"{PACKAGE}.core.block.prefix_caching_block"],
        sys.modules[f"{PACKAGE}.core.evictor"],
    )


def _quiet_logger(name: str) -> logging.Logger:
    """vLLM logs a warning whenever reset_prefix_cache refuses; the machine does it often."""
    logger = logging.getLogger(name)
    logger.setLevel(logging.ERROR)
    return logger


# --------------------------------------------------------------------------
# The target
# --------------------------------------------------------------------------


class V0SnapshotError(TargetError):
    """vLLM's allocator is in a state the model cannot describe (its trackers disagree)."""


class VllmV0Target:
    """vLLM's ``PrefixCachingBlockAllocator`` (or a subclass), speaking handles and block ids."""

    def __init__(
        self,
        config: V0Config,
        allocator_class: type[Any] | None = None,
        customize: Callable[[Any], None] | None = None,
    ) -> None:
        self.v0 = load_v0()
        cls = allocator_class or self.v0.allocator_class
        self.allocator = cls(num_blocks=config.num_blocks, block_size=config.block_size)
        if customize is not None:
            customize(self.allocator)
        self.config = config
        self.objects: dict[int, Any] = {}
        self.prev: dict[int, int | None] = {}
        self.content: dict[int, ContentHash] = {}
        self.names: dict[int, ContentHash] = {}
        self.next_handle = 0

    # -- handles and hashes -----------------------------------------------

    def _new(self, obj: Any, prev: int | None) -> int:
        handle = self.next_handle
        self.next_handle += 1
        self.objects[handle] = obj
        self.prev[handle] = prev
        self._learn(handle)
        return handle

    def _learn(self, handle: int) -> None:
        """Name the content of a block object that has just become full."""
        obj = self.objects[handle]
        if handle in self.content or len(obj.token_ids) != self.config.block_size:
            return
        prev = self.prev[handle]
        before = () if prev is None else self.content.get(prev)
        if before is None:
            return  # not full before it: vLLM has no (chained) hash for it either
        self.content[handle] = before + tuple(obj.token_ids)
        self.vllm_hash(self.content[handle])

    def vllm_hash(self, content: ContentHash) -> int:
        """vLLM's hash of a content hash, computed with vLLM's own hash function."""
        size = self.config.block_size
        value: int | None = None
        for end in range(size, len(content) + 1, size):
            value = self.v0.block_class.hash_block_tokens(
                end == size, value, list(content[end - size : end])
            )
            self.names.setdefault(value, content[:end])
        assert value is not None
        return value

    def _name(self, value: int) -> ContentHash:
        return self.names.get(value, (-1, value))

    def _obj(self, handle: int) -> Any:
        return self.objects[handle]

    def _prev_obj(self, prev: int | None) -> Any:
        return None if prev is None else self.objects[prev]

    def _call(self, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except self.v0.no_free_blocks as error:
            raise NoFreeBlocks(str(error) or "NoFreeBlocksError") from error

    # -- operations -------------------------------------------------------

    def allocate_mutable_block(self, prev: int | None) -> int:
        obj = self._call(lambda: self.allocator.allocate_mutable_block(self._prev_obj(prev)))
        return self._new(obj, prev)

    def allocate_immutable_block(self, prev: int | None, token_ids: Sequence[int]) -> int:
        obj = self._call(
            lambda: self.allocator.allocate_immutable_block(self._prev_obj(prev), list(token_ids))
        )
        return self._new(obj, prev)

    def allocate_immutable_blocks(
        self, prev: int | None, block_token_ids: Sequence[Sequence[int]]
    ) -> tuple[int, ...]:
        objs = self._call(
            lambda: self.allocator.allocate_immutable_blocks(
                self._prev_obj(prev), [list(t) for t in block_token_ids]
            )
        )
        handles = []
        for obj in objs:
            prev = self._new(obj, prev)
            handles.append(prev)
        return tuple(handles)

    def append_token_ids(self, handle: int, token_ids: Sequence[int]) -> int:
        obj = self._obj(handle)
        self._call(lambda: obj.append_token_ids(list(token_ids)))
        self._learn(handle)
        return int(obj.block_id)

    def promote_to_immutable_block(self, handle: int) -> int:
        obj = self._obj(handle)
        block_id = self._call(lambda: self.allocator.promote_to_immutable_block(obj))
        obj.block_id = block_id
        self._learn(handle)
        return int(block_id)

    def cow_block_if_not_appendable(self, handle: int) -> int:
        obj = self._obj(handle)
        block_id = self._call(lambda: self.allocator.cow_block_if_not_appendable(obj))
        obj.block_id = block_id
        return int(block_id)

    def clear_copy_on_writes(self) -> tuple[tuple[int, int], ...]:
        return tuple((int(s), int(d)) for s, d in self.allocator.clear_copy_on_writes())

    def fork(self, last_block: int) -> tuple[int, ...]:
        objs = self._call(lambda: self.allocator.fork(self._obj(last_block)))
        handles: list[int] = []
        prev: int | None = None
        for obj in objs:
            prev = self._new(obj, prev)
            handles.append(prev)
        return tuple(handles)

    def free(self, handle: int) -> None:
        obj = self.objects.pop(handle)
        self._call(lambda: self.allocator.free(obj))

    def mark_blocks_as_accessed(self, block_ids: Sequence[int], now: float) -> None:
        self.allocator.mark_blocks_as_accessed(list(block_ids), now)

    def mark_blocks_as_computed(self, block_ids: Sequence[int]) -> None:
        self.allocator.mark_blocks_as_computed(list(block_ids))

    def find_cached_blocks_prefix(
        self, block_hashes: Sequence[ContentHash]
    ) -> tuple[ContentHash, ...]:
        values = [self.vllm_hash(h) for h in block_hashes]
        found = list(self.allocator.find_cached_blocks_prefix(values))
        if found != values[: len(found)]:
            raise TargetError(f"find_cached_blocks_prefix returned {found}, not a prefix")
        return tuple(block_hashes[: len(found)])

    def get_common_computed_block_ids(
        self, seq_block_ids: Sequence[Sequence[int]]
    ) -> tuple[int, ...]:
        # vLLM returns commonprefix([]) == "" when no list is left: no ids either way
        found = self.allocator.get_common_computed_block_ids([list(s) for s in seq_block_ids])
        return tuple(found)

    def get_num_free_blocks(self) -> int:
        return int(self.allocator.get_num_free_blocks())

    def reset_prefix_cache(self) -> bool:
        return bool(self.allocator.reset_prefix_cache())

    # -- the abstraction function ----------------------------------------

    def snapshot(self) -> V0State:
        a = self.allocator
        blocks = []
        for block_id in range(self.config.num_blocks):
            ref_cnt = a._refcounter.get(block_id)
            tracker = a._block_tracker[block_id]
            if tracker.active != (ref_cnt > 0):
                raise V0SnapshotError(
                    f"block {block_id}: tracker active={tracker.active} but ref count {ref_cnt}"
                )
            if tracker.active:
                blocks.append(PhysicalBlock(ref_cnt, tracker.last_accessed, tracker.computed))
            else:
                blocks.append(PhysicalBlock(ref_cnt, NEVER_ACCESSED, False))
        handles = {}
        for handle, obj in self.objects.items():
            content = obj.content_hash if obj.is_full else None
            handles[handle] = BlockHandle(
                block_id=obj.block_id,
                prev=self.prev[handle],
                token_ids=tuple(obj.token_ids),
                content_hash=None if content is None else self._name(content),
            )
        evictor = {
            block_id: EvictorEntry(
                self._name(meta.content_hash), meta.num_hashed_tokens, meta.last_accessed
            )
            for block_id, meta in a.evictor.free_table.items()
        }
        return V0State(
            config=self.config,
            blocks=tuple(blocks),
            hashless_free=tuple(a._hashless_allocator._free_block_indices),
            cached={self._name(h): b for h, b in a._cached_blocks.items()},
            evictor=evictor,
            handles=handles,
            next_handle=self.next_handle,
            touched=frozenset(a._touched_blocks),
            copy_on_writes=tuple((int(s), int(d)) for s, d in a._cow_tracker._copy_on_writes),
        )


def make_vllm_v0_target(config: V0Config) -> VllmV0Target:
    """The factory ``kvpool.specs.v0.machine`` takes: vLLM's allocator, unchanged."""
    return VllmV0Target(config)
