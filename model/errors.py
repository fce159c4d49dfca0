"""The exceptions the specification raises when an operation's precondition fails.

Every rejected call leaves the pool exactly as it was. Conformance compares the
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
