"""SGLang's radix caches behind the radix target protocol (``kvpool.specs.radix.target``).

Three caches of SGLang 0.5.23 (``TESTED_RELEASE``), each a **core**:

* ``rust``: ``UnifiedRadixCache`` with the Rust tree core, what SGLang's
  server builds for a plain model (``sglang/srt/mem_cache/registry.py``,
  ``default_radix_cache_factory``; the core is ``sglang/srt/environ.py``'s
  ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``, default ``rust``);
* ``python``: the same cache with the Python tree core
  (``sglang/srt/mem_cache/unified_cache/unified_tree_core.py``);
* ``legacy``: ``RadixCache`` (``sglang/srt/mem_cache/radix_cache.py``), the
  base of ``PureSWARadixCache`` and the tree other projects embed.

``default`` builds what the server would: the core SGLang's own selection
picks (the environment variable, else Rust).

What the adapter translates, and why:

* **KV slots and the allocator.** The caches free KV through their
  allocator; a recording allocator (``RecordingAllocator``) keeps every
  ``free_segment`` call, which gives an insert's duplicates and an evict's
  freed nodes. ``UnifiedRadixCache.insert`` frees duplicates itself;
  ``RadixCache.insert`` leaves them to its request layer
  (``RadixCache._insert_cache`` frees ``row[cache_protected_len:prefix_len]``
  in one call), so for ``legacy`` the adapter makes that one call, as the
  request layer would, with ``prev_prefix_len`` as the protected length.
* **Time.** The unified cores stamp nodes from a counter (Python: a module
  counter, ``unified_cache/components/base.py``; Rust: a per-tree tick).
  ``RadixCache`` reads ``time.monotonic()`` through its module's ``time``;
  the adapter swaps that for a counter (``install_logical_clock``), so
  eviction order is a function of the program alone. The swap is for the
  whole process.
* **Nodes.** Handles (``TreeNode`` objects, integer ids) become paths: the
  adapter walks parents (``legacy``, ``python``) or reads
  ``collect_path_info`` (``rust``). It remembers the handle each returned
  path had, and the lock receipt of each lock (the unified caches require
  it to unlock).
* **Snapshot.** ``legacy`` and ``python`` walk their trees. The Rust core's
  production binding cannot list nodes, so the adapter probes it, read
  only, with every key inserted since the last reset
  (``match_full_device_prefix`` and ``collect_path_info``): every node lies
  on some inserted key's path.
* **Events.** SGLang's events carry int64 hashes (the first 8 bytes of the
  SHA-256 digest, big-endian, signed); the model's are those 8 bytes.
* **Rejections** (level 2). Each core refuses misuse in its own way
  (``REFUSALS``): the Python core with an ``AssertionError`` or a
  ``KeyError``, the Rust core with a ``KeyError``, a ``ValueError`` or a
  panic (``RuntimeError``); ``legacy`` mostly accepts
  (``kvpool.specs.targets.sglang.findings``). After a panic the Rust core
  refuses every later call ("mutex poisoned"): the adapter rebuilds it by
  replaying, on a fresh cache, every call it accepted, and the finding
  ``rust-refuses-after-panic`` says so.
"""

import contextlib
import os
import tempfile
import types
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvpool.model import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvpool.model.errors import PoolError
from kvpool.model.radix import (
    ROOT,
    EvictResult,
    InsertResult,
    MatchResult,
    Path,
    RadixConfig,
)
from kvpool.model.radix_errors import InvalidPrefixLength, NotLocked, TooFewSlots, UnknownNode
from kvpool.specs.errors import TargetError
from kvpool.specs.radix.target import TreeView
from kvpool.specs.targets.sglang.loading import SglangApi, load_sglang, native_hash_reason

CORES = ("default", "rust", "python", "legacy")
"""The cores a target can ask for; ``default`` is whichever SGLang's server would build."""

REFUSALS: dict[str, dict[str, dict[type[BaseException], type[PoolError]]]] = {
    "rust": {
        "lock": {KeyError: UnknownNode},
        "unlock": {KeyError: UnknownNode, RuntimeError: NotLocked},
        # both raised while building the call, before the tree is touched
        "insert": {ValueError: TooFewSlots, OverflowError: InvalidPrefixLength},
    },
    "python": {
        "lock": {KeyError: UnknownNode},
        "unlock": {KeyError: UnknownNode, AssertionError: NotLocked},
    },
    "legacy": {},
}
"""How each core refuses a call the model rejects: by operation, SGLang's exception type
and the model's rejection it stands for. docs/semantics.md tells what each check is."""


