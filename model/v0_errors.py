"""The exceptions the v0 allocator's specification raises when a precondition fails.

They derive from ``PoolError`` (so every tool that handles v1 rejections
handles these) and from ``ValueError``, like the ``NoFreeBlocksError`` and
``ValueError`` vLLM's v0 allocator raises. vLLM checks most of these
preconditions with an ``assert`` or not at all; docs/semantics.md ("The v0
allocator") lists what it does instead.
"""

from kvpool.model.errors import PoolError


class UnknownHandle(PoolError, ValueError):
    """A handle does not name a live block object: never allocated, or already freed."""


class NoFreeBlocks(PoolError, ValueError):
    """No hash-less free block and no evictable cached block is left."""


class ImmutableBlock(PoolError, ValueError):
    """A full (immutable) block was given to an operation that writes into a block."""


class BlockOverflow(PoolError, ValueError):
    """More tokens were appended than the block has empty slots."""


class WrongTokenCount(PoolError, ValueError):
    """An immutable block was allocated with a number of tokens other than the block size."""


class UnfilledPrefix(PoolError, ValueError):
    """The previous block is not full, so this block's content hash is not defined yet."""


class FreedPrefix(PoolError, ValueError):
    """A block earlier in the sequence was freed: the chain of hashes is broken."""


class NotPromotable(PoolError, ValueError):
    """promote_to_immutable_block got a block that is not full, or was already promoted."""


class BlockNotTracked(PoolError, ValueError):
    """mark_blocks_as_accessed got a block that is neither held nor evictable."""
