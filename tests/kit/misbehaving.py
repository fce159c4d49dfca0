"""Targets of every documented kind, at every layer, driven into every way of failing.

``FAILURES`` names each failure mode with what it does inside a target's
method and the exit code the kit must give. ``PATCH_POINTS`` names, per
(target kind, layer), the method a check calls in (nearly) every program: the
matrix test (``test_verdict_matrix.py``) replaces it with the failing version
and runs ``kvpool check``. The ``module:factory`` kind's factories are here
(``pool_factory``, ``manager_factory``, ``v0_factory``).
"""

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpool.model import PoolConfig
from kvpool.model.errors import InvalidBlockCount, PoolError
from kvpool.model.radix import RadixConfig
from kvpool.model.v0 import V0Config
from kvpool.specs.events.model_target import ReferenceConsumer
from kvpool.specs.events.target import ConsumerConfig
from kvpool.specs.pool.model_target import ModelTarget
from kvpool.specs.radix.model_target import ModelRadixTarget
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import ManagerSetup
from kvpool.specs.v0.model_target import ModelV0Target


class PoolTarget(ModelTarget):
    """The ``module:factory`` kind at the pool layer (the model, as a user's class)."""


class ManagerTarget(ModelManagerTarget):
    """The ``module:factory`` kind at the request layer."""


class V0Target(ModelV0Target):
    """The ``module:factory`` kind at the v0 layer."""


class Consumer(ReferenceConsumer):
    """The ``module:factory`` kind at the events layer (a KV-event consumer)."""


class RadixTarget(ModelRadixTarget):
    """The ``module:factory`` kind at the radix layer."""


def pool_factory(config: PoolConfig) -> PoolTarget:
    return PoolTarget(config)


def manager_factory(setup: ManagerSetup) -> ManagerTarget:
    return ManagerTarget(setup)


def v0_factory(config: V0Config) -> V0Target:
    return V0Target(config)


def consumer_factory(config: ConsumerConfig) -> Consumer:
    return Consumer(config)


def radix_factory(config: RadixConfig) -> RadixTarget:
    return RadixTarget(config)


def factory_without_argument() -> PoolTarget:
    """A factory with the wrong signature."""
    raise AssertionError("never called: the registry refuses it")


class Unreadable:
    """An answer the kit can neither compare, show nor encode."""

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("Unreadable.__eq__")

    def __ne__(self, other: object) -> bool:
        raise RuntimeError("Unreadable.__ne__")

    def __hash__(self) -> int:
        raise RuntimeError("Unreadable.__hash__")

    def __repr__(self) -> str:
        raise RuntimeError("Unreadable.__repr__")

    def __iter__(self) -> Any:
        raise RuntimeError("Unreadable.__iter__")

    def __int__(self) -> int:
        raise RuntimeError("Unreadable.__int__")

    def __float__(self) -> float:
        raise RuntimeError("Unreadable.__float__")


@dataclass(frozen=True)
class Failure:
    """One way a target fails: what its method does instead of answering, and the verdict."""

    name: str
    act: Callable[[Callable[[], Any], int], Any]
    """Given the real call and how many calls came before (in the whole run), the answer."""
    exit_code: int
    phrase: str
    """Words the report must hold."""


def _exit(code: int) -> Callable[[Callable[[], Any], int], Any]:
    def act(call: Callable[[], Any], calls: int) -> Any:
        raise SystemExit(code)

    return act


def _raise(error: BaseException) -> Callable[[Callable[[], Any], int], Any]:
    def act(call: Callable[[], Any], calls: int) -> Any:
        raise error

    return act


HANG_TIMEOUT = 2
"""Seconds a program may run in a hanging cell (whose target sleeps for a minute). Short: every
hanging cell sleeps that long, and a slow program timed out earlier gets the same verdict."""


def _hang(call: Callable[[], Any], calls: int) -> Any:
    time.sleep(60)
    return call()


def _flaky(call: Callable[[], Any], calls: int) -> Any:
    # A rejection of a valid call, once in the whole run: no replay shows it again.
    if calls == 25:
        raise InvalidBlockCount("only the 26th call ever is refused")
    return call()


