"""The safety property of a prefix cache: it never serves wrong KV.

The pool's invariants (``kvpool.specs.pool.invariants``) say the bookkeeping is
consistent; they cannot say whether a block *holds* what its hash claims.
Here the ground truth is explicit: ``KVTruth`` records, for every physical
block and every slot in it, which KV was last written there: the group and
the full context the KV was computed in (the *provenance*: the LoRA adapter,
the cache salt, every token up to and including that position, and the
multimodal inputs placed before it). A position's KV depends on exactly
that context, so two writes with the same provenance are interchangeable,
and any other write is wrong KV for whoever reads it.

Three properties, each a predicate returning a reason or None:

* ``cached_blocks_hold_their_prefix``: every block reachable through the hash
  map holds, slot by slot, the KV of the prefix its hash names;
* ``requests_read_their_own_kv``: every computed position of every running
  request's block table holds that request's own KV;
* ``hit_matches_request`` (checked when a hit is returned) and
  ``write_is_exclusive`` (checked at each write): a hit is the request's own
  KV, and no request writes into a block another request holds, or into
  the null block.

What a hash names comes from the *hash oracle*: every hash a request was
given, with the content it was computed from. Two contents under one hash
would be a collision of the hash spec, and is reported too.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvpool.model import NULL_BLOCK_ID, PoolState
from kvpool.model.request import Request
from kvpool.specs.errors import InvariantViolation

Reason = str | None


@dataclass(frozen=True)
class Content:
    """Everything besides position that a prefix's KV depends on, and the prefix's tokens.

    ``mm`` lists (identifier, offset) of every multimodal input starting
    inside the prefix: an identifier is a hash of the input's content, so it
    also fixes its length.
    """

    lora: tuple[str, str] | None
    salt: str | None
    tokens: tuple[int, ...]
    mm: tuple[tuple[str, int], ...] = ()
    embeds: tuple[bytes, ...] | None = None
    """The prompt embeddings of a request sent as embeddings (None otherwise)."""

    def prefix(self, num_tokens: int) -> "Content":
        """The content of the first ``num_tokens`` tokens."""
        return Content(
            self.lora,
            self.salt,
            self.tokens[:num_tokens],
            tuple(m for m in self.mm if m[1] < num_tokens),
            None if self.embeds is None else self.embeds[:num_tokens],
        )


def request_content(request: Request, extra_tokens: Sequence[int] = ()) -> Content:
    """The request's whole content, with ``extra_tokens`` (drafts) after its own tokens."""
    lora = None if request.lora is None else (request.lora.name, request.lora.path)
    return Content(
        lora=lora,
        salt=request.cache_salt or None,
        tokens=request.all_token_ids + tuple(extra_tokens),
        mm=tuple((m.identifier, m.offset) for m in request.mm_inputs),
        embeds=request.prompt_embeds or None,
    )


Slot = tuple[int, Content]
"""What one slot of a block holds: (group, provenance). The provenance of position
p is the content of the first p + 1 tokens."""

STATE = -1
"""The slot a recurrent state is written to (a Mamba "align" group's block holds one state,
not a token's KV per slot); its provenance is the content of every token the state read."""


class RequestInvariantViolation(InvariantViolation):
    """A request-level safety property failed."""


@dataclass
class KVTruth:
    """The KV actually written into each block, and what each hash names."""

    slots: dict[int, dict[int, Slot]] = field(default_factory=dict)
    """block id -> slot index -> what was last written there."""
    oracle: dict[bytes, tuple[int, Content]] = field(default_factory=dict)
    """hash -> (tokens it covers, content it was computed from)."""
    collisions: list[str] = field(default_factory=list)
    target_oracle: dict[bytes, tuple[int, Content]] = field(default_factory=dict)
    """For a target that hashes requests itself: its hash -> what it was computed from."""
    target_hash_of: dict[tuple[int, Content], bytes] = field(default_factory=dict)
    """The inverse: a prefix (tokens covered, content) -> the target's hash of it."""

    def learn_hashes(self, request: Request) -> None:
        """Record what each of the request's hashes names."""
        content = request_content(request)
        hbs = request.hash_block_size
        for i, block_hash in enumerate(request.block_hashes):
            n = (i + 1) * hbs
            named = (n, content.prefix(n))
            known = self.oracle.setdefault(block_hash, named)
            if known != named:
                self.collisions.append(f"hash {block_hash.hex()[:16]} names {known} and {named}")

    def write(self, group: int, block: int, slot: int, provenance: Content) -> None:
        """Record that KV with ``provenance`` was written into ``block[slot]`` for ``group``."""
        self.slots.setdefault(block, {})[slot] = (group, provenance)

    def copy(self, source: int, destination: int) -> None:
        """Record a block copy (copy-on-write): ``destination`` now holds what ``source`` holds."""
        self.slots[destination] = dict(self.slots.get(source, {}))

    def holds(self, block: int, slot: int) -> Slot | None:
        """What ``block[slot]`` holds, or None if nothing was ever written there."""
        return self.slots.get(block, {}).get(slot)


