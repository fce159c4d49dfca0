"""Block hashes: the names under which the prefix cache stores KV blocks.

A block hash names a whole *prefix*, not a block's own tokens: it is the
SHA-256 of the parent block's hash, the block's tokens and the block's extra
keys, so equal hashes mean equal prefixes (up to a SHA-256 collision). The
prefix cache is safe exactly when that holds: a request that finds a block
under its hash gets KV computed for its own tokens, LoRA adapter, multimodal
inputs and salt.

What is hashed is a canonical, *tagged* byte encoding (``encode``), not a
pickle or a tuple of Python values: every value carries a type tag and a
length, and every extra key carries the name of its kind. So a LoRA name can
never be read as a cache salt, a string never as bytes, and two different
inputs never encode to the same bytes (``encode`` is injective; the tests
check it by decoding). docs/semantics.md, "The request layer", records each
decision and its source.

The first block of every request chains from a seed value, ``NONE_HASH``,
itself a hash of a fixed string: the same on every machine and every run, so
caches can be shared across processes.
"""

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.model.errors import (
    InvalidBlockHashes,
    InvalidHashBlockSize,
    InvalidMultiModalInputs,
    InvalidPromptEmbeds,
)
from kvpool.model.state import BlockHash

# --------------------------------------------------------------------------
# Extra keys: what besides the tokens decides a block's KV
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraKey:
    """The LoRA adapter a request runs with: its name and where it was loaded from."""

    name: str
    path: str = ""


@dataclass(frozen=True)
class MultiModalKey:
    """A multimodal input overlapping the block.

    ``offset`` is where the input starts, relative to the block's first
    token: negative when the input started in an earlier block.
    """

    identifier: str
    offset: int


@dataclass(frozen=True)
class SaltKey:
    """A cache salt: requests with different salts never share a block."""

    salt: str


@dataclass(frozen=True)
class PromptEmbedsKey:
    """The prompt embeddings of the block's positions, for a request sent as embeddings.

    One opaque value per position (the embedding's bytes); empty for a block
    past the prompt of such a request.
    """

    embeddings: tuple[bytes, ...]


ExtraKey = LoraKey | MultiModalKey | SaltKey | PromptEmbedsKey


@dataclass(frozen=True)
class LoraAdapter:
    """A request's LoRA adapter. The id only feeds events; name and path are hashed."""

    lora_id: int
    name: str
    path: str = ""


@dataclass(frozen=True)
class MultiModalInput:
    """A multimodal input (an image, say) occupying ``length`` placeholder tokens from ``offset``.

    ``identifier`` is the hash of the input's content: two inputs with the same
    identifier produce the same embeddings.
    """

    identifier: str
    offset: int
    length: int


# --------------------------------------------------------------------------
# The canonical encoding
# --------------------------------------------------------------------------

_NONE, _INT, _STR, _BYTES, _TUPLE = b"N", b"I", b"S", b"B", b"T"
_LEN = 8  # bytes of every length prefix, big-endian

Encodable = None | int | str | bytes | tuple["Encodable", ...]


def _tagged(tag: bytes, payload: bytes) -> bytes:
    return tag + len(payload).to_bytes(_LEN, "big") + payload


def encode(value: Encodable) -> bytes:
    """The canonical bytes of ``value``: a type tag, a length, the payload.

    Integers are written as signed decimal text, strings as UTF-8, tuples as
    their element count followed by each element's encoding. No two distinct
    values share an encoding (``decode`` inverts it).

    Complexity: O(size of value).

    >>> encode(7)
    b'I\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x017'
    >>> encode(("7",)) != encode((7,)) != encode((b"7",))
    True
    """
    if value is None:
        return _NONE
    if isinstance(value, bool):
        raise TypeError("booleans are not encodable: use 0 and 1")
    if isinstance(value, int):
        return _tagged(_INT, str(value).encode("ascii"))
    if isinstance(value, str):
        return _tagged(_STR, value.encode("utf-8"))
    if isinstance(value, bytes):
        return _tagged(_BYTES, value)
    if isinstance(value, tuple):
        return _TUPLE + len(value).to_bytes(_LEN, "big") + b"".join(encode(v) for v in value)
    raise TypeError(f"cannot encode {type(value).__name__}")


def decode(data: bytes) -> Encodable:
    """The value ``encode`` turned into ``data``; raises ValueError on anything else.

    >>> decode(encode((b"x", -3, None)))
    (b'x', -3, None)
    """
    value, end = _decode_at(data, 0)
    if end != len(data):
        raise ValueError(f"{len(data) - end} trailing byte(s)")
    return value


