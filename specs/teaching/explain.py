"""A pool scenario told step by step, with the pool drawn after each step.

The scenario is a built-in one (``kvpool explain --list``), a conformance
vector file (``.jsonl``: the vector a divergence writes beside its regression
test is one) or the id of a vector in the bundled corpus. Each step is run on
the model; the terminal shows the narration, the result, the events and the
pool; ``render_html`` writes the same as one self-contained page with an SVG
picture per step (``kvpool.specs.teaching.pictures``). The command itself,
which also tells request-layer scenarios (``request_explain``), is in
``command``.
"""

import html
import json
from collections.abc import Mapping, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvpool.model import (
    NULL_BLOCK_ID,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    FreeOrder,
    HashKey,
    KVCacheEvent,
    PoolState,
)
from kvpool.specs.protocol.codec import Json
from kvpool.specs.teaching import scenarios
from kvpool.specs.teaching.pictures import hash_label, key_label, named, render_svg
from kvpool.specs.teaching.scenarios import Outcome, Scenario

HASHED_STYLE = "black on #f6c560"
HASHLESS_STYLE = "black on #dde3ea"
NULL_STYLE = "white on #2d3440"


# --------------------------------------------------------------------------
# Words: what a step did, worked out from the states around it
# --------------------------------------------------------------------------


def call_text(op: str, args: dict[str, Json] | object) -> str:
    """``op(arg=value, ...)`` with requests shortened to their hashes.

    >>> call_text("free_blocks", {"block_ids": [2, 1]})
    'free_blocks(block_ids=[2, 1])'
    """
    if not isinstance(args, dict):
        return f"{op}()"
    shown = []
    for name, value in args.items():
        if name == "request" and isinstance(value, dict):
            hashes = [_hex_label(h) for h in value.get("block_hashes", [])]
            shown.append(f"request=<hashes {', '.join(hashes) or 'none'}>")
        elif name == "block_hash":
            shown.append(f"block_hash={_hex_label(value)}")
        elif name == "block_mask" and value is None:
            continue
        else:
            shown.append(f"{name}={json.dumps(value)}")
    return f"{op}({', '.join(shown)})"


def _hex_label(value: Json) -> str:
    try:
        return hash_label(bytes.fromhex(str(value)))
    except ValueError:
        return str(value)


def _ids(ids: Sequence[int]) -> str:
    return ", ".join(str(b) for b in ids)


def _key_moves(before: PoolState, after: PoolState) -> tuple[list[str], list[str]]:
    """(added, removed) hash-map entries as ``KEY → block`` strings."""
    added, removed = [], []
    for key in sorted(set(before.cached) | set(after.cached)):
        old, new = before.cached.get(key, ()), after.cached.get(key, ())
        added += [f"{key_label(key)} → {b}" for b in new if b not in old]
        removed += [f"{key_label(key)} → {b}" for b in old if b not in new]
    return added, removed


def describe(outcome: Outcome) -> str:
    """One or two sentences saying what the step did, read off the states around it."""
    op, before, after, result = outcome.step.op, outcome.before, outcome.state, outcome.result
    if outcome.error is not None:
        return "A rejection: the pool is unchanged."
    added, removed = _key_moves(before, after)
    facts: list[str] = []
    if op == "get_new_blocks":
        facts.append(
            f"Handed out block(s) {_ids(result)} from the front of the free queue."
            if result
            else "Handed out no block."
        )
    elif op == "touch":
        left = [b for b in before.free_queue if b not in after.free_queue]
        if left:
            facts.append(f"Block(s) {_ids(left)} left the free queue with their hashes.")
        refs = [
            f"{b}: ref {after.blocks[b].ref_cnt}"
            for b in dict.fromkeys(outcome.step.args.get("block_ids", []))
            if b != NULL_BLOCK_ID and 0 <= b < after.config.num_blocks
        ]
        if refs:
            facts.append(f"Ref counts now {', '.join(refs)}.")
    elif op == "free_blocks":
        newly = [b for b in after.free_queue if b not in before.free_queue]
        rule = after.config.profile.free_order_for(after.config.enable_caching)
        if not newly:
            facts.append("No block reached ref count 0.")
        elif rule is FreeOrder.HASHLESS_FIRST:
            front = [b for b in newly if after.blocks[b].block_hash is None]
            back = [b for b in newly if after.blocks[b].block_hash is not None]
            if front:
                facts.append(f"Hash-less block(s) {_ids(front)} went to the front of the queue.")
            if back:
                facts.append(f"Hashed block(s) {_ids(back)} went to the back.")
        else:
            facts.append(f"Block(s) {_ids(newly)} went to the back of the queue ({rule.value}).")
        still = sorted(
            {b for b in outcome.step.args.get("block_ids", []) if isinstance(b, int)}
            - set(newly)
            - {NULL_BLOCK_ID}
        )
        if still:
            facts.append(f"Still held: {_ids(still)}.")
    elif op == "get_cached_block":
        facts.append("A miss." if result is None else f"A hit: block(s) {_ids(result)}.")
    elif op == "reset_prefix_cache":
        facts.append(
            "Reset done: every hash dropped, the free queue kept its order."
            if result
            else "Refused (False): some block is held. Nothing changed."
        )
    elif op == "take_events":
        facts.append(f"Took {len(result) if isinstance(result, list) else 0} event(s).")
    elif op in ("get_num_free_blocks", "get_usage"):
        facts.append(f"Answer: {result}.")
    elif op == "cache_partial_block" and result is None:
        facts.append("The null block is never cached: nothing happened.")
    if added:
        facts.append(f"Cached {'; '.join(added)}.")
    if removed:
        facts.append(f"Dropped {'; '.join(removed)}.")
    if not facts:
        facts.append("Nothing changed.")
    return " ".join(facts)


