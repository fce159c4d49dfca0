"""SGLang's radix prefix caches as radix-layer targets (optional: SGLang is imported lazily).

* ``loading``: finding the installed SGLang and the parts of its API the adapter uses;
* ``radix``: the adapter (``SglangRadixTarget``, one per core: rust, python, legacy);
* ``findings``: the known level-2 findings of each core.

Nothing here imports SGLang when it is imported: kvpool does not depend on it.
"""
