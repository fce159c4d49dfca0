"""``python -m kvpool.specs.protocol TARGET``: serve a pool target over stdin and stdout."""

import sys

from kvpool.specs.protocol.server import serve
from kvpool.specs.targets import resolve_target


def main(argv: list[str] | None = None) -> None:
    """Serve the pool target named by ``argv[0]`` (default ``impl``) until stdin closes."""
    args = list(sys.argv[1:] if argv is None else argv)
    spec = args[0] if args else "impl"
    serve(resolve_target(spec), sys.stdin, sys.stdout, name=spec)


if __name__ == "__main__":
    main()
