"""vLLM's own ``Request`` objects, hashed by vLLM's own request block hasher.

A scheduler hands vLLM's ``KVCacheManager`` requests whose ``block_hashes``
vLLM's request block hasher computed (``get_request_block_hasher`` in
``vllm/v1/core/kv_cache_utils.py``, 0.33.0: the engine core builds it and
every ``Request`` runs it when it is created and when tokens are appended).
``VllmRequests`` does the same for the machine's requests: one
``vllm.v1.request.Request`` per request id, built from the token ids and
the extra keys (LoRA adapter, multimodal inputs, cache salt, prompt
embeddings), kept in step as tokens are appended, so the hashes the manager
sees are vLLM's. The machine checks them against the token ground truth
(``kvpool.specs.request.invariants.target_hashes_name_prefixes``): their
values are vLLM's own, but equal prefixes must hash equal and different
ones differently.

Which hasher: ``find_hasher`` looks, in order, for a
``get_request_block_hasher`` defined by the manager class (or a base), in
its module, in the ``kv_cache_utils`` module beside it (a fork's own), and
finally in the installed vLLM's ``kv_cache_utils``. It has vLLM's signature:
``(hash_block_size, caching_hash_fn) -> hasher``, where ``hasher(request)``
returns the hashes of the request's new full blocks.

Prompt embeddings are the model's opaque bytes per position; vLLM hashes a
tensor slice, so each position becomes a row of four floats read from the
SHA-256 of its bytes: equal bytes give equal rows.
"""

import hashlib
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpool.model.request import Request
from kvpool.specs.errors import TargetError
from kvpool.specs.targets.vllm.eras import found_in_hierarchy

HASHER_NAME = "get_request_block_hasher"


@dataclass(frozen=True)
class Hasher:
    """A request block hasher factory and where it was found."""

    make: Callable[[int, Callable[[Any], bytes]], Callable[[Any], list[Any]]]
    where: str
    utils: Any
    """The ``kv_cache_utils`` module whose ``NONE_HASH`` the hasher chains from."""


def find_hasher(manager_class: type) -> Hasher | None:
    """The request block hasher that goes with ``manager_class`` (see the module's docstring)."""
    vllm_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    own = found_in_hierarchy(manager_class, HASHER_NAME)
    if own is not None:
        return Hasher(own, f"{manager_class.__qualname__}.{HASHER_NAME}", vllm_utils)
    module_name = manager_class.__module__
    candidates = [module_name]
    package, _, _ = module_name.rpartition(".")
    if package:
        candidates.append(f"{package}.kv_cache_utils")
    for name in candidates:
        module = sys.modules.get(name)
        if module is None and name != module_name:
            try:
                module = importlib.import_module(name)
            except ImportError:
                module = None
        function = getattr(module, HASHER_NAME, None)
        if callable(function):
            return Hasher(function, f"{name}.{HASHER_NAME}", module)
    function = getattr(vllm_utils, HASHER_NAME, None)
    if callable(function):
        return Hasher(function, f"vllm.v1.core.kv_cache_utils.{HASHER_NAME}", vllm_utils)
    return None


