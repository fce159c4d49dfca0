"""Histories made without an engine: a tiny scheduler drives kvpool's model and writes what
it did in the history format (only the scheduler's manager calls, no nested pool calls).

By construction such a history conforms; the tests then plant wrong answers in it.
"""

import json
import random
from pathlib import Path
from typing import Any

from kvpool.model import manager as ops
from kvpool.model.request import Request, append_tokens, new_request, with_computed
from kvpool.model.single_type import full_attention

BLOCK_SIZE = 4


def header(num_blocks: int, **cache: Any) -> dict[str, Any]:
    return {
        "kind": "header",
        "format": "kvpool-history",
        "version": 1,
        "engine": {"name": "synthetic", "version": "1"},
        "cache": {
            "num_blocks": num_blocks,
            "hash_block_size": BLOCK_SIZE,
            "max_model_len": 64,
            "enable_caching": True,
            "groups": [{"attention": "full", "block_size": BLOCK_SIZE}],
            **cache,
        },
    }


class Writer:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.sent: dict[str, tuple[int, int]] = {}

    def snap(self, r: Request) -> dict[str, Any]:
        n, nh = self.sent.get(r.request_id, (0, 0))
        out: dict[str, Any] = {
            "id": r.request_id,
            "n": r.num_tokens,
            "np": len(r.prompt_token_ids),
            "nc": r.num_computed_tokens,
            "npre": 0,
            "nh": len(r.block_hashes),
        }
        if r.num_tokens > n:
            out["tok+"] = list(r.all_token_ids[n:])
        if len(r.block_hashes) > nh:
            out["h+"] = [h.hex() for h in r.block_hashes[nh:]]
        self.sent[r.request_id] = (r.num_tokens, len(r.block_hashes))
        return out

    def call(self, origin: str, method: str, args: dict[str, Any], result: Any = None) -> None:
        self.calls.append(
            {
                "i": len(self.calls),
                "p": None,
                "d": 0,
                "o": origin,
                "m": method,
                "a": args,
                "r": result,
            }
        )


def blocks(value: Any) -> list[list[int]]:
    return [list(g) for g in value]


def synthesize(
    requests: int = 10, num_blocks: int = 14, seed: int = 0
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Requests over three shared prefixes, two at a time, each decoding a few tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.choice([8, 12]))] for _ in range(3)]
    state = ops.new_kv_cache_manager(num_blocks, [full_attention(BLOCK_SIZE)], 64)
    w = Writer()
    pending = [
        new_request(
            str(i),
            rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(2, 7))],
            BLOCK_SIZE,
        )
        for i in range(requests)
    ]
    while pending:
        wave, pending = pending[:2], pending[2:]
        running = []
        for r in wave:
            w.call("scheduler", "add_request", {"request": w.snap(r)})
            state, (hit, tokens) = ops.get_computed_blocks(state, r)
            w.call("manager", "get_computed_blocks", {"request": w.snap(r)}, [blocks(hit), tokens])
            args = {
                "request": w.snap(r),
                "num_new_tokens": r.num_tokens - tokens,
                "num_new_computed_tokens": tokens,
                "new_computed_blocks": blocks(hit),
            }
            state, got = ops.allocate_slots(state, r, r.num_tokens - tokens, tokens, hit)
            w.call("manager", "allocate_slots", args, None if got is None else blocks(got))
            if got is not None:
                running.append(with_computed(r, r.num_tokens))
        for _ in range(3):
            for k, r in enumerate(running):
                r = append_tokens(r, [rng.randrange(1, 50)])
                state, got = ops.allocate_slots(state, r, 1)
                w.call(
                    "manager",
                    "allocate_slots",
                    {"request": w.snap(r), "num_new_tokens": 1},
                    None if got is None else blocks(got),
                )
                running[k] = with_computed(r, r.num_tokens)
        for r in running:
            state, _ = ops.free(state, r.request_id)
            w.call("manager", "free", {"request": w.snap(r)})
            w.call("scheduler", "finish", {"request": w.snap(r)})
    return header(num_blocks), w.calls


def write(path: Path, head: dict[str, Any], calls: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in [head, *calls]))
    return path
