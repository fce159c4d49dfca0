"""Minimising a diverging history by dropping requests (delta debugging).

A reduced history keeps the scheduler's manager calls of the kept requests
(and the per-step calls about no request); nested pool calls and snapshots
go. Dropping requests changes which physical block serves whom, and frees
blocks the engine had to refuse for want of, so a reduced history is
replayed *loosely*: engine block ids are matched to model ids by a
one-to-one renaming fixed on first sight, and a refusal the model would
have granted is left out. A reduction is kept when that replay agrees up to
the original divergent call and diverges there.

The saved history is renamed into the model's block ids and stripped of the
left-out refusals, so a plain (strict) ``kvpool history check`` reproduces
the divergence from it.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvpool.specs.history.check import HistoryDivergence, replay_calls, request_of
from kvpool.specs.history.format import History, HistoryError, parse_header
from kvpool.specs.history.replay import ManagerReplay, Requests

MAX_TESTS = 400
MIN_BLOCKS = 4


@dataclass
class Minimised:
    """A minimised witness: the kept requests and the history that shows the divergence."""

    requests: list[str]
    original_requests: int
    header: dict[str, Any]
    calls: list[dict[str, Any]]
    tests: int
    reproduces: bool
    """Whether the saved history diverges under a strict check at the same call."""


def top_level(calls: Sequence[dict[str, Any]]) -> list[int]:
    """Indexes of the scheduler markers and the scheduler's manager calls."""
    return [
        i
        for i, c in enumerate(calls)
        if c["o"] == "scheduler" or (c["o"] == "manager" and c["d"] == 0)
    ]


class Reducer:
    """Builds reduced histories with re-encoded request snapshots."""

    def __init__(self, history: History) -> None:
        self.history = history
        requests = Requests(history.header.hash_block_size)
        for call in history.calls:
            snap = call["a"].get("request")
            if snap is not None:
                if isinstance(snap, dict) and snap.get("reset"):
                    raise HistoryError("a request's tokens shrank (reset): not minimised")
                requests.apply(snap)
        self.final = requests.by_id
        self.top = top_level(history.calls)

    def request_ids(self) -> list[str]:
        seen: dict[str, None] = {}
        for i in self.top:
            rid = request_of(self.history.calls[i])
            if rid is not None:
                seen.setdefault(rid, None)
        return list(seen)

    def reduce(self, keep: set[str], stop_at: int) -> tuple[list[dict[str, Any]], list[int]]:
        """The kept calls up to ``stop_at`` (an original index), re-encoded, and their indexes."""
        calls: list[dict[str, Any]] = []
        origin: list[int] = []
        emitted: dict[str, tuple[int, int]] = {}
        for i in self.top:
            if i > stop_at:
                break
            call = self.history.calls[i]
            rid = request_of(call)
            if rid is not None and rid not in keep:
                continue
            new = {k: v for k, v in call.items() if k != "s"}
            new["i"], new["p"], new["d"] = len(calls), None, 0
            snap = call["a"].get("request")
            if isinstance(snap, dict):
                new["a"] = {**call["a"], "request": self.snapshot(snap, emitted)}
            calls.append(new)
            origin.append(i)
        return calls, origin

    def snapshot(self, snap: dict[str, Any], emitted: dict[str, tuple[int, int]]) -> dict[str, Any]:
        rid = snap["id"]
        record = self.final[rid]
        n, nh = int(snap["n"]), int(snap["nh"])
        done_n, done_nh = emitted.get(rid, (0, 0))
        out = {k: v for k, v in snap.items() if k not in ("tok+", "h+", "salt", "skip_read")}
        if n > done_n:
            out["tok+"] = record.tokens[done_n:n]
        if nh > done_nh:
            out["h+"] = [h.hex() for h in record.hashes[done_nh:nh]]
        if rid not in emitted:
            if record.salt is not None:
                out["salt"] = record.salt
            if record.skip_read:
                out["skip_read"] = True
        emitted[rid] = (max(n, done_n), max(nh, done_nh))
        return out