def target_hashes_name_prefixes(
    truth: KVTruth, request: Request, target_hashes: Sequence[bytes]
) -> Reason:
    """A target hashing requests itself gives equal prefixes equal hashes, others different ones.

    The values of the target's hashes are its own (vLLM's hasher encodes
    otherwise than kvpool's); what they must agree on is which prefixes are
    the same. Two different prefixes under one hash (a salt, an adapter or
    an image left out of the hash) serve one request's KV to another; one
    prefix under two hashes never hits. Checked, and learnt, each time the
    target hashes a request; prefixes are compared by their whole content
    (tokens and extra keys), as ``KVTruth`` records them.
    """
    if len(target_hashes) != len(request.block_hashes):
        return (
            f"the target hashed {len(target_hashes)} full blocks of request "
            f"{request.request_id} ({request.num_tokens} tokens in blocks of "
            f"{request.hash_block_size}), not {len(request.block_hashes)}"
        )
    content = request_content(request)
    for i, raw in enumerate(target_hashes):
        target_hash = bytes(raw)
        n = (i + 1) * request.hash_block_size
        named = (n, content.prefix(n))
        known = truth.target_oracle.setdefault(target_hash, named)
        if known != named:
            return (
                f"different prefixes hash equal: the target's hash {target_hash.hex()[:16]} of "
                f"request {request.request_id}'s block {i} names {_describe_prefix(named)}, and "
                f"already named {_describe_prefix(known)}"
            )
        earlier = truth.target_hash_of.setdefault(named, target_hash)
        if earlier != target_hash:
            return (
                f"equal prefixes hash differently: block {i} of request {request.request_id} "
                f"({_describe_prefix(named)}) hashes to {target_hash.hex()[:16]}, the same "
                f"prefix hashed to {earlier.hex()[:16]} before"
            )
    return None


def _describe_prefix(prefix: tuple[int, Content]) -> str:
    _, content = prefix
    extras = [
        f"{name}={value!r}"
        for name, value in (
            ("lora", content.lora),
            ("salt", content.salt),
            ("mm", content.mm or None),
            ("embeds", content.embeds),
        )
        if value is not None
    ]
    return f"tokens {list(content.tokens)}" + (f" ({', '.join(extras)})" if extras else "")


def cached_blocks_hold_their_prefix(
    truth: KVTruth, pool: PoolState, block_sizes: Sequence[int], states: Sequence[bool] = ()
) -> Reason:
    """Every block the hash map leads to holds, in every slot, the KV of the prefix its key names.

    A block that fails is served to the next request with that prefix: the
    model attends to another request's (or another adapter's, or another
    tenant's) keys and values and generates from them, with no error
    anywhere. A group marked in ``states`` holds recurrent states: its block
    must hold the state after exactly the prefix its key names.
    """
    if truth.collisions:
        return truth.collisions[0]
    for (block_hash, group), block_ids in pool.cached.items():
        if block_hash not in truth.oracle:
            return f"the map holds a hash no request was given: {block_hash.hex()[:16]}"
        num_tokens, content = truth.oracle[block_hash]
        block_size = block_sizes[group]
        if _is_state(states, group):
            for block in block_ids:
                actual = truth.holds(block, STATE)
                if actual != (group, content):
                    return (
                        f"block {block} is cached under {block_hash.hex()[:16]} (group {group}, "
                        f"tokens {content.tokens}) but holds the state {_describe(actual)}"
                    )
            continue
        # a partial key (vLLM 0.33) names a prefix ending inside its block
        start = (num_tokens - 1) // block_size * block_size
        for block in block_ids:
            wrong = _first_wrong_slot(truth, block, group, content, start, num_tokens)
            if wrong is not None:
                j, actual = wrong
                return (
                    f"block {block} is cached under {block_hash.hex()[:16]} (group {group}, "
                    f"tokens {content.tokens}) but slot {j} holds "
                    f"{_describe(actual)}, not the KV of position {start + j}"
                )
    return None


