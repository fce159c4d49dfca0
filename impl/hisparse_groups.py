"""The single-type managers of HiSparse's groups (vLLM 0.33.0's ``HiSparseSourceManager``,
``HiSparseResidentManager`` and ``HiSparseHotManager`` in
``vllm/v1/core/single_type_kv_cache_manager.py``), slice 1 (docs/hisparse.md, "Slices").

The source manager works on the host pool; the resident and hot managers on the device pool.
Each knows the coordinator (``kvpool.impl.hisparse.HiSparseCoordinator``) the manager builds
with them, as vLLM's do once ``get_hisparse_coordinator`` has bound them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mypy_extensions import mypyc_attr

from kvpool.impl.block import KVCacheBlock
from kvpool.impl.pool import BlockPool
from kvpool.impl.single_type import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    verify_hash_block_size,
)
from kvpool.model.errors import InvalidArgument, UnknownRequest
from kvpool.model.single_type import KVCacheSpec

if TYPE_CHECKING:
    from kvpool.impl.hisparse import HiSparseCoordinator


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _trim_null_head(blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
    head = 0
    while head < len(blocks) and blocks[head].is_null:
        head += 1
    return blocks[head:]


@mypyc_attr(allow_interpreted_subclasses=True)
class HiSparseSourceManager(FullAttentionManager):
    """The source group: every page has a host block, in the host pool; its hashes are
    published only once durable (``HiSparseCoordinator.publish_when_ready``)."""

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        device_num_blocks: int,
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.device_num_blocks = device_num_blocks
        self.coordinator: HiSparseCoordinator | None = None

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Device blocks: 0 when the host pool backs the request, else the sentinel
        ``device pool size + 1``, which no admission passes."""
        required = super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks)
        if required > self.block_pool.get_num_free_blocks():
            return self.device_num_blocks + 1
        return 0

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        """Record a pending publication; publish its durable prefix now."""
        rid = request.request_id
        # Verify that the request is in the group's tables (before any state is created)
        if rid not in self.req_to_blocks:
            raise UnknownRequest(f"request {rid!r} holds no blocks in this group")
        # Verify that the request is hashed in the pool's hash blocks
        verify_hash_block_size(request, self.block_pool.hash_block_size)
        coordinator = self.coordinator
        assert coordinator is not None
        coordinator.publish_when_ready(request, num_tokens)

    def publish_blocks(self, request: Any, num_tokens: int) -> None:
        """Cache the host blocks full within ``num_tokens`` (full attention's caching)."""
        super().cache_blocks(request, num_tokens)

    def free(self, request_id: str) -> None:
        coordinator = self.coordinator
        assert coordinator is not None
        coordinator.free(request_id)
        super().free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        coordinator = self.coordinator
        assert coordinator is not None
        coordinator.free(request_id)
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks is None:
            return []
        del self.num_cached_block[request_id]
        return _trim_null_head(blocks)


