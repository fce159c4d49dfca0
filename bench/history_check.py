"""How fast ``kvpool history check`` replays a history: calls per second, parsing included.

    python bench/history_check.py                   # a synthetic history (no engine)
    python bench/history_check.py h.jsonl ...       # recorded histories, e.g. from
                                                    # kvpool record --blocks 17 --max-tokens 64

Calls are history lines (every recorded call: scheduler markers, the
manager's calls and the pool calls made inside them). Each figure is the best
of ``--repeat`` runs of read + check on both layers, measured in this run;
the model itself is the oracle (no impl shortcut), so a divergence is
reported exactly where it happens.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvpool.specs.history import check_history, read_history  # noqa: E402
from tests.history.synth import synthesize, write  # noqa: E402


def measure(path: Path, repeat: int) -> tuple[int, float, float, bool]:
    best_total = best_check = float("inf")
    conforms = True
    calls = 0
    for _ in range(repeat):
        started = time.perf_counter()
        history = read_history(path)
        read = time.perf_counter()
        verdict = check_history(history)
        done = time.perf_counter()
        best_total = min(best_total, done - started)
        best_check = min(best_check, done - read)
        calls, conforms = len(history.calls), verdict.conforms
    return calls, best_total, best_check, conforms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("histories", nargs="*", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4000, help="synthetic history size")
    args = parser.parse_args()
    paths = list(args.histories)
    with tempfile.TemporaryDirectory() as scratch:
        if not paths:
            head, synthetic = synthesize(requests=args.requests, num_blocks=40)
            paths = [write(Path(scratch) / "synthetic.jsonl", head, synthetic)]
        print(
            f"{'history':<40} {'calls':>8} {'read+check s':>13} {'calls/s':>10} "
            f"{'check-only calls/s':>19}  verdict"
        )
        for path in paths:
            calls, total, check, conforms = measure(path, args.repeat)
            print(
                f"{path.name:<40} {calls:>8} {total:>13.3f} {calls / total:>10,.0f} "
                f"{calls / check:>19,.0f}  {'conforms' if conforms else 'diverges'}"
            )


if __name__ == "__main__":
    main()
