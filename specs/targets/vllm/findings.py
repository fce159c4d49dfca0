"""The known level-2 findings of vLLM's pool: calls the model rejects and vLLM does not.

Each finding is a call the model rejects with a named exception, and what
vLLM does instead (accepts it, or raises something else), with what that
does to a server. docs/vllm-conformance.md tells each one. ``survey_level2``
(``kvpool.specs.targets.vllm.survey``) steps over them to list every one.
"""

import re
from dataclasses import dataclass


def vllm_reaction(error_name: str) -> str:
    """The name of the exception vLLM raised, from a ``VllmRejection`` class name."""
    return error_name[len("Vllm") :] if error_name.startswith("Vllm") else error_name


@dataclass(frozen=True)
class KnownFinding:
    """A precondition vLLM does not enforce the way the model does, already understood.

    A level-2 divergence is this finding when its operation and the model's
    exception match and vLLM's reaction is one of ``vllm_reactions``:
    ``"accepts"`` or the name of the exception vLLM raised. A call can break
    several preconditions at once and vLLM checks them in another order than
    the model (or not at all), so the reactions include what vLLM does about
    the other arguments of such a call.
    """

    key: str
    operation: str
    model_error: str
    vllm_reactions: frozenset[str]
    what_vllm_does: str


def _finding(key: str, op: str, error: str, reactions: str, does: str) -> KnownFinding:
    return KnownFinding(key, op, error, frozenset(reactions.split()), does)


