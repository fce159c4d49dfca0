"""HiSparse's bookkeeping: plain immutable records (docs/hisparse.md, "What kvpool's model
would hold", trimmed to slice 1).

The coordinator of vLLM 0.33.0 (``vllm/v1/hisparse/coordinator.py``) keeps one
``_HiSparseRequestState`` per live request and ties each pending transfer to that
*object*. The model keeps a ``PageBook`` per request with a ``generation`` number
instead: a transfer names the generation that planned it, so completions of a freed
request never touch a new request that reuses its id. Slice 1 leaves out what only a
hot region, a host hit or an import can fill (unpinned pages, pages to adopt, the
block readers, pending imports, host copies, residency changes): without a hot region
no page is unpinned or lost while its request runs.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpool.model.request import Request
from kvpool.model.state import HashKey

WATCHER = "hisparse"
"""The value the coordinator registers with ``unpin_blocks`` on the device pool."""


@dataclass(frozen=True)
class Publication:
    """The source group's pending publication (``_PendingPublication``)."""

    request: Request
    num_computed_tokens: int
    num_pages: int
    detached: tuple[int, ...] | None = None
    """Host blocks kept (one reference each) after a finished request was freed."""
    num_cached_blocks: int = 0
    """How many of them were cached when the request was freed."""


@dataclass(frozen=True)
class PageBook:
    """One request's pages (``_HiSparseRequestState``, trimmed to slice 1)."""

    generation: int
    valid: frozenset[int] = frozenset()
    """Pages whose host copy is complete (clean)."""
    ready_prefix_pages: int = 0
    """Every page below this is clean: the durable prefix."""
    pending: Mapping[int, int] = field(default_factory=dict)
    """Page to the id of the transfer writing it back."""
    publication: Publication | None = None
    copies_recorded_pages: int = 0
    pinned_clean: frozenset[int] = frozenset()
    synced_pages: int = 0
    """The worker has been sent every page below this."""
    stale: frozenset[int] = frozenset()
    unpinned: frozenset[int] = frozenset()
    """Clean pages whose GPU blocks were given back with ``unpin_blocks`` and are still read
    (``unpinned_pages``): free in the device pool, watched, until the pool reuses one."""
    lost: frozenset[int] = frozenset()
    """Pages whose GPU copies the request stopped reading: the pool reused one of their
    blocks (``_lose_page``). vLLM records them per resident group as residency changes
    to the null block (``HiSparseResidentManager.drop_resident_page``, 0.33.0); a page is
    always lost in every resident group at once, so one set per request. The block table
    stays append-only: a lost page's block id is still in the table row."""


@dataclass(frozen=True)
class Transfer:
    """A planned page transfer and its acknowledgements (``_PendingSpill``)."""

    transfer_id: int
    generation: int
    request_id: str
    page: int
    host_block: int
    resident_blocks: tuple[int, ...]
    after_forward: bool
    restore: bool = False
    expected: int = 0
    """The first non-zero enqueued count: completions needed."""
    completed: int = 0
    enqueue_applied: bool = False
    """The GPU references were given back (every completion arrived)."""


@dataclass(frozen=True)
class HiSparseState:
    """The coordinator's state besides the two pools and the group tables."""

    books: Mapping[str, PageBook] = field(default_factory=dict)
    detached: Mapping[int, PageBook] = field(default_factory=dict)
    """Generation to the book of a freed, finished request whose publication waits."""
    transfers: Mapping[int, Transfer] = field(default_factory=dict)
    """Pending transfers by id, in id order."""
    to_send: tuple[int, ...] = ()
    """Transfer ids planned and not yet handed out (``build_offload_command``)."""
    next_transfer_id: int = 0
    next_generation: int = 0
    copies: Mapping[HashKey, tuple[int, ...]] = field(default_factory=dict)
    """Published host hash to the GPU blocks (one per resident group) holding the page."""
    copy_of_block: Mapping[int, HashKey] = field(default_factory=dict)
    hot_required: frozenset[str] = frozenset()
    """Requests asked for a hot region. vLLM keeps one set per hot group, always changed
    together (``require_hot`` on every hot group, each forgetting at free), so one set."""
    resident_marks: frozenset[str] = frozenset()
    """Requests found fully resident (``_resident_requests``): a cache of the answer."""
    owners: Mapping[int, frozenset[tuple[str, int]]] = field(default_factory=dict)
    """Unpinned device block to the (request, page) pairs still reading it (``_owners``):
    when the pool reuses the block, each of those pages is lost."""
