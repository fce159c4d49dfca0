"""The radix layer: SGLang's radix prefix cache (``kvpool.model.radix``).

* ``target``: the protocol a radix cache implements (``RadixTarget``) and its operations;
* ``machine``: the lock-step state machine, one eviction policy per run;
* ``invariants``: the named invariants of the model's state, and the
  engine-neutral ones (``kvpool.specs.prefix_cache``) applied to any target;
* ``check``: ``check_radix``;
* ``model_target``: the model itself as a target.
"""
