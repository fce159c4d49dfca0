"""The known level-2 findings of SGLang's radix caches: calls the model rejects and a core does not.

Each finding is a call the model rejects with a named exception, the cores
that accept it (``REFUSALS`` in ``kvpool.specs.targets.sglang.radix`` says
how the others refuse it), and what accepting does. docs/semantics.md
("SGLang's radix cache") tells each one. A check can step over findings
with ``check_radix(..., skip=...)`` (``skip_for``): the calls are then not
sent, as at level 1, so a run can go on to look for the next divergence.
"""

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownFinding:
    """A precondition some SGLang cores do not enforce the way the model does."""

    key: str
    operation: str
    model_error: str
    cores: frozenset[str]
    """The cores that accept the call (0.5.23)."""
    what_sglang_does: str


def _finding(key: str, op: str, error: str, cores: str, does: str) -> KnownFinding:
    return KnownFinding(key, op, error, frozenset(cores.split()), does)


KNOWN_FINDINGS: dict[str, KnownFinding] = {
    f.key: f
    for f in (
        _finding(
            "unlock-not-locked",
            "unlock",
            "NotLocked",
            "legacy",
            "RadixCache.dec_lock_ref takes the count to -1 and changes no size; the node is "
            "evictable again, and a later lock protects nothing",
        ),
        _finding(
            "lock-gone-node",
            "lock",
            "UnknownNode",
            "legacy",
            "RadixCache.inc_lock_ref walks the evicted node's old parents: the evictable size "
            "goes down by tokens no longer cached (it can go negative)",
        ),
        _finding(
            "unlock-gone-node",
            "unlock",
            "UnknownNode",
            "legacy",
            "RadixCache.dec_lock_ref walks the evicted node's old parents: the sizes move for "
            "tokens no longer cached (after a reset it asserts, after moving them)",
        ),
        _finding(
            "too-few-slots",
            "insert",
            "TooFewSlots",
            "legacy python",
            "the node keeps fewer tokens' slots than it has tokens: a hit on it claims tokens "
            "it serves no KV for; RadixCache also counts the tokens as evictable, so its size "
            "and the tree disagree from then on (the Rust core refuses the call)",
        ),
        _finding(
            "negative-prev-prefix-len",
            "insert",
            "InvalidPrefixLength",
            "legacy python",
            "the Python core frees every duplicate as with 0; RadixCache's request layer frees "
            "row[-1:prefix_len], the last slot only (the Rust core refuses the call)",
        ),
        _finding(
            "evict-negative",
            "evict",
            "InvalidTokenCount",
            "legacy python rust",
            "evicts nothing and returns 0",
        ),
    )
}

RUST_REFUSES_AFTER_PANIC = (
    "After a panic (how it refuses an unmatched unlock), the Rust core refuses every later "
    "call with RuntimeError('Rust TreeCore mutex poisoned; refusing to reuse state after an "
    "earlier panic'): a server that catches the error has lost its cache. The adapter "
    "rebuilds the cache by replaying the calls it accepted."
)
"""Not a level-2 divergence (the refusal itself matches the model): what follows one."""


def for_core(core: str) -> list[KnownFinding]:
    """The findings a core shows."""
    return [f for f in KNOWN_FINDINGS.values() if core in f.cores]


def skip_for(findings: Iterable[str | KnownFinding]) -> frozenset[tuple[str, str]]:
    """The (operation, model error) pairs ``check_radix(skip=...)`` steps over."""
    pairs = set()
    for item in findings:
        finding = item if isinstance(item, KnownFinding) else KNOWN_FINDINGS[item]
        pairs.add((finding.operation, finding.model_error))
    return frozenset(pairs)
