"""Pictures of a pool: a ``PoolState`` drawn as a self-contained SVG.

``render_svg`` is a pure function of the state: the same state always gives
the same bytes (no timestamps, no random ids, no ``id`` attributes at all, so
any number of pictures can be inlined in one HTML page). The drawing has
three bands:

* the **free queue**, left to right in eviction order: the block at the left
  is the next one ``get_new_blocks`` hands out;
* the **hash map**: one box per (hash, group) key, with an arrow to each
  block under it; a key with several blocks numbers its arrows in insertion
  order (1 is what ``get_cached_block`` returns);
* the **held** blocks with their ref counts, and the null block.

Blocks that carry a hash are amber, hash-less blocks grey, the null block
dark; blocks in ``highlight`` get a thick red outline.

>>> from kvpool import model
>>> svg = render_svg(model.new_pool(3), caption="a new pool")
>>> svg.startswith("<svg") and "next to evict" in svg and svg == render_svg(model.new_pool(3),
...     caption="a new pool")
True
"""

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from xml.sax.saxutils import escape

from kvpool.model import NULL_BLOCK_ID, BlockHash, HashKey, PoolState

# Geometry (pixels). Everything is an integer so the output never depends on float repr.
BLOCK_W, BLOCK_H, GAP = 58, 46, 10
LABEL_W = 112
MARGIN = 16
KEY_H, KEY_GAP = 24, 10
CHAR_W = 7  # monospace 12px, rounded up
LINE_H = 18

HASHED_FILL = "#f6c560"
HASHLESS_FILL = "#dde3ea"
NULL_FILL = "#2d3440"
HELD_STROKE = "#2f7d4f"
FREE_STROKE = "#555d66"
HIGHLIGHT = "#d62728"
ARROW = "#38414a"
MUTED = "#6b737c"
TEXT = "#1d2126"
KEY_FILL = "#fff8e6"


MIN_WIDTH = 600
LEGEND = (
    ("fill", HASHED_FILL, "has a hash"),
    ("fill", HASHLESS_FILL, "no hash"),
    ("free", FREE_STROKE, "free"),
    ("held", HELD_STROKE, "held"),
    ("fill", NULL_FILL, "null block"),
    ("outline", HIGHLIGHT, "changed"),
    ("dotted", ARROW, "partial key"),
)


def _swatch(kind: str, colour: str, x: int, y: int) -> str:
    if kind == "fill":
        return (
            f'<rect x="{x}" y="{y - 11}" width="16" height="14" rx="3" fill="{colour}" '
            f'stroke="{FREE_STROKE}"/>'
        )
    if kind == "free":
        return (
            f'<rect x="{x}" y="{y - 11}" width="16" height="14" rx="3" fill="#ffffff" '
            f'stroke="{colour}" stroke-dasharray="4 2"/>'
        )
    if kind == "held":
        return (
            f'<rect x="{x}" y="{y - 11}" width="16" height="14" rx="3" fill="#ffffff" '
            f'stroke="{colour}" stroke-width="2.5"/>'
        )
    if kind == "outline":
        return (
            f'<rect x="{x}" y="{y - 12}" width="16" height="16" rx="4" fill="none" '
            f'stroke="{colour}" stroke-width="2.5"/>'
        )
    return (
        f'<line x1="{x}" y1="{y - 4}" x2="{x + 16}" y2="{y - 4}" stroke="{colour}" '
        f'stroke-width="1.5" stroke-dasharray="2 3"/>'
    )


