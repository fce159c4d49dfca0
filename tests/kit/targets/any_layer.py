"""Misbehaves at its first request, whatever the layer's protocol: ``python any_layer.py MODE``.

deep: answers with an array nested 100,000 deep; long: with a 20 MB line;
flood: writes 50 MB to stderr, then exits with code 3; garbage: prints a
line that is not JSON.
"""

import sys

mode = sys.argv[1]
sys.stdin.readline()
if mode == "deep":
    sys.stdout.write("[" * 100_000 + "]" * 100_000 + "\n")
elif mode == "long":
    sys.stdout.write("x" * (20 * 2**20) + "\n")
elif mode == "flood":
    for i in range(50_000):
        sys.stderr.write(f"noise {i} " + "z" * 1000 + "\n")
    sys.stderr.write("the last line\n")
    sys.exit(3)
elif mode == "garbage":
    sys.stdout.write("DEBUG starting up {oops\n")
sys.stdout.flush()
sys.stdin.read()
