"""The exceptions the radix cache's specification raises when a precondition fails.

They derive from ``PoolError`` (so every tool that handles v1 or v0
rejections handles these) and from ``ValueError``. SGLang's radix caches
check few of these preconditions, each cache in its own way (an assert, a
``KeyError``, a panic of the Rust core, or nothing);
docs/semantics.md ("SGLang's radix cache") lists what each does instead.
"""

from kvpool.model.errors import PoolError


class InvalidTokens(PoolError, ValueError):
    """Tokens are not a sequence of integers in 0..2**32-1."""


class InvalidSlots(PoolError, ValueError):
    """KV slot ids are not a sequence of non-negative integers."""


class TooFewSlots(PoolError, ValueError):
    """An insert gives fewer KV slots than the page-aligned key has tokens."""


class InvalidPrefixLength(PoolError, ValueError):
    """``prev_prefix_len`` or ``inserted_len`` is not a non-negative integer."""


class InvalidPriority(PoolError, ValueError):
    """A priority is not an integer."""


class InvalidTokenCount(PoolError, ValueError):
    """A number of tokens to evict is not a non-negative integer."""


class UnknownNode(PoolError, ValueError):
    """A path does not end at a node of the tree (it never did, or the node was evicted)."""


class NotLocked(PoolError, ValueError):
    """unlock was called on a node no lock holds."""
