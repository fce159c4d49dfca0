"""Histories: what a live engine's KV cache did, recorded, and checked against the model.

* ``format``: the JSON-lines format (header, one line per call), read bounded;
* ``replay``: the model replaying a history, on the manager and pool layers;
* ``check``: ``check_history`` and its verdict (first divergence and its context);
* ``minimise``: delta debugging over requests, down to a small witness.

Recorders live with their engines (``kvpool.specs.targets.vllm.recorder``).
"""

from kvpool.specs.history.check import HistoryDivergence, HistoryVerdict, check_history, render
from kvpool.specs.history.format import History, HistoryError, read_history, write_history
from kvpool.specs.history.minimise import Minimised, minimise

__all__ = [
    "History",
    "HistoryDivergence",
    "HistoryError",
    "HistoryVerdict",
    "Minimised",
    "check_history",
    "minimise",
    "read_history",
    "render",
    "write_history",
]
