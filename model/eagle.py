"""EAGLE and multi-module MTP in the KV cache manager, one pure function per rule.

An EAGLE drafter reads the hidden state of the token before the generation
point, so a cache hit leaves out its last matched block and the drafter
recomputes it. With several KV cache groups the groups must agree on one hit:
each EAGLE group's search may look one block past the candidate length (the
"peek") and drop back to it, so the drop does not shorten the common hit by
one block per group. Multi-module MTP (``num_prefill_lookahead`` speculative
tokens) re-prefills up to ``num_prefill_lookahead - 1`` tokens past a chunk's
end, so those last tokens are not final and are not cached yet.

Groups may be flagged as EAGLE groups (vLLM's ``is_eagle_group``,
``eagle_groups`` here): with ``use_eagle`` the flagged groups drop EAGLE's
block, or every group when none is flagged; without it no group drops. Groups
of one spec are searched together, so one flagged group makes its equal
siblings EAGLE groups too (``group_flags``).

Source: vLLM 0.33.0, ``vllm/v1/core/kv_cache_coordinator.py``
(``KVCacheCoordinator.__init__``: ``num_reprefillable_tokens`` and the
scheduler-block check; ``get_num_cacheable_tokens`` of ``KVCacheCoordinator``
and of ``HybridKVCacheCoordinator``; ``HybridKVCacheCoordinator.find_longest_cache_hit``:
the peek and ``eagle_verified``) and ``vllm/v1/core/kv_cache_utils.py``
(``eagle_proof_margin``); the flags: ``KVCacheCoordinator.__init__``
(``eagle_group_ids``, ``drop_eagle_group_ids``) and
``HybridKVCacheCoordinator.verify_and_split_kv_cache_groups`` (the spec's
groups share the flag). docs/semantics.md, "EAGLE with several groups".
"""

from collections.abc import Sequence

from kvpool.model.errors import InvalidManagerConfig
from kvpool.model.single_type import AttentionType, KVCacheSpec


def num_reprefillable_tokens(num_prefill_lookahead: int) -> int:
    """How many of the last computed tokens multi-module MTP may prefill again.

    >>> num_reprefillable_tokens(0), num_reprefillable_tokens(1), num_reprefillable_tokens(3)
    (0, 0, 2)
    """
    return max(0, num_prefill_lookahead - 1)


def group_flags(
    specs: Sequence[KVCacheSpec], use_eagle: bool, eagle_groups: Sequence[int] = ()
) -> tuple[bool, ...]:
    """Per group, whether it drops EAGLE's block: none without ``use_eagle``; else the
    flagged groups (every group when none is flagged) and every group of a spec one of
    them has.

    >>> from kvpool.model.single_type import full_attention, sliding_window
    >>> specs = [full_attention(4), sliding_window(4, 4), sliding_window(4, 4)]
    >>> group_flags(specs, True, [2]), group_flags(specs, True), group_flags(specs, False, [2])
    ((False, True, True), (True, True, True), (False, False, False))
    """
    if not use_eagle:
        return tuple(False for _ in specs)
    if not eagle_groups:
        return tuple(True for _ in specs)
    flagged = [specs[g] for g in eagle_groups]
    return tuple(any(spec == f for f in flagged) for spec in specs)


def verify_eagle_groups(specs: Sequence[KVCacheSpec], eagle_groups: Sequence[int]) -> None:
    """Raise InvalidManagerConfig unless every flagged group exists, each named once.

    >>> from kvpool.model.single_type import full_attention
    >>> verify_eagle_groups([full_attention(4)], [1])
    Traceback (most recent call last):
    ...
    kvpool.model.errors.InvalidManagerConfig: eagle_groups=[1]: not groups of 1
    """
    ids = list(eagle_groups)
    if any(type(g) is not int or not 0 <= g < len(specs) for g in ids) or len(set(ids)) < len(ids):
        raise InvalidManagerConfig(f"eagle_groups={ids!r:.60}: not groups of {len(specs)}")


