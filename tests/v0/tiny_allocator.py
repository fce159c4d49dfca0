"""A tiny mutable v0 allocator, written apart from the model, and copies of it with planted bugs.

It speaks the machine's target protocol directly (handles in, handles out).
The planted bugs are mistakes a v0 allocator author makes; the machine must
find each one.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

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


@dataclass
class _Obj:
    block_id: int
    prev: int | None
    tokens: list[int] = field(default_factory=list)
    content: ContentHash | None = None


@dataclass
class _Phys:
    ref: int = 0
    accessed: float = NEVER_ACCESSED
    computed: bool = False


class TinyV0Allocator:
    """Lists and dicts, mutated in place: a second opinion on every rule of the model."""

    def __init__(self, config: V0Config) -> None:
        self.config = config
        self.size = config.block_size
        self.phys = [_Phys() for _ in range(config.num_blocks)]
        self.free_list: list[int] = list(range(config.num_blocks))
        self.cache: dict[ContentHash, int] = {}
        self.evictable: dict[int, tuple[ContentHash, int, float]] = {}
        self.objs: dict[int, _Obj] = {}
        self.counter = 0
        self.touched: set[int] = set()
        self.cows: list[tuple[int, int]] = []

    # -- internals --------------------------------------------------------

    def evict_key(self, block_id: int) -> tuple[float, int, int]:
        _, tokens, accessed = self.evictable[block_id]
        return (accessed, -tokens, block_id)

    def take(self) -> int:
        if self.free_list:
            block_id = self.free_list.pop(0)
        elif self.evictable:
            block_id = min(self.evictable, key=self.evict_key)
            content, _, _ = self.evictable.pop(block_id)
            del self.cache[content]
        else:
            raise NoFreeBlocks("nothing free")
        self.phys[block_id] = _Phys(ref=1)
        return block_id

    def need_free(self) -> None:
        if not self.free_list and not self.evictable:
            raise NoFreeBlocks("nothing free")

    def drop(self, block_id: int, content: ContentHash | None) -> None:
        phys = self.phys[block_id]
        phys.ref -= 1
        if phys.ref > 0:
            return
        if content is None:
            self.free_list.insert(0, block_id)
        else:
            self.evictable[block_id] = (content, len(content), phys.accessed)
        self.phys[block_id] = _Phys()

    def hit(self, block_id: int) -> None:
        phys = self.phys[block_id]
        if phys.ref == 0:
            del self.evictable[block_id]
            self.phys[block_id] = _Phys(ref=1, computed=True)
        else:
            phys.ref += 1

    def make(self, obj: _Obj) -> int:
        handle = self.counter
        self.counter += 1
        self.objs[handle] = obj
        return handle

    def prefix(self, prev: int | None) -> ContentHash:
        if prev is None:
            return ()
        content = self.objs[prev].content
        assert content is not None
        return content

    def promote(self, obj: _Obj) -> None:
        obj.content = self.prefix(obj.prev) + tuple(obj.tokens)
        if obj.content in self.cache:
            self.drop(obj.block_id, None)
            obj.block_id = self.cache[obj.content]
            self.hit(obj.block_id)
        else:
            self.cache[obj.content] = obj.block_id
            self.touched.add(obj.block_id)

    def copy(self, obj: _Obj) -> None:
        self.need_free()
        source = obj.block_id
        self.drop(source, None)
        obj.block_id = self.take()
        self.cows.append((source, obj.block_id))

    # -- the protocol -----------------------------------------------------

    def allocate_mutable_block(self, prev: int | None) -> int:
        return self.make(_Obj(self.take(), prev))

    def allocate_immutable_block(self, prev: int | None, token_ids: Sequence[int]) -> int:
        content = self.prefix(prev) + tuple(token_ids)
        if content in self.cache:
            self.hit(self.cache[content])
            return self.make(_Obj(self.cache[content], prev, list(token_ids), content))
        obj = _Obj(self.take(), prev, list(token_ids))
        self.promote(obj)
        return self.make(obj)

    def allocate_immutable_blocks(
        self, prev: int | None, block_token_ids: Sequence[Sequence[int]]
    ) -> Sequence[int]:
        handles = []
        for token_ids in block_token_ids:
            prev = self.allocate_immutable_block(prev, token_ids)
            handles.append(prev)
        return handles

    def append_token_ids(self, handle: int, token_ids: Sequence[int]) -> int:
        obj = self.objs[handle]
        if token_ids:
            if self.phys[obj.block_id].ref > 1:
                self.copy(obj)
            obj.tokens.extend(token_ids)
            if len(obj.tokens) == self.size:
                self.promote(obj)
        return obj.block_id

    def cow_block_if_not_appendable(self, handle: int) -> int:
        obj = self.objs[handle]
        if self.phys[obj.block_id].ref > 1:
            self.copy(obj)
        return obj.block_id

    def clear_copy_on_writes(self) -> Sequence[tuple[int, int]]:
        cows, self.cows = self.cows, []
        return cows

    def fork(self, last_block: int) -> Sequence[int]:
        chain = [last_block]
        while (prev := self.objs[chain[-1]].prev) is not None:
            chain.append(prev)
        handles: list[int] = []
        new_prev: int | None = None
        for handle in reversed(chain):
            obj = self.objs[handle]
            self.phys[obj.block_id].ref += 1
            new_prev = self.make(_Obj(obj.block_id, new_prev, list(obj.tokens), obj.content))
            handles.append(new_prev)
        return handles

    def free(self, handle: int) -> None:
        obj = self.objs.pop(handle)
        self.drop(obj.block_id, obj.content)

    def mark_blocks_as_accessed(self, block_ids: Sequence[int], now: float) -> None:
        for block_id in block_ids:
            if self.phys[block_id].ref > 0:
                self.phys[block_id].accessed = now
            else:
                content, tokens, _ = self.evictable[block_id]
                self.evictable[block_id] = (content, tokens, now)

    def mark_blocks_as_computed(self, block_ids: Sequence[int]) -> None:
        for block_id in self.touched:
            if self.phys[block_id].ref > 0:
                self.phys[block_id].computed = True
        self.touched = set()

    def is_computed(self, block_id: int) -> bool:
        if self.phys[block_id].ref > 0:
            return self.phys[block_id].computed
        return block_id in self.evictable

    def find_cached_blocks_prefix(
        self, block_hashes: Sequence[ContentHash]
    ) -> Sequence[ContentHash]:
        lo, hi = 0, len(block_hashes)
        while lo < hi:
            mid = (lo + hi) // 2
            block_id = self.cache.get(block_hashes[mid])
            if block_id is not None and self.is_computed(block_id):
                lo = mid + 1
            else:
                hi = mid
        return block_hashes[:lo]

    def get_common_computed_block_ids(
        self, seq_block_ids: Sequence[Sequence[int]]
    ) -> Sequence[int]:
        if len(seq_block_ids) == 1:
            return list(seq_block_ids[0])
        lists = [list(ids) for ids in seq_block_ids if ids]
        if not lists:
            return []
        common = lists[0]
        for ids in lists[1:]:
            n = 0
            while n < min(len(common), len(ids)) and common[n] == ids[n]:
                n += 1
            common = common[:n]
        return common

    def get_num_free_blocks(self) -> int:
        return len(self.free_list) + len(self.evictable)

    def reset_prefix_cache(self) -> bool:
        if any(p.ref > 0 for p in self.phys):
            return False
        for block_id in sorted(self.evictable, key=self.evict_key):
            self.free_list.insert(0, block_id)
        self.evictable.clear()
        self.cache.clear()
        return True

    def snapshot(self) -> V0State:
        return V0State(
            config=self.config,
            blocks=tuple(PhysicalBlock(p.ref, p.accessed, p.computed) for p in self.phys),
            hashless_free=tuple(self.free_list),
            cached=dict(self.cache),
            evictor={b: EvictorEntry(*entry) for b, entry in self.evictable.items()},
            handles={
                h: BlockHandle(o.block_id, o.prev, tuple(o.tokens), o.content)
                for h, o in self.objs.items()
            },
            next_handle=self.counter,
            touched=frozenset(self.touched),
            copy_on_writes=tuple(self.cows),
        )


# --------------------------------------------------------------------------
# Planted bugs
# --------------------------------------------------------------------------


class NoDeduplication(TinyV0Allocator):
    """A full block whose content is already cached keeps its own block and takes over the hash.

    Two physical blocks then hold the same prefix: memory is wasted, and the
    older copy, no longer reachable from the cache, sits in the evictor under
    a hash that names another block.
    """

    def promote(self, obj: _Obj) -> None:
        obj.content = self.prefix(obj.prev) + tuple(obj.tokens)
        self.cache[obj.content] = obj.block_id
        self.touched.add(obj.block_id)


class EvictsShortestPrefixFirst(TinyV0Allocator):
    """Among equally old cached blocks, evicts the one with the *fewest* hashed tokens.

    That evicts the front of a prefix before its end: the binary search of
    find_cached_blocks_prefix then misses the whole cached tail.
    """

    def evict_key(self, block_id: int) -> tuple[float, int, int]:
        _, tokens, accessed = self.evictable[block_id]
        return (accessed, tokens, block_id)