def encode_extra_key(key: ExtraKey) -> tuple[Encodable, ...]:
    """An extra key as a tuple whose first element names its kind.

    >>> encode_extra_key(SaltKey("s")), encode_extra_key(LoraKey("s"))
    (('cache_salt', 's'), ('lora', 's', ''))
    >>> encode_extra_key(PromptEmbedsKey((b"e1", b"e2")))
    ('prompt_embeds', (b'e1', b'e2'))
    """
    if isinstance(key, LoraKey):
        return ("lora", key.name, key.path)
    if isinstance(key, MultiModalKey):
        return ("mm", key.identifier, key.offset)
    if isinstance(key, PromptEmbedsKey):
        return ("prompt_embeds", key.embeddings)
    return ("cache_salt", key.salt)


# --------------------------------------------------------------------------
# Chained block hashes
# --------------------------------------------------------------------------

DEFAULT_SEED = "kvpool-none-hash"
_DOMAIN = "kvpool-block-hash/v1"


def none_hash(seed: str = DEFAULT_SEED) -> BlockHash:
    """The value the first block of every request chains from.

    Complexity: O(len(seed)).

    >>> none_hash() == none_hash(DEFAULT_SEED) != none_hash("other")
    True
    """
    return hashlib.sha256(encode(("kvpool-none-hash/v1", seed))).digest()


NONE_HASH: BlockHash = none_hash()


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] = (),
    *,
    seed_hash: BlockHash = NONE_HASH,
) -> BlockHash:
    """The hash of a block given its parent's hash (None for the first block).

    The SHA-256 of the canonical encoding of (domain, parent or
    ``seed_hash``, tokens, tagged extra keys). It depends on exactly the
    prefix's tokens and extra keys, through the chain of parents.

    Complexity: O(len(token_ids) + len(extra_keys)).

    >>> h = hash_block_tokens(None, [1, 2])
    >>> len(h), h == hash_block_tokens(None, (1, 2)), h == hash_block_tokens(h, [1, 2])
    (32, True, False)
    """
    return hashlib.sha256(
        block_preimage(parent_block_hash, token_ids, extra_keys, seed_hash=seed_hash)
    ).digest()


def block_preimage(
    parent_block_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] = (),
    *,
    seed_hash: BlockHash = NONE_HASH,
) -> bytes:
    """The bytes ``hash_block_tokens`` hashes: the canonical encoding of the block's value.

    Complexity: O(len(token_ids) + len(extra_keys)).

    >>> block_preimage(None, [1])[:1]
    b'T'
    """
    parent = seed_hash if parent_block_hash is None else parent_block_hash
    payload = (
        _DOMAIN,
        parent,
        tuple(int(t) for t in token_ids),
        tuple(encode_extra_key(k) for k in extra_keys),
    )
    return encode(payload)


def block_extra_keys(
    start: int,
    end: int,
    lora: LoraAdapter | None = None,
    mm_inputs: Sequence[MultiModalInput] = (),
    cache_salt: str | None = None,
    prompt_embeds: Sequence[bytes] = (),
) -> tuple[ExtraKey, ...]:
    """The extra keys of the hash block covering tokens ``[start, end)``.

    In this order: the LoRA adapter (every block); each multimodal input
    overlapping the block, in input order, with its offset relative to
    ``start``; the cache salt (the block starting at token 0 only, and only a
    non-empty salt); the prompt embeddings of the block's positions (every
    block of a request that has them, empty past the prompt).

    Complexity: O(len(mm_inputs) + end - start).

    >>> block_extra_keys(0, 4, cache_salt="s", mm_inputs=[MultiModalInput("img", 2, 5)])
    (MultiModalKey(identifier='img', offset=2), SaltKey(salt='s'))
    >>> block_extra_keys(4, 8, mm_inputs=[MultiModalInput("img", 2, 5)])
    (MultiModalKey(identifier='img', offset=-2),)
    """
    keys: list[ExtraKey] = []
    if lora is not None:
        keys.append(LoraKey(lora.name, lora.path))
    keys.extend(
        MultiModalKey(m.identifier, m.offset - start)
        for m in mm_inputs
        if m.offset < end and m.offset + m.length > start
    )
    if start == 0 and cache_salt:
        keys.append(SaltKey(cache_salt))
    if prompt_embeds:
        keys.append(PromptEmbedsKey(tuple(prompt_embeds[start:end])))
    return tuple(keys)


