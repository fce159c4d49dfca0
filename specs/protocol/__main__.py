"""``python -m kvpool.specs.protocol [--layer request | --consumer] TARGET``: serve a target.

Over stdin and stdout, until stdin closes. Without an option: a pool target
(default ``impl``) over the target protocol. With ``--layer request``: a
request-layer target (a KV cache manager; default ``impl``) over the request
layer's dialect (``kvpool.specs.protocol.request_codec``). With
``--features A,B`` after ``--layer request``, its hello announces those optional
features (``request_codec.FEATURES``; empty: none) instead of the ones it finds the
target has. With ``--consumer``: a KV-event consumer (default ``model``, the reference
consumer; any events-layer consumer string) over the consumer protocol
(``kvpool.specs.protocol.consumer``). A target string that names nothing
servable exits 2, naming it.
"""

import sys

from kvpool.specs.protocol.consumer import serve_consumer
from kvpool.specs.protocol.request_codec import FEATURES
from kvpool.specs.protocol.request_server import serve_requests
from kvpool.specs.protocol.server import serve
from kvpool.specs.targets import TargetSpecError, resolve, resolve_target


def main(argv: list[str] | None = None) -> None:
    """Serve the target named by the arguments until stdin closes."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] == "--consumer":
            spec = args[1] if len(args) > 1 else "model"
            descriptor = resolve("events", spec)
            if descriptor.scope.get("role") != "consumer" or descriptor.factory is None:
                raise TargetSpecError(f"{spec} is not a KV-event consumer")
            serve_consumer(descriptor.factory, sys.stdin, sys.stdout, name=spec)
            return
        layer = "pool"
        if args[:1] == ["--layer"] and len(args) >= 2:
            layer, args = args[1], args[2:]
        features: list[str] | None = None
        if layer == "request" and args[:1] == ["--features"] and len(args) >= 2:
            features = [f for f in args[1].split(",") if f]
            args = args[2:]
            unknown = sorted(set(features) - set(FEATURES))
            if unknown:
                raise TargetSpecError(f"unknown feature(s) {unknown}; known: {', '.join(FEATURES)}")
        spec = args[0] if args else "impl"
        if layer == "request":
            factory = resolve("request", spec).factory
            if factory is None:
                raise TargetSpecError(f"{spec} cannot be served from this interpreter")
            serve_requests(factory, sys.stdin, sys.stdout, name=spec, features=features)
        elif layer == "pool":
            serve(resolve_target(spec), sys.stdin, sys.stdout, name=spec)
        else:
            raise TargetSpecError(f"unknown layer {layer!r}: use pool or request")
    except TargetSpecError as error:
        print(f"kvpool.specs.protocol: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