def hash_label(block_hash: BlockHash, width: int = 8) -> str:
    """A short label for a hash: its text if printable, else hex; long ones keep their end.

    Chained hashes differ at the end, so the end is what tells two apart.

    >>> hash_label(b"ABC"), hash_label(b"\\x01\\x02"), hash_label(bytes(range(1, 9)))
    ('ABC', '0102', '…060708')
    """
    if block_hash and all(33 <= b < 127 for b in block_hash):
        text = block_hash.decode("ascii")
        keep = width - 1
    else:
        text = block_hash.hex()
        keep = max((width - 1) // 2 * 2, 2)
    return text if len(text) <= width else "…" + text[-keep:]


def free_queue_order(svg: str) -> list[int]:
    """The block ids a picture shows in its free queue, left to right (for tests and tools).

    >>> from kvpool import model
    >>> free_queue_order(render_svg(model.new_pool(4)))
    [1, 2, 3]
    """
    start = svg.index('<g class="free-queue">')
    end = svg.index('<g class="held">', start)
    return [int(m) for m in re.findall(r'<g data-block="(\d+)">', svg[start:end])]


def key_label(key: HashKey, labels: Mapping[BlockHash, str] | None = None) -> str:
    """``hash g<group>``, e.g. ``AB g0``; ``labels`` may name hashes for the reader."""
    return f"{named(key[0], labels)} g{key[1]}"


def named(block_hash: BlockHash, labels: Mapping[BlockHash, str] | None, width: int = 8) -> str:
    """The reader's name for a hash if ``labels`` has one (long ones keep their end), else
    ``hash_label``.

    >>> named(b"\x01", {b"\x01": "ABCDEFGHIJ"}), named(b"AB", None)
    ('…DEFGHIJ', 'AB')
    """
    if labels is None or block_hash not in labels:
        return hash_label(block_hash, width)
    text = labels[block_hash]
    return text if len(text) <= width else "…" + text[-(width - 1) :]


@dataclass(frozen=True)
class _Box:
    x: int
    y: int
    w: int
    h: int

    @property
    def cx(self) -> int:
        return self.x + self.w // 2


class _Svg:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, element: str) -> None:
        self.parts.append(element)

    def text(
        self,
        x: int,
        y: int,
        content: str,
        size: int = 12,
        anchor: str = "start",
        fill: str = TEXT,
        weight: str = "normal",
        mono: bool = False,
    ) -> None:
        family = ' font-family="ui-monospace,Menlo,Consolas,monospace"' if mono else ""
        bold = ' font-weight="bold"' if weight != "normal" else ""
        self.add(
            f'<text x="{x}" y="{y}" font-size="{size}" text-anchor="{anchor}" '
            f'fill="{fill}"{family}{bold}>{escape(content)}</text>'
        )


def _wrap(text: str, width: int) -> list[str]:
    lines: list[str] = []
    line = ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return lines


def _block(
    svg: _Svg,
    box: _Box,
    state: PoolState,
    block_id: int,
    held: bool,
    highlighted: bool,
    labels: Mapping[BlockHash, str] | None = None,
) -> None:
    svg.add(f'<g data-block="{block_id}">')
    _block_body(svg, box, state, block_id, held, highlighted, labels)
    svg.add("</g>")


def _block_body(
    svg: _Svg,
    box: _Box,
    state: PoolState,
    block_id: int,
    held: bool,
    highlighted: bool,
    labels: Mapping[BlockHash, str] | None = None,
) -> None:
    block = state.blocks[block_id]
    if block_id == NULL_BLOCK_ID:
        fill, stroke, ink = NULL_FILL, NULL_FILL, "#ffffff"
    else:
        fill = HASHLESS_FILL if block.block_hash is None else HASHED_FILL
        stroke, ink = (HELD_STROKE if held else FREE_STROKE), TEXT
    width = "2.5" if held else "1.5"
    dash = "" if held or block_id == NULL_BLOCK_ID else ' stroke-dasharray="5 3"'
    svg.add(
        f'<rect x="{box.x}" y="{box.y}" width="{box.w}" height="{box.h}" rx="7" '
        f'fill="{fill}" stroke="{stroke}" stroke-width="{width}"{dash}/>'
    )
    if highlighted:
        svg.add(
            f'<rect x="{box.x - 4}" y="{box.y - 4}" width="{box.w + 8}" height="{box.h + 8}" '
            f'rx="10" fill="none" stroke="{HIGHLIGHT}" stroke-width="3"/>'
        )
    if block_id == NULL_BLOCK_ID:
        svg.text(box.cx, box.y + 20, "0", size=15, anchor="middle", fill=ink, weight="bold")
        svg.text(box.cx, box.y + 37, "null", size=11, anchor="middle", fill=ink)
        return
    svg.text(box.cx, box.y + 20, str(block_id), size=15, anchor="middle", fill=ink, weight="bold")
    if block.block_hash is not None:
        label = named(block.block_hash[0], labels, width=7)
        extra = len(block.partial_keys)
        svg.text(box.cx, box.y + 37, label, size=11, anchor="middle", fill=ink, mono=True)
        if extra:
            svg.text(box.x + box.w - 3, box.y + 12, f"+{extra}", size=10, anchor="end", fill=ink)
    else:
        svg.text(box.cx, box.y + 37, "no hash", size=10, anchor="middle", fill=MUTED)


def _ordinal(n: int) -> str:
    return f"{n}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(n if n < 20 else n % 10, 'th') }"


def _arrowhead(x: int, y: int, up: bool) -> str:
    tip = y
    base = y + 8 if up else y - 8
    return f'<polygon points="{x},{tip} {x - 5},{base} {x + 5},{base}" fill="{ARROW}"/>'