KNOWN_FINDINGS: dict[str, KnownFinding] = {
    f.key: f
    for f in (
        _finding(
            "negative-get",
            "get_new_blocks",
            "InvalidBlockCount",
            "accepts",
            "returns no blocks but raises the free count by the magnitude of the request",
        ),
        _finding(
            "double-free",
            "free_blocks",
            "BlockNotHeld",
            "accepts",
            "ref_cnt goes to -1; the block is not queued a second time and the free "
            "count does not change, but the next get_new_blocks to reach it asserts with "
            "the blocks it popped lost, and a touch takes it to 0 while it stays queued",
        ),
        _finding(
            "over-free",
            "free_blocks",
            "OverFree",
            "accepts",
            "a block held once and listed twice ends at ref_cnt -1, queued once",
        ),
        _finding(
            "touch-unknown-block",
            "touch",
            "UnknownBlock",
            "RuntimeError accepts",
            "a block object of no pool (what an unknown id stands for) fails to leave the "
            "free queue with RuntimeError",
        ),
        _finding(
            "free-unknown-block",
            "free_blocks",
            "UnknownBlock",
            "accepts RuntimeError",
            "a block object of no pool is decremented to -1 and otherwise ignored",
        ),
        _finding(
            "evict-unknown-id",
            "evict_blocks",
            "UnknownBlock",
            "accepts AssertionError IndexError",
            "ids >= N fail an assert; negative ids index Python-style and evict another block",
        ),
        _finding(
            "cache-disabled",
            "cache_full_blocks",
            "CachingDisabled",
            "accepts AssertionError IndexError",
            "the pool does not check enable_caching: it caches anyway",
        ),
        _finding(
            "partial-cache-disabled",
            "cache_partial_block",
            "CachingDisabled",
            "accepts AssertionError OverflowError",
            "the pool does not check enable_caching: it caches anyway",
        ),
        _finding(
            "cache-free-block",
            "cache_full_blocks",
            "BlockNotHeld",
            "accepts AssertionError IndexError",
            "a free block is hashed in place, at a position meant for hash-less blocks",
        ),
        _finding(
            "recache",
            "cache_full_blocks",
            "AlreadyCached",
            "AssertionError",
            "an assert, possibly after the blocks before it were cached",
        ),
        _finding(
            "too-few-hashes",
            "cache_full_blocks",
            "NotEnoughHashes",
            "accepts AssertionError IndexError",
            "IndexError after caching the blocks that have hashes (an assert before 0.24)",
        ),
        _finding(
            "range-beyond-blocks",
            "cache_full_blocks",
            "InvalidBlockRange",
            "accepts AssertionError IndexError",
            "slices the block list: caches the blocks that exist, or fails the mask assert",
        ),
        _finding(
            "duplicate-block",
            "cache_full_blocks",
            "DuplicateBlock",
            "accepts AssertionError",
            "the second position re-caches the block",
        ),
        _finding(
            "full-block-size",
            "cache_full_blocks",
            "InvalidBlockSize",
            "accepts AssertionError IndexError",
            "nothing checked when there is nothing to cache; an assert otherwise (before "
            "0.10.1 an IndexError when the range also starts past the blocks: those "
            "releases read the block before the range first)",
        ),
        _finding(
            "full-negative-group",
            "cache_full_blocks",
            "InvalidGroup",
            "accepts AssertionError IndexError OverflowError",
            "nothing checked when there is nothing to cache; OverflowError packing the group",
        ),
        _finding(
            "partial-negative-group",
            "cache_partial_block",
            "InvalidGroup",
            "accepts AssertionError OverflowError",
            "OverflowError packing the group id (or an assert on another argument)",
        ),
        _finding(
            "mask-length",
            "cache_full_blocks",
            "InvalidBlockMask",
            "accepts AssertionError IndexError",
            "nothing checked when there is nothing to cache; an assert otherwise (before "
            "0.10.1 an IndexError when the range also starts past the blocks: those "
            "releases read the block before the range first)",
        ),
        _finding(
            "partial-on-boundary",
            "cache_partial_block",
            "InvalidPartialBlock",
            "accepts AssertionError",
            "0.32+ accept a prefix ending on a block boundary; any release asserts on a "
            "prefix that is not a whole number of hash blocks",
        ),
        _finding(
            "partial-too-few-hashes",
            "cache_partial_block",
            "NotEnoughHashes",
            "AssertionError",
            "an assert",
        ),
        _finding(
            "partial-free-block",
            "cache_partial_block",
            "BlockNotHeld",
            "accepts AssertionError",
            "a free block gets a partial key in place (or an assert on another argument)",
        ),
        _finding(
            "block-size",
            "cache_partial_block",
            "InvalidBlockSize",
            "accepts AssertionError",
            "0.32+ accept block_size == hash_block_size; earlier releases assert",
        ),
        # vLLM 0.33's operations (docs/vllm-conformance.md "0.33 operations")
        _finding(
            "unpin-not-held",
            "unpin_blocks",
            "BlockNotHeld",
            "AssertionError",
            "an assert; the blocks listed before the free one were already released and "
            "given the watcher, but never queued: leaked (free count unchanged)",
        ),
        _finding(
            "unpin-over-listed",
            "unpin_blocks",
            "OverFree",
            "AssertionError",
            "an assert once the count reaches 0; the block is then neither held nor queued",
        ),
        _finding(
            "unpin-unknown-block",
            "unpin_blocks",
            "UnknownBlock",
            "AssertionError accepts",
            "a block object of no pool (what an unknown id stands for) fails the held assert",
        ),
        _finding(
            "move-to-unheld-block",
            "move_block_hashes",
            "BlockNotHeld",
            "accepts",
            "the keys move onto a free block (a keyed block in the free queue) or onto the "
            "null block (a lookup then returns the null block as a hit); with a keyless "
            "source nothing happens",
        ),
        _finding(
            "move-to-keyed-block",
            "move_block_hashes",
            "AlreadyCached",
            "AssertionError",
            "an assert before anything changes (python -O accepts and corrupts the map)",
        ),
        _finding(
            "move-unknown-block",
            "move_block_hashes",
            "UnknownBlock",
            "accepts AssertionError",
            "the keys are inserted pointing at a block object of no pool",
        ),
        _finding(
            "writable-unknown-block",
            "is_block_writable",
            "UnknownBlock",
            "accepts",
            "answers for a block object of no pool",
        ),
        _finding(
            "emit-negative-group",
            "emit_cached_block_events",
            "InvalidGroup",
            "accepts AssertionError",
            "an event with a negative group index (nothing is checked with events off); "
            "when the block size is wrong too, vLLM's block-size assert fails first (the "
            "model checks the group first)",
        ),
        _finding(
            "emit-block-size",
            "emit_cached_block_events",
            "InvalidBlockSize",
            "accepts AssertionError",
            "nothing checked with events off or no blocks; an assert otherwise",
        ),
        _finding(
            "emit-negative-count",
            "emit_cached_block_events",
            "InvalidBlockCount",
            "accepts",
            "emits nothing",
        ),
        _finding(
            "emit-too-few-hashes",
            "emit_cached_block_events",
            "NotEnoughHashes",
            "accepts IndexError",
            "IndexError with events on (nothing checked with events off)",
        ),
        _finding(
            "negative-group",
            "get_cached_block",
            "InvalidGroup",
            "OverflowError",
            "OverflowError packing the group id into 4 bytes",
        ),
    )
}
"""The level-2 divergences of vLLM's pool, by key (docs/vllm-conformance.md, docs/semantics.md)."""