def verify_eagle_config(
    specs: Sequence[KVCacheSpec],
    enable_caching: bool,
    use_eagle: bool,
    num_prefill_lookahead: int,
    scheduler_block_size: int,
    eagle_groups: Sequence[int] = (),
) -> None:
    """Raise InvalidManagerConfig for an EAGLE or look-ahead setting vLLM 0.33 cannot run.

    * a look-ahead that is not an int, or negative (vLLM reads a negative one
      as 0; kvpool names it);
    * EAGLE on a chunked-local group with prefix caching: vLLM 0.33's
      chunked-local finder asserts it is never asked to drop a block;
    * EAGLE (or a group flagged as EAGLE's, even without ``use_eagle``) with
      prefix caching and a look-ahead longer than ``scheduler_block_size``
      (``kvpool.model.geometry``): hits land on scheduler-block boundaries, so
      the dropped tail is a scheduler block and must hold every re-prefilled
      token.

    >>> from kvpool.model.single_type import full_attention
    >>> verify_eagle_config([full_attention(2)], True, True, 2, 2) is None
    True
    """
    # Verify that the look-ahead is a count, not negative
    if type(num_prefill_lookahead) is not int:
        raise InvalidManagerConfig(
            f"num_prefill_lookahead must be an int, got {type(num_prefill_lookahead).__name__}"
        )
    if num_prefill_lookahead < 0:
        raise InvalidManagerConfig(f"num_prefill_lookahead={num_prefill_lookahead} is negative")
    if not ((use_eagle or eagle_groups) and enable_caching):
        return
    # Verify that no chunked-local group is asked to drop EAGLE's block
    flags = group_flags(specs, use_eagle, eagle_groups)
    if any(
        s.attention is AttentionType.CHUNKED_LOCAL for s, f in zip(specs, flags, strict=True) if f
    ):
        raise InvalidManagerConfig("EAGLE with prefix caching cannot have a chunked-local group")
    # Verify that a scheduler block holds the tokens multi-module MTP prefills again
    if scheduler_block_size < num_prefill_lookahead:
        raise InvalidManagerConfig(
            "multi-module MTP with prefix caching needs "
            f"scheduler_block_size={scheduler_block_size} "
            f">= num_prefill_lookahead={num_prefill_lookahead}"
        )


def peek(spec: KVCacheSpec, max_length: int, num_hashed_tokens: int) -> int:
    """How far an EAGLE group's search in a hybrid may reach for a candidate of ``max_length``.

    One block past it, within the request's hashed tokens; a Mamba group does
    not peek (its finder never drops a block, so the hit would grow past the
    candidate).

    >>> from kvpool.model.single_type import full_attention, mamba
    >>> peek(full_attention(4), 8, 16), peek(full_attention(4), 8, 10), peek(mamba(16), 8, 16)
    (12, 10, 8)
    """
    if spec.attention is AttentionType.MAMBA:
        return max_length
    return min(max_length + spec.block_size, num_hashed_tokens)


def cacheable_tokens(
    num_groups: int,
    block_size: int,
    alignment: int,
    use_eagle: bool,
    fine_grained: bool,
    reprefillable: int,
    num_tokens: int,
) -> int:
    """How many of ``num_tokens`` computed tokens a group may cache.

    One group (vLLM's unitary coordinator): all but the ``reprefillable``
    last. Several (the hybrid one): rounded down to ``alignment`` (the
    scheduler block size, ``kvpool.model.geometry``), which a hit always
    lands on (not rounded with fine-grained hits); an EAGLE group of
    ``block_size``-token blocks instead takes all but the ``reprefillable``
    last, up to one of its blocks past the last aligned boundary within them,
    once an aligned boundary is computed: it matches one block past the
    boundary and drops it. Only the prompt's partial tail and the full blocks
    within the count depend on it.

    >>> cacheable_tokens(1, 4, 4, True, False, 2, 9), cacheable_tokens(2, 4, 4, False, False, 2, 9)
    (7, 8)
    >>> cacheable_tokens(2, 4, 4, True, False, 2, 9), cacheable_tokens(2, 4, 4, True, False, 2, 3)
    (7, 0)
    >>> cacheable_tokens(2, 4, 8, False, False, 0, 15)
    8
    >>> cacheable_tokens(2, 4, 8, True, False, 0, 15)
    12
    """
    if num_groups == 1:
        return max(0, num_tokens - reprefillable)
    aligned = num_tokens if fine_grained else num_tokens // alignment * alignment
    if use_eagle and aligned > 0:
        final = max(0, num_tokens - reprefillable)
        final_aligned = final if fine_grained else final // alignment * alignment
        return min(final, final_aligned + block_size)
    return aligned