def ddmin(
    items: list[str], fails: Callable[[list[str]], bool], budget: int
) -> tuple[list[str], int]:
    """Zeller's delta debugging: a 1-minimal failing subset (within ``budget`` tests)."""
    tests = 0
    n = 2
    while len(items) >= 2 and tests < budget:
        size = -(-len(items) // n)
        chunks = [items[i : i + size] for i in range(0, len(items), size)]
        reduced = False
        for chunk in chunks + [[x for x in items if x not in c] for c in chunks]:
            if len(chunk) == len(items) or tests >= budget:
                continue
            tests += 1
            if fails(chunk):
                n = 2 if len(chunk) <= size else max(n - 1, 2)
                items = chunk
                reduced = True
                break
        if not reduced:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    return items, tests


def minimise(history: History, at: HistoryDivergence, budget: int = MAX_TESTS) -> Minimised:
    """The fewest requests whose calls still diverge at the same call (manager layer)."""
    if at.layer != "manager":
        raise HistoryError("only manager-layer divergences are minimised")
    reducer = Reducer(history)
    everyone = reducer.request_ids()
    pinned = request_of(at.call)

    sizes: dict[frozenset[str], int] = {}

    def diverges_alike(keep: set[str], num_blocks: int) -> bool:
        header = replace(history.header, num_blocks=num_blocks)
        calls, origin = reducer.reduce(keep, at.index)
        replays, first = replay_calls(
            header, calls, ("manager",), loose=True, relax_before=len(calls) - 1
        )
        if first is None or origin[first.index] != at.index:
            return False
        # The same divergence: the model's answer, in the engine's block names, is
        # the one it gave on the whole history (not merely "some other answer").
        to_engine = replays["manager"].ids.to_engine
        same: bool = _renamed(first.model, to_engine) == _renamed(at.model, {})
        return same

    def fails(subset: list[str]) -> bool:
        # Dropped requests held blocks: the pressure that made the engine evict may
        # need a smaller pool, so every pool size down to MIN_BLOCKS is tried.
        keep = set(subset) | ({pinned} if pinned else set())
        for num_blocks in range(history.header.num_blocks, MIN_BLOCKS - 1, -1):
            if diverges_alike(keep, num_blocks):
                sizes[frozenset(keep)] = num_blocks
                return True
        return False

    candidates = [r for r in everyone if r != pinned]
    kept: list[str]
    if fails([]):
        kept, tests = [], 1
    else:
        kept, tests = ddmin(candidates, fails, budget)
    keep = set(kept) | ({pinned} if pinned else set())
    num_blocks = sizes.get(frozenset(keep), history.header.num_blocks)
    header, calls = witness(history, reducer, keep, at.index, num_blocks)
    _, first = replay_calls(parse_header(header), calls, ("manager",))
    reproduces = first is not None and first.index == len(calls) - 1
    ordered = [r for r in everyone if r in keep]
    return Minimised(ordered, len(everyone), header, calls, tests, reproduces)


def witness(
    history: History, reducer: Reducer, keep: set[str], stop_at: int, num_blocks: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The reduced history in the model's block ids, without the refusals the model would grant."""
    calls, _ = reducer.reduce(keep, stop_at)
    replay = ManagerReplay(
        replace(history.header, num_blocks=num_blocks), loose=True, relax_before=len(calls) - 1
    )
    out: list[dict[str, Any]] = []
    for call in calls:
        skipped = replay.skipped_refusals
        args = _renamed_args(call["a"], dict(replay.ids.to_model))
        try:
            replay.step(call)
        except Exception:  # the divergent call: kept as the engine answered, renamed
            diverged = True
        else:
            diverged = False
            if replay.skipped_refusals != skipped:
                continue
        new = dict(call, i=len(out), a=args)
        if "r" in call:
            new["r"] = _renamed_result(call["m"], call["r"], replay.ids.to_model)
        out.append(new)
        if diverged:
            break
    emitted: dict[str, tuple[int, int]] = {}
    for call in out:  # left-out refusals carried token deltas: encode them again
        if isinstance(call["a"].get("request"), dict):
            call["a"] = dict(call["a"], request=reducer.snapshot(call["a"]["request"], emitted))
    header = dict(history.header.raw)
    header["cache"] = dict(header["cache"], num_blocks=num_blocks)
    header["recorder"] = dict(
        history.header.recorder,
        minimised=True,
        snapshots=False,
        nested=False,
        requests=len(keep),
    )
    return header, out


def _rename(value: Any, rename: dict[int, int]) -> Any:
    if isinstance(value, list):
        return [_rename(v, rename) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return rename.get(value, value)
    return value


def _renamed_args(args: dict[str, Any], rename: dict[int, int]) -> dict[str, Any]:
    out = dict(args)
    for key in ("new_computed_blocks", "block_ids"):
        if key in out:
            out[key] = _rename(out[key], rename)
    return out


def _renamed_result(method: str, result: Any, rename: dict[int, int]) -> Any:
    if method in ("allocate_slots", "get_block_ids"):
        return _rename(result, rename)
    if method == "get_computed_blocks" and isinstance(result, list) and len(result) == 2:
        return [_rename(result[0], rename), result[1]]
    return result


def _renamed(value: Any, rename: dict[int, int]) -> Any:
    """An answer with tuples as lists and block ids renamed (token counts are not blocks)."""
    if isinstance(value, list | tuple):
        if len(value) == 2 and isinstance(value[1], int) and isinstance(value[0], list | tuple):
            return [_renamed(value[0], rename), value[1]]  # (blocks, number of tokens)
        return [_renamed(v, rename) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return rename.get(value, value)
    return value
