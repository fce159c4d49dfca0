"""The hash spec: a block's hash names exactly its whole prefix, extra keys included."""

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.model.errors import (
    InvalidBlockHashes,
    InvalidHashBlockSize,
    InvalidMultiModalInputs,
    InvalidPromptEmbeds,
    InvalidTokenCount,
)
from kvpool.model.hashing import (
    NONE_HASH,
    LoraAdapter,
    LoraKey,
    MultiModalInput,
    MultiModalKey,
    PromptEmbedsKey,
    SaltKey,
    block_extra_keys,
    decode,
    encode,
    extend_block_hashes,
    hash_block_tokens,
    none_hash,
)
from kvpool.model.request import Request, append_tokens, new_request
from kvpool.specs.request.invariants import request_content

# --------------------------------------------------------------------------
# The canonical encoding
# --------------------------------------------------------------------------

values = st.recursive(
    st.none() | st.integers() | st.text(max_size=4) | st.binary(max_size=4),
    lambda inner: st.lists(inner, max_size=3).map(tuple),
    max_leaves=8,
)


@given(values)
def test_decode_inverts_encode(value: object) -> None:
    assert decode(encode(value)) == value  # type: ignore[arg-type]


@given(values, values)
def test_encode_is_injective(a: object, b: object) -> None:
    assert (encode(a) == encode(b)) == (a == b)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "data",
    [b"", b"X", b"I" + (2).to_bytes(8, "big") + b"01", b"I" + (1).to_bytes(8, "big"), b"NN"],
    ids=["empty", "unknown-tag", "non-canonical-int", "truncated", "trailing"],
)
def test_decode_rejects_what_encode_never_produces(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode(data)


def test_booleans_and_other_types_are_not_encodable() -> None:
    with pytest.raises(TypeError):
        encode(True)
    with pytest.raises(TypeError):
        encode(1.5)  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# Block hashes
# --------------------------------------------------------------------------


def test_known_answers_pin_the_encoding() -> None:
    """Changing the encoding changes every cache key: it must be a deliberate decision."""
    assert NONE_HASH.hex() == "ca6c2204e24d7fe293cddac69a0568398482a58fde9dbfaca3492edc13c17d07"
    first = hash_block_tokens(None, [1, 2])
    assert first.hex() == "18eac8cf10724f14dde391529ff7f90cbd977908ac31fe682fb6c5928ac69246"
    assert first == hashlib.sha256(encode(("kvpool-block-hash/v1", NONE_HASH, (1, 2), ()))).digest()
    keyed = hash_block_tokens(
        None, [1, 2], [LoraKey("a", "/a"), MultiModalKey("img", -1), SaltKey("s")]
    )
    assert keyed.hex() == "bff30e1f1bb35fab799898c973909ff7aa5447c58fc61f1de3ddc62bf9b4373e"


def test_the_first_block_chains_from_the_seed() -> None:
    assert hash_block_tokens(None, [5]) == hash_block_tokens(NONE_HASH, [5])
    other = none_hash("another deployment")
    assert hash_block_tokens(None, [5], seed_hash=other) != hash_block_tokens(None, [5])


def test_a_lora_name_never_collides_with_a_salt() -> None:
    """vLLM's untagged tuple of extra keys could not tell these apart; the tags do."""
    tokens = [1, 2, 3]
    as_lora = hash_block_tokens(None, tokens, [LoraKey("tenant", "")])
    as_salt = hash_block_tokens(None, tokens, [SaltKey("tenant")])
    as_image = hash_block_tokens(None, tokens, [MultiModalKey("tenant", 0)])
    assert len({as_lora, as_salt, as_image, hash_block_tokens(None, tokens)}) == 4


def test_extra_keys_of_a_block() -> None:
    image = MultiModalInput("img", 3, 4)  # tokens 3..6
    lora = LoraAdapter(7, "a", "/a")
    assert block_extra_keys(0, 4, lora, [image], "s") == (
        LoraKey("a", "/a"),
        MultiModalKey("img", 3),
        SaltKey("s"),
    )
    assert block_extra_keys(4, 8, None, [image], "s") == (MultiModalKey("img", -1),)
    assert block_extra_keys(7, 8, None, [image]) == ()  # the image ended at token 6
    assert block_extra_keys(0, 3, None, [image]) == ()  # it starts at token 3
    assert block_extra_keys(0, 4, cache_salt="") == ()  # an empty salt is no salt


def test_prompt_embeddings_key_every_block_of_their_request() -> None:
    embeds = (b"e0", b"e1", b"e2")
    assert block_extra_keys(0, 2, cache_salt="s", prompt_embeds=embeds) == (
        SaltKey("s"),
        PromptEmbedsKey((b"e0", b"e1")),
    )
    assert block_extra_keys(2, 4, prompt_embeds=embeds) == (PromptEmbedsKey((b"e2",)),)
    assert block_extra_keys(4, 6, prompt_embeds=embeds) == (PromptEmbedsKey(()),)
    as_tokens = new_request("r", [1, 2, 3, 4], 2)
    as_embeds = new_request("r", [1, 2, 3, 4], 2, prompt_embeds=[b"a", b"b", b"c", b"d"])
    other = new_request("r", [1, 2, 3, 4], 2, prompt_embeds=[b"a", b"b", b"c", b"x"])
    assert as_tokens.block_hashes[0] != as_embeds.block_hashes[0]
    assert as_embeds.block_hashes[0] == other.block_hashes[0]
    assert as_embeds.block_hashes[1] != other.block_hashes[1]
    grown = append_tokens(as_embeds, [5, 6])
    assert grown.block_hashes[:2] == as_embeds.block_hashes and len(grown.block_hashes) == 3


@pytest.mark.parametrize(
    "inputs",
    [
        [MultiModalInput("a", 2, 2), MultiModalInput("b", 3, 1)],
        [MultiModalInput("a", 2, 2), MultiModalInput("b", 0, 1)],
        [MultiModalInput("a", -1, 2)],
        [MultiModalInput("a", 0, 0)],
    ],
    ids=["overlapping", "out-of-order", "negative-offset", "empty"],
)
def test_invalid_multimodal_inputs_are_rejected(inputs: list[MultiModalInput]) -> None:
    with pytest.raises(InvalidMultiModalInputs):
        extend_block_hashes((), [1] * 8, 2, mm_inputs=inputs)


@pytest.mark.parametrize(
    "embeds", [[b"a"], [b"a", b"b", b"c"], ["a", "b"]], ids=["too-few", "too-many", "not-bytes"]
)
def test_invalid_prompt_embeds_are_rejected(embeds: list[bytes]) -> None:
    with pytest.raises(InvalidPromptEmbeds):
        new_request("r", [1, 2], 1, prompt_embeds=embeds)


def test_hasher_preconditions() -> None:
    with pytest.raises(InvalidHashBlockSize):
        extend_block_hashes((), [1, 2], 0)
    with pytest.raises(InvalidBlockHashes):
        extend_block_hashes((b"a", b"b"), [1, 2, 3], 2)
    with pytest.raises(InvalidTokenCount):
        new_request("r", [], 2)


# --------------------------------------------------------------------------
# Properties over whole requests
# --------------------------------------------------------------------------

LORAS = [None, LoraAdapter(1, "a", "/a"), LoraAdapter(2, "b", "/b"), LoraAdapter(3, "a", "/a2")]
SALTS = [None, "", "s", "t"]
IMAGES = {"x": 2, "y": 3}  # an identifier fixes the input's length


@st.composite
def requests(draw: st.DrawFn, hbs: int) -> Request:
    tokens = draw(st.lists(st.integers(1, 2), min_size=1, max_size=12))
    images: list[MultiModalInput] = []
    position = draw(st.integers(0, 3))
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from(sorted(IMAGES)))
        if position + IMAGES[name] > len(tokens):
            break
        images.append(MultiModalInput(name, position, IMAGES[name]))
        position += IMAGES[name] + draw(st.integers(0, 2))
    embeds: list[bytes] = []
    if draw(st.booleans()):
        embeds = draw(
            st.lists(st.sampled_from([b"p", b"q"]), min_size=len(tokens), max_size=len(tokens))
        )
    return new_request(
        "r",
        tokens,
        hbs,
        lora=draw(st.sampled_from(LORAS)),
        mm_inputs=images,
        cache_salt=draw(st.sampled_from(SALTS)),
        prompt_embeds=embeds,
    )


