"""Semantics profiles: the rules that changed between vLLM releases.

The model takes a profile as an explicit parameter instead of silently choosing
one release's behaviour. The default is the behaviour the seed documents
specify (vLLM 0.24 and later). docs/semantics.md says which release introduced
each profile.

Two axes make a profile: the free order (``PROFILES``, one named profile per
rule vLLM releases have followed) and the event semantics (``EVENT_SEMANTICS``:
when a removal is published). ``with_event_semantics`` combines them; the
combined profile is named ``"<free order profile>+<event semantics>"`` unless
its event semantics is the default, so every profile that existed before the
second axis keeps its name.
"""

from dataclasses import dataclass, replace
from enum import Enum

from kvpool.model.errors import InvalidConfig


class FreeOrder(Enum):
    """Where free_blocks puts the blocks whose ref count dropped to zero."""

    APPEND = "append"
    """Every freed block goes to the back of the free queue, in the order given."""

    HASHLESS_FIRST = "hashless-first"
    """Hash-less blocks go to the front (they can never be a cache hit, so they
    are the cheapest to reuse); hashed blocks go to the back."""


class EventSemantics(Enum):
    """When a pool publishes ``BlockRemoved`` for a hash several physical blocks carry."""

    MULTISET = "multiset"
    """One ``BlockRemoved`` per block that loses the hash, copies included: the
    stream describes a multiset of (hash, group) entries (every vLLM release
    with events, up to 0.33.0 at least)."""

    LAST_COPY = "last-copy"
    """``BlockRemoved`` only when the last block under the key loses it; stores
    are still published per block. The stream describes a set of keys
    (vllm-project/vllm#55092, open, in no release)."""


@dataclass(frozen=True)
class Profile:
    """A named set of release-dependent rules."""

    name: str
    free_order: FreeOrder
    free_order_without_caching: FreeOrder
    releases: str
    event_semantics: EventSemantics = EventSemantics.MULTISET

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

EVENT_SEMANTICS: dict[str, EventSemantics] = {e.value: e for e in EventSemantics}
"""The event semantics by name: the second axis of a profile."""


def with_event_semantics(profile: Profile, semantics: EventSemantics) -> Profile:
    """``profile`` publishing its removals as ``semantics`` says.

    >>> with_event_semantics(HASHLESS_FIRST, EventSemantics.LAST_COPY).name
    'hashless-first+last-copy'
    >>> with_event_semantics(HASHLESS_FIRST, EventSemantics.MULTISET) == HASHLESS_FIRST
    True
    """
    base = PROFILES.get(profile.name.partition("+")[0], profile)
    if semantics is base.event_semantics:
        return base
    return replace(base, name=f"{base.name}+{semantics.value}", event_semantics=semantics)


def profile_named(name: str) -> Profile:
    """The profile a name means: a key of ``PROFILES``, optionally ``+`` an event semantics.

    >>> profile_named("append+last-copy").event_semantics.value
    'last-copy'
    """
    base_name, plus, semantics_name = name.partition("+") if isinstance(name, str) else ("", "", "")
    # Verify that the name is a known profile, with a known event semantics after a "+"
    if base_name not in PROFILES or (plus and semantics_name not in EVENT_SEMANTICS):
        raise InvalidConfig(
            f"unknown profile {name!r}: use one of {', '.join(PROFILES)}, "
            f"optionally followed by +{' or +'.join(EVENT_SEMANTICS)}"
        )
    profile = PROFILES[base_name]
    return with_event_semantics(profile, EVENT_SEMANTICS[semantics_name]) if plus else profile