def extend_block_hashes(
    block_hashes: Sequence[BlockHash],
    token_ids: Sequence[int],
    hash_block_size: int,
    lora: LoraAdapter | None = None,
    mm_inputs: Sequence[MultiModalInput] = (),
    cache_salt: str | None = None,
    *,
    seed_hash: BlockHash = NONE_HASH,
    prompt_embeds: Sequence[bytes] = (),
) -> tuple[BlockHash, ...]:
    """The request hasher: ``block_hashes`` extended over every new *full* hash block.

    ``block_hashes`` are the hashes already computed for the first blocks of
    ``token_ids``; a trailing partial block is not hashed until tokens are
    appended to fill it. Extending step by step gives the same hashes as
    hashing all tokens at once.

    Complexity: O(number of new hash blocks * (hash_block_size + len(mm_inputs))).

    >>> hs = extend_block_hashes((), [1, 2, 3], 2)
    >>> len(hs), extend_block_hashes(hs, [1, 2, 3, 4], 2)[0] == hs[0]
    (1, True)
    """
    # Verify that a hash block holds at least one token
    if hash_block_size < 1:
        raise InvalidHashBlockSize(f"hash_block_size must be at least 1, got {hash_block_size}")
    # Verify that the multimodal inputs are in order, disjoint and non-empty
    verify_mm_inputs(mm_inputs)
    # Verify that prompt embeddings are bytes and cover no more than the tokens
    verify_prompt_embeds(prompt_embeds, len(token_ids))
    # Verify that the hashes already computed cover whole blocks of these tokens
    if len(block_hashes) * hash_block_size > len(token_ids):
        raise InvalidBlockHashes(
            f"{len(block_hashes)} hashes of {hash_block_size} tokens exceed {len(token_ids)} tokens"
        )

    hashes = list(block_hashes)
    parent = hashes[-1] if hashes else None
    start = len(hashes) * hash_block_size
    while start + hash_block_size <= len(token_ids):
        end = start + hash_block_size
        extra = block_extra_keys(start, end, lora, mm_inputs, cache_salt, prompt_embeds)
        parent = hash_block_tokens(parent, token_ids[start:end], extra, seed_hash=seed_hash)
        hashes.append(parent)
        start = end
    return tuple(hashes)


def verify_mm_inputs(mm_inputs: Sequence[MultiModalInput]) -> None:
    """Raise InvalidMultiModalInputs unless the inputs are sorted, disjoint and non-empty.

    >>> verify_mm_inputs([MultiModalInput("a", 0, 2), MultiModalInput("b", 2, 1)])
    """
    previous_end = 0
    for m in mm_inputs:
        if m.offset < 0 or m.length < 1:
            raise InvalidMultiModalInputs(f"{m} has a negative offset or no length")
        if m.offset < previous_end:
            raise InvalidMultiModalInputs(f"{m} overlaps or precedes the input before it")
        previous_end = m.offset + m.length


def verify_prompt_embeds(prompt_embeds: Sequence[bytes], num_tokens: int) -> None:
    """Raise InvalidPromptEmbeds unless there is one bytes value per position, at most.

    >>> verify_prompt_embeds([b"e1", b"e2"], 3)
    """
    if len(prompt_embeds) > num_tokens or not all(isinstance(e, bytes) for e in prompt_embeds):
        raise InvalidPromptEmbeds(
            f"{len(prompt_embeds)} prompt embeddings for {num_tokens} tokens, each must be bytes"
        )


# --------------------------------------------------------------------------
# Helpers (not operations)
# --------------------------------------------------------------------------


def _decode_at(data: bytes, at: int) -> tuple[Encodable, int]:
    tag = data[at : at + 1]
    if tag == _NONE:
        return None, at + 1
    if tag not in (_INT, _STR, _BYTES, _TUPLE):
        raise ValueError(f"unknown tag {tag!r} at byte {at}")
    if at + 1 + _LEN > len(data):
        raise ValueError("truncated length")
    n = int.from_bytes(data[at + 1 : at + 1 + _LEN], "big")
    at += 1 + _LEN
    if tag == _TUPLE:
        items: list[Encodable] = []
        for _ in range(n):
            item, at = _decode_at(data, at)
            items.append(item)
        return tuple(items), at
    if at + n > len(data):
        raise ValueError("truncated payload")
    payload = data[at : at + n]
    if tag == _BYTES:
        return payload, at + n
    if tag == _STR:
        return payload.decode("utf-8"), at + n
    text = payload.decode("ascii")
    value = int(text)
    if str(value) != text:
        raise ValueError(f"non-canonical integer {text!r}")
    return value, at + n
