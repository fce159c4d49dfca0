"""The exceptions the v1 specification raises when an operation's precondition fails.

One module for the v1 family: the block pool, the hash chain and the request
layer (the v0 allocator's are in ``v0_errors``). The model and the impl raise
the same classes: they share types and exceptions, never logic.

Every rejected call leaves the state exactly as it was. Conformance compares the
exception *type*, never its message, so each precondition has its own class.
Classes that vLLM reports with a ``ValueError`` also derive from ``ValueError``,
so code written against vLLM's pool keeps working.
"""


class PoolError(Exception):
    """Base class: a call the block pool must reject."""


class InvalidConfig(PoolError, ValueError):
    """The pool cannot be built with these parameters."""


class InvalidBlockCount(PoolError, ValueError):
    """A number of blocks is negative."""


class NotEnoughFreeBlocks(PoolError, ValueError):
    """More blocks were asked for than the free queue holds."""


class UnknownBlock(PoolError, ValueError):
    """A block id does not name a block of this pool."""


class BlockNotHeld(PoolError, ValueError):
    """An operation that needs a held block (ref count above 0) got a free one."""


class OverFree(PoolError, ValueError):
    """One free_blocks call releases a block more times than it is held."""


class DuplicateBlock(PoolError, ValueError):
    """The same physical block stands at two positions of one request's blocks."""


class AlreadyCached(PoolError, ValueError):
    """A block that already carries a full hash was cached again."""


class CachingDisabled(PoolError, ValueError):
    """A caching operation was called on a pool built with enable_caching=False."""


class InvalidBlockSize(PoolError, ValueError):
    """A block size is not a positive multiple of the pool's hash block size."""


class InvalidBlockRange(PoolError, ValueError):
    """num_cached_blocks / num_full_blocks do not describe a slice of the blocks."""


class InvalidBlockMask(PoolError, ValueError):
    """block_mask does not have one entry per block being cached."""


class NotEnoughHashes(PoolError, ValueError):
    """The request has fewer block hashes than the blocks being cached need."""


class InvalidPartialBlock(PoolError, ValueError):
    """cache_partial_block arguments do not describe a partial prefix of a block."""


class InvalidGroup(PoolError, ValueError):
    """A KV cache group id is negative."""


class InvalidArgument(PoolError, TypeError):
    """An argument is not of the type the operation takes (a count that is no int,
    a list of blocks that is no iterable, a request without block hashes, ...).

    A block argument that is not a block of the pool is ``UnknownBlock`` instead.
    """


POOL_ERRORS: tuple[type[PoolError], ...] = (
    InvalidConfig,
    InvalidBlockCount,
    NotEnoughFreeBlocks,
    UnknownBlock,
    BlockNotHeld,
    OverFree,
    DuplicateBlock,
    AlreadyCached,
    CachingDisabled,
    InvalidBlockSize,
    InvalidBlockRange,
    InvalidBlockMask,
    NotEnoughHashes,
    InvalidPartialBlock,
    InvalidGroup,
    InvalidArgument,
)
"""The block pool's rejections: what a pool target may answer with."""


# --------------------------------------------------------------------------
# The hash chain
# --------------------------------------------------------------------------


class InvalidMultiModalInputs(PoolError, ValueError):
    """Multimodal inputs overlap, are out of order, or have a negative offset or no length."""


class InvalidHashBlockSize(PoolError, ValueError):
    """A hash block size is not positive."""


class InvalidPromptEmbeds(PoolError, ValueError):
    """Prompt embeddings are not one bytes value per prompt position."""


class InvalidBlockHashes(PoolError, ValueError):
    """A request's hashes cover more tokens than the request has."""


# --------------------------------------------------------------------------
# The request layer
# --------------------------------------------------------------------------


class RequestError(PoolError):
    """Base class: a call the request layer (the KV cache manager) must reject."""


class InvalidManagerConfig(RequestError, ValueError):
    """The KV cache manager cannot be built with these parameters."""


class UnknownGroup(RequestError, ValueError):
    """A KV cache group index does not name a group of this manager."""


class NoNewTokens(RequestError, ValueError):
    """allocate_slots was asked for no new tokens."""


class InvalidTokenCount(RequestError, ValueError):
    """A token count is negative, or exceeds what the request holds."""


class InvalidHit(RequestError, ValueError):
    """The computed blocks passed to allocate_slots do not fit this manager or request."""


class HitOnRunningRequest(RequestError, ValueError):
    """Cache hits were passed for a request that already holds blocks."""


class HashBlockSizeMismatch(RequestError, ValueError):
    """A request was hashed with another hash block size than the manager's pool uses."""


class UnknownRequest(RequestError, ValueError):
    """A request id names no request holding blocks in this manager."""


class InvalidHiSparseLayout(InvalidManagerConfig):
    """The groups do not make a HiSparse layout vLLM accepts (docs/hisparse.md, "The groups")."""


class HiSparseNotModelled(RequestError, ValueError):
    """A call would take a HiSparse path kvpool does not model yet (docs/hisparse.md, "Slices").

    Raised before anything changes, so the state is as it was.
    """
