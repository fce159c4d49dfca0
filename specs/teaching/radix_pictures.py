"""Pictures of SGLang's radix cache, and the three-engine story the documentation tells with them.

``render_radix_svg`` draws a ``RadixState`` as a self-contained SVG, a pure
function of the state like ``kvpool.specs.teaching.pictures.render_svg``
(same colours, no ids, no timestamps): the **tree**, one row per depth, each
node a box with its segment's tokens, its KV slots, and either its lock
count (solid green outline) or its place in the eviction order (dashed);
then a **ledger** with the sizes, the eviction order and the events still
queued.

``SIDE_BY_SIDE`` is one story played on vLLM's v1 pool, vLLM's v0 allocator
and SGLang's radix cache (two requests sharing a prefix, a third computing
the same prompt again, all finishing, then memory needed):
``side_by_side_pictures`` and ``side_by_side_markdown`` turn it into the
pictures and the Markdown of docs/explanation/side-by-side.md (expanded by
``docs/hooks/radix_docs.py``).

>>> from kvpool.model import radix
>>> svg = render_radix_svg(radix.new_radix_cache(2), caption="an empty cache")
>>> svg.startswith("<svg") and "evictable 0" in svg
True
"""

import posixpath
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

from kvpool import model
from kvpool.model import AllBlocksCleared, BlockRemoved, BlockStored, CacheRequest, PoolState, radix
from kvpool.model import v0 as v0model
from kvpool.model.radix import ROOT, Path, RadixState
from kvpool.model.v0 import V0State
from kvpool.specs.teaching.pictures import (
    ARROW,
    FREE_STROKE,
    HASHED_FILL,
    HELD_STROKE,
    HIGHLIGHT,
    LINE_H,
    MARGIN,
    MIN_WIDTH,
    MUTED,
    TEXT,
    _Svg,
    _wrap,
    render_svg,
)
from kvpool.specs.teaching.v0_pictures import render_v0_svg, tokens_label

NODE_H = 58
NODE_GAP, ROW_GAP = 14, 34
CHAR_W = 8


def _segment(state: RadixState, path: Path) -> tuple[int, ...]:
    return path[len(state.nodes[path].parent) :]


def _children(state: RadixState, path: Path) -> list[Path]:
    return sorted(p for p, n in state.nodes.items() if n.parent == path)


def _width(state: RadixState, path: Path) -> int:
    label = max(len(tokens_label(_segment(state, path), 16)), 3 * len(state.nodes[path].slots))
    return max(64, label * CHAR_W + 16)


def event_label(event: object) -> str:
    """One queued event in a few words: ``stored AB CD``, ``removed 2 pages``, ``cleared``.

    >>> event_label(AllBlocksCleared())
    'cleared'
    """
    if isinstance(event, BlockStored):
        return f"stored {tokens_label(event.token_ids, 24)}"
    if isinstance(event, BlockRemoved):
        return f"removed {len(event.block_hashes)} page(s)"
    return "cleared" if isinstance(event, AllBlocksCleared) else repr(event)