class RecordingAllocator:
    """The KV allocator the caches free into: it records every free and allocates nothing."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed: list[tuple[int, ...]] = []

    def free(self, indices: Any) -> None:
        self._record(indices)

    def free_segment(self, values: Any, start_pos: int = 0) -> None:
        self._record(values)

    def _record(self, values: Any) -> None:
        slots = tuple(int(v) for v in values)
        if slots:  # the legacy request layer frees an empty tensor when nothing is duplicate
            self.freed.append(slots)

    def available_size(self) -> int:
        return 0

    def since(self, mark: int) -> tuple[tuple[int, ...], ...]:
        return tuple(self.freed[mark:])


_CLOCK: list[float] = [0.0]


def install_logical_clock(api: SglangApi) -> None:
    """Make ``RadixCache``'s recency a counter: its module reads time only through ``time``."""
    module: Any = api.radix_module
    if getattr(module.time, "kvpool_logical", False):
        return
    import time as real_time

    def tick() -> float:
        _CLOCK[0] += 1.0
        return _CLOCK[0]

    module.time = types.SimpleNamespace(
        monotonic=tick, perf_counter=real_time.perf_counter, kvpool_logical=True
    )


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Within the block, file descriptor 2 goes nowhere: a Rust panic prints its message there."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def event_to_model(event: Any) -> KVCacheEvent:
    """One of SGLang's KV events as the model's (hashes as the 8 bytes of the int64)."""
    name = type(event).__name__
    if name == "AllBlocksCleared":
        return AllBlocksCleared()
    if name == "BlockRemoved":
        return BlockRemoved(tuple(_hash(h) for h in event.block_hashes), _medium(event), 0)
    if name == "BlockStored":
        parent = event.parent_block_hash
        return BlockStored(
            block_hashes=tuple(_hash(h) for h in event.block_hashes),
            parent_block_hash=None if parent is None else _hash(parent),
            token_ids=tuple(int(t) for t in event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=_medium(event),
            lora_name=event.lora_name,
            extra_keys=None,
            group_idx=0,
        )
    raise TargetError(f"SGLang emitted an event kvpool does not know: {event!r}")


def _hash(value: int) -> bytes:
    return int(value).to_bytes(8, "big", signed=True)


def _medium(event: Any) -> str | None:
    medium = event.medium
    return None if medium is None else str(getattr(medium, "value", medium))


class SglangRadixTarget:
    """One SGLang radix cache (``core``) built for ``config``, speaking paths.

    ``cache_class`` replaces the core's class (a subclass of ``RadixCache``
    for ``legacy``, of ``UnifiedRadixCache`` otherwise); ``customize`` is
    called with each cache built (a bug corpus swaps parts in).
    """

    def __init__(
        self,
        config: RadixConfig,
        core: str = "default",
        cache_class: type[Any] | None = None,
        customize: Callable[[Any], None] | None = None,
    ) -> None:
        if core not in CORES:
            raise TargetError(f"unknown SGLang core {core!r}; known: {', '.join(CORES)}")
        self.api = load_sglang()
        self.config = config
        self.requested = core
        self.cache_class = cache_class
        self.customize = customize
        self.core = "legacy" if core == "legacy" else "python"
        self.log: list[tuple[str, tuple[Any, ...]]] = []
        """Every call SGLang accepted, to rebuild a Rust core after a panic."""
        self.rebuilds = 0
        self._build()

    # -- building --------------------------------------------------------------

    def _build(self) -> None:
        api = self.api
        self.allocator = RecordingAllocator()
        self.handles: dict[Path, Any] = {}
        self.receipts: dict[Path, list[Any]] = {}
        self.keys: set[Path] = set()
        """Every page-aligned key inserted since the last reset (the Rust snapshot's probes)."""
        config = self.config
        if config.enable_events and self.requested in ("legacy", "python"):
            reason = native_hash_reason()
            if reason is not None:
                raise TargetError(reason)
        policy_config = None
        if config.policy == "slru" and config.slru_protected_threshold != 2:
            policy_config = {"protected_threshold": config.slru_protected_threshold}
        common: dict[str, Any] = {
            "disable": False,
            "req_to_token_pool": None,
            "token_to_kv_pool_allocator": self.allocator,
            "page_size": config.page_size,
            "enable_kv_cache_events": config.enable_events,
            "eviction_policy": config.policy,
            "eviction_policy_config": policy_config,
        }
        try:
            if self.requested == "legacy":
                install_logical_clock(api)
                cls = self.cache_class or api.radix_cache
                self.cache = cls(api.cache_init_params(**common))
            else:
                cls = self.cache_class or api.unified_radix_cache
                backend = None if self.requested == "default" else self.requested
                params = api.cache_init_params(
                    **common, tree_components=(api.full_component,), tree_core_backend=backend
                )
                self.cache = cls(params)
        except TargetError:
            raise
        except Exception as error:
            raise TargetError(
                f"SGLang {api.version} could not build a {self.requested} radix cache for "
                f"{config}: {error!r}"
            ) from error
        if self.requested != "legacy":
            built = type(self.cache.tree_core).__name__
            self.core = "rust" if built.startswith("Rust") else "python"
            if self.requested in ("rust", "python") and self.core != self.requested:
                raise TargetError(
                    f"asked SGLang for the {self.requested} tree core, it built {built} "
                    "(SGLang falls back to Python for some options)"
                )
        if self.customize is not None:
            self.customize(self.cache)

    def _replay(self) -> None:
        """A fresh cache that has received every call this one accepted (after a Rust panic)."""
        log = self.log
        self.rebuilds += 1
        self._build()
        self.log = []
        for name, args in log:
            getattr(self, name)(*args)
        self.allocator.freed.clear()

    def _sglang(self, operation: str, args: tuple[Any, ...], call: Callable[[], Any]) -> Any:
        """One SGLang call: a refusal becomes the model's rejection; accepted calls are logged."""
        quiet = quiet_stderr() if self.core == "rust" else contextlib.nullcontext()
        try:
            with quiet:
                result = call()
        except Exception as error:
            if self.core == "rust" and isinstance(error, RuntimeError):
                self._replay()
            refusal = REFUSALS[self.core].get(operation, {}).get(type(error))
            if refusal is not None:
                raise refusal(f"SGLang ({self.core} core) refused: {error!r}") from error
            raise
        self.log.append((operation, args))
        return result

    # -- nodes -------------------------------------------------------------------

    def _key(self, tokens: Sequence[int]) -> Any:
        return self.api.radix_key(array("q", tokens))

    def _path(self, handle: Any, tokens: Sequence[int]) -> Path:
        if self.core == "legacy":
            return self._walk(handle, self.cache.root_node)
        tree = self.cache.tree_core
        if self.core == "python":
            return self._walk(tree.node_by_id(handle), tree.root_node)
        (infos,) = tree.collect_path_info([handle])
        end = infos[-1].path_end if infos else 0
        return tuple(tokens[:end]) if end <= len(tokens) else (*tokens, *[-1] * (end - len(tokens)))

    @staticmethod
    def _walk(node: Any, root: Any) -> Path:
        parts: list[tuple[int, ...]] = []
        while node is not root and node is not None and node.key is not None:
            parts.append(tuple(int(t) for t in node.key.token_ids))
            node = node.parent
        return tuple(t for part in reversed(parts) for t in part)

    def _returned(self, path: Path, handle: Any) -> None:
        self.handles[path] = handle

    def _handle(self, path: Path) -> Any:
        if path == ROOT:
            return self._root_handle()
        if path not in self.handles:
            raise TargetError(f"the adapter has no SGLang handle for the node at {list(path)}")
        return self.handles[path]

    def _root_handle(self) -> Any:
        if self.core == "legacy":
            return self.cache.root_node
        return self.cache.match_prefix(
            self.api.match_prefix_params(key=self._key([]))
        ).last_device_node

    # -- the target protocol -----------------------------------------------------

    def insert(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        prev_prefix_len: int,
        priority: int,
        inserted_len: int,
    ) -> InsertResult:
        import torch  # type: ignore[import-not-found,unused-ignore]

        args = (tuple(tokens), tuple(slots), prev_prefix_len, priority, inserted_len)
        value = torch.tensor(list(slots), dtype=torch.int64)
        params = self.api.insert_params(
            key=self._key(tokens),
            value=value,
            prev_prefix_len=prev_prefix_len,
            priority=priority,
            inserted_len=inserted_len,
        )
        mark = len(self.allocator.freed)
        result = self._sglang("insert", args, lambda: self.cache.insert(params))
        if self.core == "legacy":
            # RadixCache._insert_cache: the request layer frees its duplicates
            self.allocator.free_segment(
                value[prev_prefix_len : result.prefix_len], start_pos=prev_prefix_len
            )
        page = self.config.page_size
        key = tuple(tokens[: len(tokens) - len(tokens) % page])
        if key:
            self.keys.add(key)
        path = self._path(result.last_device_node, key)
        self._returned(path, result.last_device_node)
        return InsertResult(int(result.prefix_len), path, self.allocator.since(mark))

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        params = self.api.match_prefix_params(key=self._key(tokens))
        result = self._sglang(
            "match_prefix", (tuple(tokens),), lambda: self.cache.match_prefix(params)
        )
        node = result.last_device_node
        slots = tuple(int(s) for s in self.cache.path_device_indices(node).tolist())
        path = self._path(node, tokens)
        self._returned(path, node)
        return MatchResult(int(result.device_prefix_len), path, slots)

    def lock(self, path: Path) -> int:
        handle = self._handle(path)
        result = self._sglang("lock", (path,), lambda: self.cache.inc_lock_ref(handle))
        self.receipts.setdefault(path, []).append(result)
        delta = int(result.delta or 0)
        # RadixCache reports the change of the evictable size, the unified caches the
        # tokens newly protected.
        return -delta if self.core == "legacy" else delta

    def unlock(self, path: Path) -> None:
        handle = self._handle(path)
        if self.core == "legacy":
            self._sglang("unlock", (path,), lambda: self.cache.dec_lock_ref(handle))
            return
        held = self.receipts.get(path)
        # Without a lock taken (a level-2 call): the receipt a lock would have given.
        params = held[-1].to_dec_params() if held else self.api.dec_lock_ref_params(node_id=handle)
        self._sglang("unlock", (path,), lambda: self.cache.dec_lock_ref(handle, params))
        if held:
            held.pop()

    def evict(self, num_tokens: int) -> EvictResult:
        params = self.api.evict_params(num_tokens=num_tokens)
        mark = len(self.allocator.freed)
        result = self._sglang("evict", (num_tokens,), lambda: self.cache.evict(params))
        return EvictResult(int(result.num_tokens_evicted), self.allocator.since(mark))

    def reset(self) -> None:
        self._sglang("reset", (), self.cache.reset)
        self.receipts = {}
        self.keys = set()

    def take_events(self) -> Sequence[KVCacheEvent]:
        events = self._sglang("take_events", (), self.cache.take_events)
        return tuple(event_to_model(e) for e in events)

    def evictable_size(self) -> int:
        return int(self.cache.evictable_size())

    def protected_size(self) -> int:
        return int(self.cache.protected_size())

    def snapshot(self) -> TreeView:
        if self.core == "legacy":
            return _walk_tree(self.cache.root_node, lambda n: n.value)
        tree = self.cache.tree_core
        full = self.api.full_component
        if self.core == "python":
            return _walk_tree(tree.root_node, lambda n: n.component_data[full].value)
        return self._probe_rust(tree, full)

    def _probe_rust(self, tree: Any, full: Any) -> TreeView:
        nodes: dict[Path, tuple[int, ...]] = {}
        for key in self.keys:
            matched, node_id, _ = tree.match_full_device_prefix(self._key(key))
            if not matched:
                continue
            (infos,) = tree.collect_path_info([node_id])
            for info in infos:
                if info.path_end <= matched:
                    value = tree.get_component_device_value(info.node_id, full)
                    slots = () if value is None else tuple(int(s) for s in value.tolist())
                    nodes[key[: info.path_end]] = slots
        return tuple(sorted(nodes.items()))


def _walk_tree(root: Any, value_of: Callable[[Any], Any]) -> TreeView:
    """Every node under ``root`` that holds a value, as (path, slots)."""
    nodes: list[tuple[Path, tuple[int, ...]]] = []
    stack: list[tuple[Any, Path]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        for child in list(node.children.values()):
            value = value_of(child)
            if value is None:
                continue
            child_path = path + tuple(int(t) for t in child.key.token_ids)
            nodes.append((child_path, tuple(int(s) for s in value.tolist())))
            stack.append((child, child_path))
    return tuple(sorted(nodes))


class SglangRadixFactory:
    """Builds ``SglangRadixTarget``s of one core (and cache class) for each program."""

    def __init__(
        self,
        core: str = "default",
        cache_class: type[Any] | None = None,
        customize: Callable[[Any], None] | None = None,
    ) -> None:
        if core not in CORES:
            raise ValueError(f"unknown SGLang core {core!r}; known: {', '.join(CORES)}")
        self.core = core
        self.cache_class = cache_class
        self.customize = customize

    def __call__(self, config: RadixConfig) -> SglangRadixTarget:
        return SglangRadixTarget(config, self.core, self.cache_class, self.customize)

    def preflight(self, level: int = 1, profiles: Sequence[str] = ()) -> None:
        """Fail fast (TargetError) if SGLang cannot be loaded, or this core cannot be built."""
        load_sglang()
        SglangRadixTarget(RadixConfig(enable_events=False), self.core, self.cache_class)
