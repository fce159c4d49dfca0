"""Pictures of the request layer: panels drawn from the facts of ``request_facts``, stacked.

A request-layer picture is a stack of panels, each a pure function of the
model's state (same input, same bytes; no ids, no timestamps):

* ``chain_panel``: a request's hash chain, from ``NONE_HASH`` to its last full
  hash block, each link with its tokens and tagged extra keys; amber when the
  hash is in the cache;
* ``hits_panel``: a lookup position by position, one row per group (or per
  attention type): hit blocks, null blocks, what was cached but not used;
* ``admission_panel``: the slot layout of an ``allocate_slots`` call and what
  it counted, with the verdict;
* ``release_panel``: the blocks a free let go of, in order, and where each went;
* ``requests_panel``, ``tables_panel``: the live requests and every group's
  block tables;
* ``pool_panel``: the pool itself, the picture of ``pictures.render_svg`` with
  hashes named by the prefix they cover.

``render_outcome_svg`` draws one step of a request scenario: the panel of its
operation, then the requests, the tables and the pool.

>>> from kvpool.specs.teaching import request_stories
>>> story = request_stories.get("request-life")
>>> svg = render_world_svg(request_scenarios.initial_state(story), "a new manager")
>>> svg.startswith("<svg") and "block tables" in svg
True
"""

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

from kvpool.model import NULL_BLOCK_ID, BlockHash, PoolState
from kvpool.model.request import Request
from kvpool.specs.teaching import request_facts as facts
from kvpool.specs.teaching import request_scenarios
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
    LINE_H,
    MARGIN,
    MIN_WIDTH,
    MUTED,
    NULL_FILL,
    TEXT,
    _wrap,
    render_svg,
)
from kvpool.specs.teaching.request_scenarios import Outcome, World

LABEL_W = 150
"""Room for row labels (request ids, group names) left of the cells."""
MONO = "ui-monospace,Menlo,Consolas,monospace"
REFUSED = "#b23a3a"
ADMITTED = HELD_STROKE


@dataclass
class Panel:
    """A band of a picture: SVG elements in the band's own coordinates, and its size."""

    title: str
    width: int = MIN_WIDTH
    height: int = 0
    parts: list[str] = field(default_factory=list)

    def text(
        self,
        x: int,
        y: int,
        content: str,
        size: int = 12,
        anchor: str = "start",
        fill: str = TEXT,
        bold: bool = False,
        mono: bool = False,
    ) -> None:
        family = f' font-family="{MONO}"' if mono else ""
        weight = ' font-weight="bold"' if bold else ""
        self.parts.append(
            f'<text x="{x}" y="{y}" font-size="{size}" text-anchor="{anchor}" '
            f'fill="{fill}"{family}{weight}>{escape(content)}</text>'
        )

    def rect(
        self,
        x: int,
        y: int,
        w: int,
        h: int,
        fill: str,
        stroke: str = FREE_STROKE,
        width: str = "1.5",
        dash: str = "",
        rx: int = 7,
    ) -> None:
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        self.parts.append(
            f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="{rx}" fill="{fill}" '
            f'stroke="{stroke}" stroke-width="{width}"{dashed}/>'
        )

    def arrow(self, x1: int, y1: int, x2: int, y2: int) -> None:
        """A straight arrow, left to right, ending at (x2, y2)."""
        self.parts.append(
            f'<line x1="{x1}" y1="{y1}" x2="{x2 - 7}" y2="{y2}" stroke="{ARROW}" '
            'stroke-width="1.5"/>'
        )
        self.parts.append(
            f'<polygon points="{x2},{y2} {x2 - 8},{y2 - 5} {x2 - 8},{y2 + 5}" fill="{ARROW}"/>'
        )

    def grow(self, right: int, bottom: int) -> None:
        self.width = max(self.width, right + MARGIN)
        self.height = max(self.height, bottom)


