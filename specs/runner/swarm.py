"""How many of a machine's rules one program may use: a gentler swarm than Hypothesis's.

Hypothesis does swarm testing on every ``RuleBasedStateMachine``: each program
draws a probability p in [0, 1) and disables each rule with probability p
(``hypothesis.strategies._internal.featureflags``). That finds bugs that need
one rule absent, but a bug that needs k rules is reachable only in about one
program in k + 1, and with p near 1 a program mostly repeats the few rules that
are always allowed. kvpool's bugs need several rules together (a cache hit
needs an admission and a free first), so ``gentle_swarm`` scales p down to at
most ``MAX_DISABLED``: every program keeps most of its rules, and many still
drop a few. The pool and request machines use it (their ``__init__``) in
every run but a derandomized one (``gentle_swarm``); the other layers keep
Hypothesis's swarm. Measured in docs/verification.md, "Time to detection".

This reaches into Hypothesis's private ``RuleStrategy`` and ``FeatureFlags``
(6.170): if their attributes change, ``gentle_swarm`` leaves Hypothesis's own
swarm in place; ``tests/specs/test_swarm.py`` fails instead of letting that
pass unnoticed.
"""

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.strategies._internal.featureflags import FeatureFlags, FeatureStrategy

MAX_DISABLED = 0.25
"""The largest chance that a program disables a rule (Hypothesis's own: 254/255).

Over 20 seeds of ``dev`` on the three corpus bugs it missed most often, 0.25
did best of the four tried (1, 0.5, 0.25 and 0: no swarm at all); see
docs/verification.md."""

_P_DISABLED = "_FeatureFlags__p_disabled"


class _GentleFeatures(FeatureStrategy):
    def do_draw(self, data: Any) -> Any:
        flags = super().do_draw(data)
        # The same choice as Hypothesis's (an integer 0..254), mapped to a lower p:
        # programs and their shrinking keep Hypothesis's shape.
        setattr(flags, _P_DISABLED, getattr(flags, _P_DISABLED) * MAX_DISABLED)
        return flags


def gentle_swarm(machine: RuleBasedStateMachine) -> None:
    """Make each program of ``machine`` disable a rule with a chance of at most ``MAX_DISABLED``.

    Not in a derandomized run (``ci``): its one fixed sample of programs is
    what CI's corpus tests (tests/corpus) require to find every bug, and that
    sample, drawn with Hypothesis's own swarm, does; the gentle swarm's missed
    one request-layer bug (sliding-window-eagle-drop). A machine is built
    inside the running test, so the settings in force are the run's.
    """
    if settings.default is not None and settings.default.derandomize:
        return
    rules: Any = getattr(machine, "_rules_strategy", None)
    if not hasattr(rules, "enabled_rules_strategy") or not hasattr(FeatureFlags(), _P_DISABLED):
        return
    names = frozenset(r.function.__name__ for r in rules.rules)
    rules.enabled_rules_strategy = st.shared(
        _GentleFeatures(at_least_one_of=names), key=("enabled rules", machine)
    )
