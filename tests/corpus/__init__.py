"""The bug corpus: planted bugs the conformance checks must find."""
