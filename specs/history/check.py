"""Checking a history: replay it on both layers, report the first divergence with its context."""

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.specs.history.format import Header, History, HistoryError
from kvpool.specs.history.replay import IGNORED, CallDiverges, ManagerReplay, PoolReplay

LAYERS = ("manager", "pool")
CONTEXT_CALLS = 8
CONTEXT_POOL_CALLS = ("get_new_blocks", "evict_cached_block", "free_blocks")
MALFORMED = (KeyError, TypeError, ValueError, IndexError, AttributeError)


@dataclass
class HistoryDivergence:
    """The first call whose engine answer the model does not allow."""

    layer: str
    index: int
    call: dict[str, Any]
    what: str
    engine: Any
    model: Any
    context: list[dict[str, Any]] = field(default_factory=list)
    """Earlier calls that touched the same request or blocks, oldest first."""

    @property
    def line(self) -> int:
        return self.index + 2


@dataclass
class HistoryVerdict:
    """What a check of one history found."""

    header: Header
    calls: int
    checked: dict[str, int]
    divergence: HistoryDivergence | None
    seconds: float
    counts: dict[str, int]
    notes: list[str] = field(default_factory=list)

    @property
    def conforms(self) -> bool:
        return self.divergence is None


def replay_calls(
    header: Header,
    calls: Sequence[dict[str, Any]],
    layers: Iterable[str] = LAYERS,
    loose: bool = False,
    stop_at: int | None = None,
    relax_before: int | None = None,
    oracle: str = "model",
) -> tuple[dict[str, Any], HistoryDivergence | None]:
    """Replay ``calls`` on the chosen layers; the replays and the earliest divergence.

    ``HistoryError`` (naming the line) when a call cannot be checked.
    """
    replays: dict[str, Any] = {}
    for layer in layers:
        if layer == "manager":
            replays[layer] = ManagerReplay(
                header, loose=loose, relax_before=relax_before, oracle=oracle
            )
        elif layer == "pool":
            replays[layer] = PoolReplay(header)
        else:
            raise HistoryError(f"unknown layer {layer!r}: use {', '.join(LAYERS)}")
    live = dict(replays)
    first: HistoryDivergence | None = None
    for index, call in enumerate(calls):
        if not live or (stop_at is not None and index > stop_at):
            break
        for layer, replay in list(live.items()):
            try:
                replay.step(call)
            except CallDiverges as diverges:
                del live[layer]
                if first is None:
                    first = HistoryDivergence(
                        layer, index, call, diverges.what, diverges.engine, diverges.model
                    )
                    live.clear()
            except HistoryError as error:
                if error.line is not None:
                    raise
                raise HistoryError(f"{call['o']}.{call['m']}: {error.reason}", index + 2) from None
            except MALFORMED as error:
                raise HistoryError(
                    f"malformed {call.get('o')}.{call.get('m')} call: {type(error).__name__}: "
                    f"{str(error)[:120]}",
                    index + 2,
                ) from None
    return replays, first


def check_history(
    history: History, layers: Iterable[str] = LAYERS, oracle: str = "impl"
) -> HistoryVerdict:
    """Replay a history against the specification on the chosen layers.

    The manager layer runs on ``oracle`` (``impl``: kvpool's fast implementation,
    which the lock-step machines check equal to the model; ``model``: the model
    itself); a divergence found on the impl is confirmed on the model, which
    replays the calls up to it and gives the answer reported.
    """
    started = time.perf_counter()
    notes = []
    replays, first = replay_calls(history.header, history.calls, layers, oracle=oracle)
    if first is not None and first.layer == "manager" and oracle != "model":
        # The fast oracle found it; the specification itself must agree, call for call.
        _, confirmed = replay_calls(
            history.header, history.calls, ("manager",), stop_at=first.index, oracle="model"
        )
        if confirmed is None or confirmed.index != first.index:
            notes.append(
                f"kvpool's impl and model disagree on line {first.line}: "
                "the model's verdict is reported"
            )
            replays, first = replay_calls(history.header, history.calls, layers, oracle="model")
        else:
            first = confirmed
    if first is not None:
        first.context = context_of(history.calls, first)
    verdict = HistoryVerdict(
        header=history.header,
        calls=len(history.calls),
        checked={layer: replay.checked for layer, replay in replays.items()},
        divergence=first,
        seconds=time.perf_counter() - started,
        counts=counts_of(history.calls),
        notes=notes,
    )
    if "manager" in replays and not history.header.recorder.get("snapshots", False):
        verdict.notes.append("no pool snapshots recorded: results compared, not whole states")
    return verdict


