"""vLLM as a target: its v1 pool, its KV cache manager, its v0 allocator, and its releases.

Optional: nothing here imports vLLM until a target is built.

* ``pool``: ``BlockPool`` (and subclasses, forks, old releases through their API era);
* ``request``: ``KVCacheManager``;
* ``v0``: the v0 ``PrefixCachingBlockAllocator`` (releases up to 0.10.2);
* ``releases``: fetching a release and checking it in a child interpreter;
* ``findings``: the known level-2 divergences of vLLM's pool.
"""
