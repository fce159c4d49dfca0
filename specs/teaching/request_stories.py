"""The built-in request-layer scenarios: how a KV cache manager treats requests.

Each story is data (``request_scenarios``): a manager layout and steps, each
with one sentence. Tokens are letters and hashes cover two tokens, so a
block of two tokens holds, and is named by, a prefix such as ``ABCD``.
``kvpool explain NAME`` tells a story in a terminal or as HTML; the docs
build draws every picture of the request-layer pages from them.

>>> from kvpool.specs.teaching.request_scenarios import run
>>> outcome = list(run(get("hit-stops-one-short")))[3]
>>> outcome.step.op, outcome.result["num_tokens"]
('get_computed_blocks', 2)
"""

from kvpool.model.single_type import chunked_local, full_attention, mamba, sliding_window
from kvpool.specs.teaching.request_scenarios import (
    RequestScenario,
    allocate,
    arrive,
    computed,
    finish,
    lookup,
    preempt,
    setup,
)
from kvpool.specs.teaching.scenarios import ScenarioError, Step

FULL = full_attention(2)
WINDOW = sliding_window(2, 4)
CHUNKED = chunked_local(2, 4)

HASH_CHAIN = RequestScenario(
    name="hash-chain",
    title="What goes into a block hash, and what a request can share",
    summary=(
        "A block's hash covers its parent's hash, its own tokens and the request's extra "
        "keys (LoRA, image, cache salt), so a hit on block i means the whole prefix up to "
        "block i is the same. Six requests with the prompt ABCDE, or nearly, look up what "
        "the first one left in the cache."
    ),
    setup=setup(12, [FULL]),
    steps=(
        arrive(
            "a",
            "ABCDE",
            "Request a arrives with the prompt ABCDE. Its two full hash blocks are hashed, "
            "AB from the root value NONE_HASH and ABCD from AB; the lone E waits for a partner.",
        ),
        allocate(
            "a",
            5,
            "a is computed: its two full blocks are cached under AB and ABCD. The block "
            "holding E is not full and gets no hash.",
        ),
        finish("a", "a finishes. Its cached blocks stay in the free queue, hashes intact."),
        arrive(
            "b",
            "ABCDE",
            "Request b has the same tokens and a cache salt s. The salt goes into the first "
            "block's hash, and through the chain into every later one.",
            cache_salt="s",
        ),
        lookup("b", "So b finds nothing: a salt keeps requests from sharing any block."),
        arrive(
            "c",
            "ABCDE",
            "Request c runs with a LoRA adapter. The adapter's name and path go into every "
            "block's hash.",
            lora={"id": 1, "name": "sql", "path": "/lora/sql"},
        ),
        lookup("c", "c misses too: KV computed under another adapter is other KV."),
        arrive(
            "d",
            "ABCDE",
            "Request d carries an image in positions 2 and 3. Its identifier (a hash of the "
            "image) and offset go into the hash of the block it overlaps, ABCD.",
            mm_inputs=[{"identifier": "cat", "offset": 2, "length": 2}],
        ),
        lookup("d", "d shares AB with a, and nothing from the image on."),
        arrive(
            "e",
            "ABXDE",
            "Request e differs from a in its third token only.",
        ),
        lookup(
            "e",
            "e hits AB and misses ABXD: one changed token changes its block and every later one.",
        ),
        arrive("f", "ABCDE", "Request f is a's twin."),
        lookup("f", "f hits both of a's blocks: four tokens of five, the last is computed anyway."),
    ),
)

HIT_STOPS_ONE_SHORT = RequestScenario(
    name="hit-stops-one-short",
    title="A full-prompt hit stops one token short",
    summary=(
        "The last token of a prompt is always computed, because its logits pick the first "
        "output token. A hit covers whole blocks, so a prompt whose blocks are all cached "
        "recomputes its whole last block, and caches it a second time."
    ),
    setup=setup(10, [FULL], enable_events=True),
    steps=(
        arrive("a", "ABCD", "Request a has the prompt ABCD: two full blocks."),
        allocate("a", 4, "a is computed and both blocks are cached, AB and ABCD."),
        arrive("b", "ABCD", "Request b has the same prompt."),
        lookup(
            "b",
            "b may hit at most 3 tokens (its length minus one). ABCD covers 4, so only AB "
            "hits: 2 tokens.",
        ),
        allocate(
            "b",
            2,
            "b takes AB and computes CD into a new block of its own, which is cached under "
            "ABCD beside a's block: a duplicate.",
            hit=True,
        ),
        arrive("c", "ABCDE", "Request c has one token more."),
        lookup(
            "c",
            "c may hit 4 tokens, and does: AB and ABCD, the older copy answering for ABCD.",
        ),
        Step(
            "take_events",
            {},
            "Two BlockStored events name ABCD: a router counting copies sees two.",
        ),
    ),
)

