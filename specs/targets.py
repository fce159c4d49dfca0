"""Turning a ``--target`` string into a target factory.

* ``impl``: kvpool's own fast pool (the default);
* ``model``: the model itself (a self-check of the harness);
* ``module:factory``: any importable callable taking a ``PoolConfig``.
"""

import importlib

from kvpool.specs.target import TargetFactory


class TargetSpecError(ValueError):
    """The ``--target`` string names no usable target."""


def resolve_target(spec: str) -> TargetFactory:
    """The factory a target string names; raise TargetSpecError if there is none."""
    if spec == "impl":
        from kvpool.specs.adapters.impl_target import ImplTarget

        return ImplTarget
    if spec == "model":
        from kvpool.specs.adapters.model_target import ModelTarget

        return ModelTarget
    if ":" in spec:
        module_name, _, attribute = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise TargetSpecError(f"cannot import {module_name!r}: {error}") from error
        factory = getattr(module, attribute, None)
        if not callable(factory):
            raise TargetSpecError(f"{module_name!r} has no callable {attribute!r}")
        return factory  # type: ignore[no-any-return]
    raise TargetSpecError(f"unknown target {spec!r}: use impl, model, or module:factory")
