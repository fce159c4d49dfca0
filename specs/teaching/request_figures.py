"""Named figures of the request layer, each drawn from the model as SVG and as plain text.

The explanation pages show a figure twice: as a picture the docs build draws
(``<!-- kvpool-request:figure NAME -->``) and as a plain-text block committed
in the Markdown, which reads on GitHub too. The text is generated here as
well, and a test checks that every committed block equals ``text(NAME)``, so
neither can drift from the model.

============= =========================================================================
``hash-chain``  the inputs of each block hash of a request with LoRA, image and salt
``hash-sharing``  which hashes requests differing in one input share with a plain one
``hit-windows``   one prompt, one cache, searched by each attention type
``hybrid-rounds`` the rounds of a full-attention plus sliding-window lookup
``admission``     what ``allocate_slots`` counts, refused and then admitted
``free-order``    where a finished hybrid request's blocks go, and in which order
``request-life``  the life of the ``request-life`` story, one line per step
============= =========================================================================

>>> sorted(FIGURES) == sorted(NAMES)
True
>>> "NONE_HASH" in text("hash-chain")
True
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpool.model import request as rq
from kvpool.model import single_type as st
from kvpool.model.hashing import LoraAdapter, MultiModalInput
from kvpool.model.request import Request
from kvpool.specs.teaching import request_facts as facts
from kvpool.specs.teaching import request_pictures as pictures
from kvpool.specs.teaching import request_scenarios, request_stories
from kvpool.specs.teaching.request_scenarios import Outcome, World, tokens
from kvpool.specs.teaching.scenarios import Step

# --------------------------------------------------------------------------
# The inputs of the figures
# --------------------------------------------------------------------------


def example_request() -> Request:
    """Six tokens in hash blocks of two, with a LoRA adapter, an image and a cache salt."""
    return rq.new_request(
        "x",
        tokens("ABCDEF"),
        2,
        lora=LoraAdapter(1, "sql", "/lora/sql"),
        mm_inputs=(MultiModalInput("cat", 2, 3),),
        cache_salt="s",
    )


SHARING: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("a", "ABCDE", {}),
    ("b", "ABCDE", {"cache_salt": "s"}),
    ("c", "ABCDE", {"lora": LoraAdapter(1, "sql", "/lora/sql")}),
    ("d", "ABCDE", {"mm_inputs": (MultiModalInput("cat", 2, 2),)}),
    ("e", "ABXDE", {}),
    ("f", "ABCDE", {}),
)
"""The requests of the ``hash-chain`` story: a, then five that differ in one input or none."""


def window_world() -> tuple[World, Request]:
    """A cache holding the prompt ABCDEFGHIJKL in blocks of 2, with ABCD evicted."""
    story = request_scenarios.RequestScenario(
        "hit-windows",
        "one prompt, every attention type",
        request_scenarios.setup(10, [st.full_attention(2)]),
        (
            request_scenarios.arrive("p", "ABCDEFGHIJKL", "The prompt arrives."),
            request_scenarios.allocate("p", 12, "It is computed; its six blocks are cached."),
            request_scenarios.finish("p", "It finishes."),
            Step("evict_blocks", {"block_ids": [2]}, "ABCD is evicted."),
            request_scenarios.arrive("q", "ABCDEFGHIJKL", "The same prompt arrives again."),
        ),
    )
    world = request_scenarios.final_state(story)
    return world, world.requests["q"]


WINDOW_SPECS = (
    st.full_attention(2),
    st.sliding_window(2, 4),
    st.chunked_local(2, 4),
    st.mamba(16),
)
"""The four attention types of ``hit-windows``, all over blocks of 2 tokens but Mamba's."""


