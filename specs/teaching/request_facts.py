"""What a request-layer step did, worked out from the model, as data and as plain text.

The pictures (``request_pictures``), the terminal (``request_explain``) and the
plain-text figures of the docs all read these facts, so they cannot disagree:

* ``chain``: what went into each block hash of a request (the hash chain);
* ``hit_rows``: a lookup position by position, for each group: hit, skipped
  (a null block), cached but not used, missed, or beyond the hit limit;
* ``admission``: what ``allocate_slots`` counted and decided;
* ``release``: where each block freed by a request went.

Each is computed by calling the model's own functions (``single_type`` and
``manager``) on the state before the step, so a fact is what the model did.

>>> from kvpool.model import request
>>> [row.tokens for row in chain(request.new_request("a", b"ABCDE", 2))]
['AB', 'CD']
"""

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpool.model import NULL_BLOCK_ID, BlockHash, PoolState
from kvpool.model import manager as mm
from kvpool.model import single_type as single
from kvpool.model.hashing import NONE_HASH, Encodable, block_extra_keys, encode_extra_key
from kvpool.model.manager import Blocks
from kvpool.model.pool import get_cached_block, hashes_at_block_size
from kvpool.model.profiles import FreeOrder
from kvpool.model.request import Request
from kvpool.model.single_type import AttentionType, KVCacheSpec
from kvpool.specs.protocol.codec import Json
from kvpool.specs.teaching.request_scenarios import Outcome, World, decode_args, tokens_text

# --------------------------------------------------------------------------
# The hash chain
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ChainLink:
    """One hash block of a request: the inputs of its hash, and the hash."""

    index: int
    start: int
    tokens: str
    extra_keys: tuple[tuple[Encodable, ...], ...]
    parent: BlockHash
    block_hash: BlockHash


def chain(request: Request) -> list[ChainLink]:
    """Each full hash block of the request with its parent, tokens and tagged extra keys."""
    links = []
    size = request.hash_block_size
    parent = request.seed_hash
    for i, block_hash in enumerate(request.block_hashes):
        start = i * size
        keys = block_extra_keys(
            start,
            start + size,
            request.lora,
            request.mm_inputs,
            request.cache_salt,
            request.prompt_embeds,
        )
        links.append(
            ChainLink(
                index=i,
                start=start,
                tokens=tokens_text(request.all_token_ids[start : start + size]),
                extra_keys=tuple(encode_extra_key(k) for k in keys),
                parent=parent,
                block_hash=block_hash,
            )
        )
        parent = block_hash
    return links


def short_hex(block_hash: BlockHash) -> str:
    """The first 8 hex digits of a hash, or ``NONE_HASH`` for the root.

    >>> short_hex(NONE_HASH)
    'NONE_HASH'
    """
    return "NONE_HASH" if block_hash == NONE_HASH else block_hash.hex()[:8]


def key_text(key: tuple[Encodable, ...]) -> str:
    """A tagged extra key as it is hashed: ``("cache_salt", "s")``."""
    return "(" + ", ".join(repr(k) if isinstance(k, str) else str(k) for k in key) + ")"


def chain_text(request: Request) -> str:
    """The request's hash chain as plain text, one hash block a line."""
    lines = [
        f"request {request.request_id}: {tokens_text(request.all_token_ids, 40)}, "
        f"hash blocks of {request.hash_block_size} tokens"
    ]
    for link in chain(request):
        keys = ", ".join(key_text(k) for k in link.extra_keys) or "none"
        lines.append(
            f"  hash {link.index}  = H({short_hex(link.parent)}, {link.tokens}, keys: {keys})"
            f"  = {short_hex(link.block_hash)}"
        )
    rest = request.num_tokens - len(request.block_hashes) * request.hash_block_size
    if rest:
        lines.append(f"  ({rest} token(s) left over: not hashed until the block fills)")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# A lookup, position by position