@given(st.data(), st.integers(1, 3))
def test_a_hash_names_exactly_its_whole_prefix(data: st.DataObject, hbs: int) -> None:
    """Hash i of two requests is equal iff their first (i+1)*hbs tokens and keys are equal."""
    a = data.draw(requests(hbs))
    b = data.draw(requests(hbs))
    content_a, content_b = request_content(a), request_content(b)
    for i, (ha, hb) in enumerate(zip(a.block_hashes, b.block_hashes, strict=False)):
        n = (i + 1) * hbs
        assert (ha == hb) == (content_a.prefix(n) == content_b.prefix(n))


@given(st.data(), st.integers(1, 3))
def test_different_salts_or_adapters_never_share_a_block_hash(
    data: st.DataObject, hbs: int
) -> None:
    tokens = data.draw(st.lists(st.integers(1, 2), min_size=hbs, max_size=12))
    salts = data.draw(
        st.lists(st.sampled_from(["s", "t", "u"]), min_size=2, max_size=2, unique=True)
    )
    loras = data.draw(st.lists(st.sampled_from(LORAS[1:]), min_size=2, max_size=2, unique=True))
    by_salt = [set(new_request("r", tokens, hbs, cache_salt=s).block_hashes) for s in salts]
    by_lora = [set(new_request("r", tokens, hbs, lora=lo).block_hashes) for lo in loras]
    assert not by_salt[0] & by_salt[1]
    assert not by_lora[0] & by_lora[1]


@given(
    st.lists(st.integers(1, 2), min_size=1, max_size=6),
    st.lists(st.lists(st.integers(1, 2), max_size=4), max_size=5),
    st.integers(1, 3),
    st.sampled_from(SALTS),
)
def test_hashing_as_tokens_arrive_equals_hashing_at_once(
    prompt: list[int], chunks: list[list[int]], hbs: int, salt: str | None
) -> None:
    lora = LoraAdapter(1, "a")
    request = new_request("r", prompt, hbs, lora=lora, cache_salt=salt)
    for chunk in chunks:
        request = append_tokens(request, chunk)
        assert len(request.block_hashes) == request.num_tokens // hbs  # only full blocks
    at_once = new_request("r", request.all_token_ids, hbs, lora=lora, cache_salt=salt)
    assert request.block_hashes == at_once.block_hashes
