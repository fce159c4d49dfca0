"""Semantics profiles: the rules that changed between vLLM releases.

The model takes a profile as an explicit parameter instead of silently choosing
one release's behaviour. The default is the behaviour the seed documents
specify (vLLM 0.24 and later). docs/semantics.md says which release introduced
each profile.
"""

from dataclasses import dataclass
from enum import Enum


class FreeOrder(Enum):
    """Where free_blocks puts the blocks whose ref count dropped to zero."""

    APPEND = "append"
    """Every freed block goes to the back of the free queue, in the order given."""

    HASHLESS_FIRST = "hashless-first"
    """Hash-less blocks go to the front (they can never be a cache hit, so they
    are the cheapest to reuse); hashed blocks go to the back."""


@dataclass(frozen=True)
class Profile:
    """A named set of release-dependent rules."""

    name: str
    free_order: FreeOrder
    free_order_without_caching: FreeOrder
    releases: str

    def free_order_for(self, enable_caching: bool) -> FreeOrder:
        """The free-order rule in force for a pool built with ``enable_caching``."""
        return self.free_order if enable_caching else self.free_order_without_caching


HASHLESS_FIRST = Profile(
    name="hashless-first",
    free_order=FreeOrder.HASHLESS_FIRST,
    free_order_without_caching=FreeOrder.HASHLESS_FIRST,
    releases="vLLM 0.24.0-0.26.x and 0.28.0 onwards (the seeds)",
)

APPEND = Profile(
    name="append",
    free_order=FreeOrder.APPEND,
    free_order_without_caching=FreeOrder.APPEND,
    releases="vLLM 0.8.0-0.23.x",
)

HASHLESS_FIRST_APPEND_UNCACHED = Profile(
    name="hashless-first-append-uncached",
    free_order=FreeOrder.HASHLESS_FIRST,
    free_order_without_caching=FreeOrder.APPEND,
    releases="vLLM 0.27.0 only (a bug, fixed in 0.28.0)",
)

DEFAULT_PROFILE = HASHLESS_FIRST

PROFILES: dict[str, Profile] = {
    p.name: p for p in (HASHLESS_FIRST, APPEND, HASHLESS_FIRST_APPEND_UNCACHED)
}
