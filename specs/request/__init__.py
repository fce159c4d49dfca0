"""The request layer: a KV cache manager over the pool (``kvpool.model.manager``).

Hash chains, the hit search of each attention type, admission in
``allocate_slots``, hybrid groups, and the token ground truth that says the
cache never serves wrong KV.

* ``target``: the protocol a manager implements (``ManagerTarget``) and its operations;
* ``machine``: the scheduler-driven lock-step state machine;
* ``invariants``: the safety properties, checked against the KV actually written;
* ``check``: ``run_request_conformance``;
* ``model_target``: the model itself as a target.
"""