REQUEST_FINDINGS: dict[str, KnownFinding] = {
    f.key: f
    for f in (
        _finding(
            "manager-no-new-tokens",
            "allocate_slots",
            "NoNewTokens",
            "accepts",
            "0.33 raises ValueError only when there are no new tokens and no computed tokens "
            "to adopt: zero new tokens with a hit adopts the hit (a deliberate 0.33 extension "
            "for asynchronous KV loads), and a negative count allocates nothing",
        ),
        _finding(
            "manager-negative-count",
            "allocate_slots",
            "InvalidTokenCount",
            "accepts",
            "a negative num_new_computed_tokens or num_lookahead_tokens is not checked: the "
            "call allocates as if the count were smaller",
        ),
        _finding(
            "manager-hash-block-size",
            "get_computed_blocks allocate_slots",
            "HashBlockSizeMismatch",
            "accepts",
            "vLLM's Request carries no hash block size: hashes of other-sized hash blocks "
            "are read as the pool's, so a lookup hits nothing and an allocation keys its "
            "blocks with hashes naming other prefixes than the blocks hold",
        ),
        _finding(
            "manager-hit-groups",
            "allocate_slots",
            "InvalidHit",
            "accepts",
            "hit lists are zipped with the groups: extra lists are ignored",
        ),
        _finding(
            "manager-unknown-hit-block",
            "allocate_slots",
            "UnknownBlock",
            "accepts RuntimeError",
            "a hit block of no pool (what an unknown id stands for) fails to leave the free "
            "queue with RuntimeError when touched, and is ignored when the call adopts no hit",
        ),
        _finding(
            "manager-cache-range",
            "cache_blocks",
            "InvalidBlockRange",
            "accepts",
            "caching past the request's blocks is not checked: nothing is cached beyond them",
        ),
        _finding(
            "manager-evict-unknown-id",
            "evict_blocks",
            "UnknownBlock",
            "accepts AssertionError IndexError",
            "ids >= N fail an assert; negative ids index Python-style and evict another block "
            "(the pool's evict-unknown-id, reached through the manager)",
        ),
    )
}
"""The known level-2 findings of vLLM 0.33's ``KVCacheManager`` (the request layer), by
key; an operation field may name several operations. docs/vllm-conformance.md tells each."""


@dataclass(frozen=True)
class Level2Divergence:
    """A level-2 divergence taken apart: which call, what the model and vLLM did."""

    operation: str
    model_error: str
    vllm_reaction: str
    """``"accepts"``, or the name of the exception vLLM raised."""
    finding: KnownFinding | None
    """The known finding it is, or None: a new one."""


_REJECTION = re.compile(
    r"^(?P<op>\w+)\(.*?: the model rejects it with (?P<error>\w+), "
    r"the target (?:(?P<accepts>accepts it)|with (?P<raised>\w+))\s*$",
    re.DOTALL,
)


def classify_divergence(
    failure: str | None, catalogue: dict[str, KnownFinding] | None = None
) -> Level2Divergence | None:
    """Match a divergence message against ``catalogue`` (default ``KNOWN_FINDINGS``).

    Returns None when the message is not a rejection mismatch at all (a
    wrong result, state or event: never a known finding), otherwise the
    parsed divergence with its known finding, if any.
    """
    if not failure:
        return None
    first_line = failure.strip().splitlines()[0]
    found = _REJECTION.match(first_line)
    if found is None:
        return None
    reaction = "accepts" if found["accepts"] else vllm_reaction(found["raised"])
    known = known_finding(found["op"], found["error"], reaction, catalogue)
    return Level2Divergence(found["op"], found["error"], reaction, known)


def known_finding(
    operation: str,
    model_error: str,
    reaction: str,
    catalogue: dict[str, KnownFinding] | None = None,
) -> KnownFinding | None:
    """The known finding for this operation, model exception and vLLM reaction, if any
    (in ``catalogue``, default the pool's ``KNOWN_FINDINGS``)."""
    for known in (KNOWN_FINDINGS if catalogue is None else catalogue).values():
        if (
            operation in known.operation.split()
            and known.model_error == model_error
            and reaction in known.vllm_reactions
        ):
            return known
    return None
