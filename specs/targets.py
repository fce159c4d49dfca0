"""Turning a ``--target`` string into a target factory.

* ``impl``: kvpool's own fast pool (the default);
* ``model``: the model itself (a self-check of the harness);
* ``cmd:PROGRAM ARGS``: a program in any language speaking the JSON-lines
  protocol (docs/formats.md, ``kvpool.specs.adapters.cmd_target``);
* ``module:factory``: any importable callable taking a ``PoolConfig``;
* ``vllm``: the installed vLLM's ``BlockPool``;
* ``vllm:package.module:Class``: a ``BlockPool`` subclass or fork, same constructor;
* ``vllm==X.Y.Z``: a vLLM release, run by ``kvpool check`` in a child interpreter
  (``kvpool.specs.vllm_releases``); resolvable here only if it is the installed one.
"""

from kvpool.specs.importing import import_from_here
from kvpool.specs.target import TargetFactory
from kvpool.specs.vllm_releases import (
    VLLM,
    ReleaseError,
    installed_version,
    is_vllm_target,
    release_of,
)


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
    if spec.startswith("cmd:"):
        from kvpool.specs.adapters.cmd_target import CmdTargetFactory

        try:
            return CmdTargetFactory.from_spec(spec)
        except ValueError as error:
            raise TargetSpecError(f"bad cmd: target {spec!r}: {error}") from error
    if is_vllm_target(spec):
        return _vllm_target(spec)
    if ":" in spec:
        module_name, _, attribute = spec.partition(":")
        try:
            module = import_from_here(module_name)
        except ImportError as error:
            raise TargetSpecError(f"cannot import {module_name!r}: {error}") from error
        factory = getattr(module, attribute, None)
        if not callable(factory):
            raise TargetSpecError(f"{module_name!r} has no callable {attribute!r}")
        return factory  # type: ignore[no-any-return]
    raise TargetSpecError(
        f"unknown target {spec!r}: use impl, model, module:factory, cmd:PROGRAM ARGS, vllm, "
        "vllm:module:Class or vllm==X.Y.Z"
    )


def _vllm_target(spec: str) -> TargetFactory:
    try:
        release = release_of(spec)
    except ReleaseError as error:
        raise TargetSpecError(str(error)) from error
    if release is not None:
        if release != installed_version():
            raise TargetSpecError(
                f"{spec} runs in its own interpreter: use `kvpool check --target {spec}` "
                "or kvpool.specs.vllm_releases.run_check_in_release"
            )
        spec = VLLM
    if installed_version() is None:
        raise TargetSpecError(
            "vLLM is not installed: pip install vllm, or use --target vllm==X.Y.Z"
        )
    from kvpool.specs.adapters.vllm_target import vllm_factory

    try:
        return vllm_factory(spec)
    except ValueError as error:
        raise TargetSpecError(str(error)) from error
