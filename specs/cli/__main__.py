"""``python -m kvpool.specs.cli``: the ``kvpool`` command, also in a release's child interpreter.

``kvpool check --target vllm==X.Y.Z`` runs this module in a child whose
``PYTHONPATH`` starts with release X.Y.Z's sources; the release is activated
(preloads that old releases need) before anything imports vLLM.
"""

import os

from kvpool.specs.targets.vllm.releases import RELEASE_ENV, activate_release

activate_release(os.environ.get(RELEASE_ENV))

from kvpool.specs.cli import main  # noqa: E402  (after the release is activated)

main()