def render_radix_svg(state: RadixState, caption: str = "", highlight: Iterable[Path] = ()) -> str:
    """The radix cache as an SVG document; ``highlight`` outlines nodes (by path)."""
    marked = frozenset(highlight)
    svg = _Svg()
    order = radix.eviction_order(state)
    place = {p: i + 1 for i, p in enumerate(order)}

    # Leaves left to right in path order; a parent is centred over its children.
    x_of: dict[Path, int] = {}
    depth: dict[Path, int] = {ROOT: 0}
    cursor = [MARGIN + 70]

    def lay_out(path: Path, level: int) -> int:
        kids = _children(state, path)
        for kid in kids:
            depth[kid] = level + 1
        if path != ROOT and not kids:
            x_of[path] = cursor[0]
            cursor[0] += _width(state, path) + NODE_GAP
            return x_of[path] + _width(state, path) // 2
        centres = [lay_out(kid, level + 1) for kid in kids]
        if path == ROOT:
            return 0
        centre = (centres[0] + centres[-1]) // 2
        x_of[path] = centre - _width(state, path) // 2
        return centre

    lay_out(ROOT, 0)
    top = 10
    svg.text(MARGIN, top + 20, "tree", size=13, weight="bold")
    svg.text(
        MARGIN, top + 36, f"{len(state.nodes)} node(s), page {state.config.page_size}",
        size=11, fill=MUTED,
    )  # fmt: skip
    root_x = MARGIN + 70
    svg.add(
        f'<circle cx="{root_x + 8}" cy="{top + 14}" r="7" fill="{TEXT}"/>'
        f'<text x="{root_x + 20}" y="{top + 18}" font-size="11" fill="{MUTED}">root</text>'
    )

    def y_of(path: Path) -> int:
        return top + 34 + (depth[path] - 1) * (NODE_H + ROW_GAP)

    for path in sorted(state.nodes):
        parent = state.nodes[path].parent
        if parent == ROOT:
            sx, sy = root_x + 8, top + 21
        else:
            sx, sy = x_of[parent] + _width(state, parent) // 2, y_of(parent) + NODE_H
        ex, ey = x_of[path] + _width(state, path) // 2, y_of(path)
        svg.add(
            f'<line x1="{sx}" y1="{sy}" x2="{ex}" y2="{ey}" stroke="{ARROW}" stroke-width="1.5"/>'
        )
    svg.add('<g class="nodes">')
    for path in sorted(state.nodes):
        node = state.nodes[path]
        x, y, w = x_of[path], y_of(path), _width(state, path)
        held = node.lock_ref > 0
        stroke = HELD_STROKE if held else FREE_STROKE
        dash = "" if held else ' stroke-dasharray="5 3"'
        svg.add(f'<g data-path="{"-".join(map(str, path))}">')
        svg.add(
            f'<rect x="{x}" y="{y}" width="{w}" height="{NODE_H}" rx="7" fill="{HASHED_FILL}" '
            f'stroke="{stroke}" stroke-width="{2.5 if held else 1.5}"{dash}/>'
        )
        if path in marked:
            svg.add(
                f'<rect x="{x - 4}" y="{y - 4}" width="{w + 8}" height="{NODE_H + 8}" rx="10" '
                f'fill="none" stroke="{HIGHLIGHT}" stroke-width="3"/>'
            )
        cx = x + w // 2
        svg.text(cx, y + 19, tokens_label(_segment(state, path), 16), 14, "middle", weight="bold")
        slots = " ".join(str(s) for s in node.slots)
        svg.text(cx, y + 35, f"slots {slots}", size=10, anchor="middle", mono=True)
        status = f"lock {node.lock_ref}" if held else f"evict {place.get(path, '-')}"
        svg.text(
            cx, y + 50, f"{status} · t={node.last_access}", size=10, anchor="middle",
            fill=HELD_STROKE if held else MUTED,
        )  # fmt: skip
        svg.add("</g>")
    svg.add("</g>")

    levels = max(depth.values(), default=0)
    right = max([MIN_WIDTH, cursor[0]])
    y = top + 34 + max(levels, 1) * (NODE_H + ROW_GAP) + 6
    order_text = ", ".join(tokens_label(p, 16) for p in order)
    events = ", ".join(event_label(e) for e in state.pending_events)
    facts = [
        (
            "sizes (tokens)",
            f"evictable {radix.evictable_size(state)}, protected {radix.protected_size(state)}",
        ),
        ("eviction order (first first)", order_text or "nothing evictable"),
        ("events queued", events or "none"),
    ]
    wrap_at = max((right - MARGIN - 220) // 7, 30)
    for title, value in facts:
        svg.text(MARGIN, y, title, size=11, weight="bold")
        for i, line in enumerate(_wrap(value, wrap_at)):
            svg.text(MARGIN + 220, y + i * (LINE_H - 2), line, size=11, mono=True)
            if i:
                y += LINE_H - 2
        y += LINE_H
    legend = (
        f"policy {state.config.policy} · a node: its tokens, its KV slots · solid green: "
        "locked · dashed: evictable, with its place in line and last access"
    )
    for line in _wrap(legend, max((right - 2 * MARGIN) // 6, 30)):
        svg.text(MARGIN, y + 4, line, size=11, fill=MUTED)
        y += LINE_H

    width = right + MARGIN
    caption_lines = _wrap(caption, max((width - 2 * MARGIN) // 9, 30)) if caption else []
    head_top = MARGIN + len(caption_lines) * LINE_H + (10 if caption_lines else 0)
    head_parts = [
        f'<text x="{MARGIN}" y="{MARGIN + (i + 1) * LINE_H - 4}" font-size="14" '
        f'font-weight="bold" fill="{TEXT}">{escape(text)}</text>'
        for i, text in enumerate(caption_lines)
    ]
    height = head_top + y + MARGIN
    label = escape(caption or "radix cache", {'"': "&quot;"})
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{label}" '
        f'font-family="system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif">'
    )
    background = f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>'
    body = [f'<g transform="translate(0,{head_top})">', *svg.parts, "</g>"]
    return "\n".join([head, background, *head_parts, *body, "</svg>"]) + "\n"


def node_paths(svg: str) -> list[Path]:
    """The nodes a picture draws, by path (for tests and tools).

    >>> from kvpool.model import radix
    >>> cache, _ = radix.insert(radix.new_radix_cache(), [1, 2], [10, 11])
    >>> node_paths(render_radix_svg(cache))
    [(1, 2)]
    """
    import re

    found = re.findall(r'<g data-path="([\d-]+)">', svg)
    return [tuple(int(t) for t in item.split("-")) for item in found]


# --------------------------------------------------------------------------
# One story, three engines
# --------------------------------------------------------------------------

PAGE = 2
V1_BLOCKS = 6  # block 0 is the null block
V0_BLOCKS = 4


def _t(text: str) -> list[int]:
    """Tokens of a readable prompt: one letter, one token."""
    return [ord(c) for c in text]


def _request(text: str) -> CacheRequest:
    tokens = _t(text)
    hashes = tuple(bytes(tokens[:end]) for end in range(PAGE, len(tokens) + 1, PAGE))
    return CacheRequest(block_hashes=hashes, all_token_ids=tuple(tokens))


@dataclass(frozen=True)
class Engines:
    """The three engines' states at one point of the story."""

    v1: PoolState
    v0: V0State
    radix: RadixState


@dataclass(frozen=True)
class StoryStep:
    """One step of the story and the calls each engine makes for it."""

    say: str
    v1_calls: str
    v0_calls: str
    radix_calls: str
    play: Callable[[Engines], Engines]
    note: str = ""


def _v1_prompt(state: PoolState, text: str, hits: int) -> PoolState:
    request = _request(text)
    found = []
    for i in range(hits):
        cached = model.get_cached_block(state, request.block_hashes[i], [0])
        assert cached is not None
        found.append(cached[0])
    state, _ = model.touch(state, found)
    state, new = model.get_new_blocks(state, len(request.block_hashes) - hits)
    blocks = [*found, *new]
    return model.cache_full_blocks(state, request, blocks, hits, len(blocks), PAGE, 0)[0]


def _v0_prompt(state: V0State, text: str) -> V0State:
    tokens = _t(text)
    chunks = [tokens[i : i + PAGE] for i in range(0, len(tokens), PAGE)]
    return v0model.allocate_immutable_blocks(state, None, chunks)[0]


def _v0_prompt_computed(state: V0State, text: str) -> V0State:
    """Blocks filled token by token (computed, not looked up): each is de-duplicated when full."""
    tokens = _t(text)
    prev = None
    for i in range(0, len(tokens), PAGE):
        state, prev = v0model.allocate_mutable_block(state, prev)
        state, _ = v0model.append_token_ids(state, prev, tokens[i : i + PAGE])
    return state


def _radix_request(state: RadixState, text: str, slots: Sequence[int], share: bool) -> RadixState:
    """Match (if ``share``), lock the node, insert the rest with the shared slots."""
    tokens = _t(text)
    shared: tuple[int, ...]
    prev, shared = 0, ()
    if share:
        state, hit = radix.match_prefix(state, tokens)
        prev, shared = hit.prefix_len, hit.slots
    state, result = radix.insert(state, tokens, [*shared, *slots[prev:]], prev_prefix_len=prev)
    return radix.lock(state, result.path)[0]


def _finish(engines: Engines) -> Engines:
    """Every request frees what it holds: v1 its blocks (last first), v0 its block objects
    (marked as accessed at time 1 first), SGLang its locks."""
    v1 = engines.v1
    for blocks in ([2, 1], [3, 1], [5, 4]):
        v1, _ = model.free_blocks(v1, blocks)
    v0 = engines.v0
    held = sorted({obj.block_id for obj in v0.handles.values()})
    v0, _ = v0model.mark_blocks_as_accessed(v0, held, 1.0)
    for handle in sorted(v0.handles):
        v0, _ = v0model.free(v0, handle)
    state = engines.radix
    for path in ((*_t("ABCD"),), (*_t("ABEF"),), (*_t("ABCD"),)):
        state, _ = radix.unlock(state, path)
    return Engines(v1, v0, state)


def _need_memory(engines: Engines) -> Engines:
    v1, _ = model.get_new_blocks(engines.v1, 2)
    v0, _ = v0model.allocate_mutable_block(engines.v0)
    v0, _ = v0model.allocate_mutable_block(v0)
    state, _ = radix.evict(engines.radix, 4)
    return Engines(v1, v0, state)


SIDE_BY_SIDE: tuple[StoryStep, ...] = (
    StoryStep(
        say="Request A arrives with the prompt ABCD and is computed.",
        v1_calls="get_new_blocks(2) → [1, 2]; cache_full_blocks(A, [1, 2], 0, 2)",
        v0_calls="allocate_immutable_blocks(None, [AB, CD]) → blocks 0, 1",
        radix_calls="match_prefix(ABCD) → 0; insert(ABCD, slots 0-3); lock(ABCD)",
        play=lambda e: Engines(
            _v1_prompt(e.v1, "ABCD", 0),
            _v0_prompt(e.v0, "ABCD"),
            _radix_request(e.radix, "ABCD", [0, 1, 2, 3], True),
        ),
        note="All three cache the prompt. vLLM caches **blocks** under chained hashes "
        "(v1: a map from hash to blocks; v0: from content to one block); SGLang caches "
        "**tokens** in a tree: one node holds the whole prompt, two pages, with the KV slot "
        "of every token. The running request holds its data: a reference on each block in "
        "vLLM, a **lock** on the node (and every ancestor) in SGLang.",
    ),
    StoryStep(
        say="Request B arrives with the prompt ABEF: AB is a hit.",
        v1_calls="get_cached_block(AB) → [1]; touch([1]); get_new_blocks(1) → [3]; "
        "cache_full_blocks(B, [1, 3], 1, 2)",
        v0_calls="allocate_immutable_blocks(None, [AB, EF]) → block 0 (a hit), block 2",
        radix_calls="match_prefix(ABEF) → 2 tokens, slots 0 1 (the node splits); "
        "insert(ABEF, slots 0 1 4 5, prev_prefix_len=2); lock(ABEF)",
        play=lambda e: Engines(
            _v1_prompt(e.v1, "ABEF", 1),
            _v0_prompt(e.v0, "ABEF"),
            _radix_request(e.radix, "ABEF", [0, 1, 4, 5], True),
        ),
        note="**What a hit returns**: vLLM returns block ids (whole blocks; v1 also its "
        "hashes), SGLang a number of tokens, the KV slots of each and a node. The match "
        "ended inside the node ABCD, so SGLang **split** it into AB and CD: a node now ends "
        "exactly where the hit ends, and the new leaf EF hangs under AB. A split moves no "
        "KV and sends **no event** (since 0.5.7, sgl-project/sglang#14934).",
    ),
    StoryStep(
        say="Request C computed ABCD itself (it started before A was cached) and caches it.",
        v1_calls="get_new_blocks(2) → [4, 5]; cache_full_blocks(C, [4, 5], 0, 2)",
        v0_calls="allocate_mutable_block, append_token_ids x 2: each full block is "
        "de-duplicated onto blocks 0 and 1",
        radix_calls="insert(ABCD, slots 6-9) → prefix 4, duplicates 6 7, 8 9; lock(ABCD)",
        play=lambda e: Engines(
            _v1_prompt(e.v1, "ABCD", 0),
            _v0_prompt_computed(e.v0, "ABCD"),
            _radix_request(e.radix, "ABCD", [6, 7, 8, 9], False),
        ),
        note="**De-duplication** parts the engines. v1 keeps the duplicate blocks 4 and 5 "
        "under the same keys (block tables only ever grow); v0 moves C's block objects onto "
        "the cached blocks and frees its own; SGLang keeps its own slots and returns C's as "
        "**duplicates** for the caller to free (the unified cache frees them itself).",
    ),
    StoryStep(
        say="All three requests finish.",
        v1_calls="free_blocks([2, 1]); free_blocks([3, 1]); free_blocks([5, 4])",
        v0_calls="mark_blocks_as_accessed(…, 1.0); free(each block object)",
        radix_calls="unlock(ABCD); unlock(ABEF); unlock(ABCD)",
        play=_finish,
        note="Everything is evictable now, and each engine has decided its **eviction "
        "order**: v1 by position in its free queue (decided when blocks are freed), v0 by "
        "last access then depth, SGLang by the policy's key over **leaves** (LRU: least "
        "recently used first; a parent waits until its children are gone).",
    ),
    StoryStep(
        say="Memory is needed for two blocks (four tokens).",
        v1_calls="get_new_blocks(2): the front of the free queue, hashes dropped",
        v0_calls="allocate_mutable_block() x 2: a hash-less block, then an evicted one",
        radix_calls="evict(4) → leaves in LRU order, whole nodes, until 4 tokens are gone",
        play=_need_memory,
        note="**The unit of eviction**: vLLM evicts one block at a time (v0 only once no "
        "hash-less block is left); SGLang removes whole leaf nodes, as many as it takes "
        "(overshooting by up to one node), least recently used first, and a parent only "
        "after its children. SGLang's removal is one `BlockRemoved` per node with all its "
        "page hashes, consecutive removals merged into one event.",
    ),
)


def story() -> list[tuple[StoryStep, Engines]]:
    """Each step of ``SIDE_BY_SIDE`` with the three states after it."""
    engines = Engines(
        model.new_pool(V1_BLOCKS, hash_block_size=PAGE),
        v0model.new_allocator(V0_BLOCKS, PAGE),
        radix.new_radix_cache(PAGE),
    )
    played = []
    for step in SIDE_BY_SIDE:
        engines = step.play(engines)
        played.append((step, engines))
    return played


PICTURES = "pictures/side-by-side"
SIDES = ("v1", "v0", "radix")


def picture_path(side: str, index: int) -> str:
    """Where the picture of ``side`` after step ``index`` lives in the site."""
    return f"{PICTURES}/{side}-step-{index:02d}.svg"


def side_by_side_pictures() -> dict[str, str]:
    """Every picture of the story, by site path."""
    pictures: dict[str, str] = {}
    before = None
    for index, (step, engines) in enumerate(story(), start=1):
        pictures[picture_path("v1", index)] = render_svg(
            engines.v1, caption=f"vLLM v1 after step {index}: {step.v1_calls}"
        )
        pictures[picture_path("v0", index)] = render_v0_svg(
            engines.v0, caption=f"vLLM v0 after step {index}: {step.v0_calls}"
        )
        changed = [
            p for p, n in engines.radix.nodes.items() if before is None or before.nodes.get(p) != n
        ]
        pictures[picture_path("radix", index)] = render_radix_svg(
            engines.radix,
            caption=f"SGLang after step {index}: {step.radix_calls}",
            highlight=changed,
        )
        before = engines.radix
    return pictures


def side_by_side_markdown(page_src: str) -> str:
    """The story as Markdown: each step's narration, the three engines' calls and pictures."""

    def image(side: str, index: int, alt: str) -> str:
        path = posixpath.relpath(picture_path(side, index), posixpath.dirname(page_src) or ".")
        return f"![{alt}]({path})"

    names = {"v1": "vLLM v1", "v0": "vLLM v0", "radix": "SGLang"}
    lines = [
        f"Pages and blocks hold {PAGE} tokens; one letter is one token. vLLM v1 has "
        f"{V1_BLOCKS - 1} usable blocks (and its null block 0), v0 {V0_BLOCKS}; SGLang's "
        "slots are numbered by the request that wrote them.",
        "",
    ]
    for index, (step, _) in enumerate(story(), start=1):
        lines += [
            f"### Step {index}. {step.say}",
            "",
            f"* **vLLM v1**: `{step.v1_calls}`",
            f"* **vLLM v0**: `{step.v0_calls}`",
            f"* **SGLang**: `{step.radix_calls}`",
            "",
        ]
        if step.note:
            lines += [step.note, ""]
        for side in ("radix", "v1", "v0"):
            lines += [image(side, index, f"{names[side]} after step {index}"), ""]
    return "\n".join(lines)
