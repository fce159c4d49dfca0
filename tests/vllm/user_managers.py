"""A user's own vLLM ``KVCacheManager`` subclasses, for ``kvpool check --layer request``.

Importing this module imports vLLM. Each class is what a fork or a user
might write: one wraps the constructor and changes nothing, one leaks, two
bring their own request block hasher (``get_request_block_hasher``, which
the adapter finds on the class) with a mistake of old vLLM releases.
"""

from collections.abc import Callable
from typing import Any, cast

from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheManager


class WrappedManager(KVCacheManager):
    """Wraps the constructor the usual way; behaves exactly like vLLM's manager."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wrapped = True


class LeakyManager(WrappedManager):
    """``free`` never returns a request's last block to the pool: it keeps a reference to it.

    The block is neither free nor in any request's table: it leaks, and the
    pool shrinks by one block per finished request.
    """

    def free(self, request: Any) -> None:
        groups = self.get_blocks(request.request_id).blocks
        if groups and groups[0]:
            groups[0][-1].ref_cnt += 1
        super().free(request)


def _saltless_hasher(
    hash_block_size: int, hash_function: Callable[[Any], bytes]
) -> Callable[[Any], list[Any]]:
    """vLLM's own hasher, run with the request's cache salt hidden."""
    hasher = kv_cache_utils.get_request_block_hasher(hash_block_size, hash_function)

    def hash_without_salt(request: Any) -> list[Any]:
        salt, request.cache_salt = request.cache_salt, None
        try:
            return cast(list[Any], hasher(request))
        finally:
            request.cache_salt = salt

    return hash_without_salt


class SaltlessHasherManager(KVCacheManager):
    """Its request block hasher drops the cache salt: tenants share each other's blocks."""

    get_request_block_hasher = staticmethod(_saltless_hasher)


def _untagged_hasher(
    hash_block_size: int, hash_function: Callable[[Any], bytes]
) -> Callable[[Any], list[Any]]:
    """Extra keys as old releases wrote them: a bare LoRA name and a bare salt, untagged."""

    def hash_untagged(request: Any) -> list[Any]:
        hashes: list[Any] = []
        parent = request.block_hashes[-1] if request.block_hashes else None
        start = len(request.block_hashes) * hash_block_size
        while start + hash_block_size <= request.num_tokens:
            end = start + hash_block_size
            keys: list[Any] = []
            if request.lora_request is not None:
                keys.append(request.lora_request.lora_name)
            for feature in request.mm_features:
                offset, length = feature.mm_position.offset, feature.mm_position.length
                if offset < end and offset + length > start:
                    keys.append((feature.identifier, offset - start))
            if start == 0 and request.cache_salt:
                keys.append(request.cache_salt)
            tokens = request.all_token_ids[start:end]
            parent = kv_cache_utils.hash_block_tokens(
                hash_function, parent, tokens, tuple(keys) or None
            )
            hashes.append(parent)
            start = end
        return hashes

    return hash_untagged


class UntaggedLoraHasherManager(KVCacheManager):
    """Its hasher leaves the LoRA key untagged: adapter "a" and cache salt "a" hash alike."""

    get_request_block_hasher = staticmethod(_untagged_hasher)


class NotAManager:
    """Not a KV cache manager at all."""


class BrokenConstructorManager(KVCacheManager):
    """A subclass that cannot be constructed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("this manager needs a GPU")
