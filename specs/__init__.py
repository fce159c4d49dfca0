"""kvpool.specs: what conformance means."""
