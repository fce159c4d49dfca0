"""Adapters that put an implementation behind the target protocol."""
