"""A request as the KV cache manager sees it: tokens, hashes, and how far it has computed.

The manager never changes a request: the caller (a scheduler, or the
request-level machine) builds a new ``Request`` value when tokens are
appended (``append_tokens``), when a step has computed tokens
(``with_computed``) or when the request is preempted (``preempted``). Its
block hashes are always those of every full hash block of its tokens
(``kvpool.model.hashing.extend_block_hashes``).

The request layer's own exceptions live here too; like the pool's, each
precondition has its own class.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvpool.model.errors import HashBlockSizeMismatch, InvalidPromptEmbeds, InvalidTokenCount
from kvpool.model.hashing import (
    NONE_HASH,
    LoraAdapter,
    MultiModalInput,
    extend_block_hashes,
)
from kvpool.model.state import BlockHash, CacheRequest

# --------------------------------------------------------------------------
# The request
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """The parts of a request the KV cache manager reads.

    ``block_hashes[i]`` is the chained hash of the first ``(i + 1) *
    hash_block_size`` tokens, with this request's extra keys.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    hash_block_size: int
    output_token_ids: tuple[int, ...] = ()
    lora: LoraAdapter | None = None
    mm_inputs: tuple[MultiModalInput, ...] = ()
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    skip_reading_prefix_cache: bool = False
    block_hashes: tuple[BlockHash, ...] = ()
    seed_hash: BlockHash = NONE_HASH
    prompt_embeds: tuple[bytes, ...] = ()
    """Empty, or one opaque value (the embedding's bytes) per prompt token: a prompt
    sent as embeddings, whose KV depends on them rather than on the token ids."""
    shared_prefix_boundary: int = 0
    """Where the scheduler last saw this request's prefix shared past its hit (the third
    value of vLLM 0.33's ``get_computed_blocks``; 0: none). Sparse retention keeps the
    sliding window ending there (``kvpool.model.retention``)."""

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        """The prompt followed by every token generated so far."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """How many tokens the request holds (prompt and output)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """How many tokens the prompt holds (vLLM's ``Request.num_prompt_tokens``)."""
        return len(self.prompt_token_ids)

    @property
    def lora_id(self) -> int | None:
        """The LoRA adapter's id, for events (None without an adapter)."""
        return None if self.lora is None else self.lora.lora_id

    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter's name, for events (None without an adapter)."""
        return None if self.lora is None else self.lora.name


def new_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    hash_block_size: int,
    lora: LoraAdapter | None = None,
    mm_inputs: Sequence[MultiModalInput] = (),
    cache_salt: str | None = None,
    skip_reading_prefix_cache: bool = False,
    seed_hash: BlockHash = NONE_HASH,
    prompt_embeds: Sequence[bytes] = (),
) -> Request:
    """A request that has computed nothing yet, with the hashes of its full prompt blocks.

    Complexity: O(len(prompt_token_ids) + number of blocks * len(mm_inputs)).

    >>> r = new_request("a", [1, 2, 3], hash_block_size=2)
    >>> r.num_tokens, len(r.block_hashes)
    (3, 1)
    """
    prompt = tuple(prompt_token_ids)
    # Verify that the prompt has at least one token
    if not prompt:
        raise InvalidTokenCount(f"request {request_id!r} has an empty prompt")
    # Verify that prompt embeddings, if any, give one value per prompt token
    if prompt_embeds and len(prompt_embeds) != len(prompt):
        raise InvalidPromptEmbeds(
            f"{len(prompt_embeds)} prompt embeddings for a prompt of {len(prompt)} tokens"
        )
    # Verify that the hash block size, multimodal inputs and embeddings are valid (the hasher)
    hashes = extend_block_hashes(
        (),
        prompt,
        hash_block_size,
        lora,
        mm_inputs,
        cache_salt,
        seed_hash=seed_hash,
        prompt_embeds=prompt_embeds,
    )
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        hash_block_size=hash_block_size,
        lora=lora,
        mm_inputs=tuple(mm_inputs),
        cache_salt=cache_salt,
        skip_reading_prefix_cache=skip_reading_prefix_cache,
        block_hashes=hashes,
        seed_hash=seed_hash,
        prompt_embeds=tuple(prompt_embeds),
    )


def append_tokens(request: Request, token_ids: Sequence[int]) -> Request:
    """The request with generated tokens appended and the new full blocks hashed.

    Complexity: O(number of new hash blocks * hash_block_size).

    >>> r = append_tokens(new_request("a", [1, 2, 3], hash_block_size=2), [4])
    >>> r.all_token_ids, len(r.block_hashes)
    ((1, 2, 3, 4), 2)
    """
    output = request.output_token_ids + tuple(token_ids)
    hashes = extend_block_hashes(
        request.block_hashes,
        request.prompt_token_ids + output,
        request.hash_block_size,
        request.lora,
        request.mm_inputs,
        request.cache_salt,
        seed_hash=request.seed_hash,
        prompt_embeds=request.prompt_embeds,
    )
    return replace(request, output_token_ids=output, block_hashes=hashes)


def with_computed(request: Request, num_computed_tokens: int) -> Request:
    """The request after the scheduler set how many of its tokens have computed KV.

    >>> with_computed(new_request("a", [1, 2], 1), 2).num_computed_tokens
    2
    """
    # Verify that the count is not negative
    if num_computed_tokens < 0:
        raise InvalidTokenCount(f"num_computed_tokens={num_computed_tokens} is negative")
    return replace(request, num_computed_tokens=num_computed_tokens)


def preempted(request: Request) -> Request:
    """The request after preemption: nothing computed, one more preemption counted.

    >>> preempted(with_computed(new_request("a", [1, 2], 1), 2)).num_computed_tokens
    0
    """
    return replace(request, num_computed_tokens=0, num_preemptions=request.num_preemptions + 1)


def verify_hash_block_size(request: Request, hash_block_size: int) -> None:
    """Raise HashBlockSizeMismatch unless the request's hashes cover ``hash_block_size`` tokens.

    >>> verify_hash_block_size(new_request("a", [1], 2), 2)
    """
    if request.hash_block_size != hash_block_size:
        raise HashBlockSizeMismatch(
            f"request {request.request_id!r} is hashed in blocks of {request.hash_block_size} "
            f"tokens, the pool uses {hash_block_size}"
        )


def cache_request(request: Request) -> CacheRequest:
    """The part of the request the block pool reads when caching its blocks.

    >>> cache_request(new_request("a", [1, 2], 2)).all_token_ids
    (1, 2)
    """
    return CacheRequest(
        block_hashes=request.block_hashes,
        all_token_ids=request.all_token_ids,
        lora_id=request.lora_id,
        lora_name=request.lora_name,
    )