def counts_of(calls: Sequence[dict[str, Any]]) -> dict[str, int]:
    """What the engine did: steps, requests, refusals, preemptions, evictions."""
    counts: Counter[str] = Counter()
    for call in calls:
        origin, method = call["o"], call["m"]
        if origin == "scheduler":
            counts[
                {
                    "step": "steps",
                    "add_request": "requests",
                    "preempt": "preemptions",
                    "finish": "finishes",
                }.get(method, method)
            ] += 1
        elif origin == "manager" and call["d"] == 0:
            counts["manager calls"] += 1
            if method == "allocate_slots" and call.get("r") is None and "x" not in call:
                counts["refusals"] += 1
        elif method == "evict_cached_block" and call.get("r") is True:
            counts["evictions"] += 1
    return dict(counts)


def request_of(call: dict[str, Any]) -> str | None:
    """The request a call is about, if any."""
    args = call["a"]
    request = args.get("request")
    if isinstance(request, dict) and isinstance(request.get("id"), str):
        return str(request["id"])
    rid = args.get("request_id")
    return rid if isinstance(rid, str) else None


def _ints(value: Any) -> set[int]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list | tuple):
        out: set[int] = set()
        for item in value:
            out |= _ints(item)
        return out
    return set()


def blocks_touched(call: dict[str, Any]) -> set[int]:
    """Block ids a call hands out, frees, hits or caches (the null block left out)."""
    args, method = call["a"], call["m"]
    found: set[int] = set()
    if method == "get_computed_blocks" and isinstance(call.get("r"), list) and call["r"]:
        found = _ints(call["r"][0])
    elif method in ("allocate_slots", "get_block_ids", "get_new_blocks"):
        found = _ints(call.get("r"))
    for key in ("new_computed_blocks", "blocks", "ordered_blocks", "block_ids", "block"):
        if key in args:
            found |= _ints(args[key])
    found.discard(0)
    return found


def context_of(calls: Sequence[dict[str, Any]], at: HistoryDivergence) -> list[dict[str, Any]]:
    """The last calls before the divergence that touched its request or its blocks."""
    rid = request_of(at.call)
    blocks = blocks_touched(at.call) | _ints(at.engine) | _ints(at.model)
    blocks.discard(0)
    found: list[dict[str, Any]] = []
    for call in reversed(calls[: at.index]):
        if call["o"] == "pool" and call["m"] not in CONTEXT_POOL_CALLS:
            continue
        if call["m"] in IGNORED:
            continue
        if (rid is not None and request_of(call) == rid) or blocks & blocks_touched(call):
            found.append(call)
            if len(found) >= CONTEXT_CALLS:
                break
    return list(reversed(found))


def describe_call(call: dict[str, Any], width: int = 160) -> str:
    """One line for a call: number, origin.method(arguments) -> result (request tokens left out)."""
    args = {}
    for key, value in call["a"].items():
        if isinstance(value, dict) and "id" in value:
            value = {k: v for k, v in value.items() if k not in ("tok+", "h+")}
        args[key] = value
    text = ", ".join(f"{k}={v!r}" for k, v in args.items())
    if len(text) > width:
        text = text[: width - 3] + "..."
    result = f"raised {call['x']}" if "x" in call else repr(call.get("r"))
    return f"line {call['i'] + 2}: {call['o']}.{call['m']}({text}) -> {result}"


def render(verdict: HistoryVerdict) -> str:
    """The verdict as text for a terminal."""
    h = verdict.header
    rate = verdict.calls / verdict.seconds if verdict.seconds > 0 else float("inf")
    lines = [
        f"history of {h.engine.get('name')} {h.engine.get('version')}: {verdict.calls} calls, "
        f"{h.num_blocks} blocks, {len(h.groups)} group(s) "
        f"({', '.join(g.attention for g in h.groups)})",
        "engine did: " + ", ".join(f"{v} {k}" for k, v in sorted(verdict.counts.items())),
        "checked: "
        + ", ".join(f"{layer} layer {n} calls" for layer, n in verdict.checked.items())
        + f" in {verdict.seconds:.2f} s ({rate:,.0f} calls/s)",
    ]
    d = verdict.divergence
    if d is None:
        lines.append("CONFORMS: every checked answer is one the model allows")
    else:
        lines += [
            f"DIVERGES at line {d.line} ({d.layer} layer): {d.what}",
            f"  {describe_call(d.call)}",
            f"  engine: {d.engine!r}",
            f"  model:  {d.model!r}",
        ]
        if d.context:
            lines.append("  earlier calls on the same request or blocks:")
            lines += [f"    {describe_call(c, 120)}" for c in d.context]
    lines += [f"note: {n}" for n in verdict.notes]
    return "\n".join(lines)