def event_text(event: KVCacheEvent) -> str:
    """One event in a line."""
    if isinstance(event, BlockStored):
        hashes = ", ".join(hash_label(h) for h in event.block_hashes) or "nothing"
        return f"BlockStored {hashes} (group {event.group_idx})"
    if isinstance(event, BlockRemoved):
        hashes = ", ".join(hash_label(h) for h in event.block_hashes)
        return f"BlockRemoved {hashes} (group {event.group_idx})"
    assert isinstance(event, AllBlocksCleared)
    return "AllBlocksCleared"


def _result_text(outcome: Outcome) -> str:
    if outcome.error is not None:
        return f"rejected: {outcome.error}"
    result = outcome.result
    if outcome.step.op == "take_events":
        return f"{len(result)} event(s)" if isinstance(result, list) else "[]"
    if outcome.step.op == "cache_partial_block" and isinstance(result, dict):
        return f"key {_hex_label(result.get('hash'))} g{result.get('group')}"
    return repr(result)


# --------------------------------------------------------------------------
# The terminal
# --------------------------------------------------------------------------


def _block_text(
    state: PoolState,
    block_id: int,
    changed: frozenset[int],
    labels: Mapping[BlockHash, str] | None = None,
) -> Text:
    block = state.blocks[block_id]
    if block_id == NULL_BLOCK_ID:
        return Text(" 0 null ", style=NULL_STYLE)
    label = f" {block_id}"
    if block.block_hash is not None:
        label += f" {named(block.block_hash[0], labels, width=7)}"
        if block.partial_keys:
            label += f" +{len(block.partial_keys)}"
    if block.ref_cnt > 0:
        label += f" ×{block.ref_cnt}"  # noqa: RUF001 (a multiplication sign: held n times)
    label += " "
    style = HASHLESS_STYLE if block.block_hash is None else HASHED_STYLE
    text = Text(label, style=style)
    if block_id in changed:
        text.stylize("bold underline")
        text.append("*", style="bold red")
    return text


def pool_table(
    state: PoolState,
    changed: frozenset[int] = frozenset(),
    labels: Mapping[BlockHash, str] | None = None,
) -> Table:
    """The pool as three rows: free queue, hash map, held blocks (and the null block).

    ``labels`` names hashes for the reader (see ``pictures.named``).
    """
    table = Table(show_header=False, box=None, padding=(0, 1))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    row = Text("next ▸ ", style="dim")
    for i, block_id in enumerate(state.free_queue):
        if i:
            row.append(" ")
        row.append_text(_block_text(state, block_id, changed, labels))
    if not state.free_queue:
        row.append("(empty: every usable block is held)", style="dim")
    table.add_row("free queue", row)
    keys = Text()
    entries: list[tuple[HashKey, tuple[int, ...]]] = sorted(state.cached.items())
    if labels is not None:
        entries.sort(key=lambda item: (item[0][1], key_label(item[0], labels)))
    for i, (key, ids) in enumerate(entries):
        if i:
            keys.append("   ")
        keys.append(key_label(key, labels), style="bold")
        keys.append(f" → {_ids(ids)}")
    if not entries:
        keys.append("(empty)", style="dim")
    table.add_row("hash map", keys)
    held = Text()
    for block_id in range(1, state.config.num_blocks):
        if state.blocks[block_id].ref_cnt > 0:
            held.append_text(_block_text(state, block_id, changed, labels))
            held.append(" ")
    if not held:
        held.append("(none) ", style="dim")
    held.append("   ")
    held.append_text(_block_text(state, NULL_BLOCK_ID, changed))
    table.add_row("held", held)
    return table