def _first_wrong_slot(
    truth: KVTruth, block: int, group: int, content: Content, start: int, end: int
) -> tuple[int, Slot | None] | None:
    """The first slot of ``block`` (which starts at position ``start``) that does not hold
    ``content``'s KV for its position, up to position ``end``: its index and what it holds."""
    for j in range(end - start):
        actual = truth.holds(block, j)
        if actual != (group, content.prefix(start + j + 1)):
            return j, actual
    return None


def requests_read_their_own_kv(
    truth: KVTruth,
    requests: Mapping[str, Request],
    tables: Mapping[str, Sequence[Sequence[int]]],
    block_sizes: Sequence[int],
    states: Sequence[bool] = (),
) -> Reason:
    """Every computed position of every running request's blocks holds the request's own KV.

    ``tables`` maps each running request to its block table per group. A
    position that fails is read by the request's attention as if it were
    its own past: generation silently goes wrong. In a group marked in
    ``states`` the block of the last computed token holds the state after
    every computed token (the next step starts from it).
    """
    for rid, groups in tables.items():
        request = requests[rid]
        content = request_content(request)
        for group, blocks in enumerate(groups):
            size = block_sizes[group]
            if _is_state(states, group):
                computed = request.num_computed_tokens
                index = (computed - 1) // size
                if computed == 0 or index >= len(blocks):
                    continue
                actual = truth.holds(blocks[index], STATE)
                if actual != (group, content.prefix(computed)):
                    return (
                        f"request {rid} has computed {computed} tokens but its block "
                        f"{blocks[index]} (group {group}, index {index}) holds the state "
                        f"{_describe(actual)}"
                    )
                continue
            for i, block in enumerate(blocks):
                if block == NULL_BLOCK_ID:
                    continue
                for j in range(size):
                    position = i * size + j
                    if position >= request.num_computed_tokens:
                        break
                    expected = (group, content.prefix(position + 1))
                    actual = truth.holds(block, j)
                    if actual != expected:
                        return (
                            f"request {rid} has computed {request.num_computed_tokens} tokens "
                            f"but its block {block} (group {group}, index {i}) slot {j} holds "
                            f"{_describe(actual)}, not its position {position}"
                        )
    return None


def hit_matches_request(
    truth: KVTruth,
    request: Request,
    hit: Sequence[Sequence[int]],
    block_sizes: Sequence[int],
    num_tokens: int | None = None,
    states: Sequence[bool] = (),
) -> Reason:
    """Every block of a cache hit holds the requesting request's own KV at its position.

    A hit that fails is computed-on-arrival KV for the wrong prefix: the
    request skips computing those tokens and reads someone else's. With
    ``num_tokens`` only the hit's positions are checked (a fine-grained hit
    ends inside its last block). In a group marked in ``states`` a hit block
    at index i holds the state after the request's first (i + 1) blocks.
    """
    content = request_content(request)
    for group, blocks in enumerate(hit):
        size = block_sizes[group]
        for i, block in enumerate(blocks):
            if block == NULL_BLOCK_ID:
                continue
            if _is_state(states, group):
                # a hit may end inside a Mamba block (kvpool.model.mamba_fine): its last block
                # holds the state after exactly the hit's tokens
                end = (i + 1) * size if num_tokens is None else min((i + 1) * size, num_tokens)
                actual = truth.holds(block, STATE)
                if actual != (group, content.prefix(end)):
                    return (
                        f"the hit for request {request.request_id} gives block {block} (group "
                        f"{group}) at index {i}, which holds the state {_describe(actual)}, not "
                        f"that of its first {end} tokens"
                    )
                continue
            for j in range(size):
                position = i * size + j
                if num_tokens is not None and position >= num_tokens:
                    break
                expected = (group, content.prefix(position + 1))
                actual = truth.holds(block, j)
                if actual != expected:
                    return (
                        f"the hit for request {request.request_id} gives block {block} (group "
                        f"{group}) at index {i}, whose slot {j} holds {_describe(actual)}, not "
                        f"its position {position}"
                    )
    return None