def caching_hash_function() -> Callable[[Any], bytes]:
    """vLLM's default prefix-caching hash function (``sha256`` of ``vllm.utils.hashing``)."""
    for module_name in ("vllm.utils.hashing", "vllm.utils"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        function = getattr(module, "sha256", None)
        if callable(function):
            return function  # type: ignore[no-any-return]
    raise TargetError("vLLM's sha256 hash function was not found")


def embedding_rows(prompt_embeds: tuple[bytes, ...]) -> list[list[float]]:
    """One row of four floats per position, equal exactly when the positions' bytes are."""
    return [[float(b) for b in hashlib.sha256(e).digest()[:4]] for e in prompt_embeds]


class VllmRequests:
    """vLLM ``Request`` objects for the machine's requests, kept in step by request id."""

    def __init__(self, hasher: Hasher, status: Any) -> None:
        self.hasher = hasher
        self.status = status
        self.hash_function = caching_hash_function()
        init_none_hash = getattr(hasher.utils, "init_none_hash", None)
        if callable(init_none_hash):
            init_none_hash(self.hash_function)
        try:
            self._request_class = importlib.import_module("vllm.v1.request").Request
            self._sampling = importlib.import_module("vllm.sampling_params").SamplingParams
            self._lora = importlib.import_module("vllm.lora.request").LoRARequest
            inputs = importlib.import_module("vllm.multimodal.inputs")
            self._feature = inputs.MultiModalFeatureSpec
            self._placeholder = inputs.PlaceholderRange
            self._torch = importlib.import_module("torch")
        except (ImportError, AttributeError) as error:
            raise TargetError(f"vLLM's Request cannot be built here: {error!r}") from error
        self._hashers: dict[int, Callable[[Any], list[Any]]] = {}
        self._by_id: dict[str, tuple[Request, Any]] = {}

    def _hasher(self, hash_block_size: int) -> Callable[[Any], list[Any]]:
        if hash_block_size not in self._hashers:
            self._hashers[hash_block_size] = self.hasher.make(hash_block_size, self.hash_function)
        return self._hashers[hash_block_size]

    def get(self, request: Request) -> Any:
        """The vLLM request for ``request``, its tokens and progress brought up to date."""
        known = self._by_id.get(request.request_id)
        vllm_request = None
        if known is not None and _same_stem(known[0], request):
            vllm_request = known[1]
            grown = request.output_token_ids[len(vllm_request.output_token_ids) :]
            if grown:
                vllm_request.append_output_token_ids(list(grown))
        if vllm_request is None or vllm_request.num_tokens != request.num_tokens:
            vllm_request = self._build(request)
        vllm_request.num_computed_tokens = request.num_computed_tokens
        vllm_request.num_preemptions = request.num_preemptions
        if hasattr(vllm_request, "shared_prefix_boundary"):  # 0.33 (the scheduler sets it)
            vllm_request.shared_prefix_boundary = request.shared_prefix_boundary
        vllm_request.status = self.status
        self._by_id[request.request_id] = (request, vllm_request)
        return vllm_request

    def _build(self, request: Request) -> Any:
        lora = request.lora
        embeds = None
        if request.prompt_embeds:
            embeds = self._torch.tensor(
                embedding_rows(request.prompt_embeds), dtype=self._torch.float32
            )
        vllm_request = self._request_class(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=self._sampling(
                max_tokens=64, skip_reading_prefix_cache=request.skip_reading_prefix_cache
            ),
            pooling_params=None,
            prompt_embeds=embeds,
            lora_request=None
            if lora is None
            else self._lora(lora_name=lora.name, lora_int_id=lora.lora_id, lora_path=lora.path),
            mm_features=[
                self._feature(
                    data=None,
                    modality="image",
                    identifier=m.identifier,
                    mm_position=self._placeholder(offset=m.offset, length=m.length),
                )
                for m in request.mm_inputs
            ],
            cache_salt=request.cache_salt,
            block_hasher=self._hasher(request.hash_block_size),
        )
        if request.output_token_ids:
            vllm_request.append_output_token_ids(list(request.output_token_ids))
        return vllm_request


def _same_stem(known: Request, request: Request) -> bool:
    """Whether ``request`` is ``known`` with (possibly) more output tokens."""
    return (
        known.prompt_token_ids == request.prompt_token_ids
        and request.output_token_ids[: len(known.output_token_ids)] == known.output_token_ids
        and (known.lora, known.mm_inputs, known.cache_salt, known.prompt_embeds)
        == (request.lora, request.mm_inputs, request.cache_salt, request.prompt_embeds)
        and known.hash_block_size == request.hash_block_size
        and known.skip_reading_prefix_cache == request.skip_reading_prefix_cache
    )