def window_rows() -> list[facts.HitRow]:
    """The prompt searched by each attention type in turn, on the same cache."""
    world, request = window_world()
    limit = request.num_tokens - 1
    rows = []
    for spec in WINDOW_SPECS:
        (hit,) = st.find_longest_cache_hit(world.pool, spec, request.block_hashes, limit, [0])
        cells = facts.hit_cells(world.pool, spec, request, hit, limit, 0)
        rows.append(facts.HitRow(facts.spec_text(spec), cells, len(hit) * spec.block_size))
    return rows


def _outcome(story: str, index: int) -> Outcome:
    return list(request_scenarios.run(request_stories.get(story)))[index - 1]


def hybrid_input() -> tuple[World, Request]:
    """The world of the ``hybrid-hit`` story when b is looked up."""
    outcome = _outcome("hybrid-hit", 6)
    return outcome.before, outcome.before.requests["b"]


# --------------------------------------------------------------------------
# Plain text
# --------------------------------------------------------------------------


def _sharing_text() -> str:
    lines = []
    first: tuple[bytes, ...] = ()
    for rid, prompt, extra in SHARING:
        request = rq.new_request(rid, tokens(prompt), 2, **extra)
        hashes = request.block_hashes
        if not first:
            first = hashes
        shared = 0
        while shared < len(hashes) and shared < len(first) and hashes[shared] == first[shared]:
            shared += 1
        what = ", ".join(f"{k}={v}" for k, v in _extra_words(request).items()) or "plain"
        lines.append(
            f"{rid}  {prompt}  {what:<18} hashes {' '.join(facts.short_hex(h) for h in hashes)}"
            f"  shares with a: {shared} of {len(hashes)}"
        )
    return "\n".join(lines)


def _extra_words(request: Request) -> dict[str, str]:
    words = {}
    if request.cache_salt:
        words["salt"] = request.cache_salt
    if request.lora is not None:
        words["lora"] = request.lora.name
    for m in request.mm_inputs:
        words["image"] = f"{m.identifier}@{m.offset}"
    return words


def _windows_text() -> str:
    _, request = window_world()
    rows = window_rows()
    head = (
        f"prompt {request_scenarios.tokens_text(request.all_token_ids)}: cached AB, EF, GH, IJ, "
        "KL (ABCD evicted); a hit may cover 11 tokens"
    )
    return facts.hits_text(rows, head)


def _rounds_text() -> str:
    world, request = hybrid_input()
    rounds, length = facts.hybrid_rounds(world, request)
    parts = []
    for n, r in enumerate(rounds, 1):
        parts.append(
            facts.hits_text(r.rows, f"round {n}, candidate {r.length} tokens:", legend=False)
        )
    parts.append(f"settled: {length} tokens in every group")
    parts.append(facts.legend_text())
    return "\n".join(parts)


def _admission_text() -> str:
    refused, admitted = _outcome("admission", 8), _outcome("admission", 9)
    return "\n".join(
        [
            facts.pool_text(refused.before.pool, refused.before.labels),
            facts.admission_text(facts.admission(refused.before, refused.step.args)),
            facts.admission_text(facts.admission(admitted.before, admitted.step.args)),
            facts.pool_text(admitted.state.pool, admitted.state.labels),
        ]
    )


def _free_text() -> str:
    outcome = _outcome("free-order", 3)
    before, after = outcome.before, outcome.state
    items = facts.release(before.pool, after.pool, facts.freed_order(before, "a"))
    return "\n".join(
        [
            facts.tables_text(before),
            facts.release_text(items, before.labels, before.pool),
            facts.pool_text(after.pool, after.labels),
        ]
    )


def life_text() -> str:
    """The ``request-life`` story, one line per step: the call, the tables, the free queue."""
    story = request_stories.get("request-life")
    lines = []
    for o in request_scenarios.run(story):
        w = o.state
        table = w.manager.managers.tables[0].req_to_blocks
        tables = "  ".join(f"{r}:{','.join(map(str, b))}" for r, b in table.items()) or "-"
        queue = ",".join(map(str, w.pool.free_queue)) or "-"
        args = o.step.args
        call = f"{o.step.op}({args.get('request_id', '')}"
        if o.step.op == "allocate_slots":
            call += f", {args['num_new_tokens']}" + (
                ", hit" if "new_computed_blocks" in args else ""
            )
        call += ")"
        lines.append(f"{o.index:>2} {call:<26} tables {tables:<18} free queue {queue}")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Pictures
