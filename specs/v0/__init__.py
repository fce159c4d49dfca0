"""The v0 layer: vLLM's v0 prefix-caching block allocator (``kvpool.model.v0``).

* ``target``: the protocol an allocator implements (``V0Target``) and its operations;
* ``machine``: the lock-step state machine, under the ``any`` or ``engine`` discipline;
* ``invariants``: the named invariants of an allocator's state;
* ``check``: ``check_v0``;
* ``model_target``: the model itself as a target.
"""