SLIDING_WINDOW_HIT = RequestScenario(
    name="sliding-window-hit",
    title="A sliding-window hit searches from the right",
    summary=(
        "A token of a sliding-window layer reads only the last few tokens, so a hit needs "
        "only enough cached blocks to fill one window, at the end of the prefix. The "
        "search runs right to left and stops at the first run long enough; earlier blocks "
        "are skipped (the null block stands in) even if they are gone from the cache."
    ),
    setup=setup(12, [WINDOW]),
    steps=(
        arrive(
            "a", "ABCDEFGHIJ", "Request a has ten tokens: five blocks. Its layers see 4 tokens."
        ),
        allocate("a", 10, "a is computed in one chunk; all five blocks are cached."),
        finish("a", "a finishes; its blocks wait in the free queue, cached."),
        Step(
            "evict_blocks",
            {"block_ids": [2]},
            "The block holding ABCD is evicted (say, by an operator). Full attention would "
            "now hit only AB.",
        ),
        arrive("b", "ABCDEFGHIJK", "Request b extends a's prompt by one token."),
        lookup(
            "b",
            "The search starts at the right: ABCDEFGHIJ and ABCDEFGH are cached, two "
            "contiguous blocks cover a window of 4 tokens, so it stops there. 10 tokens hit.",
        ),
        allocate(
            "b",
            1,
            "b takes the two blocks; null blocks stand for the three it will never read.",
            hit=True,
        ),
    ),
)

CHUNKED_LOCAL_HIT = RequestScenario(
    name="chunked-local-hit",
    title="Chunked local attention: earlier chunks count as computed",
    summary=(
        "A token of a chunked-local layer reads only its own chunk of tokens. Blocks of "
        "earlier chunks are never read again, so a hit counts them as computed (null "
        "blocks) and looks up only the blocks of the current chunk."
    ),
    setup=setup(12, [CHUNKED]),
    steps=(
        arrive("a", "ABCDEFGHIJ", "Request a has ten tokens; chunks are 4 tokens, blocks 2."),
        allocate("a", 10, "a is computed; its five blocks are cached."),
        finish("a", "a finishes."),
        arrive("b", "ABCDEFGHIJK", "Request b extends a by one token."),
        lookup(
            "b",
            "b may hit 10 tokens. Tokens 0 to 7 are in earlier chunks: four null blocks. "
            "Only IJ, in the current chunk, is looked up, and hits: 10 tokens.",
        ),
        arrive("c", "ABCDEFGHX", "Request c shares a's first 8 tokens, then differs."),
        lookup(
            "c",
            "c may hit 8 tokens, exactly two chunks: every block is in an earlier chunk, so "
            "the hit is four null blocks and no cached block at all.",
        ),
        allocate(
            "c",
            1,
            "c computes only X, in a block of its own; its table starts with four nulls.",
            hit=True,
        ),
    ),
)

MAMBA_STATE = RequestScenario(
    name="mamba-state",
    title="Mamba keeps one state block, and never a hit",
    summary=(
        "A Mamba layer keeps a running state, not one KV entry per token: one block per "
        "request holds it. The state after token n is not the KV of tokens 0..n, so the "
        "model never caches it and never serves a hit (vLLM 0.33's state caching is not "
        "modelled)."
    ),
    setup=setup(6, [mamba(16)], max_model_len=16),
    steps=(
        arrive("a", "ABCD", "Request a has four tokens; the Mamba block holds 16."),
        allocate("a", 4, "a gets one block, which will hold its state. Nothing is cached."),
        computed("a", 4, "a has computed its prompt and samples E.", sampled="E"),
        allocate("a", 1, "Decoding E needs no new block: the state block holds everything."),
        finish("a", "a finishes: its block has no hash and goes to the front of the queue."),
        arrive("b", "ABCD", "Request b has a's prompt."),
        lookup("b", "Nothing hits: a Mamba group has no prefix to share."),
    ),
)

