"""What the HiSparse model and impl share: the records the coordinator hands the workers.

HiSparse (docs/hisparse.md) puts a host tier under the request layer. The
scheduler side answers the workers with three kinds of record, named and shaped
after vLLM 0.33.0's ``vllm/v1/hisparse/types.py``. They are plain data, so
model and impl can return the same values and be compared field by field. The
impl's vLLM-facing view turns them into the shapes vLLM's callers read (lists
where vLLM uses lists).
"""

from dataclasses import dataclass

ACTIVE_TAIL_PAGES = 2
"""The last pages of a request's row that are never unpinned: a step still in
flight may be writing them (vLLM 0.33.0 ``hisparse/types.py``)."""


@dataclass(frozen=True)
class PageTransfer:
    """One page to copy between the GPU resident groups and its host block.

    A spill (``restore`` false) writes the GPU copy back to the host block; a
    restore copies the host block into the GPU copy. ``after_forward`` says the
    copy runs after the step's forward pass (the step writes the page first).
    """

    transfer_id: int
    host_block_id: int
    resident_block_ids: tuple[int, ...]
    """One block per resident group, in group order."""
    after_forward: bool
    restore: bool = False


@dataclass(frozen=True)
class RowMirror:
    """Rows of one page the step writes on the GPU, to be mirrored into its host block.

    Offsets are in rows (tokens): ``block_id * block_size + row_offset``.
    """

    source_starts: tuple[int, ...]
    """One start per resident group, in group order."""
    destination_start: int
    num_rows: int


@dataclass(frozen=True)
class ResidencyUpdate:
    """The GPU blocks of some of a request's pages, one row per resident group.

    The null block's id stands for a page read from the host.
    """

    pages: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]
