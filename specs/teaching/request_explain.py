"""``kvpool explain`` for request-layer scenarios: the terminal and the HTML page.

Each step shows the call, its narration, the result and what it did
(``request_facts.describe``), the facts of its operation as plain text (the
hash chain, the lookup by position, the admission count, the free order),
then the block tables and the pool. ``--html`` writes the same as one
self-contained page, with the picture of ``request_pictures`` after every step.
"""

import html
import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from kvpool.specs.teaching import request_facts as facts
from kvpool.specs.teaching import request_scenarios, request_stories
from kvpool.specs.teaching.explain import _CSS, event_text, pool_table
from kvpool.specs.teaching.request_pictures import render_outcome_svg, render_world_svg
from kvpool.specs.teaching.request_scenarios import Outcome, RequestScenario, World


def call_text(op: str, args: object) -> str:
    """``op(arg=value, ...)``; a prompt or sampled tokens read as letters when they can.

    >>> call_text("new_request", {"request_id": "a", "prompt": [65, 66]})
    'new_request(request_id="a", prompt=AB)'
    """
    if not isinstance(args, dict):
        return f"{op}()"
    shown = []
    for name, value in args.items():
        if name in ("prompt", "sampled") and isinstance(value, list):
            ints = [v for v in value if isinstance(v, int)]
            shown.append(f"{name}={request_scenarios.tokens_text(ints, 40) or '[]'}")
        else:
            shown.append(f"{name}={json.dumps(value)}")
    return f"{op}({', '.join(shown)})"


def header(scenario: RequestScenario) -> str:
    """The manager's configuration in a line."""
    s = scenario.setup
    groups = "; ".join(f"g{g}: {facts.spec_text(spec)}" for g, spec in enumerate(s.specs))
    return (
        f"KV cache manager over {s.num_blocks} blocks (block 0 is the null block); {groups}; "
        f"hash block size {s.hash_block_size}; max_model_len {s.max_model_len}; "
        f"profile {s.profile.name}; caching {'on' if s.enable_caching else 'off'}"
        + ("; EAGLE" if s.use_eagle else "")
        + (f"; prefill look-ahead {s.num_prefill_lookahead}" if s.num_prefill_lookahead else "")
        + ("; events on" if s.enable_events else "")
    )


def result_text(outcome: Outcome) -> str:
    """The step's answer in a few words."""
    if outcome.error is not None:
        return f"rejected: {outcome.error}"
    if outcome.step.op == "new_request" and isinstance(outcome.result, list):
        return f"{len(outcome.result)} hash(es)"
    if outcome.step.op == "take_events" and isinstance(outcome.result, list):
        return f"{len(outcome.result)} event(s)"
    return json.dumps(outcome.result)


def step_text(outcome: Outcome) -> str:
    """The facts of the step's operation as plain text ('' when it has none)."""
    if outcome.error is not None:
        return ""
    op, args, before, after = outcome.step.op, outcome.step.args, outcome.before, outcome.state
    rid = str(args.get("request_id", ""))
    if op in ("new_request", "run_model") and rid in after.requests:
        return facts.chain_text(after.requests[rid])
    if op == "get_computed_blocks" and rid in after.lookups:
        blocks, num = after.lookups[rid]
        return facts.hits_text(facts.hit_rows(after, after.requests[rid], blocks, num))
    if op == "allocate_slots":
        return facts.admission_text(facts.admission(before, args))
    if op in ("free", "preempt"):
        items = facts.release(before.pool, after.pool, facts.freed_order(before, rid))
        return facts.release_text(items, before.labels, before.pool)
    return ""


def _world(console: Console, world: World, changed: frozenset[int] = frozenset()) -> None:
    console.print(facts.tables_text(world), highlight=False, markup=False)
    console.print(pool_table(world.pool, changed, world.labels))