def render_svg(
    state: PoolState,
    caption: str = "",
    highlight: Iterable[int] = (),
    labels: Mapping[BlockHash, str] | None = None,
) -> str:
    """The pool as an SVG document (a string starting with ``<svg``).

    ``caption`` is printed above the picture (wrapped); ``highlight`` names
    blocks to outline, e.g. the blocks the last operation changed; ``labels``
    names hashes (the request layer's SHA-256 hashes by the prefix they cover).
    """
    marked = frozenset(highlight)
    config = state.config
    free = list(state.free_queue)
    held = [b for b in range(1, config.num_blocks) if state.blocks[b].ref_cnt > 0]
    keys = sorted(state.cached, key=lambda k: (k[0], k[1]))

    y = 0
    svg = _Svg()

    # --- free queue -------------------------------------------------------
    x0 = MARGIN + LABEL_W
    free_label_y = y + 16
    free_y = free_label_y + 12
    svg.text(MARGIN, free_y + 20, "free queue", size=13, weight="bold")
    svg.text(MARGIN, free_y + 36, f"{len(free)} block(s)", size=11, fill=MUTED)
    boxes: dict[int, _Box] = {}
    for i, block_id in enumerate(free):
        boxes[block_id] = _Box(x0 + i * (BLOCK_W + GAP), free_y, BLOCK_W, BLOCK_H)
    if free:
        first, last = boxes[free[0]], boxes[free[-1]]
        svg.text(first.x, free_label_y, "next to evict ▸", size=11, weight="bold")
        if len(free) > 3:
            svg.text(last.x + last.w, free_label_y, "evicted last", size=11, anchor="end")
        for i, block_id in enumerate(free):
            box = boxes[block_id]
            svg.text(box.cx, box.y + box.h + 13, str(i + 1), size=10, anchor="middle", fill=MUTED)
    else:
        svg.text(x0, free_y + 28, "(empty: every usable block is held)", size=12, fill=MUTED)
    free_right = x0 + max(len(free), 1) * (BLOCK_W + GAP)

    # --- hash map keys ----------------------------------------------------
    keys_y = free_y + BLOCK_H + 46
    held_y = keys_y + KEY_H + 46
    null_box = _Box(x0, held_y, BLOCK_W, BLOCK_H)
    held_x0 = x0 + BLOCK_W + 3 * GAP
    for i, block_id in enumerate(held):
        boxes[block_id] = _Box(held_x0 + i * (BLOCK_W + GAP), held_y, BLOCK_W, BLOCK_H)
    held_right = held_x0 + max(len(held), 1) * (BLOCK_W + GAP)

    svg.text(MARGIN, keys_y + 16, "hash map", size=13, weight="bold")
    svg.text(MARGIN, keys_y + 32, f"{len(keys)} key(s)", size=11, fill=MUTED)
    key_boxes: list[tuple[HashKey, _Box]] = []
    wanted: list[tuple[int, HashKey, int]] = []
    for key in keys:
        targets = [boxes[b].cx for b in state.cached[key] if b in boxes]
        width = len(key_label(key, labels)) * CHAR_W + 16
        centre = sum(targets) // len(targets) if targets else x0 + width // 2
        wanted.append((centre - width // 2, key, width))
    wanted.sort(key=lambda item: (item[0], item[1]))
    cursor = x0
    for left, key, width in wanted:
        left = max(left, cursor)
        key_boxes.append((key, _Box(left, keys_y, width, KEY_H)))
        cursor = left + width + KEY_GAP
    if not keys:
        svg.text(x0, keys_y + 17, "(empty: nothing is cached)", size=12, fill=MUTED)
    keys_right = cursor

    # arrows first, so boxes are drawn over their ends
    for key, kbox in key_boxes:
        ids = [b for b in state.cached[key] if b in boxes]
        # start points ordered like the targets, so a key's arrows never cross
        by_x = sorted(range(len(ids)), key=lambda n: boxes[ids[n]].cx)
        spread = kbox.w // (len(ids) + 1)
        for slot, n in enumerate(by_x):
            block_id = ids[n]
            target = boxes[block_id]
            up = target.y < kbox.y
            sx = kbox.x + spread * (slot + 1)
            sy = kbox.y if up else kbox.y + kbox.h
            ex = target.cx
            # an arrow from below stops under the queue position number
            ey = target.y + target.h + 17 if up else target.y - 1
            end = ey + 8 if up else ey - 8
            mid = (sy + end) // 2
            partial = key in state.blocks[block_id].partial_keys
            style = ' stroke-dasharray="2 3"' if partial else ""
            if n > 0 and not partial:
                style = ' stroke-dasharray="6 4"'
            svg.add(
                f'<path d="M{sx},{sy} C{sx},{mid} {ex},{mid} {ex},{end}" '
                f'fill="none" stroke="{ARROW}" stroke-width="1.5"{style}/>'
            )
            svg.add(_arrowhead(ex, ey, up))
            if len(ids) > 1:
                ly = ey + 20 if up else ey - 6
                svg.text(ex + 7, ly, _ordinal(n + 1), size=10, fill=ARROW, weight="bold")
    for key, kbox in key_boxes:
        svg.add(
            f'<rect x="{kbox.x}" y="{kbox.y}" width="{kbox.w}" height="{kbox.h}" rx="4" '
            f'fill="{KEY_FILL}" stroke="{ARROW}" stroke-width="1"/>'
        )
        svg.text(kbox.cx, kbox.y + 16, key_label(key, labels), size=12, anchor="middle", mono=True)

    # --- held blocks and the null block ------------------------------------
    svg.text(MARGIN, held_y + 20, "held", size=13, weight="bold")
    svg.text(MARGIN, held_y + 36, f"{len(held)} block(s)", size=11, fill=MUTED)
    svg.add('<g class="null-block">')
    _block(svg, null_box, state, NULL_BLOCK_ID, held=False, highlighted=False, labels=labels)
    svg.add("</g>")
    svg.text(null_box.cx, held_y + BLOCK_H + 14, "never free", size=10, anchor="middle", fill=MUTED)
    sep_x = null_box.x + null_box.w + (3 * GAP) // 2
    svg.add(
        f'<line x1="{sep_x}" y1="{held_y - 6}" x2="{sep_x}" y2="{held_y + BLOCK_H + 6}" '
        f'stroke="{MUTED}" stroke-width="1" stroke-dasharray="3 3"/>'
    )
    for block_id in held:
        box = boxes[block_id]
        ref = state.blocks[block_id].ref_cnt
        svg.add(
            f'<rect x="{box.cx - 22}" y="{box.y + box.h + 3}" width="44" height="16" rx="8" '
            f'fill="{HELD_STROKE}"/>'
        )
        svg.text(box.cx, box.y + box.h + 15, f"ref {ref}", size=10, anchor="middle", fill="#fff")
    if not held:
        svg.text(held_x0, held_y + 28, "(none)", size=12, fill=MUTED)
    for band, members, is_held in (("free-queue", free, False), ("held", held, True)):
        svg.add(f'<g class="{band}">')
        for block_id in members:
            _block(svg, boxes[block_id], state, block_id, is_held, block_id in marked, labels)
        svg.add("</g>")

    # --- legend and summary, wrapped to the width of the drawing ----------
    right = max(free_right, held_right, keys_right, MIN_WIDTH)
    y = held_y + BLOCK_H + 42
    lx = MARGIN
    for kind, colour, text in LEGEND:
        item_w = 22 + len(text) * 6 + 16
        if lx > MARGIN and lx + item_w > right:
            lx, y = MARGIN, y + LINE_H
        svg.add(_swatch(kind, colour, lx, y))
        svg.text(lx + 22, y, text, size=11)
        lx += item_w

    usage = 0.0 if config.num_blocks <= 1 else 1 - len(free) / (config.num_blocks - 1)
    facts = [
        f"{config.num_blocks} blocks",
        f"{len(free)} free",
        f"{len(held)} held",
        f"usage {usage:.0%}",
        f"profile {config.profile.name}",
        f"caching {'on' if config.enable_caching else 'off'}",
    ]
    if config.hash_block_size != 1:
        facts.append(f"hash block size {config.hash_block_size}")
    if state.pending_events:
        facts.append(f"{len(state.pending_events)} event(s) pending")
    line = ""
    y += 22
    for fact in facts:
        candidate = f"{line} · {fact}" if line else fact
        if line and MARGIN + len(candidate) * 6 > right:
            svg.text(MARGIN, y, line, size=11, fill=MUTED)
            line, y = fact, y + LINE_H - 2
        else:
            line = candidate
    svg.text(MARGIN, y, line, size=11, fill=MUTED)

    # --- the caption on top, wrapped to the same width ----------------------
    width = right + MARGIN
    caption_lines = _wrap(caption, max((width - 2 * MARGIN) // 9, 30)) if caption else []
    top = MARGIN + len(caption_lines) * LINE_H + (10 if caption_lines else 0)
    head_parts = [
        f'<text x="{MARGIN}" y="{MARGIN + (i + 1) * LINE_H - 4}" font-size="14" '
        f'font-weight="bold" fill="{TEXT}">{escape(text)}</text>'
        for i, text in enumerate(caption_lines)
    ]
    height = top + y + MARGIN
    label = escape(caption or "block pool", {'"': "&quot;"})
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{label}" '
        f'font-family="system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif">'
    )
    background = f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>'
    body = [f'<g transform="translate(0,{top})">', *svg.parts, "</g>"]
    return "\n".join([head, background, *head_parts, *body, "</svg>"]) + "\n"