# --------------------------------------------------------------------------

HIT, SKIPPED, UNUSED, MISS, BEYOND, UNHASHED, STATE = (
    "hit",
    "skipped",
    "cached, not used",
    "miss",
    "beyond the limit",
    "no hash yet",
    "state",
)
"""What a block position of a lookup can be."""


@dataclass(frozen=True)
class Cell:
    """One block position of one group in a lookup."""

    kind: str
    block: int | None = None
    tokens: str = ""


@dataclass(frozen=True)
class HitRow:
    """One group's (or one attention type's) answer to a lookup."""

    label: str
    cells: tuple[Cell, ...]
    num_tokens: int
    """Tokens this row's hit covers."""


def spec_text(spec: KVCacheSpec) -> str:
    """An attention type in words, e.g. ``sliding window of 4 tokens, 2 tokens/block``."""
    kind = spec.attention
    if kind is AttentionType.SLIDING_WINDOW:
        what = f"sliding window of {spec.sliding_window} tokens"
    elif kind is AttentionType.CHUNKED_LOCAL:
        what = f"chunked local, chunks of {spec.attention_chunk_size}"
    elif kind is AttentionType.MAMBA:
        what = "Mamba state"
    else:
        what = "full attention"
    return f"{what}, {spec.block_size} tokens/block"