def _unreadable(call: Callable[[], Any], calls: int) -> Any:
    call()
    return Unreadable()


FAILURES = {
    f.name: f
    for f in (
        Failure("exits-0", _exit(0), 2, "raised SystemExit(0)"),
        Failure("exits-3", _exit(3), 2, "raised SystemExit(3)"),
        Failure("raises-keyboard-interrupt", _raise(KeyboardInterrupt()), 2, "KeyboardInterrupt"),
        Failure("recurses-forever", _raise(RecursionError("deep")), 2, "RecursionError"),
        Failure("hangs", _hang, 2, f"ran for more than {HANG_TIMEOUT} s"),
        Failure(
            "rejects-a-valid-call",
            _raise(InvalidBlockCount("refused")),
            1,
            "InvalidBlockCount",
        ),
        Failure("is-flaky", _flaky, 2, "is flaky"),
        Failure("answers-unreadably", _unreadable, 2, "Unreadable"),
    )
}


_HERE = "tests.kit.misbehaving"
PATCH_POINTS: dict[tuple[str, str], tuple[str, str, str]] = {
    ("module", "pool"): (f"{_HERE}:pool_factory", f"{_HERE}.PoolTarget", "get_new_blocks"),
    ("module", "request"): (
        f"{_HERE}:manager_factory",
        f"{_HERE}.ManagerTarget",
        "allocate_slots",
    ),
    ("module", "v0"): (f"{_HERE}:v0_factory", f"{_HERE}.V0Target", "get_num_free_blocks"),
    ("impl", "pool"): ("impl", "kvpool.specs.targets.impl.pool.ImplTarget", "get_new_blocks"),
    ("impl", "request"): (
        "impl",
        "kvpool.specs.targets.impl.request.ImplManagerTarget",
        "allocate_slots",
    ),
    ("model", "pool"): ("model", "kvpool.specs.pool.model_target.ModelTarget", "get_new_blocks"),
    ("model", "request"): (
        "model",
        "kvpool.specs.request.model_target.ModelManagerTarget",
        "allocate_slots",
    ),
    ("model", "v0"): (
        "model",
        "kvpool.specs.v0.model_target.ModelV0Target",
        "get_num_free_blocks",
    ),
    ("module", "events"): (f"{_HERE}:consumer_factory", f"{_HERE}.Consumer", "scores"),
    ("model", "events"): ("model", "kvpool.specs.events.model_target.ReferenceConsumer", "scores"),
    ("module", "radix"): (f"{_HERE}:radix_factory", f"{_HERE}.RadixTarget", "match_prefix"),
    ("model", "radix"): (
        "model",
        "kvpool.specs.radix.model_target.ModelRadixTarget",
        "match_prefix",
    ),
    ("vllm", "pool"): ("vllm", "kvpool.specs.targets.vllm.pool.VllmTarget", "get_new_blocks"),
    ("vllm", "request"): (
        "vllm",
        "kvpool.specs.targets.vllm.request.VllmManagerTarget",
        "allocate_slots",
    ),
    ("sglang", "radix"): (
        "sglang",
        "kvpool.specs.targets.sglang.radix.SglangRadixTarget",
        "match_prefix",
    ),
    ("dynamo", "events"): (
        "dynamo",
        "kvpool.specs.targets.dynamo.radix_tree.DynamoConsumer",
        "scores",
    ),
}
"""(kind, layer) -> (target string, class whose method fails, that method)."""


def owner(path: str) -> type[Any]:
    """The class named by a dotted path."""
    module, _, name = path.rpartition(".")
    found: type[Any] = getattr(importlib.import_module(module), name)
    return found


def failing(original: Callable[..., Any], failure: Failure) -> Callable[..., Any]:
    """``original`` (a method) made to fail as ``failure`` says, counting calls across the run."""
    calls = [0]

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return failure.act(lambda: original(self, *args, **kwargs), calls[0] - 1)

    return method


__all__ = ["FAILURES", "PATCH_POINTS", "PoolError"]
