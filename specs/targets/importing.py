"""Importing a user's module named on the command line."""

import importlib
import os
import sys
from types import ModuleType


def import_from_here(module_name: str) -> ModuleType:
    """Import ``module_name``, also from the working directory, as ``python -m`` would.

    A console script's ``sys.path`` starts at the script's own directory, not
    the working directory, so ``kvpool check --target mypool:make`` would
    otherwise not find ``./mypool.py``.
    """
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        here = os.getcwd()
        # Only retry when the missing module is the one named (or its package),
        # not something it imports.
        if here in sys.path or not module_name.startswith(error.name or "\0"):
            raise
        sys.path.append(here)
        return importlib.import_module(module_name)
