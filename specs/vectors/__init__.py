"""Conformance vectors: operation sequences with the model's answers, as JSON lines.

A vector is one test case any implementation can replay without Python: a
pool configuration, then steps, each an operation with its JSON arguments,
what the model answers (``{"ok": result}`` or ``{"error": "ExceptionName"}``)
and the whole state after it.

* ``generate``: the corpus, written from the model alone (scenarios and seeded walks);
* ``format``: reading vector files against their schema and manifest;
* ``replay``: running vectors against a target;
* ``data/``: the committed corpus, shipped with the package.

``kvpool vectors export|validate|run`` is the command line (``kvpool.specs.cli``).
"""

from kvpool.specs.vectors.format import (
    FORMAT,
    FORMAT_VERSION,
    GENERATOR,
    GENERATOR_VERSION,
    MANIFEST,
    LoadedVector,
    VectorFormatError,
    bundled_corpus,
    count_valid,
    load,
    load_schema,
    scan,
    validators,
)
from kvpool.specs.vectors.generate import (
    SCENARIOS,
    Script,
    dump_line,
    export,
    generate,
    random_walk,
    req,
    vector_from_calls,
)
from kvpool.specs.vectors.replay import (
    Mismatch,
    RunResult,
    check_step,
    normal_state,
    run_corpus,
    run_vector,
    same_result,
    state_of,
    state_problem,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "GENERATOR",
    "GENERATOR_VERSION",
    "MANIFEST",
    "SCENARIOS",
    "LoadedVector",
    "Mismatch",
    "RunResult",
    "Script",
    "VectorFormatError",
    "bundled_corpus",
    "check_step",
    "count_valid",
    "dump_line",
    "export",
    "generate",
    "load",
    "load_schema",
    "normal_state",
    "random_walk",
    "req",
    "run_corpus",
    "run_vector",
    "same_result",
    "scan",
    "state_of",
    "state_problem",
    "validators",
    "vector_from_calls",
]