@mypyc_attr(allow_interpreted_subclasses=True)
class HiSparseResidentManager(SingleTypeKVCacheManager):
    """A resident group: GPU copies of source pages. The block table is append-only; a page
    the request stops reading from the GPU is recorded in ``residency_changes``."""

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        max_admission_blocks_per_request: int,
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self.residency_changes: dict[str, dict[int, KVCacheBlock]] = {}
        self.coordinator: HiSparseCoordinator | None = None

    def get_num_blocks_to_allocate_capped(self, request_id: str, num_tokens: int) -> int:
        """A whole-sequence admission's count: the pages, at most the admission window,
        the request lacks."""
        required = _cdiv(num_tokens, self.block_size)
        if required > self.max_admission_blocks_per_request:
            required = self.max_admission_blocks_per_request
        lacking = required - len(self.req_to_blocks.get(request_id, ()))
        return lacking if lacking > 0 else 0

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        """Never cached: the source owns prefix caching."""

    def free(self, request_id: str) -> None:
        self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """The residency row (dropped pages are null: not freed twice), without nulls ahead."""
        coordinator = self.coordinator
        assert coordinator is not None
        coordinator.free(request_id)
        row = self.get_residency_row(request_id)
        self.residency_changes.pop(request_id, None)
        if self.req_to_blocks.pop(request_id, None) is None:
            return []
        del self.num_cached_block[request_id]
        return _trim_null_head(row)

    def get_resident_page(self, request_id: str, page: int) -> KVCacheBlock | None:
        """The GPU block the request reads page ``page`` from, or None (host only, or none)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or page >= len(blocks):
            return None
        block = blocks[page]
        changes = self.residency_changes.get(request_id)
        if changes:
            block = changes.get(page, block)
        return None if block.is_null else block

    def get_residency_row(self, request_id: Any, start: Any = 0) -> list[KVCacheBlock]:
        """The request's row from ``start`` with the residency changes applied (the null block
        for host-only pages); a new list."""
        # Verify that the arguments have the query's types
        if not isinstance(request_id, str):
            raise InvalidArgument(f"a request id is a str, not {type(request_id).__name__}")
        if type(start) is not int or start < 0:
            raise InvalidArgument(f"start={start!r} must be a non-negative int")
        blocks = self.req_to_blocks.get(request_id, [])
        changes = self.residency_changes.get(request_id)
        if not changes:
            return blocks[start:]
        return [changes.get(page, blocks[page]) for page in range(start, len(blocks))]

    def drop_resident_page(self, request_id: str, page: int) -> KVCacheBlock | None:
        """Stop reading page ``page`` from the GPU; the block it was read from, or None."""
        block = self.get_resident_page(request_id, page)
        if block is not None:
            self.residency_changes.setdefault(request_id, {})[page] = self._null_block
        return block


@mypyc_attr(allow_interpreted_subclasses=True)
class HiSparseHotManager(SingleTypeKVCacheManager):
    """A hot group: a region of ``blocks_per_request`` blocks for a request reading from host.

    The region is allocated at the request's first allocation after it was required
    (``require_hot``), whole, and held until the free; a request holding it in every hot
    group can read from host (its clean pages are unpinned)."""

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        blocks_per_request: int,
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.blocks_per_request = blocks_per_request
        self.hot_required: set[str] = set()

    def require_hot(self, request_id: Any) -> None:
        """Ask for the request's region at its next allocation."""
        # Verify that the id is a request id
        if not isinstance(request_id, str):
            raise InvalidArgument(f"a request id is a str, not {type(request_id).__name__}")
        self.hot_required.add(request_id)

    def has_hot(self, request_id: Any) -> bool:
        """Whether the request holds its whole region."""
        return len(self.req_to_blocks.get(request_id, ())) == self.blocks_per_request

    def get_num_required_blocks(self, request_id: str) -> int:
        missing = self.blocks_per_request - len(self.req_to_blocks.get(request_id, ()))
        return missing if missing > 0 else 0

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """The missing part of the region once it is required (slice 1: no host hit and no
        import, vLLM's two other reasons, reach here); else 0."""
        if request_id in self.hot_required:
            return self.get_num_required_blocks(request_id)
        return 0

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: Any = None
    ) -> list[KVCacheBlock]:
        """The missing part of the region if it is required (the manager counted it and
        found room), else nothing; the token counts play no part. The third argument is
        vLLM 0.33's (its tests call this method directly to give a request its region)."""
        self.num_cached_block[request_id] = 0
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = []
            self.req_to_blocks[request_id] = blocks
        if request_id not in self.hot_required:
            return []
        missing = self.blocks_per_request - len(blocks)
        if missing <= 0:
            return []
        new = self.block_pool.get_new_blocks(missing)
        blocks.extend(new)
        return new

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        """Never cached."""

    def free(self, request_id: str) -> None:
        self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self.hot_required.discard(request_id)
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks is None:
            return []
        del self.num_cached_block[request_id]
        return _trim_null_head(blocks)
