"""Plain-text worked examples: what the docs commit in ``text`` blocks, generated from the model.

A page that shows a worked example as plain text (so that it reads on GitHub,
in a terminal, anywhere) marks the block with ``<!-- kvpool-text NAME -->``
right before it. ``text(NAME)`` generates the block's content from the model,
and a test checks that every marked block equals it: edit the model and the
test names the blocks to regenerate (``python -m kvpool.specs.teaching.texts
NAME`` prints one; ``--update PAGE.md ...`` rewrites every marked block of the
pages in place).

The names are the request-layer figures (``request_figures``) and a trace of
every pool scenario (``trace:SCENARIO``): each step's call, the free queue and
hash map after it, and the events it emitted.

>>> print(text("trace:evict-held-then-free").splitlines()[8])
 3 evict_blocks(block_ids=[2])
"""

import re
import sys
from pathlib import Path

from kvpool.model import PoolState
from kvpool.specs.teaching import request_figures, scenarios
from kvpool.specs.teaching.explain import call_text, event_text
from kvpool.specs.teaching.pictures import hash_label, key_label


def pool_line(state: PoolState) -> str:
    """The free queue (next first, hashed blocks with their hash), the held blocks (``x2``:
    held twice) and the hash map, in a line."""

    def block(b: int) -> str:
        key = state.blocks[b].block_hash
        return f"{b} {hash_label(key[0])}" if key else str(b)

    queue = " · ".join(block(b) for b in state.free_queue) or "(empty)"
    held = ", ".join(
        f"{b}" + (f" x{state.blocks[b].ref_cnt}" if state.blocks[b].ref_cnt > 1 else "")
        for b in range(1, state.config.num_blocks)
        if state.blocks[b].ref_cnt > 0
    )
    keys = " | ".join(
        f"{key_label(k)} -> {', '.join(map(str, state.cached[k]))}" for k in sorted(state.cached)
    )
    return f"queue: {queue}   held: {held or '-'}   map: {keys or '(empty)'}"


def trace(name: str) -> str:
    """A pool scenario as a plain-text trace: each call, the pool after it, its events."""
    scenario = scenarios.get(name)
    lines = [
        f" 0 new_pool({scenario.config.num_blocks})",
        f"   {pool_line(scenarios.initial_state(scenario))}",
    ]
    for o in scenarios.run(scenario):
        call = call_text(o.step.op, dict(o.step.args))
        if o.step.op == "cache_full_blocks":
            call = call.split(", num_cached_blocks")[0] + ", ...)"
        result = "" if o.result is None else f" -> {o.result}"
        if o.step.op == "get_cached_block" and o.result is None:
            result = " -> None (a miss)"
        if o.step.op == "take_events" and isinstance(o.result, list):
            result = f" -> {len(o.result)} event(s)"
        lines.append(f"{o.index:>2} {call}{result}")
        moved = (o.state.free_queue, o.state.cached) != (o.before.free_queue, o.before.cached)
        if moved or o.state.blocks != o.before.blocks:
            lines.append(f"   {pool_line(o.state)}")
        events = list(o.before.pending_events) if o.step.op == "take_events" else list(o.events)
        verb = "taken" if o.step.op == "take_events" else "emits"
        if events:
            lines += [f"   {verb}: {event_text(e)}" for e in events]
        elif o.step.op != "take_events":
            lines.append("   emits nothing")
    return "\n".join(lines)


def names() -> list[str]:
    """Every name ``text`` knows."""
    return [*request_figures.NAMES, *(f"trace:{n}" for n in scenarios.BUILT_IN)]


def text(name: str) -> str:
    """The plain text of ``name``; KeyError if there is none."""
    if name.startswith("trace:"):
        scenario = name.removeprefix("trace:")
        if scenario not in scenarios.BUILT_IN:
            raise KeyError(name)
        return trace(scenario)
    if name not in request_figures.FIGURES:
        raise KeyError(name)
    return request_figures.text(name)


MARKED = re.compile(r"(<!--\s*kvpool-text\s+(\S+)\s*-->\n```text\n)(.*?)(\n```)", re.S)
"""A marked block: the marker, the opening fence, the committed text, the closing fence."""


def marked_blocks(markdown: str) -> list[tuple[str, str]]:
    """Every (name, committed text) a page marks with ``<!-- kvpool-text NAME -->``."""
    return [(m.group(2), m.group(3)) for m in MARKED.finditer(markdown)]


def update(markdown: str) -> str:
    """The page with every marked block replaced by the text the model gives now."""
    return MARKED.sub(lambda m: m.group(1) + text(m.group(2)) + m.group(4), markdown)


if __name__ == "__main__":  # pragma: no cover  (a helper for whoever edits the docs)
    if sys.argv[1:2] == ["--update"]:
        for page in sys.argv[2:]:
            path = Path(page)
            path.write_text(update(path.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        for wanted in sys.argv[1:] or names():
            print(f"<!-- kvpool-text {wanted} -->\n```text\n{text(wanted)}\n```\n")
