"""The pool layer: vLLM's v1 block pool (``kvpool.model.pool``) and what conforming to it means.

* ``target``: the protocol a pool implements (``PoolTarget``) and its one list of operations;
* ``machine``: the lock-step state machine;
* ``invariants``: the named invariants of a pool's state;
* ``check``: ``run_conformance``;
* ``model_target``: the model itself as a target; ``record`` and
  ``counterexample``: a failure replayed and explained; ``contracts``: CrossHair
  contracts on the model and the impl.
"""