HYBRID_HIT = RequestScenario(
    name="hybrid-hit",
    title="A hybrid model hits only what every group has",
    summary=(
        "With a full-attention group and a sliding-window group, a prefix is a hit only if "
        "each group can serve it. The manager asks each attention type in turn, full "
        "attention first, each one only ever shortening the candidate length, until no "
        "type shortens it."
    ),
    setup=setup(18, [FULL, WINDOW]),
    steps=(
        arrive("a", "ABCDEFGHIJ", "Request a has ten tokens: five blocks in each group."),
        allocate(
            "a",
            10,
            "a is computed. Each group has its own blocks, cached under the same hashes with "
            "its own group id: g0 and g1.",
        ),
        finish("a", "a finishes; both groups' blocks stay cached."),
        Step(
            "evict_blocks",
            {"block_ids": [9]},
            "The sliding-window group's copy of ABCDEFGH is evicted. Full attention still "
            "has all five blocks.",
        ),
        arrive("b", "ABCDEFGHIJK", "Request b extends a by one token."),
        lookup(
            "b",
            "Full attention offers 10 tokens. The window, searching right to left within "
            "10, misses ABCDEFGH and settles on ABCD and ABCDEF: 6 tokens. Full attention is "
            "cut to 6, the window confirms 6: the hit is 6 tokens in both groups.",
        ),
        allocate("b", 5, "b takes the hit in both groups and computes the rest.", hit=True),
    ),
)

ADMISSION = RequestScenario(
    name="admission",
    title="allocate_slots counts, then admits or refuses",
    summary=(
        "Before it changes anything, allocate_slots counts the free blocks a call needs: "
        "new blocks for the slots the request lacks, plus every hit block that is free now, "
        "because touching it takes it out of the free queue. Short of that, it returns None "
        "and changes nothing."
    ),
    setup=setup(8, [FULL], max_model_len=16),
    steps=(
        arrive("a", "ABCDEF", "Request a has six tokens."),
        allocate("a", 6, "a is computed into blocks 1, 2 and 3, all cached."),
        finish("a", "a finishes: seven blocks are free, three of them cached."),
        arrive("x", "UVWXYZ", "Request x, unrelated, arrives."),
        allocate("x", 4, "x's first chunk of 4 tokens takes blocks 4 and 5: five blocks free."),
        arrive("b", "ABCDEFGHIJKL", "Request b has twelve tokens and starts with a's prompt."),
        lookup("b", "b hits a's three blocks: 6 tokens. All three are free (eviction candidates)."),
        allocate(
            "b",
            6,
            "b asks for all 12 slots: 3 new blocks plus 3 free hit blocks to touch makes 6, "
            "and only 5 are free. Refused: None, and nothing changed.",
            hit=True,
        ),
        allocate(
            "b",
            2,
            "A smaller chunk of 2 tokens needs 1 new block plus the 3 hits: 4, admitted. The "
            "hits leave the free queue before the new block is taken from its front.",
            hit=True,
        ),
    ),
)

WINDOW_SLIDES = RequestScenario(
    name="window-slides",
    title="A sliding window frees blocks behind it, even when allocate_slots refuses",
    summary=(
        "Before it counts, allocate_slots releases the blocks no future token of the "
        "request can see (for a sliding window, the blocks wholly before the window) and "
        "puts the null block in their place. That release stands even if the call is then "
        "refused: it is the one change a refusal leaves."
    ),
    setup=setup(5, [WINDOW], max_model_len=16),
    steps=(
        arrive("a", "ABCDEF", "Request a has six tokens; its layers see 4 tokens."),
        allocate("a", 6, "a's prompt takes blocks 1, 2 and 3, all cached; block 4 is free."),
        computed("a", 6, "a has computed its prompt and samples G.", sampled="G"),
        allocate(
            "a",
            1,
            "To decode G the window covers tokens 3 to 6: block 1 (AB) is out of sight. It is "
            "released and nulled; then G gets a new block.",
        ),
        computed("a", 7, "a has computed G and samples H.", sampled="H"),
        allocate(
            "a",
            1,
            "Decoding H with 6 look-ahead slots for draft tokens needs 3 new blocks. Block 2 "
            "(ABCD) leaves the window and is released first, but that makes only 2 free: "
            "refused, with the release kept.",
            num_lookahead_tokens=6,
        ),
    ),
)

FREE_ORDER = RequestScenario(
    name="free-order",
    title="A finished request is freed group by group, last block first",
    summary=(
        "free releases each group's blocks in reverse: the tail of a prompt, which fewer "
        "future requests share, goes back to the free queue before its head. Hash-less "
        "blocks go to the front, to be reused first; cached ones to the back, group 0's "
        "before group 1's."
    ),
    setup=setup(12, [FULL, WINDOW]),
    steps=(
        arrive("a", "ABCDEFG", "Request a has seven tokens: three full blocks and G."),
        allocate(
            "a",
            7,
            "a takes four blocks per group; the three full ones of each group are cached.",
        ),
        finish(
            "a",
            "a finishes. Group 0's blocks are freed last first (4, 3, 2, 1), then group 1's "
            "(8, 7, 6, 5): hash-less 4 and then 8 to the front, the cached ones to the back "
            "in that order.",
        ),
        arrive("x", "UVWXYZ", "Request x, unrelated, needs six blocks: three per group."),
        allocate(
            "x",
            6,
            "They come from the front: hash-less 8 and 4 first, then the never-used 9, 10 "
            "and 11, and only then a cached block, ABCDEF in group 0, the tail of a's prompt.",
        ),
    ),
)

