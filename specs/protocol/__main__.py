"""``python -m kvpool.specs.protocol [--consumer] TARGET``: serve a target over stdin and stdout.

Without ``--consumer``: a pool target (default ``impl``) over the target
protocol. With it: a KV-event consumer (default ``model``, the reference
consumer; any events-layer consumer string) over the consumer protocol
(``kvpool.specs.protocol.consumer``).
"""

import sys

from kvpool.specs.protocol.consumer import serve_consumer
from kvpool.specs.protocol.server import serve
from kvpool.specs.targets import resolve, resolve_target


def main(argv: list[str] | None = None) -> None:
    """Serve the target named by the arguments until stdin closes."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--consumer":
        spec = args[1] if len(args) > 1 else "model"
        descriptor = resolve("events", spec)
        if descriptor.scope.get("role") != "consumer" or descriptor.factory is None:
            raise SystemExit(f"{spec} is not a KV-event consumer")
        serve_consumer(descriptor.factory, sys.stdin, sys.stdout, name=spec)
        return
    spec = args[0] if args else "impl"
    serve(resolve_target(spec), sys.stdin, sys.stdout, name=spec)


if __name__ == "__main__":
    main()
