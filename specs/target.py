"""``kvpool.specs.target``: the path the README and docs gave the pool's target protocol; kept.

New code imports from ``kvpool.specs`` (the public face) or from
``kvpool.specs.pool.target``.
"""

from kvpool.specs.errors import TargetError
from kvpool.specs.pool.target import Normalizing, PoolTarget, Snapshottable, TargetFactory

__all__ = ["Normalizing", "PoolTarget", "Snapshottable", "TargetError", "TargetFactory"]
