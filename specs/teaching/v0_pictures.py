"""Pictures of the v0 allocator, and the v0-versus-v1 story the documentation tells with them.

``render_v0_svg`` draws a ``V0State`` as a self-contained SVG, a pure
function of the state like ``kvpool.specs.pictures.render_svg`` (same
colours, no ids, no timestamps). Three bands:

* **sequences**: each live block object, grouped by sequence (first block
  first), with its tokens and an arrow to the physical block it sits on;
* **physical blocks** in id order: amber when cached, grey when hash-less;
  solid green outline when held (with its ref count), dashed when free;
  under a free block, its place in line: ``next 1`` on the hash-less free
  list, ``evict 1`` in the evictor (with its last-access time);
* a **ledger**: the hash-less free list and the evictor in order, the
  cache, pending copy-on-writes and touched blocks.

``COMPARISON`` is one story played on both allocators (two requests with
one prompt, then a fork); ``comparison_pictures`` and
``comparison_markdown`` turn it into the pictures and the Markdown of
docs/explanation/v0-vs-v1.md (expanded by the docs hook
``docs/hooks/v0_docs.py``).

>>> from kvpool.model import v0
>>> svg = render_v0_svg(v0.new_allocator(2, 2), caption="a new allocator")
>>> svg.startswith("<svg") and "hash-less free" in svg
True
"""

import posixpath
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

from kvpool import model
from kvpool.model import CacheRequest, PoolState
from kvpool.model import v0 as v0model
from kvpool.model.v0 import NEVER_ACCESSED, V0State
from kvpool.specs.teaching.pictures import (
    ARROW,
    BLOCK_H,
    BLOCK_W,
    FREE_STROKE,
    GAP,
    HASHED_FILL,
    HASHLESS_FILL,
    HELD_STROKE,
    HIGHLIGHT,
    LABEL_W,
    LINE_H,
    MARGIN,
    MIN_WIDTH,
    MUTED,
    TEXT,
    _Box,
    _Svg,
    _wrap,
    hash_label,
    render_svg,
)

OBJECT_W = 64
"""Block objects are a little wider than physical blocks: they show their tokens."""


def tokens_label(tokens: Sequence[int], width: int = 8) -> str:
    """Tokens as text: letters when they are printable ASCII, else the numbers.

    >>> tokens_label([65, 66]), tokens_label([1, 2]), tokens_label([])
    ('AB', '1 2', '·')
    """
    if not tokens:
        return "·"
    if all(33 <= t < 127 for t in tokens):
        return hash_label(bytes(tokens), width)
    text = " ".join(str(t) for t in tokens)
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def _time(value: float) -> str:
    return "never" if value == NEVER_ACCESSED else f"t={value:g}"


def sequences(state: V0State) -> list[tuple[int, ...]]:
    """The live block objects grouped by sequence: each chain that no live object extends.

    A chain whose earlier blocks were freed starts at its first live block.
    """
    followed = {obj.prev for obj in state.handles.values()}
    chains = []
    for handle in sorted(state.handles):
        if handle in followed:
            continue
        chain = [handle]
        prev = state.handles[handle].prev
        while prev is not None and prev in state.handles:
            chain.append(prev)
            prev = state.handles[prev].prev
        chains.append(tuple(reversed(chain)))
    return chains


