"""The event layer: what a KV-aware router rebuilds from engines' KV events.

* ``target``: the consumer protocol (an index over events) and the engine
  protocol (a producer of events);
* ``engine``: a serving engine over any block pool (the producer the machine drives);
* ``model_target``: the reference consumer, folding as ``kvpool.model.events.fold_events`` says;
* ``machine``: engines serve requests, batches go to the consumer, aimed queries compare;
* ``invariants``: no phantom hits, no missed hits;
* ``check``: ``check_events``, one run per event semantics, a verdict for each.

``kvpool check --layer events --target model|dynamo|dynamo:raw|cmd:...|vllm|impl``
runs it (docs/explanation/routers.md).
"""
