"""Seeded random scheduler runs beside a Mamba "align" group, for several targets at once.

Shared by ``test_mamba_align_geometry.py`` (the model and the impl) and
``test_vllm_mamba_align.py`` (with vLLM 0.33 too); vLLM 0.33's aligned-resend test under
EAGLE by ``test_mamba_align_eagle.py`` and ``test_vllm_mamba_align_eagle.py``.
"""

import random
from collections.abc import Callable
from typing import Any

from kvpool.model.request import new_request, with_computed
from kvpool.model.single_type import full_attention, mamba_align, mamba_reserving, sliding_window
from kvpool.specs.request.machine import mamba_aligned_chunk
from kvpool.specs.request.target import ManagerSetup

GEOMETRIES = (
    (full_attention(2), mamba_align(1)),
    (full_attention(4), mamba_align(1)),
    (full_attention(4), mamba_align(2)),
    (sliding_window(4, 3), mamba_align(2)),
    (full_attention(2), mamba_align(2)),
    (full_attention(4), sliding_window(4, 5), mamba_align(2)),
)
"""A Mamba block of one hash block beside blocks of one, two or four times its size."""


def random_program(seed: int, make_targets: Callable[[ManagerSetup], list[Any]]) -> dict[str, int]:
    """One random scheduler run on several targets at once (``make_targets``), every call's
    answers equal: admissions (looked up plainly or as with a KV connector, looked up again
    when the connector's hit diverged), block-aligned chunks, frees, evictions and steps.
    Returns how often the connector's hit diverged and how often a lookup hit."""
    rnd = random.Random(seed)
    specs = GEOMETRIES[seed % len(GEOMETRIES)]
    hbs = specs[-1].block_size
    setup = ManagerSetup(rnd.randint(6, 20), specs, 64, hbs, log_stats=True)
    targets = make_targets(setup)
    stem = [rnd.randint(1, 2) for _ in range(16)]
    waiting: dict[str, Any] = {}
    running: dict[str, Any] = {}
    seen = {"diverged": 0, "hits": 0}

    def call(name: str, *args: Any, **kwargs: Any) -> Any:
        got = [getattr(t, name)(*args, **kwargs) for t in targets]
        assert all(g == got[0] for g in got), (seed, name, args, got)
        return got[0]

    for step in range(40):
        roll = rnd.random()
        if roll < 0.25 and len(waiting) + len(running) < 4:
            rid = f"r{step}"
            tail = [rnd.randint(3, 4) for _ in range(rnd.randint(1, 4))]
            prompt = stem[: rnd.choice([4, 6, 8, 10, 12, 14])] + tail
            waiting[rid] = new_request(rid, prompt, hbs)
        elif roll < 0.5 and waiting:
            rid = rnd.choice(sorted(waiting))
            request = waiting[rid]
            if rnd.random() < 0.5:
                hit, num_hit, _, diverged = call("get_computed_blocks_for_connector", request)
                seen["diverged"] += diverged
                if diverged:  # no external tokens back it: the scheduler looks up again
                    hit, num_hit = call("get_computed_blocks", request)
            else:
                hit, num_hit = call("get_computed_blocks", request)
            seen["hits"] += num_hit > 0
            num_new = min(rnd.randint(1, 12), request.num_tokens - num_hit)
            num_new = mamba_aligned_chunk(request, num_hit, num_new, hbs)
            if num_new and call("allocate_slots", request, num_new, num_hit, hit) is not None:
                running[rid] = with_computed(request, num_hit + num_new)
                del waiting[rid]
        elif roll < 0.75 and running:
            rid = rnd.choice(sorted(running))
            request = running[rid]
            start = request.num_computed_tokens
            if start == request.num_tokens:
                call("free", request)
                del running[rid]
                continue
            num_new = min(rnd.randint(1, 12), request.num_tokens - start)
            num_new = mamba_aligned_chunk(request, start, num_new, hbs)
            if num_new and call("allocate_slots", request, num_new) is not None:
                running[rid] = with_computed(request, start + num_new)
        elif roll < 0.85:
            call("evict_blocks", {rnd.randrange(1, setup.num_blocks)})
        else:
            call("new_step_starts")
    call("make_prefix_cache_stats")
    return seen


def resend_scenario(target: Any) -> list[Any]:
    """vLLM 0.33's test_hybrid_mamba_retention_mtp_resend_of_aligned_prompt in blocks of 4:
    a prompt of four blocks computed a block a chunk (three look-ahead tokens), freed; its
    resend and a longer sibling. Returns what every step answered."""
    prompt = [i for i in range(4) for _ in range(4)]
    first = new_request("0", prompt, 4)
    answers: list[Any] = [target.get_computed_blocks_with_boundary(first)]
    for start in (0, 4, 8, 12):
        answers.append(target.allocate_slots(with_computed(first, start), 4, 0, None, 3))
        target.new_step_starts()
    target.free(with_computed(first, 16))
    answers.append(target.get_computed_blocks_with_boundary(new_request("1", prompt, 4)))
    answers.append(target.get_computed_blocks_with_boundary(new_request("2", prompt + [9] * 4, 4)))
    return answers


RESEND_SETUP = ManagerSetup(
    32,
    (full_attention(4), mamba_reserving(4, num_speculative_blocks=3)),
    64,
    4,
    use_eagle=True,
    retention_interval=0,
)


def latest_only_sibling(target: Any) -> tuple[Any, Any]:
    """A lone "align" group of blocks of 2 under retention 0: a prompt of 11 tokens computed
    in one chunk of 10 (its state at 10), then a sibling of 12 tokens sharing them looks up."""
    prompt = [1, 2, 2, 1, 1, 2, 1, 2, 2, 2, 1]
    first = new_request("a", prompt, 2)
    target.get_computed_blocks_with_boundary(first)
    allocated = target.allocate_slots(first, 10)
    target.new_step_starts()
    return allocated, target.get_computed_blocks_with_boundary(new_request("b", [*prompt, 1], 2))
