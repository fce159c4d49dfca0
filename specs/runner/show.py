"""Values as reports show them: in the protocol's terms, hashes as lowercase hex.

Python's ``repr`` prints a hash as ``b'\\x01\\x02'``; the protocol, the
vectors and docs/formats.md write it ``0102``. Reports use ``show`` so the
hash a user reads is the hash their target sent.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

MAX_SHOWN = 2000
"""Characters of one value a report shows at most."""


class _Shown:
    """Stands for a value whose repr is ``text`` (a dataclass with its hashes in hex)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def plain(value: Any, depth: int = 0) -> Any:
    """``value`` with every ``bytes`` turned into its hex string, containers kept.

    >>> plain((b"\\x01\\xab", 0))
    ('01ab', 0)
    """
    if depth > 20:
        return "..."
    if isinstance(value, bytes | bytearray):
        return bytes(value).hex()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(plain(v, depth + 1) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(plain(v, depth + 1) for v in value)
    if isinstance(value, set | frozenset):
        return sorted((plain(v, depth + 1) for v in value), key=repr)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(
            f"{f.name}={plain(getattr(value, f.name), depth + 1)!r}"
            for f in dataclasses.fields(value)
            if f.repr
        )
        return _Shown(f"{type(value).__name__}({fields})")
    if isinstance(value, Mapping):
        return {plain(k, depth + 1): plain(v, depth + 1) for k, v in value.items()}
    return value


def show(value: Any) -> str:
    """``repr`` of ``value`` with hashes in hex, cut to ``MAX_SHOWN`` characters.

    >>> show([(b"\\x01", 2)])
    "[('01', 2)]"
    """
    try:
        text = repr(plain(value))
    except Exception as error:  # a target's object whose repr fails
        text = f"<{type(value).__name__} whose repr raises {type(error).__name__}>"
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."