def _header(scenario: Scenario) -> str:
    c = scenario.config
    return (
        f"pool of {c.num_blocks} blocks (block 0 is the null block), profile "
        f"{c.profile.name}, caching {'on' if c.enable_caching else 'off'}, hash block size "
        f"{c.hash_block_size}, events {'on' if c.enable_events else 'off'}"
    )


def print_scenario(console: Console, scenario: Scenario) -> int:
    """Tell the scenario on ``console``; return how many steps disagree with their vector."""
    console.rule(f"[bold]{scenario.name}[/bold]: {scenario.title}")
    if scenario.summary:
        console.print(scenario.summary)
    console.print(_header(scenario), style="dim")
    console.print(
        "Blocks: [black on #f6c560] id hash [/] has a hash, [black on #dde3ea] id [/] has "
        "none, ×n ref count, * changed by the step."  # noqa: RUF001
    )
    console.print()
    console.print("[bold]Step 0[/bold]: the new pool")
    console.print(pool_table(scenarios.initial_state(scenario)))
    mismatches = 0
    total = len(scenario.steps)
    for outcome in scenarios.run(scenario):
        console.print()
        console.print(
            f"[bold]Step {outcome.index}/{total}[/bold]: "
            f"[cyan]{call_text(outcome.step.op, dict(outcome.step.args))}[/cyan]",
            highlight=False,
        )
        if outcome.step.say:
            console.print(outcome.step.say, highlight=False)
        console.print(f"[dim]→ {_result_text(outcome)}.[/dim] {describe(outcome)}", highlight=False)
        for event in outcome.events:
            console.print(f"  [magenta]event[/magenta] {event_text(event)}", highlight=False)
        if outcome.step.op == "take_events" and isinstance(outcome.result, list):
            for event in outcome.before.pending_events:
                console.print(f"  [magenta]taken[/magenta] {event_text(event)}", highlight=False)
        if outcome.mismatch:
            mismatches += 1
            console.print(f"[red]note: {outcome.mismatch}[/red]", highlight=False)
        console.print(pool_table(outcome.state, outcome.changed))
    return mismatches


# --------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif;
       max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #1d2126; }
h1 { font-size: 1.6em; margin-bottom: .2em; }
.meta { color: #6b737c; }
section { border-top: 1px solid #dde3ea; padding: 1em 0; }
code { background: #f2f4f7; padding: 1px 4px; border-radius: 3px; font-size: .95em; }
.result { color: #38414a; }
.events { margin: .3em 0 .6em 1.2em; padding: 0; font-size: .92em; color: #6a2c91; }
.note { color: #d62728; font-weight: bold; }
figure { margin: .6em 0 0 0; overflow-x: auto; }
figure svg { max-width: 100%; height: auto; }
"""


def render_html(scenario: Scenario) -> str:
    """The scenario as one self-contained HTML page: narration and an SVG per step."""
    e = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>kvpool explain: {e(scenario.name)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{e(scenario.title or scenario.name)}</h1>",
        f'<p class="meta"><code>kvpool explain {e(scenario.name)}</code>: '
        f"{e(_header(scenario))}</p>",
    ]
    if scenario.summary:
        parts.append(f"<p>{e(scenario.summary)}</p>")
    initial = scenarios.initial_state(scenario)
    parts += [
        "<section><h2>Step 0: the new pool</h2>",
        f"<figure>{render_svg(initial, caption='The pool as built')}</figure></section>",
    ]
    total = len(scenario.steps)
    for outcome in scenarios.run(scenario):
        call = call_text(outcome.step.op, dict(outcome.step.args))
        parts.append(f"<section><h2>Step {outcome.index} of {total}: <code>{e(call)}</code></h2>")
        if outcome.step.say:
            parts.append(f"<p>{e(outcome.step.say)}</p>")
        parts.append(
            f'<p class="result">→ <code>{e(_result_text(outcome))}</code>. '
            f"{e(describe(outcome))}</p>"
        )
        events = list(outcome.events)
        if outcome.step.op == "take_events":
            events = list(outcome.before.pending_events)
        if events:
            items = "".join(f"<li>{e(event_text(ev))}</li>" for ev in events)
            parts.append(f'<ul class="events">{items}</ul>')
        if outcome.mismatch:
            parts.append(f'<p class="note">{e(outcome.mismatch)}</p>')
        caption = f"After step {outcome.index} of {total}"
        svg = render_svg(outcome.state, caption=caption, highlight=outcome.changed)
        parts.append(f"<figure>{svg}</figure></section>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