def document(panels: Sequence[Panel], caption: str = "") -> str:
    """The panels stacked top to bottom under a wrapped caption, as one SVG document."""
    width = max([MIN_WIDTH + MARGIN, *(p.width for p in panels)])
    lines = _wrap(caption, max((width - 2 * MARGIN) // 9, 30)) if caption else []
    body: list[str] = [
        f'<text x="{MARGIN}" y="{MARGIN + (i + 1) * LINE_H - 4}" font-size="14" '
        f'font-weight="bold" fill="{TEXT}">{escape(line)}</text>'
        for i, line in enumerate(lines)
    ]
    y = MARGIN + len(lines) * LINE_H + (12 if lines else 0)
    for panel in panels:
        body.append(f'<g class="panel" data-panel="{escape(panel.title)}">')
        body.append(
            f'<text x="{MARGIN}" y="{y + 14}" font-size="13" font-weight="bold" '
            f'fill="{TEXT}">{escape(panel.title)}</text>'
        )
        body.append(f'<g transform="translate(0,{y + 24})">')
        body.extend(panel.parts)
        body.append("</g></g>")
        y += panel.height + 24 + 14
    height = y + MARGIN
    label = escape(caption or "request layer", {'"': "&quot;"})
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{label}" '
        f'font-family="system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif">'
    )
    background = f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>'
    return "\n".join([head, background, *body, "</svg>"]) + "\n"


# --------------------------------------------------------------------------
# Requests and block tables
# --------------------------------------------------------------------------


def _extras(request: Request) -> str:
    parts = []
    if request.lora is not None:
        parts.append(f"LoRA {request.lora.name}")
    if request.cache_salt:
        parts.append(f"salt {request.cache_salt}")
    parts += [f"image {m.identifier} at {m.offset}+{m.length}" for m in request.mm_inputs]
    return " · ".join(parts)


def requests_panel(world: World) -> Panel:
    """One line per live request: its tokens, what it has computed, its extra keys."""
    panel = Panel("requests")
    y = 4
    if not world.requests:
        panel.text(MARGIN, y + 14, "(none: no request has arrived, or all finished)", fill=MUTED)
        y += LINE_H
    for rid, request in world.requests.items():
        tokens = request_scenarios.tokens_text(request.all_token_ids, 40)
        facts_line = (
            f"{request.num_tokens} tokens, {request.num_computed_tokens} computed, "
            f"{len(request.block_hashes)} hash(es)"
        )
        extras = _extras(request)
        if extras:
            facts_line += " · " + extras
        if request.num_preemptions:
            facts_line += f" · preempted {request.num_preemptions}×"  # noqa: RUF001
        panel.text(MARGIN, y + 14, rid, bold=True)
        panel.text(MARGIN + 40, y + 14, tokens, mono=True)
        panel.text(MARGIN + 40 + 8 * max(len(tokens), 6) + 16, y + 14, facts_line, fill=MUTED)
        panel.grow(MARGIN + 56 + 8 * max(len(tokens), 6) + 7 * len(facts_line), 0)
        y += LINE_H + 2
    panel.height = y + 4
    return panel


def _cell(
    panel: Panel,
    x: int,
    y: int,
    block: int,
    text: str,
    pool: PoolState,
    highlighted: bool,
) -> None:
    panel.parts.append(f'<g data-block="{block}">')
    if block == NULL_BLOCK_ID:
        panel.rect(x, y, BLOCK_W, BLOCK_H, NULL_FILL, NULL_FILL)
        panel.text(
            x + BLOCK_W // 2, y + 20, "null", size=13, anchor="middle", fill="#fff", bold=True
        )
    else:
        hashed = pool.blocks[block].block_hash is not None
        panel.rect(
            x, y, BLOCK_W, BLOCK_H, HASHED_FILL if hashed else HASHLESS_FILL, HELD_STROKE, "2"
        )
        panel.text(x + BLOCK_W // 2, y + 20, str(block), size=15, anchor="middle", bold=True)
    ink = "#ffffff" if block == NULL_BLOCK_ID else TEXT
    panel.text(x + BLOCK_W // 2, y + 37, text, size=11, anchor="middle", fill=ink, mono=True)
    if highlighted:
        panel.rect(x - 4, y - 4, BLOCK_W + 8, BLOCK_H + 8, "none", HIGHLIGHT, "3", rx=10)
    panel.parts.append("</g>")


def tables_panel(world: World, highlight: Iterable[int] = ()) -> Panel:
    """Every group's block tables: per request, its blocks in order, with the tokens they hold."""
    marked = frozenset(highlight)
    panel = Panel("block tables")
    m = world.manager.managers
    y = 0
    for g, (spec, table) in enumerate(zip(m.specs, m.tables, strict=True)):
        panel.text(
            MARGIN, y + 14, f"g{g} · {facts.spec_text(spec)}", size=12, fill=MUTED, bold=True
        )
        y += 22
        if not table.req_to_blocks:
            panel.text(MARGIN + 10, y + 12, "(no request holds blocks in this group)", fill=MUTED)
            y += LINE_H + 4
        for rid, blocks in table.req_to_blocks.items():
            panel.parts.append(f'<g class="table" data-group="{g}" data-request="{escape(rid)}">')
            panel.text(MARGIN + 10, y + 28, rid, size=13, bold=True)
            request = world.requests.get(rid)
            for i, block in enumerate(blocks):
                text = ""
                if request is not None:
                    size = spec.block_size
                    chunk = request.all_token_ids[i * size : (i + 1) * size]
                    text = request_scenarios.tokens_text(chunk, 6)
                x = LABEL_W + i * (BLOCK_W + GAP)
                _cell(panel, x, y, block, text, world.pool, block in marked and block != 0)
                panel.grow(x + BLOCK_W, 0)
            panel.parts.append("</g>")
            y += BLOCK_H + 12
    panel.height = y
    return panel


def pool_panel(
    pool: PoolState, labels: Mapping[BlockHash, str], highlight: Iterable[int] = ()
) -> Panel:
    """The pool picture of ``pictures.render_svg``, nested, with hashes named by their prefix."""
    inner = render_svg(pool, highlight=highlight, labels=labels)
    size = re.match(r'<svg [^>]*width="(\d+)" height="(\d+)"', inner)
    assert size is not None
    width, height = int(size.group(1)), int(size.group(2))
    panel = Panel("block pool", width=width, height=height)
    panel.parts.append(inner.replace("<svg ", '<svg x="0" y="0" ', 1).rstrip())
    return panel


# --------------------------------------------------------------------------
# The hash chain
# --------------------------------------------------------------------------


def chain_panel(request: Request, cached: Iterable[BlockHash] = ()) -> Panel:
    """The request's hash chain: the root, then one box per full hash block, left to right."""
    known = frozenset(cached)
    links = facts.chain(request)
    panel = Panel(f"hash chain of request {request.request_id}")
    y = 4
    root_w = 96
    panel.rect(MARGIN, y + 20, root_w, 40, NULL_FILL, NULL_FILL)
    panel.text(
        MARGIN + root_w // 2, y + 45, "NONE_HASH", size=11, anchor="middle", fill="#fff", bold=True
    )
    x = MARGIN + root_w + 30
    height = 60
    for link in links:
        keys = [facts.key_text(k) for k in link.extra_keys]
        longest = max([len(f"tokens {link.tokens}"), 14, *(len(k) for k in keys)])
        w = longest * 7 + 20
        h = 62 + 14 * len(keys)
        fill = HASHED_FILL if link.block_hash in known else "#ffffff"
        panel.parts.append(f'<g class="link" data-index="{link.index}">')
        panel.rect(x, y, w, h, fill, FREE_STROKE)
        panel.text(x + 10, y + 16, f"hash {link.index}", size=11, fill=MUTED, bold=True)
        panel.text(x + 10, y + 32, f"tokens {link.tokens}", size=12, mono=True)
        for k, key in enumerate(keys):
            panel.text(x + 10, y + 47 + 14 * k, key, size=11, mono=True, fill="#6a2c91")
        panel.text(
            x + 10,
            y + h - 9,
            f"= {facts.short_hex(link.block_hash)}",
            size=11,
            mono=True,
            bold=True,
        )
        panel.parts.append("</g>")
        panel.arrow(x - 30, y + 40, x, y + 40)
        x += w + 30
        height = max(height, h)
    rest = request.num_tokens - len(links) * request.hash_block_size
    if rest:
        left = request_scenarios.tokens_text(request.all_token_ids[-rest:], 8)
        panel.text(x - 20, y + 45, f"{left}: no hash until its block fills", size=11, fill=MUTED)
        x += 230
    panel.text(
        MARGIN,
        y + height + 18,
        "each hash = SHA-256 of (parent hash, tokens, tagged extra keys); amber: in the cache",
        size=11,
        fill=MUTED,
    )
    panel.grow(x, y + height + 24)
    return panel


# --------------------------------------------------------------------------
# A lookup, position by position
# --------------------------------------------------------------------------

_CELL_STYLE = {
    facts.HIT: (HASHED_FILL, HELD_STROKE, "", TEXT),
    facts.SKIPPED: (NULL_FILL, NULL_FILL, "", "#ffffff"),
    facts.UNUSED: ("#ffffff", "#c98a00", "5 3", TEXT),
    facts.MISS: ("#ffffff", FREE_STROKE, "2 3", MUTED),
    facts.BEYOND: ("#eef1f4", FREE_STROKE, "", MUTED),
    facts.UNHASHED: ("#eef1f4", FREE_STROKE, "2 3", MUTED),
    facts.STATE: ("#e6dcf2", FREE_STROKE, "", TEXT),
}
_CELL_WORD = {
    facts.SKIPPED: "null",
    facts.UNUSED: "cached",
    facts.MISS: "miss",
    facts.BEYOND: "last",
    facts.UNHASHED: "no hash",
    facts.STATE: "state",
}
HIT_LEGEND = (
    (facts.HIT, "hit (block id)"),
    (facts.SKIPPED, "skipped: null block"),
    (facts.UNUSED, "cached, not used"),
    (facts.MISS, "not cached"),
    (facts.BEYOND, "holds the last token: always computed"),
    (facts.UNHASHED, "no full hash block"),
    (facts.STATE, "Mamba state: never a hit"),
)


def hits_panel(rows: Sequence[facts.HitRow], title: str = "lookup") -> Panel:
    """One row per group or attention type, one cell per block position, and the hit length."""
    panel = Panel(title)
    label_w = max([LABEL_W, *(min(len(r.label), 30) * 7 + 24 for r in rows)])
    y = 0
    for row in rows:
        panel.parts.append(f'<g class="hit-row" data-tokens="{row.num_tokens}">')
        for n, line in enumerate(_wrap(row.label, (label_w - 24) // 7)[:3]):
            panel.text(MARGIN, y + 16 + 13 * n, line, size=11, bold=n == 0)
        for i, cell in enumerate(row.cells):
            fill, stroke, dash, ink = _CELL_STYLE[cell.kind]
            x = label_w + i * (BLOCK_W + GAP)
            panel.parts.append(f'<g data-kind="{cell.kind}">')
            panel.rect(x, y, BLOCK_W, BLOCK_H, fill, stroke, "2", dash)
            panel.text(
                x + BLOCK_W // 2, y + 17, cell.tokens, size=11, anchor="middle", fill=ink, mono=True
            )
            word = str(cell.block) if cell.kind == facts.HIT else _CELL_WORD[cell.kind]
            if cell.kind == facts.UNUSED and cell.block is not None:
                word = f"{cell.block} unused"
            bold = cell.kind == facts.HIT
            panel.text(
                x + BLOCK_W // 2,
                y + 36,
                word,
                size=13 if bold else 10,
                anchor="middle",
                fill=ink,
                bold=bold,
            )
            panel.parts.append("</g>")
        end = label_w + len(row.cells) * (BLOCK_W + GAP)
        hit_cells = sum(1 for c in row.cells if c.kind in (facts.HIT, facts.SKIPPED))
        if hit_cells:
            panel.parts.append(
                f'<line x1="{label_w}" y1="{y + BLOCK_H + 5}" '
                f'x2="{label_w + hit_cells * (BLOCK_W + GAP) - GAP}" y2="{y + BLOCK_H + 5}" '
                f'stroke="{HELD_STROKE}" stroke-width="4"/>'
            )
        panel.text(end + 4, y + 28, f"{row.num_tokens} tokens", size=13, bold=True)
        panel.parts.append("</g>")
        panel.grow(end + 90, 0)
        y += BLOCK_H + 20
    x = MARGIN
    for kind, words in HIT_LEGEND:
        fill, stroke, dash, _ = _CELL_STYLE[kind]
        item = 24 + len(words) * 6 + 14
        if x > MARGIN and x + item > panel.width:
            x, y = MARGIN, y + LINE_H
        panel.rect(x, y + 2, 16, 14, fill, stroke, "1.5", dash, rx=3)
        panel.text(x + 22, y + 13, words, size=11)
        x += item
    panel.height = y + LINE_H + 4
    return panel


# --------------------------------------------------------------------------
# Admission
# --------------------------------------------------------------------------


def admission_panel(adm: facts.Admission) -> Panel:
    """The slot layout (computed | hits | new | look-ahead), the count per group, the verdict."""
    panel = Panel(f"allocate_slots({adm.request_id}): what it counts")
    segments = [
        ("computed", adm.num_computed, "#c9d3dd"),
        ("hits", adm.num_hit, HASHED_FILL),
        ("new", adm.num_new, "#a9d4b5"),
        ("look-ahead", adm.num_lookahead, "#e6dcf2"),
    ]
    x = MARGIN
    y = 4
    for name, count, fill in segments:
        if count <= 0:
            continue
        w = max(70, count * 16)
        panel.rect(x, y, w, 34, fill, FREE_STROKE, "1", rx=3)
        panel.text(x + w // 2, y + 15, name, size=11, anchor="middle", bold=True)
        panel.text(x + w // 2, y + 29, f"{count} token(s)", size=10, anchor="middle")
        x += w
    panel.text(
        x + 10, y + 22, f"= {adm.num_slots} slots" + (" (capped)" if adm.capped else ""), size=12
    )
    panel.grow(x + 150, 0)
    y += 52
    for line in facts.admission_text(adm).splitlines()[2:-1]:
        panel.text(MARGIN, y, line.strip(), size=12, mono=True)
        panel.grow(MARGIN + len(line) * 8, 0)
        y += LINE_H
    verdict = facts.admission_text(adm).splitlines()[-1].strip()
    panel.text(
        MARGIN, y + 4, verdict, size=13, bold=True, fill=ADMITTED if adm.admitted else REFUSED
    )
    panel.grow(MARGIN + len(verdict) * 8, 0)
    panel.height = y + 14
    return panel


# --------------------------------------------------------------------------
# Release
# --------------------------------------------------------------------------


def release_panel(
    items: Sequence[facts.Released],
    before: PoolState,
    after: PoolState,
    labels: Mapping[BlockHash, str],
) -> Panel:
    """The blocks a free released, left to right in the order released, and where each went."""
    panel = Panel("freed, in this order")
    where_words = {"front": "→ front", "back": "→ back", "held": "still held"}
    y = 4
    if not items:
        panel.text(MARGIN, y + 16, "(nothing: the request held no block)", fill=MUTED)
        panel.height = 28
        return panel
    for i, item in enumerate(items):
        x = MARGIN + i * (BLOCK_W + GAP)
        key = before.blocks[item.block].block_hash
        fill = HASHLESS_FILL if key is None else HASHED_FILL
        panel.parts.append(f'<g data-block="{item.block}" data-where="{item.where}">')
        panel.rect(
            x, y, BLOCK_W, BLOCK_H, fill, HELD_STROKE if item.where == "held" else FREE_STROKE, "2"
        )
        panel.text(x + BLOCK_W // 2, y + 20, str(item.block), size=15, anchor="middle", bold=True)
        name = "no hash" if key is None else facts.name_of(key[0], labels)
        panel.text(x + BLOCK_W // 2, y + 37, name[-7:], size=10, anchor="middle", mono=True)
        panel.text(
            x + BLOCK_W // 2,
            y + BLOCK_H + 14,
            f"g{item.group}",
            size=10,
            anchor="middle",
            fill=MUTED,
        )
        panel.text(
            x + BLOCK_W // 2,
            y + BLOCK_H + 28,
            where_words[item.where],
            size=11,
            anchor="middle",
            bold=True,
        )
        panel.parts.append("</g>")
        panel.grow(x + BLOCK_W, 0)
    panel.height = y + BLOCK_H + 36
    return panel


# --------------------------------------------------------------------------
# Whole pictures
# --------------------------------------------------------------------------


def world_panels(world: World, highlight: Iterable[int] = ()) -> list[Panel]:
    """The requests, the block tables and the pool."""
    marked = tuple(highlight)
    return [
        requests_panel(world),
        tables_panel(world, marked),
        pool_panel(world.pool, world.labels, marked),
    ]


def render_world_svg(world: World, caption: str = "", highlight: Iterable[int] = ()) -> str:
    """The request layer's whole state as one SVG document."""
    return document(world_panels(world, highlight), caption)


def step_panel(outcome: Outcome) -> Panel | None:
    """The panel that shows what the step's operation did, if it has one."""
    if outcome.error is not None:
        return None
    op, args, before, after = outcome.step.op, outcome.step.args, outcome.before, outcome.state
    rid = str(args.get("request_id", ""))
    if op in ("new_request", "run_model") and rid in after.requests:
        cached = {h for h, _ in after.pool.cached}
        return chain_panel(after.requests[rid], cached)
    if op == "get_computed_blocks" and isinstance(outcome.result, dict):
        blocks, num = after.lookups[rid]
        rows = facts.hit_rows(after, after.requests[rid], blocks, num)
        return hits_panel(rows, f"lookup of request {rid}: {num} tokens hit")
    if op == "allocate_slots":
        return admission_panel(facts.admission(before, args))
    if op in ("free", "preempt"):
        items = facts.release(before.pool, after.pool, facts.freed_order(before, rid))
        return release_panel(items, before.pool, after.pool, after.labels)
    return None


def render_outcome_svg(outcome: Outcome, caption: str = "") -> str:
    """One step of a request scenario: what its operation did, then the whole state after it."""
    panel = step_panel(outcome)
    panels = ([panel] if panel is not None else []) + world_panels(outcome.state, outcome.changed)
    return document(panels, caption)
