"""The target registry: what a target string names, and the adapters behind each name.

``resolve(layer, spec)`` returns a ``TargetDescriptor`` (``registry``). The
adapters live one folder per implementation: ``impl/`` (kvpool's fast
implementation), ``cmd/`` (any program speaking the JSON-lines protocol),
``vllm/`` (vLLM's pool, manager, v0 allocator and releases; optional) and
``sglang/`` (SGLang's radix caches; optional). The
model's own adapters live with their layers (``kvpool.specs.pool.model_target``
and so on), because the vectors and counterexamples replay on them.
"""

from kvpool.specs.targets.registry import (
    LAYERS,
    TargetDescriptor,
    TargetSpecError,
    resolve,
    resolve_target,
)

__all__ = ["LAYERS", "TargetDescriptor", "TargetSpecError", "resolve", "resolve_target"]
