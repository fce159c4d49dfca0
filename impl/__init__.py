"""kvpool.impl: the fast block pool."""