def copy_serves_source_prefix(
    truth: KVTruth,
    request: Request,
    source: int,
    index: int,
    num_tokens: int,
    group: int,
    block_size: int,
) -> Reason:
    """When a copy-on-write copy runs, its source holds the request's KV for every hit
    position in the block: the copy then serves exactly the tokens of its source prefix.

    ``index`` is the block's place in the request's table, ``num_tokens`` the
    request's hit. A source that fails was reused or overwritten while the
    copy waited: the request reads another prefix's KV as its own.
    """
    start = index * block_size
    wrong = _first_wrong_slot(truth, source, group, request_content(request), start, num_tokens)
    if wrong is None:
        return None
    j, actual = wrong
    return (
        f"the copy of block {source} for request {request.request_id} (group {group}, "
        f"index {index}) runs when its slot {j} holds {_describe(actual)}, not "
        f"position {start + j}"
    )


def copy_serves_source_state(
    truth: KVTruth, request: Request, source: int, num_tokens: int, group: int
) -> Reason:
    """When the copy of a Mamba state a hit ends inside runs, its source holds the state after
    exactly the hit's ``num_tokens`` tokens: the copy then resumes the request there.

    A source that fails was overwritten or reused while the copy waited: the request
    resumes from another prefix's state.
    """
    actual = truth.holds(source, STATE)
    if actual == (group, request_content(request).prefix(num_tokens)):
        return None
    return (
        f"the copy of block {source} for request {request.request_id} (group {group}) runs "
        f"when it holds the state {_describe(actual)}, not that of its first {num_tokens} tokens"
    )


def ref_counts_match_tables(
    pool: PoolState,
    tables: Mapping[str, Sequence[Sequence[int]]],
    retained: Sequence[int] = (),
) -> Reason:
    """Every real block is held exactly as many times as request block tables list it,
    plus once per end of a pending copy-on-write copy that retains it (``retained``).

    More references than listings is a leak: the block never returns to the
    free queue. Fewer is worse: the block is free (or about to be) while a
    request still reads it, or a copy's source while the copy waits, and the
    next allocation overwrites its KV.
    """
    listed: dict[int, int] = {}
    for block in retained:
        listed[block] = listed.get(block, 0) + 1
    for groups in tables.values():
        for blocks in groups:
            for block in blocks:
                if block != NULL_BLOCK_ID:
                    listed[block] = listed.get(block, 0) + 1
    for block, state in enumerate(pool.blocks):
        if block == NULL_BLOCK_ID:
            continue
        if state.ref_cnt != listed.get(block, 0):
            return (
                f"block {block} has ref count {state.ref_cnt} but request tables list it "
                f"{listed.get(block, 0)} time(s)"
            )
    return None


def write_is_exclusive(
    block: int, writer: str, tables: Mapping[str, Sequence[Sequence[int]]]
) -> Reason:
    """A request writes only into real blocks no other running request holds.

    Writing into a shared block changes KV another request is reading (or
    the null block every request shares as a placeholder).
    """
    if block == NULL_BLOCK_ID:
        return f"request {writer} writes into the null block"
    for rid, groups in tables.items():
        if rid != writer and any(block in blocks for blocks in groups):
            return f"request {writer} writes into block {block}, which request {rid} holds"
    return None


def _is_state(states: Sequence[bool], group: int) -> bool:
    return group < len(states) and states[group]


def check(name_and_reason: tuple[str, Reason]) -> None:
    """Raise RequestInvariantViolation if the reason is not None."""
    name, reason = name_and_reason
    if reason is None:
        return
    doc = (globals()[name].__doc__ or "").strip()
    raise RequestInvariantViolation(name, reason, doc)


def _describe(slot: Slot | None) -> str:
    if slot is None:
        return "nothing ever written"
    group, content = slot
    return (
        f"KV of group {group} for tokens {content.tokens} "
        f"(lora={content.lora}, salt={content.salt}, mm={content.mm})"
    )
