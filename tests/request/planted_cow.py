"""A copy-on-write served before it is written: a subclass of kvpool.impl's KVCacheManager.

``SCOPE`` is a request-layer target for ``kvpool check --layer request
--target tests.request.planted_cow:SCOPE``: full attention, blocks of two
hash blocks, fine-grained hits on.
"""

from typing import Any

from kvpool.impl.manager import KVCacheManager
from kvpool.specs.request.target import ManagerTargetSpec
from kvpool.specs.targets.impl.request import ImplManagerTarget


class CopyServedBeforeWritten(KVCacheManager):
    """BUG: hands the copy to the request but keeps it pending one step more, so the
    request's forward pass reads its private block before the copy has written it."""

    def take_kv_cache_block_copies(self) -> Any:
        if self.pending_copies and not getattr(self, "_held", False):
            self._held = True
            return [], []
        self._held = False
        return super().take_kv_cache_block_copies()


class CopyServedBeforeWrittenTarget(ImplManagerTarget):
    manager_class = CopyServedBeforeWritten


SCOPE = ManagerTargetSpec(
    CopyServedBeforeWrittenTarget, layouts=("full",), block_factors=(2,), fine_grained=(True,)
)