def render_v0_svg(state: V0State, caption: str = "", highlight: Iterable[int] = ()) -> str:
    """The allocator as an SVG document; ``highlight`` outlines physical blocks."""
    marked = frozenset(highlight)
    config = state.config
    svg = _Svg()
    x0 = MARGIN + LABEL_W
    order = v0model.eviction_order(state)

    # --- sequences -----------------------------------------------------------
    seq_y = 10
    svg.text(MARGIN, seq_y + 20, "sequences", size=13, weight="bold")
    chains = sequences(state)
    svg.text(MARGIN, seq_y + 36, f"{len(state.handles)} block object(s)", size=11, fill=MUTED)
    object_boxes: dict[int, _Box] = {}
    x = x0
    for chain in chains:
        for handle in chain:
            object_boxes[handle] = _Box(x, seq_y, OBJECT_W, BLOCK_H)
            x += OBJECT_W + 4
        x += 3 * GAP
    if not chains:
        svg.text(x0, seq_y + 28, "(none: no block object is live)", size=12, fill=MUTED)
    seq_right = x

    # --- physical blocks -------------------------------------------------------
    phys_y = seq_y + BLOCK_H + 58
    svg.text(MARGIN, phys_y + 20, "physical", size=13, weight="bold")
    svg.text(MARGIN, phys_y + 36, f"{config.num_blocks} block(s)", size=11, fill=MUTED)
    boxes = {
        b: _Box(x0 + b * (BLOCK_W + GAP), phys_y, BLOCK_W, BLOCK_H)
        for b in range(config.num_blocks)
    }
    phys_right = x0 + max(config.num_blocks, 1) * (BLOCK_W + GAP)

    # arrows first, so boxes are drawn over their ends
    for handle, obox in object_boxes.items():
        target = boxes[state.handles[handle].block_id]
        sx, sy = obox.cx, obox.y + obox.h
        ex, ey = target.cx, target.y - 1
        mid = (sy + ey) // 2
        svg.add(
            f'<path d="M{sx},{sy} C{sx},{mid} {ex},{mid} {ex},{ey - 8}" fill="none" '
            f'stroke="{ARROW}" stroke-width="1.5"/>'
        )
        svg.add(f'<polygon points="{ex},{ey} {ex - 5},{ey - 8} {ex + 5},{ey - 8}" fill="{ARROW}"/>')

    svg.add('<g class="sequences">')
    for handle, obox in object_boxes.items():
        obj = state.handles[handle]
        full = obj.content_hash is not None
        fill = HASHED_FILL if full else HASHLESS_FILL
        svg.add(f'<g data-handle="{handle}">')
        svg.add(
            f'<rect x="{obox.x}" y="{obox.y}" width="{obox.w}" height="{obox.h}" rx="7" '
            f'fill="{fill}" stroke="{TEXT}" stroke-width="1"/>'
        )
        svg.text(obox.cx, obox.y + 18, f"#{handle}", size=12, anchor="middle", weight="bold")
        empty = config.block_size - len(obj.token_ids)
        label = tokens_label(obj.token_ids, 7) + ("_" * empty if empty <= 3 else "_…")
        svg.text(obox.cx, obox.y + 36, label, size=11, anchor="middle", mono=True)
        svg.add("</g>")
    svg.add("</g>")

    svg.add('<g class="physical">')
    cached_ids = {b: h for h, b in state.cached.items()}
    free_position = {b: i + 1 for i, b in enumerate(state.hashless_free)}
    evict_position = {b: i + 1 for i, b in enumerate(order)}
    for block_id, box in boxes.items():
        block = state.blocks[block_id]
        held = block.ref_cnt > 0
        cached = cached_ids.get(block_id)
        fill = HASHED_FILL if cached is not None else HASHLESS_FILL
        if not held and cached is None:
            fill = "#ffffff"
        stroke = HELD_STROKE if held else FREE_STROKE
        stroke_width = "2.5" if held else "1.5"
        dash = "" if held else ' stroke-dasharray="5 3"'
        svg.add(f'<g data-block="{block_id}">')
        svg.add(
            f'<rect x="{box.x}" y="{box.y}" width="{box.w}" height="{box.h}" rx="7" '
            f'fill="{fill}" stroke="{stroke}" stroke-width="{stroke_width}"{dash}/>'
        )
        if block_id in marked:
            svg.add(
                f'<rect x="{box.x - 4}" y="{box.y - 4}" width="{box.w + 8}" '
                f'height="{box.h + 8}" rx="10" fill="none" stroke="{HIGHLIGHT}" stroke-width="3"/>'
            )
        svg.text(box.cx, box.y + 20, str(block_id), size=15, anchor="middle", weight="bold")
        if cached is not None:
            own = cached[len(cached) - config.block_size :]
            svg.text(box.cx, box.y + 37, tokens_label(own, 7), size=11, anchor="middle", mono=True)
        else:
            svg.text(box.cx, box.y + 37, "no hash", size=10, anchor="middle", fill=MUTED)
        if held:
            computed = " ✓" if block.computed else ""
            svg.add(
                f'<rect x="{box.cx - 24}" y="{box.y + box.h + 3}" width="48" height="16" '
                f'rx="8" fill="{HELD_STROKE}"/>'
            )
            svg.text(
                box.cx,
                box.y + box.h + 15,
                f"ref {block.ref_cnt}{computed}",
                size=10,
                anchor="middle",
                fill="#fff",
            )
        elif block_id in evict_position:
            entry = state.evictor[block_id]
            svg.text(
                box.cx, box.y + box.h + 14, f"evict {evict_position[block_id]}", size=10,
                anchor="middle", fill=TEXT, weight="bold",
            )  # fmt: skip
            svg.text(
                box.cx, box.y + box.h + 27, _time(entry.last_accessed), size=10,
                anchor="middle", fill=MUTED,
            )  # fmt: skip
        elif block_id in free_position:
            svg.text(
                box.cx, box.y + box.h + 14, f"next {free_position[block_id]}", size=10,
                anchor="middle", fill=MUTED,
            )  # fmt: skip
        svg.add("</g>")
    svg.add("</g>")

    # --- ledger -----------------------------------------------------------------
    right = max(seq_right, phys_right, MIN_WIDTH)
    y = phys_y + BLOCK_H + 52
    evictor_text = ", ".join(
        f"{b} ({_time(state.evictor[b].last_accessed)}, "
        f"{state.evictor[b].num_hashed_tokens} tokens)"
        for b in order
    )
    cache_text = ", ".join(
        f"{tokens_label(h, 12)}→{b}" for h, b in sorted(state.cached.items(), key=lambda i: i[1])
    )
    facts = [
        ("hash-less free (next first)", ", ".join(map(str, state.hashless_free)) or "empty"),
        ("evictor (evicted first)", evictor_text or "empty"),
        ("cache (content→block)", cache_text or "empty"),
    ]
    if state.copy_on_writes:
        pairs = ", ".join(f"{s}→{d}" for s, d in state.copy_on_writes)
        facts.append(("copy-on-writes to do", pairs))
    if state.touched:
        facts.append(("touched, not yet computed", ", ".join(map(str, sorted(state.touched)))))
    wrap_at = max((right - MARGIN - 210) // 7, 30)
    for title, value in facts:
        svg.text(MARGIN, y, title, size=11, weight="bold")
        for i, line in enumerate(_wrap(value, wrap_at)):
            svg.text(MARGIN + 210, y + i * (LINE_H - 2), line, size=11, mono=True)
            if i:
                y += LINE_H - 2
        y += LINE_H
    legend = (
        f"{config.num_blocks} blocks of {config.block_size} tokens · amber: cached · grey: "
        "no hash · green outline: held (✓ computed) · dashed: free"
    )
    svg.text(MARGIN, y + 4, legend, size=11, fill=MUTED)
    y += LINE_H

    width = right + MARGIN
    caption_lines = _wrap(caption, max((width - 2 * MARGIN) // 9, 30)) if caption else []
    top = MARGIN + len(caption_lines) * LINE_H + (10 if caption_lines else 0)
    head_parts = [
        f'<text x="{MARGIN}" y="{MARGIN + (i + 1) * LINE_H - 4}" font-size="14" '
        f'font-weight="bold" fill="{TEXT}">{escape(text)}</text>'
        for i, text in enumerate(caption_lines)
    ]
    height = top + y + MARGIN
    label = escape(caption or "v0 block allocator", {'"': "&quot;"})
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{label}" '
        f'font-family="system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif">'
    )
    background = f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>'
    body = [f'<g transform="translate(0,{top})">', *svg.parts, "</g>"]
    return "\n".join([head, background, *head_parts, *body, "</svg>"]) + "\n"


def physical_order(svg: str, kind: str) -> list[int]:
    """The blocks a picture labels ``next N`` (kind ``next``) or ``evict N`` (``evict``), in order.

    >>> from kvpool.model import v0
    >>> physical_order(render_v0_svg(v0.new_allocator(3, 1)), "next")
    [0, 1, 2]
    """
    import re

    found = re.findall(rf'<g data-block="(\d+)">(?:(?!</g>).)*?>{kind} (\d+)<', svg, re.S)
    return [int(b) for b, _ in sorted(found, key=lambda item: int(item[1]))]


# --------------------------------------------------------------------------
# One story, both allocators
# --------------------------------------------------------------------------

BLOCK_SIZE = 2
V0_BLOCKS = 4
V1_BLOCKS = V0_BLOCKS + 1  # v1's block 0 is the null block


def _t(text: str) -> list[int]:
    """Tokens of a readable prompt: one letter, one token."""
    return [ord(c) for c in text]


def _request(text: str) -> CacheRequest:
    tokens = _t(text)
    hashes = tuple(bytes(tokens[:end]) for end in range(BLOCK_SIZE, len(tokens) + 1, BLOCK_SIZE))
    return CacheRequest(block_hashes=hashes, all_token_ids=tuple(tokens))


@dataclass(frozen=True)
class ComparisonStep:
    """One step of the story: what happens, and the calls each allocator makes for it."""

    say: str
    v0_calls: str
    v0: Callable[[V0State], V0State]
    v1_calls: str
    v1: Callable[[PoolState], PoolState] | None
    """None: v1 has no counterpart (the state does not change)."""
    note: str = ""


def _v0_prefill(state: V0State, prompt: str) -> V0State:
    """A prompt's full blocks as immutable blocks, its rest in a mutable block after them."""
    tokens = _t(prompt)
    full = len(tokens) // BLOCK_SIZE * BLOCK_SIZE
    chunks = [tokens[i : i + BLOCK_SIZE] for i in range(0, full, BLOCK_SIZE)]
    state, handles = v0model.allocate_immutable_blocks(state, None, chunks)
    state, tail = v0model.allocate_mutable_block(state, handles[-1] if handles else None)
    state, _ = v0model.append_token_ids(state, tail, tokens[full:])
    return state


def _v0_append(state: V0State, handle: int, text: str) -> V0State:
    return v0model.append_token_ids(state, handle, _t(text))[0]


def _v0_finish(state: V0State, handles: Sequence[int], now: float) -> V0State:
    ids = [state.handles[h].block_id for h in handles]
    state, _ = v0model.mark_blocks_as_accessed(state, ids, now)
    for handle in handles:
        state, _ = v0model.free(state, handle)
    return state


def _v1_prefill(state: PoolState, prompt: str, hits: int, fresh: int) -> PoolState:
    """The first ``hits`` blocks are cache hits (touched), then ``fresh`` new blocks."""
    request = _request(prompt)
    hit_ids: list[int] = []
    for i in range(hits):
        found = model.get_cached_block(state, request.block_hashes[i], [0])
        assert found is not None
        hit_ids.append(found[0])
    state, _ = model.touch(state, hit_ids)
    state, new = model.get_new_blocks(state, fresh)
    blocks = [*hit_ids, *new]
    full = len(request.block_hashes)
    state, _ = model.cache_full_blocks(state, request, blocks, hits, full, BLOCK_SIZE, 0)
    return state


def _v1_cache(state: PoolState, text: str, blocks: Sequence[int], done: int) -> PoolState:
    request = _request(text)
    full = len(request.block_hashes)
    return model.cache_full_blocks(state, request, blocks, done, full, BLOCK_SIZE, 0)[0]


COMPARISON: tuple[ComparisonStep, ...] = (
    ComparisonStep(
        say="Request A arrives with the prompt ABC: one full block (AB) and one partial block (C).",
        v0_calls="allocate_immutable_blocks(None, [AB]) → #0; allocate_mutable_block(#0) → #1; "
        "append_token_ids(#1, C)",
        v0=lambda s: _v0_prefill(s, "ABC"),
        v1_calls="get_new_blocks(2) → [1, 2]; cache_full_blocks(A, [1, 2], 0, 1)",
        v1=lambda s: _v1_prefill(s, "ABC", hits=0, fresh=2),
        note="Both cache the full block AB. v0 caches it the moment it is allocated full "
        "(promotion); v1 when the request layer calls cache_full_blocks.",
    ),
    ComparisonStep(
        say="Request B arrives with the same prompt ABC.",
        v0_calls="allocate_immutable_block(None, AB) → #2 (a hit on block 0); "
        "allocate_mutable_block(#2) → #3; append_token_ids(#3, C)",
        v0=lambda s: _v0_prefill(s, "ABC"),
        v1_calls="get_cached_block(AB) → [1]; touch([1]); get_new_blocks(1) → [3]",
        v1=lambda s: _v1_prefill(s, "ABC", hits=1, fresh=1),
        note="The same on both sides: the full block is shared (ref 2), the partial block C is "
        "written twice, once per request.",
    ),
    ComparisonStep(
        say="A generates the token D: its second block fills up.",
        v0_calls="append_token_ids(#1, D) → block 1, promoted: ABCD is cached on block 1",
        v0=lambda s: _v0_append(s, 1, "D"),
        v1_calls="cache_full_blocks(A, [1, 2], 1, 2)",
        v1=lambda s: _v1_cache(s, "ABCD", [1, 2], 1),
    ),
    ComparisonStep(
        say="B generates the same token D: its second block fills with the same content.",
        v0_calls="append_token_ids(#3, D) → block 1: de-duplicated, block 2 is released",
        v0=lambda s: _v0_append(s, 3, "D"),
        v1_calls="cache_full_blocks(B, [1, 3], 1, 2)",
        v1=lambda s: _v1_cache(s, "ABCD", [1, 3], 1),
        note="Here the two part ways. v0 **de-duplicates**: B's object moves onto block 1 "
        "(ref 2) and its own block goes back to the front of the hash-less free list, so B's "
        "block table changes under it. v1 **keeps the duplicate**: blocks 2 and 3 both sit "
        "under the key ABCD (the map numbers them 1st and 2nd) and block tables stay "
        "append-only.",
    ),
    ComparisonStep(
        say="A finishes at time 1, then B at time 2 (each request's blocks freed in order).",
        v0_calls="mark_blocks_as_accessed(A's blocks, 1); free(#0); free(#1); "
        "mark_blocks_as_accessed(B's blocks, 2); free(#2); free(#3)",
        v0=lambda s: _v0_finish(_v0_finish(s, [0, 1], 1), [2, 3], 2),
        v1_calls="free_blocks([2, 1]); free_blocks([3, 1])",
        v1=lambda s: model.free_blocks(model.free_blocks(s, [2, 1])[0], [3, 1])[0],
        note="v0 ranks unused cached blocks by **last access**, then by depth: blocks 0 and 1 "
        "were both last used at time 2, so the deeper block 1 (ABCD) is evicted first and the "
        "prefix AB outlives it. v1 decides by **position**: freed blocks join the back of the "
        "queue in the order the request frees them (its last block first).",
    ),
    ComparisonStep(
        say="Request C arrives with the prompt ABE: AB is a cache hit, E needs a new block.",
        v0_calls="allocate_immutable_block(None, AB) → #4 on block 0 (back from the evictor); "
        "allocate_mutable_block(#4) → #5; append_token_ids(#5, E)",
        v0=lambda s: _v0_prefill(s, "ABE"),
        v1_calls="get_cached_block(AB) → [1]; touch([1]); get_new_blocks(1) → [4]",
        v1=lambda s: _v1_prefill(s, "ABE", hits=1, fresh=1),
        note="v0 takes a hash-less block before evicting anything: block 2, released by the "
        "de-duplication, is first on its free list. v1's queue gives the never-used block 4.",
    ),
    ComparisonStep(
        say="C is sampled twice (parallel sampling): the second sample forks C.",
        v0_calls="fork(#5) → #6, #7 (sharing blocks 0 and 2)",
        v0=lambda s: v0model.fork(s, 5)[0],
        v1_calls="(no counterpart in the pool)",
        v1=None,
        note="v1's pool has no fork: each sample is a request of its own, its full blocks "
        "cache hits and its partial block computed again.",
    ),
    ComparisonStep(
        say="The second sample generates F into the shared partial block.",
        v0_calls="append_token_ids(#7, F) → copy-on-write to block 3, then promoted: ABEF",
        v0=lambda s: _v0_append(s, 7, "F"),
        v1_calls="(no counterpart in the pool)",
        v1=None,
        note="The block is shared (ref 2), so the writer moves first: **copy-on-write** takes a "
        "free block (3, the last on the hash-less free list), records 2→3 for the engine to "
        "copy, and then the now full block is promoted. The first sample keeps block 2.",
    ),
)


def comparison() -> list[tuple[ComparisonStep, V0State, PoolState]]:
    """Each step of ``COMPARISON`` with the v0 and v1 states after it."""
    v0_state = v0model.new_allocator(V0_BLOCKS, BLOCK_SIZE)
    v1_state = model.new_pool(V1_BLOCKS, hash_block_size=BLOCK_SIZE)
    played = []
    for step in COMPARISON:
        v0_state = step.v0(v0_state)
        if step.v1 is not None:
            v1_state = step.v1(v1_state)
        played.append((step, v0_state, v1_state))
    return played


PICTURES = "pictures/v0-vs-v1"


def picture_path(side: str, index: int) -> str:
    """Where the picture of ``side`` (v0 or v1) after step ``index`` (0: new) lives in the site."""
    return f"{PICTURES}/{side}-step-{index:02d}.svg"


def _changed_v0(before: V0State, after: V0State) -> list[int]:
    return [
        b
        for b in range(after.config.num_blocks)
        if before.blocks[b] != after.blocks[b]
        or (b in before.hashless_free) != (b in after.hashless_free)
        or before.evictor.get(b) != after.evictor.get(b)
    ]


def _changed_v1(before: PoolState, after: PoolState) -> list[int]:
    return [
        b
        for b in range(after.config.num_blocks)
        if before.blocks[b] != after.blocks[b]
        or (b in before.free_queue) != (b in after.free_queue)
    ]


def comparison_pictures() -> dict[str, str]:
    """Every picture of the comparison, by site path."""
    v0_before = v0model.new_allocator(V0_BLOCKS, BLOCK_SIZE)
    v1_before = model.new_pool(V1_BLOCKS, hash_block_size=BLOCK_SIZE)
    pictures = {
        picture_path("v0", 0): render_v0_svg(v0_before, caption="v0: a new allocator"),
        picture_path("v1", 0): render_svg(v1_before, caption="v1: a new pool"),
    }
    for index, (step, v0_state, v1_state) in enumerate(comparison(), start=1):
        pictures[picture_path("v0", index)] = render_v0_svg(
            v0_state,
            caption=f"v0 after step {index}: {step.v0_calls}",
            highlight=_changed_v0(v0_before, v0_state),
        )
        if step.v1 is not None:
            pictures[picture_path("v1", index)] = render_svg(
                v1_state,
                caption=f"v1 after step {index}: {step.v1_calls}",
                highlight=_changed_v1(v1_before, v1_state),
            )
        v0_before, v1_before = v0_state, v1_state
    return pictures


def comparison_markdown(page_src: str) -> str:
    """The story as Markdown: each step's narration, calls, note and both pictures."""

    def image(side: str, index: int, alt: str) -> str:
        path = posixpath.relpath(picture_path(side, index), posixpath.dirname(page_src) or ".")
        alt = alt.replace("[", "(").replace("]", ")")
        return f"![{alt}]({path})"

    lines = [
        f"Both allocators start with {V0_BLOCKS} usable blocks of {BLOCK_SIZE} tokens "
        "(v1 has one more, its null block 0). One letter is one token.",
        "",
        image("v0", 0, "v0: a new allocator"),
        "",
        image("v1", 0, "v1: a new pool"),
        "",
    ]
    for index, (step, _, _) in enumerate(comparison(), start=1):
        lines += [
            f"### Step {index}. {step.say}",
            "",
            f"* **v0**: `{step.v0_calls}`",
            f"* **v1**: `{step.v1_calls}`",
            "",
        ]
        if step.note:
            lines += [step.note, ""]
        lines += [image("v0", index, f"v0 after step {index}"), ""]
        if step.v1 is not None:
            lines += [image("v1", index, f"v1 after step {index}"), ""]
    return "\n".join(lines)