def print_scenario(console: Console, scenario: RequestScenario) -> int:
    """Tell the scenario on ``console``; return how many steps disagree with their file."""
    console.rule(f"[bold]{scenario.name}[/bold]: {scenario.title}")
    if scenario.summary:
        console.print(scenario.summary, highlight=False)
    console.print(header(scenario), style="dim", highlight=False)
    console.print()
    console.print("[bold]Step 0[/bold]: the new manager")
    _world(console, request_scenarios.initial_state(scenario))
    mismatches = 0
    total = len(scenario.steps)
    for outcome in request_scenarios.run(scenario):
        console.print()
        console.print(
            f"[bold]Step {outcome.index}/{total}[/bold]: "
            f"[cyan]{escape(call_text(outcome.step.op, dict(outcome.step.args)))}[/cyan]",
            highlight=False,
        )
        if outcome.step.say:
            console.print(outcome.step.say, highlight=False, markup=False)
        console.print(
            Text(f"→ {result_text(outcome)}. ", style="dim") + Text(facts.describe(outcome))
        )
        for event in outcome.events:
            console.print(f"  [magenta]event[/magenta] {event_text(event)}", highlight=False)
        if outcome.step.op == "take_events":
            for event in outcome.before.pool.pending_events:
                console.print(f"  [magenta]taken[/magenta] {event_text(event)}", highlight=False)
        text = step_text(outcome)
        if text:
            console.print(text, highlight=False, markup=False)
        if outcome.mismatch:
            mismatches += 1
            console.print(Text(f"note: {outcome.mismatch}", style="red"))
        _world(console, outcome.state, outcome.changed)
    return mismatches


def render_html(scenario: RequestScenario) -> str:
    """The scenario as one self-contained HTML page: narration, facts and a picture per step."""
    e = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>kvpool explain: {e(scenario.name)}</title>",
        f"<style>{_CSS} pre {{ background: #f7f8fa; padding: .6em; overflow-x: auto; }}</style>",
        "</head><body>",
        f"<h1>{e(scenario.title or scenario.name)}</h1>",
        f'<p class="meta"><code>kvpool explain {e(scenario.name)}</code>: '
        f"{e(header(scenario))}</p>",
    ]
    if scenario.summary:
        parts.append(f"<p>{e(scenario.summary)}</p>")
    initial = render_world_svg(request_scenarios.initial_state(scenario), "The manager as built")
    parts += [
        "<section><h2>Step 0: the new manager</h2>",
        f"<figure>{initial}</figure></section>",
    ]
    total = len(scenario.steps)
    for outcome in request_scenarios.run(scenario):
        call = call_text(outcome.step.op, dict(outcome.step.args))
        parts.append(f"<section><h2>Step {outcome.index} of {total}: <code>{e(call)}</code></h2>")
        if outcome.step.say:
            parts.append(f"<p>{e(outcome.step.say)}</p>")
        parts.append(
            f'<p class="result">→ <code>{e(result_text(outcome))}</code>. '
            f"{e(facts.describe(outcome))}</p>"
        )
        events = list(outcome.events)
        if outcome.step.op == "take_events":
            events = list(outcome.before.pool.pending_events)
        if events:
            items = "".join(f"<li>{e(event_text(ev))}</li>" for ev in events)
            parts.append(f'<ul class="events">{items}</ul>')
        text = step_text(outcome)
        if text:
            parts.append(f"<pre>{e(text)}</pre>")
        if outcome.mismatch:
            parts.append(f'<p class="note">{e(outcome.mismatch)}</p>')
        svg = render_outcome_svg(outcome, f"After step {outcome.index} of {total}")
        parts.append(f"<figure>{svg}</figure></section>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def list_table() -> Table:
    """The built-in request-layer scenarios as a table, for ``kvpool explain --list``."""
    table = Table("scenario", "what it shows", "steps", "groups", title="request-layer scenarios")
    for s in request_stories.BUILT_IN.values():
        groups = " + ".join(spec.attention.value for spec in s.setup.specs)
        table.add_row(s.name, s.title, str(len(s.steps)), groups)
    return table
