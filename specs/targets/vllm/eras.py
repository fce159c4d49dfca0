"""Which API era a vLLM class speaks, from its class hierarchy rather than its outer signature.

The usual way to wrap a constructor, in a subclass or a fork::

    class MyPool(BlockPool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            ...

hides every parameter: its signature says nothing about whether the pool
takes ``hash_block_size``. ``takes`` therefore reads the first definition
of the method, walking the class's method resolution order, that *decides*
the question: one naming the parameter says yes, one without it and without
``*args``/``**kwargs`` says no, and one that only passes arguments on
(``*args``, ``**kwargs``, possibly after named ones) leaves it to the next
class. A fork's class that decides nothing is read like the installed
vLLM's own class (``base``): the release the fork runs with.
"""

import inspect
from collections.abc import Callable
from typing import Any

_PASSING_ON = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _signature(function: Any) -> inspect.Signature | None:
    if isinstance(function, staticmethod | classmethod):
        function = function.__func__
    if not callable(function):
        return None
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None


def decides(cls: type, method: str, parameter: str) -> bool | None:
    """Whether ``method`` of ``cls`` takes ``parameter``; None if no class of its hierarchy says.

    >>> class Base:
    ...     def __init__(self, num_blocks, hash_block_size=1): ...
    >>> class Wrapper(Base):
    ...     def __init__(self, *args, **kwargs): super().__init__(*args, **kwargs)
    >>> class Old:
    ...     def __init__(self, num_blocks): ...
    >>> decides(Wrapper, "__init__", "hash_block_size"), decides(Old, "__init__", "hash_block_size")
    (True, False)
    """
    for klass in inspect.getmro(cls):
        if klass is object or method not in vars(klass):
            continue
        signature = _signature(vars(klass)[method])
        if signature is None:
            continue
        parameters = signature.parameters
        if parameter in parameters:
            return True
        if any(p.kind in _PASSING_ON for p in parameters.values()):
            continue
        return False
    return None


def takes(cls: type, method: str, parameter: str, base: type | None = None) -> bool:
    """Whether ``method`` of ``cls`` takes ``parameter``: its hierarchy, else ``base``'s, else no.

    >>> class Fork:
    ...     def __init__(self, *args, **kwargs): ...
    >>> class Installed:
    ...     def __init__(self, num_blocks, hash_block_size): ...
    >>> takes(Fork, "__init__", "hash_block_size", base=Installed)
    True
    """
    found = decides(cls, method, parameter)
    if found is None and base is not None and base is not cls:
        found = decides(base, method, parameter)
    return bool(found)


def annotation(cls: type, method: str, parameter: str, base: type | None = None) -> str:
    """The annotation of ``parameter`` where the hierarchy (else ``base``'s) first names it; ""."""
    for klass in (*inspect.getmro(cls), *(inspect.getmro(base) if base is not None else ())):
        if klass is object or method not in vars(klass):
            continue
        signature = _signature(vars(klass)[method])
        if signature is not None and parameter in signature.parameters:
            return str(signature.parameters[parameter].annotation)
    return ""


def found_in_hierarchy(cls: type, name: str) -> Callable[..., Any] | None:
    """A callable attribute ``name`` that ``cls`` or one of its bases defines, else None."""
    for klass in inspect.getmro(cls):
        if name in vars(klass):
            value = getattr(cls, name)
            return value if callable(value) else None
    return None