def hit_cells(
    pool: PoolState,
    spec: KVCacheSpec,
    request: Request,
    hit: Sequence[int],
    max_length: int,
    group: int,
) -> tuple[Cell, ...]:
    """Every block position of the request in one group, classified against the hit."""
    size = spec.block_size
    hashes = hashes_at_block_size(request.block_hashes, pool.config.hash_block_size, size)
    num_positions = -(-request.num_tokens // size)
    cells = []
    for i in range(num_positions):
        text = tokens_text(request.all_token_ids[i * size : (i + 1) * size], 6)
        if spec.attention is AttentionType.MAMBA:
            cells.append(Cell(STATE, None, text))
        elif i < len(hit):
            kind = SKIPPED if hit[i] == NULL_BLOCK_ID else HIT
            cells.append(Cell(kind, hit[i], text))
        elif i >= len(hashes):
            cells.append(Cell(UNHASHED, None, text))
        elif (i + 1) * size > max_length:
            cells.append(Cell(BEYOND, None, text))
        else:
            found = get_cached_block(pool, hashes[i], [group])
            cells.append(Cell(UNUSED if found else MISS, found[0] if found else None, text))
    return tuple(cells)


def hit_rows(world: World, request: Request, blocks: Blocks, num_tokens: int) -> list[HitRow]:
    """A lookup's answer, one row per group, read against the pool it searched."""
    specs = world.manager.managers.specs
    limit = request.num_tokens - 1
    return [
        HitRow(
            f"g{g} {spec_text(spec)}",
            hit_cells(world.pool, spec, request, blocks[g], limit, g),
            num_tokens,
        )
        for g, spec in enumerate(specs)
    ]


HITS_LEGEND = (
    "#n: hit on block n; null: skipped, counted as computed; cached: cached but not "
    "part of the hit; miss: not cached; last: holds the last token, always computed; "
    "-: no full hash block; state: a Mamba state block, never a hit"
)


def hits_text(rows: Sequence[HitRow], title: str = "", legend: bool = True) -> str:
    """Lookup rows as plain text: one line per row, one cell per block position."""
    symbol = {
        HIT: "",
        SKIPPED: "null",
        UNUSED: "cached",
        MISS: "miss",
        BEYOND: "last",
        UNHASHED: "-",
        STATE: "state",
    }
    lines = [title] if title else []
    width = max((len(r.label) for r in rows), default=0)
    texts = [
        [f"{c.tokens}:" + (f"#{c.block}" if c.kind == HIT else symbol[c.kind]) for c in row.cells]
        for row in rows
    ]
    columns = max((len(t) for t in texts), default=0)
    widths = [max((len(t[i]) for t in texts if i < len(t)), default=0) for i in range(columns)]
    for row, cells in zip(rows, texts, strict=True):
        padded = " ".join(cell.ljust(widths[i]) for i, cell in enumerate(cells))
        padded = padded.ljust(sum(widths) + len(widths) - 1)
        lines.append(f"  {row.label.ljust(width)}  {padded}  -> {row.num_tokens} tokens")
    if legend:
        lines.append(legend_text())
    return "\n".join(lines)


def legend_text() -> str:
    """The key to ``hits_text``'s cells, wrapped."""
    return textwrap.fill(f"({HITS_LEGEND})", 88, initial_indent="  ", subsequent_indent="   ")


def spec_groups(specs: Sequence[KVCacheSpec]) -> list[tuple[KVCacheSpec, list[int]]]:
    """The groups by attention spec, full attention first, as the manager searches them."""
    kinds: list[tuple[KVCacheSpec, list[int]]] = []
    for g, spec in enumerate(specs):
        for known, ids in kinds:
            if known == spec:
                ids.append(g)
                break
        else:
            kinds.append((spec, [g]))
    kinds.sort(key=lambda k: k[0].attention is not AttentionType.FULL)
    return kinds


@dataclass(frozen=True)
class Round:
    """One round of a hybrid lookup: the length it started from and each group's answer."""

    length: int
    rows: tuple[HitRow, ...]


def hybrid_rounds(world: World, request: Request) -> tuple[list[Round], int]:
    """The rounds of a hybrid lookup, and the length they settle on.

    Each attention type in turn (full attention first) searches within the
    candidate length and may only shorten it; a full-attention hit found in
    an earlier round is only cut, never searched again. The rounds repeat
    until no type shortens the length: the manager's ``find_hit``, one round
    at a time (the tests check that both agree).
    """
    m = world.manager.managers
    kinds = spec_groups(m.specs)
    length = request.num_tokens - 1
    hits: dict[int, tuple[int, ...]] = {}
    rounds = []
    while True:
        candidate = length
        rows: list[HitRow] = []
        for spec, ids in kinds:
            size = spec.block_size
            if spec.attention is AttentionType.FULL and ids[0] in hits:
                candidate = min(candidate, len(hits[ids[0]]) * size)
                for g in ids:
                    kept = hits[g][: candidate // size]
                    cells = hit_cells(m.pool, spec, request, kept, request.num_tokens - 1, g)
                    rows.append(
                        HitRow(f"g{g} {spec_text(spec)}: cut to {candidate}", cells, candidate)
                    )
                continue
            found = single.find_longest_cache_hit(
                m.pool, spec, request.block_hashes, candidate, ids
            )
            searched = candidate
            candidate = len(found[0]) * size
            for g, blocks in zip(ids, found, strict=True):
                hits[g] = blocks
                cells = hit_cells(m.pool, spec, request, blocks, request.num_tokens - 1, g)
                rows.append(HitRow(f"g{g} {spec_text(spec)}: within {searched}", cells, candidate))
        rounds.append(Round(length, tuple(rows)))
        if candidate >= length:
            return rounds, length
        length = candidate


# --------------------------------------------------------------------------
# Admission: what allocate_slots counted
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupNeed:
    """One group's share of an allocate_slots call."""

    group: int
    released: tuple[int, ...]
    """Blocks released first, because no future token of the request sees them."""
    held: int
    """Blocks the request holds once they are released (null blocks included)."""
    hits: int
    evictable: int
    """Hit blocks that are free now: touching one takes it out of the free queue."""
    slots: int
    """Blocks needed to hold every slot."""
    new: int
    """Blocks to take from the free queue: slots lacking after held blocks and hits."""

    @property
    def needed(self) -> int:
        """What this group takes from the free queue: new blocks and evictable hits."""
        return self.new + self.evictable


@dataclass(frozen=True)
class Admission:
    """Everything allocate_slots weighed before it answered."""

    request_id: str
    num_computed: int
    num_hit: int
    num_new: int
    num_lookahead: int
    num_slots: int
    capped: bool
    """Whether max_model_len cut the slots."""
    num_to_cache: int
    groups: tuple[GroupNeed, ...]
    free: int
    """Free blocks after the release."""
    delay_cache: bool

    @property
    def needed(self) -> int:
        return sum(g.needed for g in self.groups)

    @property
    def admitted(self) -> bool:
        return self.needed <= self.free


def admission(world: World, args: Mapping[str, Json]) -> Admission:
    """What ``allocate_slots(args)`` on ``world`` counts, from the model's own functions."""
    a = decode_args("allocate_slots", args)
    request = world.requests[a["request_id"]]
    hits, num_hit = a["new_computed_blocks"], a["num_new_computed_tokens"]
    if a["from_lookup"]:
        hits, num_hit = world.lookups[request.request_id]
    m = world.manager.managers
    groups = range(len(m.specs))
    hits = tuple(() for _ in groups) if hits is None else hits
    rid = request.request_id
    released: list[tuple[int, ...]] = []
    for g in groups:
        before = m.tables[g].req_to_blocks.get(rid, ())
        m, _ = single.remove_skipped_blocks(m, g, rid, request.num_computed_tokens)
        after = m.tables[g].req_to_blocks.get(rid, ())
        released.append(tuple(b for b, c in zip(before, after, strict=True) if b != c))
    num_computed = request.num_computed_tokens + num_hit
    wanted = num_computed + a["num_new_tokens"] + a["num_lookahead_tokens"]
    num_slots = min(wanted, world.manager.config.max_model_len)
    needs = []
    for g in groups:
        size = m.specs[g].block_size
        held = len(m.tables[g].req_to_blocks.get(rid, ()))
        evictable = sum(1 for b in hits[g] if b != NULL_BLOCK_ID and m.pool.blocks[b].ref_cnt == 0)
        total = single.get_num_blocks_to_allocate(m, g, rid, num_slots, hits[g])
        needs.append(
            GroupNeed(
                group=g,
                released=released[g][::-1],
                held=held,
                hits=len(hits[g]),
                evictable=evictable,
                slots=-(-num_slots // size),
                new=total - evictable,
            )
        )
    return Admission(
        request_id=rid,
        num_computed=request.num_computed_tokens,
        num_hit=num_hit,
        num_new=a["num_new_tokens"],
        num_lookahead=a["num_lookahead_tokens"],
        num_slots=num_slots,
        capped=wanted > num_slots,
        num_to_cache=min(num_computed + a["num_new_tokens"], request.num_tokens),
        groups=tuple(needs),
        free=mm.num_free_blocks(world.manager) + sum(len(r) for r in released),
        delay_cache=a["delay_cache_blocks"],
    )


def admission_text(adm: Admission) -> str:
    """The admission as plain text: the slot layout, the count per group, the verdict."""
    lines = [
        f"allocate_slots({adm.request_id}): | computed {adm.num_computed} | hits "
        f"{adm.num_hit} | new {adm.num_new} | look-ahead {adm.num_lookahead} |",
        f"  slots needed: {adm.num_slots}"
        + (" (capped at max_model_len)" if adm.capped else "")
        + (
            "; caches nothing (delay_cache_blocks)"
            if adm.delay_cache
            else f"; if admitted, caches the full blocks of its first {adm.num_to_cache} tokens"
        ),
    ]
    for g in adm.groups:
        released = f"released first: {', '.join(map(str, g.released))}; " if g.released else ""
        lines.append(
            f"  g{g.group}: {released}{g.slots} blocks for the slots - {g.held} held - "
            f"{g.hits} hits = {g.new} new; + {g.evictable} free hits to touch = {g.needed}"
        )
    verdict = "admitted" if adm.admitted else "refused: returns None, changes nothing else"
    lines.append(f"  needs {adm.needed} free blocks, has {adm.free}: {verdict}")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Release: where a finished request's blocks went
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Released:
    """One block a free (or a release of skipped blocks) let go of."""

    group: int
    block: int
    where: str
    """``front``, ``back`` (it reached ref count 0) or ``held`` (another request holds it)."""


def release(
    before: PoolState, after: PoolState, order: Sequence[tuple[int, int]]
) -> list[Released]:
    """Where each (group, block) of ``order`` went, read off the pools around the free."""
    newly = set(after.free_queue) - set(before.free_queue)
    rule = after.config.profile.free_order_for(after.config.enable_caching)
    out = []
    for group, block in order:
        if block not in newly:
            where = "held"
        elif rule is FreeOrder.HASHLESS_FIRST and after.blocks[block].block_hash is None:
            where = "front"
        else:
            where = "back"
        out.append(Released(group, block, where))
    return out


def freed_order(world: World, request_id: str) -> list[tuple[int, int]]:
    """The (group, block) pairs ``free`` releases, in the order it releases them."""
    tables = world.manager.managers.tables
    return [
        (g, b)
        for g, table in enumerate(tables)
        for b in reversed(table.req_to_blocks.get(request_id, ()))
        if b != NULL_BLOCK_ID
    ]


def release_text(
    items: Sequence[Released], labels: Mapping[BlockHash, str], pool: PoolState
) -> str:
    """The release as plain text: each block in the order freed, and where it went."""
    if not items:
        return "freed: nothing"
    parts = []
    for r in items:
        key = pool.blocks[r.block].block_hash
        name = labels.get(key[0], key[0].hex()[:6]) if key else "no hash"
        where = {"front": "front of the queue", "back": "back of the queue"}.get(
            r.where, "still held"
        )
        parts.append(f"  g{r.group} block {r.block} ({name}) -> {where}")
    return "\n".join(["freed, in this order:", *parts])


# --------------------------------------------------------------------------
# The world as text
# --------------------------------------------------------------------------


def name_of(block_hash: BlockHash, labels: Mapping[BlockHash, str]) -> str:
    return labels.get(block_hash, "…" + block_hash.hex()[-6:])


def tables_text(world: World) -> str:
    """Each group's block tables, one request a line: ``a: 1 AB | 2 CD | 3 E``."""
    m = world.manager.managers
    lines = []
    for g, (spec, table) in enumerate(zip(m.specs, m.tables, strict=True)):
        lines.append(f"g{g} ({spec_text(spec)}):")
        if not table.req_to_blocks:
            lines.append("  (no request holds blocks)")
        for rid, blocks in table.req_to_blocks.items():
            request = world.requests.get(rid)
            cells = []
            for i, b in enumerate(blocks):
                text = ""
                if request is not None:
                    size = spec.block_size
                    text = " " + tokens_text(request.all_token_ids[i * size : (i + 1) * size], 6)
                cells.append(("null" if b == NULL_BLOCK_ID else str(b)) + text)
            lines.append(f"  {rid}: {' | '.join(cells) or '(none)'}")
    return "\n".join(lines)


def pool_text(pool: PoolState, labels: Mapping[BlockHash, str]) -> str:
    """The pool in three lines: the free queue (next first), the held blocks, the hash map."""

    def block(b: int) -> str:
        key = pool.blocks[b].block_hash
        return f"{b} {name_of(key[0], labels)}" if key else str(b)

    queue = " · ".join(block(b) for b in pool.free_queue) or "(empty)"
    held = [b for b in range(1, pool.config.num_blocks) if pool.blocks[b].ref_cnt > 0]
    held_text = " · ".join(f"{block(b)} ×{pool.blocks[b].ref_cnt}" for b in held) or "(none)"  # noqa: RUF001
    keys = sorted(pool.cached, key=lambda k: (k[1], name_of(k[0], labels)))
    cached = " | ".join(
        f"{name_of(h, labels)} g{g} -> {', '.join(map(str, pool.cached[(h, g)]))}" for h, g in keys
    )
    return f"free queue (next first): {queue}\nheld: {held_text}\nhash map: {cached or '(empty)'}"


def world_text(world: World) -> str:
    """Block tables and pool as plain text."""
    return tables_text(world) + "\n" + pool_text(world.pool, world.labels)


# --------------------------------------------------------------------------
# Words: what a step did
# --------------------------------------------------------------------------


def describe(outcome: Outcome) -> str:
    """One or two sentences saying what the step did, read off the worlds around it."""
    op, before, after, result = outcome.step.op, outcome.before, outcome.state, outcome.result
    if outcome.error is not None:
        return f"Rejected ({outcome.error}): nothing changed."
    args = outcome.step.args
    if op == "new_request":
        request = after.requests[str(args["request_id"])]
        left = request.num_tokens - len(request.block_hashes) * request.hash_block_size
        return (
            f"{request.request_id}: {request.num_tokens} tokens, "
            f"{len(request.block_hashes)} hash(es)"
            + (f"; {left} token(s) wait for their hash block to fill." if left else ".")
        )
    if op == "run_model":
        request = after.requests[str(args["request_id"])]
        return (
            f"{request.request_id} has computed {request.num_computed_tokens} of "
            f"{request.num_tokens} tokens and holds {len(request.block_hashes)} hash(es)."
        )
    if op == "get_computed_blocks" and isinstance(result, dict):
        n = result.get("num_tokens")
        return "A miss: 0 tokens." if not n else f"A hit of {n} tokens: {result.get('blocks')}."
    if op == "allocate_slots":
        adm = admission(before, args)
        released = [b for g in adm.groups for b in g.released]
        extra = f" Released first: {', '.join(map(str, released))}." if released else ""
        if result is None:
            return (
                f"Refused (None): it needs {adm.needed} free block(s), the pool has "
                f"{adm.free}.{extra} Nothing else changed."
            )
        return (
            f"Admitted: new blocks {result}; {adm.needed} block(s) taken from the free queue."
            + extra
            + _cached_words(before, after)
        )
    if op in ("free", "preempt"):
        order = freed_order(before, str(args["request_id"]))
        items = release(before.pool, after.pool, order)
        front = [str(r.block) for r in items if r.where == "front"]
        back = [str(r.block) for r in items if r.where == "back"]
        held = [str(r.block) for r in items if r.where == "held"]
        words = []
        if front:
            words.append(f"hash-less {', '.join(front)} to the front")
        if back:
            words.append(f"{', '.join(back)} to the back")
        if held:
            words.append(f"{', '.join(held)} still held")
        return ("Freed last first: " + "; ".join(words) + ".") if words else "Nothing to free."
    if op == "evict_blocks":
        return "Dropped from the cache:" + (_cached_words(before, after) or " nothing.")
    if op == "take_events":
        return f"Took {len(result) if isinstance(result, list) else 0} event(s)."
    if op == "reset_prefix_cache":
        return "Reset: every hash dropped." if result else "Refused: a block is held."
    return f"Answer: {result}."


def _cached_words(before: World, after: World) -> str:
    labels = after.labels
    old, new = before.pool.cached, after.pool.cached
    added = [
        f"{name_of(h, labels)} g{g}"
        for (h, g), ids in new.items()
        if any(b not in old.get((h, g), ()) for b in ids)
    ]
    dropped = [
        f"{name_of(h, labels)} g{g}"
        for (h, g), ids in old.items()
        if any(b not in new.get((h, g), ()) for b in ids)
    ]
    words = ""
    if added:
        words += f" Cached {', '.join(added)}."
    if dropped:
        words += f" Evicted {', '.join(dropped)}."
    return words