PREEMPT_RESUME = RequestScenario(
    name="preempt-resume",
    title="A preempted request finds its own blocks in the cache",
    summary=(
        "Preemption frees a running request's blocks and forgets what it computed. Its "
        "full blocks stay cached, so when it is admitted again it hits its own prefix, "
        "generated tokens included, and recomputes only the rest."
    ),
    setup=setup(10, [FULL]),
    steps=(
        arrive("a", "ABCDEFG", "Request a has seven tokens."),
        allocate(
            "a", 7, "a is computed: AB, ABCD and ABCDEF are cached, G has a block of its own."
        ),
        computed("a", 7, "a has computed its prompt and samples H.", sampled="H"),
        preempt(
            "a",
            "Memory is short: a is preempted. Its blocks are freed, last first, and it will "
            "start again from token 0.",
        ),
        lookup(
            "a",
            "Looked up again, a (now 8 tokens) hits its own three cached blocks: 6 tokens.",
        ),
        allocate(
            "a",
            2,
            "It takes them back out of the free queue and recomputes only G and H.",
            hit=True,
        ),
    ),
)

REQUEST_LIFE = RequestScenario(
    name="request-life",
    title="A request's life, from arrival to free",
    summary=(
        "Request a arrives, misses, is admitted, computes its prompt and decodes; request b "
        "shares a's prefix; then both finish, and the order of their frees decides what "
        "the cache keeps longest."
    ),
    setup=setup(8, [FULL], max_model_len=16),
    steps=(
        arrive(
            "a",
            "ABCDEF",
            "Request a arrives with six tokens. Its three full hash blocks are hashed, each "
            "from the one before: AB, ABCD, ABCDEF.",
        ),
        lookup("a", "The scheduler looks a up. The cache is empty: a miss, 0 tokens."),
        allocate(
            "a",
            6,
            "a is admitted: allocate_slots gives it three blocks from the front of the free "
            "queue and caches all three, since they will be full once this step runs.",
        ),
        computed(
            "a",
            6,
            "The model runs: a's six tokens are computed and it samples G, its first output token.",
            sampled="G",
        ),
        allocate(
            "a",
            1,
            "To decode G, a needs a seventh slot: a fourth block, 4. It holds one token, so "
            "it gets no hash.",
        ),
        arrive(
            "b",
            "ABCDXY",
            "Request b arrives. Its first two hashes equal a's (same tokens, same parents); "
            "the third differs.",
        ),
        lookup("b", "b hits AB and ABCD: blocks 1 and 2, 4 tokens."),
        allocate(
            "b",
            2,
            "b is admitted: it touches blocks 1 and 2 (now held twice) and computes XY into "
            "a block of its own, 5, cached as ABCDXY.",
            hit=True,
        ),
        finish(
            "a",
            "a finishes. Its blocks are freed last first: 4 has no hash and goes to the "
            "front, 3 (ABCDEF) to the back; 2 and 1 stay, b still holds them.",
        ),
        finish(
            "b",
            "b finishes: 5, 2 and 1 are cached and go to the back in that order. Every block "
            "is free, every prefix still cached, the shared head evicted last.",
        ),
    ),
)

BUILT_IN: dict[str, RequestScenario] = {
    s.name: s
    for s in (
        REQUEST_LIFE,
        HASH_CHAIN,
        HIT_STOPS_ONE_SHORT,
        SLIDING_WINDOW_HIT,
        CHUNKED_LOCAL_HIT,
        MAMBA_STATE,
        HYBRID_HIT,
        ADMISSION,
        WINDOW_SLIDES,
        FREE_ORDER,
        PREEMPT_RESUME,
    )
}
"""Every built-in request-layer scenario by name, the tutorial's first."""


def get(name: str) -> RequestScenario:
    """A built-in request scenario by name; ScenarioError lists the names if there is none."""
    try:
        return BUILT_IN[name]
    except KeyError:
        raise ScenarioError(
            f"no built-in request scenario {name!r}; built-in: {', '.join(BUILT_IN)}"
        ) from None