# --------------------------------------------------------------------------


def _chain_svg() -> str:
    request = example_request()
    return pictures.document(
        [pictures.chain_panel(request)],
        "What goes into each block hash: the parent's hash, the tokens, the tagged extra keys",
    )


def _sharing_svg() -> str:
    panels = []
    cached = {h for h in rq.new_request("a", tokens("ABCDE"), 2).block_hashes}
    for rid, prompt, extra in SHARING[1:5]:
        request = rq.new_request(rid, tokens(prompt), 2, **extra)
        panels.append(pictures.chain_panel(request, cached))
    return pictures.document(
        panels, "Amber: the same hash as request a's (ABCDE, no extra key), so a cache hit"
    )


def _windows_svg() -> str:
    return pictures.document(
        [pictures.hits_panel(window_rows(), "one prompt, one cache, four attention types")],
        "ABCDEFGHIJKL cached in blocks of 2, ABCD evicted; each type searches for a hit "
        "of at most 11 tokens",
    )


def _rounds_svg() -> str:
    world, request = hybrid_input()
    rounds, length = facts.hybrid_rounds(world, request)
    panels = [
        pictures.hits_panel(r.rows, f"round {n}: candidate {r.length} tokens")
        for n, r in enumerate(rounds, 1)
    ]
    return pictures.document(panels, f"A hybrid lookup settles on {length} tokens")


def _admission_svg() -> str:
    refused, admitted = _outcome("admission", 8), _outcome("admission", 9)
    return pictures.document(
        [
            pictures.admission_panel(facts.admission(refused.before, refused.step.args)),
            pictures.admission_panel(facts.admission(admitted.before, admitted.step.args)),
            pictures.pool_panel(admitted.state.pool, admitted.state.labels, admitted.changed),
        ],
        "Request b asks for 12 slots and is refused; a chunk of 2 is admitted",
    )


def _free_svg() -> str:
    outcome = _outcome("free-order", 3)
    panel = pictures.step_panel(outcome)
    assert panel is not None
    return pictures.document(
        [panel, pictures.pool_panel(outcome.state.pool, outcome.state.labels, outcome.changed)],
        "A finished request is freed group by group, each group's blocks last first",
    )


@dataclass(frozen=True)
class Figure:
    """A figure: its title, its SVG and its plain text, both drawn from the model."""

    title: str
    svg: Callable[[], str]
    text: Callable[[], str]


FIGURES: dict[str, Figure] = {
    "hash-chain": Figure(
        "The inputs of each block hash", _chain_svg, lambda: facts.chain_text(example_request())
    ),
    "hash-sharing": Figure("Which requests share which hashes", _sharing_svg, _sharing_text),
    "hit-windows": Figure("One prompt, four attention types", _windows_svg, _windows_text),
    "hybrid-rounds": Figure("The rounds of a hybrid lookup", _rounds_svg, _rounds_text),
    "admission": Figure("What allocate_slots counts", _admission_svg, _admission_text),
    "free-order": Figure("The order of a free", _free_svg, _free_text),
    "request-life": Figure(
        "A request's life",
        lambda: pictures.render_world_svg(
            request_scenarios.final_state(request_stories.get("request-life")),
            "After the request-life story: both requests freed, every prefix still cached",
        ),
        life_text,
    ),
}

NAMES = tuple(FIGURES)


def svg(name: str) -> str:
    """The figure as an SVG document."""
    return FIGURES[name].svg()


def text(name: str) -> str:
    """The figure as plain text (the block its page commits)."""
    return FIGURES[name].text()
