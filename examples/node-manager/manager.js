#!/usr/bin/env node
// A KV cache manager (kvpool's request layer) in plain Node.js, speaking the
// request layer's JSON-lines protocol (docs/formats.md) on stdin/stdout. It is
// the reference for checking a manager written in a language other than Python:
//
//   kvpool check --layer request --target "cmd:node examples/node-manager/manager.js" --level 2
//
// Semantics: kvpool.model.manager and kvpool.model.single_type (full attention,
// sliding window, chunked local attention, Mamba, hybrids of several groups),
// over the block pool of examples/node-pool/pool.js. It hashes every request
// itself from its token ids and extra keys (kvpool.model.hashing: SHA-256 of a
// tagged canonical encoding), so it also answers the hasher's operations and
// replays the hash vectors. No npm packages.

"use strict";

const crypto = require("crypto");
const path = require("path");
const readline = require("readline");
const { BlockPool, PoolError, PROFILES, NULL_BLOCK_ID } = require(
  path.join(__dirname, "..", "node-pool", "pool.js"),
);

const PROTOCOL_VERSION = 1;

// ------------------------------------------------------------------ hashing
// The canonical encoding of kvpool.model.hashing.encode: a type tag, an 8-byte
// big-endian length (or element count for tuples), the payload.

function tagged(tag, payload) {
  const length = Buffer.alloc(8);
  length.writeBigUInt64BE(BigInt(payload.length));
  return Buffer.concat([Buffer.from(tag), length, payload]);
}
const encInt = (n) => tagged("I", Buffer.from(String(n), "ascii"));
const encStr = (s) => tagged("S", Buffer.from(s, "utf8"));
const encBytes = (b) => tagged("B", b);
function encTuple(items) {
  const count = Buffer.alloc(8);
  count.writeBigUInt64BE(BigInt(items.length));
  return Buffer.concat([Buffer.from("T"), count, ...items]);
}
const sha256 = (data) => crypto.createHash("sha256").update(data).digest();
const hex = (buffer) => buffer.toString("hex");

function noneHash(seed) {
  return sha256(encTuple([encStr("kvpool-none-hash/v1"), encStr(seed)]));
}

// The extra keys of the hash block [start, end): LoRA, overlapping multimodal
// inputs (offset relative to start), the salt (first block only), the prompt
// embeddings of the block (every block of a request that has them).
function extraKeys(request, start, end) {
  const keys = [];
  if (request.lora !== null) {
    keys.push(encTuple([encStr("lora"), encStr(request.lora.name), encStr(request.lora.path)]));
  }
  for (const m of request.mm_inputs) {
    if (m.offset < end && m.offset + m.length > start) {
      keys.push(encTuple([encStr("mm"), encStr(m.identifier), encInt(m.offset - start)]));
    }
  }
  if (start === 0 && request.cache_salt) {
    keys.push(encTuple([encStr("cache_salt"), encStr(request.cache_salt)]));
  }
  if (request.prompt_embeds.length > 0) {
    const slice = request.prompt_embeds.slice(start, end).map((e) => encBytes(Buffer.from(e, "hex")));
    keys.push(encTuple([encStr("prompt_embeds"), encTuple(slice)]));
  }
  return keys;
}

// Every full hash block of the request, chained from its seed hash.
function blockHashes(request) {
  const hbs = request.hash_block_size;
  const tokens = [...request.prompt_token_ids, ...request.output_token_ids];
  // Verify that a hash block holds at least one token
  if (!(hbs >= 1)) throw new PoolError("InvalidHashBlockSize", `hash_block_size ${hbs}`);
  // Verify that the multimodal inputs are in order, disjoint and non-empty
  let previousEnd = 0;
  for (const m of request.mm_inputs) {
    if (m.offset < 0 || m.length < 1 || m.offset < previousEnd) {
      throw new PoolError("InvalidMultiModalInputs", `multimodal input ${m.identifier}`);
    }
    previousEnd = m.offset + m.length;
  }
  // Verify that prompt embeddings cover no more than the tokens
  if (request.prompt_embeds.length > tokens.length) {
    throw new PoolError("InvalidPromptEmbeds", "more prompt embeddings than tokens");
  }
  const hashes = [];
  let parent = Buffer.from(request.seed_hash, "hex");
  for (let start = 0; start + hbs <= tokens.length; start += hbs) {
    const payload = encTuple([
      encStr("kvpool-block-hash/v1"),
      encBytes(parent),
      encTuple(tokens.slice(start, start + hbs).map(encInt)),
      encTuple(extraKeys(request, start, start + hbs)),
    ]);
    parent = sha256(payload);
    hashes.push(hex(parent));
  }
  return hashes;
}

// ------------------------------------------------------------------ manager

const cdiv = (a, b) => -Math.floor(-a / b);
const gcd = (a, b) => (b === 0 ? a : gcd(b, a % b));
// The longest multiple of `alignment` within `n` tokens (hits of several groups end there).
const alignDown = (n, alignment) => n - (n % alignment);

class KVCacheManager {
  constructor(setup) {
    const { specs, max_model_len, use_eagle } = setup;
    // Verify that requests can hold at least one token
    if (!(max_model_len >= 1)) throw new PoolError("InvalidManagerConfig", "max_model_len");
    // Verify that there is at least one group
    if (specs.length === 0) throw new PoolError("InvalidManagerConfig", "no group");
    // Verify that context parallelism is not asked for (this example does not model it)
    if ((setup.dcp_world_size ?? 1) !== 1 || (setup.pcp_world_size ?? 1) !== 1) {
      throw new PoolError("InvalidManagerConfig", "context parallelism is not modelled here");
    }
    // Verify that a Mamba block holds a whole request
    for (const spec of specs) {
      if (spec.attention === "mamba" && spec.block_size < max_model_len) {
        throw new PoolError("InvalidManagerConfig", "a Mamba block must hold a whole request");
      }
    }
    // Verify that EAGLE runs with a single full-attention or sliding-window group
    if (use_eagle && (specs.length !== 1 || !["full", "sliding_window"].includes(specs[0].attention))) {
      throw new PoolError("InvalidManagerConfig", "EAGLE needs one full or sliding-window group");
    }
    try {
      this.pool = new BlockPool(setup);
    } catch (error) {
      if (error instanceof PoolError) throw new PoolError("InvalidManagerConfig", error.message);
      throw error;
    }
    const hbs = setup.hash_block_size;
    for (const spec of specs) {
      // Verify that each block size is a positive multiple of the hash block size
      if (spec.block_size < hbs || spec.block_size % hbs !== 0) {
        throw new PoolError("InvalidManagerConfig", `block_size ${spec.block_size}`);
      }
      // Verify that windows and chunks are positive
      if (spec.attention === "sliding_window" && spec.sliding_window < 1) {
        throw new PoolError("InvalidManagerConfig", "sliding_window must be positive");
      }
      if (spec.attention === "chunked_local" && spec.attention_chunk_size < 1) {
        throw new PoolError("InvalidManagerConfig", "attention_chunk_size must be positive");
      }
    }
    // Hits of several groups end on multiples of the scheduler block size (by default the
    // least common multiple of the block sizes; kvpool.model.geometry)
    const scheduler =
      setup.scheduler_block_size ?? specs.reduce((m, s) => (m * s.block_size) / gcd(m, s.block_size), 1);
    // Verify that it is a multiple of the hash block size and of every block size
    if (!(scheduler >= 1) || scheduler % hbs !== 0 || specs.some((s) => scheduler % s.block_size !== 0)) {
      throw new PoolError("InvalidManagerConfig", `scheduler_block_size ${scheduler}`);
    }
    // Verify that a chunked-local group beside others has blocks of exactly that size
    if (specs.length > 1 && specs.some((s) => s.attention === "chunked_local" && s.block_size !== scheduler)) {
      throw new PoolError("InvalidManagerConfig", "chunked-local blocks must be the scheduler block");
    }
    this.scheduler = scheduler;
    this.specs = specs;
    this.maxModelLen = max_model_len;
    this.eagle = use_eagle;
    this.caching = setup.enable_caching;
    this.hbs = hbs;
    // Per group: request id -> block ids, request id -> leading blocks cached.
    this.tables = specs.map(() => ({ blocks: new Map(), cached: new Map() }));
    this.stats = setup.log_stats ? KVCacheManager.freshStats() : null;
  }

  static freshStats() {
    return {
      reset: false,
      requests: 0,
      queries: 0,
      hits: 0,
      preempted_requests: 0,
      preempted_queries: 0,
      preempted_hits: 0,
    };
  }

  // Every mutable part, to restore when an operation is rejected half way:
  // a rejected call leaves the manager exactly as it was.
  save() {
    return structuredClone({
      blocks: this.pool.blocks,
      freeQueue: this.pool.freeQueue,
      cached: this.pool.cached,
      pending: this.pool.pending,
      tables: this.tables,
      stats: this.stats,
    });
  }

  restore(saved) {
    this.pool.blocks = saved.blocks;
    this.pool.freeQueue = saved.freeQueue;
    this.pool.cached = saved.cached;
    this.pool.pending = saved.pending;
    this.tables = saved.tables;
    this.stats = saved.stats;
  }

  atomically(operation) {
    const saved = this.save();
    try {
      return operation();
    } catch (error) {
      this.restore(saved);
      throw error;
    }
  }

  // The request as this manager reads it: its own hashes, computed here.
  prepare(request) {
    // Verify that the request is hashed in the pool's hash blocks
    if (request.hash_block_size !== this.hbs) {
      throw new PoolError(
        "HashBlockSizeMismatch",
        `request ${request.request_id} is hashed in blocks of ${request.hash_block_size}`,
      );
    }
    const tokens = [...request.prompt_token_ids, ...request.output_token_ids];
    return { ...request, tokens, hashes: blockHashes(request) };
  }

  hashesAt(hashes, blockSize) {
    const factor = blockSize / this.hbs;
    return hashes.filter((_, i) => (i + 1) % factor === 0);
  }

  cached(hash, groups) {
    return this.pool.get_cached_block({ block_hash: hash, kv_cache_group_ids: groups });
  }

  // ------------------------------------------------------------- hit search

  prefixHit(hashes, start, stop, groups) {
    const hit = [];
    for (let i = start; i < stop; i++) {
      const found = this.cached(hashes[i], groups);
      if (found === null) break;
      hit.push(found);
    }
    return hit;
  }

  slidingWindowHit(spec, hashes, maxBlocks, groups, eagle, alignment) {
    const size = spec.block_size;
    const needed = cdiv(spec.sliding_window - 1, size) + (eagle ? 1 : 0);
    const nulls = groups.map(() => NULL_BLOCK_ID);
    let hit = new Array(maxBlocks).fill(nulls);
    let run = 0;
    let end = null;
    for (let i = maxBlocks - 1; i >= 0; i--) {
      const found = this.cached(hashes[i], groups);
      if (found === null) {
        run = 0;
        continue;
      }
      // a run starts only where the hit (after EAGLE's drop) ends on the alignment
      if (run === 0 && ((eagle ? i : i + 1) * size) % alignment !== 0) continue;
      hit[i] = found;
      run += 1;
      if (run >= needed) {
        end = i + run;
        break;
      }
    }
    hit = end !== null ? hit.slice(0, end) : hit.slice(0, alignDown(run * size, alignment) / size);
    if (eagle && hit.length > 0) {
      hit.pop();
      hit = hit.slice(0, alignDown(hit.length * size, alignment) / size);
    }
    return hit;
  }

  // One hit per group of `groups` (which share `spec`), of at most maxLength tokens, its
  // length a multiple of `alignment` (default: the block size).
  longestHit(spec, hashes, maxLength, groups, eagle, alignment = spec.block_size) {
    const own = this.hashesAt(hashes, spec.block_size);
    const maxBlocks = Math.min(Math.floor(maxLength / spec.block_size), own.length);
    let hit = [];
    if (spec.attention === "full") {
      hit = this.prefixHit(own, 0, maxBlocks, groups);
      if (eagle && hit.length > 0) hit.pop();
      hit = hit.slice(0, alignDown(hit.length * spec.block_size, alignment) / spec.block_size);
    } else if (spec.attention === "sliding_window") {
      hit = this.slidingWindowHit(spec, own, maxBlocks, groups, eagle, alignment);
    } else if (spec.attention === "chunked_local") {
      const chunk = spec.attention_chunk_size;
      const first = Math.min(
        Math.floor((Math.floor(maxLength / chunk) * chunk) / spec.block_size),
        maxBlocks,
      );
      const skipped = new Array(first).fill(groups.map(() => NULL_BLOCK_ID));
      hit = [...skipped, ...this.prefixHit(own, first, maxBlocks, groups)];
    }
    return groups.map((_, g) => hit.map((blocks) => blocks[g]));
  }

  findHit(hashes, maxLength) {
    const specs = this.specs;
    if (specs.length === 1) {
      const [hit] = this.longestHit(specs[0], hashes, maxLength, [0], this.eagle);
      return [[hit], hit.length * specs[0].block_size];
    }
    // Groups of one spec are searched together; full attention first.
    const kinds = [];
    specs.forEach((spec, g) => {
      const known = kinds.find((k) => JSON.stringify(k.spec) === JSON.stringify(spec));
      if (known) known.ids.push(g);
      else kinds.push({ spec, ids: [g] });
    });
    kinds.sort((a, b) => (a.spec.attention === "full" ? 0 : 1) - (b.spec.attention === "full" ? 0 : 1));
    const hits = new Map();
    let length = maxLength;
    for (;;) {
      let candidate = length;
      for (const { spec, ids } of kinds) {
        if (spec.attention === "full" && hits.has(ids[0])) {
          candidate = Math.min(candidate, hits.get(ids[0]).length * spec.block_size);
          continue;
        }
        const found = this.longestHit(spec, hashes, candidate, ids, false, this.scheduler);
        ids.forEach((g, i) => hits.set(g, found[i]));
        candidate = found[0].length * spec.block_size;
      }
      if (candidate >= length) break;
      length = candidate;
    }
    const trimmed = specs.map((s, g) => hits.get(g).slice(0, cdiv(length, s.block_size)));
    return [trimmed, length];
  }

  // ------------------------------------------------------------- operations

  get_computed_blocks({ request }) {
    const r = this.prepare(request);
    const empty = this.specs.map(() => []);
    if (!this.caching || r.skip_reading_prefix_cache) return { blocks: empty, num_tokens: 0 };
    const [blocks, numTokens] = this.findHit(r.hashes, r.tokens.length - 1);
    if (this.stats !== null) {
      const prefix = r.num_preemptions > 0 ? "preempted_" : "";
      this.stats[`${prefix}requests`] += 1;
      this.stats[`${prefix}queries`] += r.tokens.length;
      this.stats[`${prefix}hits`] += numTokens;
    }
    return { blocks, num_tokens: numTokens };
  }

  allocate_slots(args) {
    const r = this.prepare(args.request);
    const rid = r.request_id;
    const groups = this.specs.map((_, g) => g);
    const hits = args.new_computed_blocks ?? groups.map(() => []);
    const numNew = args.num_new_tokens;
    const numNewComputed = args.num_new_computed_tokens;
    const lookahead = args.num_lookahead_tokens;
    // Verify that at least one new token is asked for
    if (numNew <= 0) throw new PoolError("NoNewTokens", `num_new_tokens ${numNew}`);
    // Verify that the other counts are not negative
    if (numNewComputed < 0 || lookahead < 0) throw new PoolError("InvalidTokenCount", "negative");
    // Verify that the hits have one entry per group, of known blocks
    if (hits.length !== this.specs.length) throw new PoolError("InvalidHit", "one list per group");
    for (const groupHits of hits) {
      for (const b of groupHits) {
        if (!(b >= 0 && b < this.pool.numBlocks)) throw new PoolError("UnknownBlock", `block ${b}`);
      }
    }
    const hasHits = hits.some((h) => h.length > 0);
    // Verify that hits come only with prefix caching
    if (hasHits && !this.caching) throw new PoolError("CachingDisabled", "hits without caching");
    // Verify that only a request holding no blocks takes hits
    if (hasHits && groups.some((g) => this.tables[g].blocks.has(rid))) {
      throw new PoolError("HitOnRunningRequest", `request ${rid} already holds blocks`);
    }
    return this.atomically(() => {
      for (const g of groups) this.removeSkippedBlocks(g, rid, r.num_computed_tokens);
      const numComputed = r.num_computed_tokens + numNewComputed;
      const numSlots = Math.min(numComputed + numNew + lookahead, this.maxModelLen);
      let needed = 0;
      for (const g of groups) needed += this.numBlocksToAllocate(g, rid, numSlots, hits[g]);
      if (needed > this.pool.freeQueue.length) return null;
      if (this.caching) for (const groupHits of hits) this.pool.touch({ block_ids: groupHits });
      for (const g of groups) this.saveNewComputedBlocks(g, rid, hits[g]);
      const newBlocks = groups.map((g) => this.allocateNewBlocks(g, rid, numSlots));
      if (this.caching && !args.delay_cache_blocks) {
        const numToCache = this.cacheable(Math.min(numComputed + numNew, r.tokens.length));
        for (const g of groups) this.cacheGroup(g, r, numToCache);
      }
      return newBlocks;
    });
  }

  free({ request }) {
    return this.atomically(() => {
      this.specs.forEach((_, g) => this.freeGroup(g, request.request_id));
      return null;
    });
  }

  cache_blocks({ request, num_computed_tokens }) {
    if (!this.caching) return null;
    return this.atomically(() => {
      this.specs.forEach((_, g) => {
        this.verifyRequest(g, request.request_id);
        this.cacheGroup(g, this.prepare(request), this.cacheable(num_computed_tokens));
      });
      return null;
    });
  }

  evict_blocks({ block_ids }) {
    return this.pool.evict_blocks({ block_ids });
  }

  reset_prefix_cache() {
    const done = this.pool.reset_prefix_cache();
    if (done && this.stats !== null) this.stats.reset = true;
    return done;
  }

  get_num_common_prefix_blocks({ request_id }) {
    return this.specs.map((spec, g) => {
      if (spec.attention !== "full") return 0;
      const table = this.tables[g];
      let count = 0;
      for (const b of table.blocks.get(request_id) ?? []) {
        if (this.pool.blocks[b].refCnt !== table.blocks.size) break;
        count += 1;
      }
      return count;
    });
  }

  get_block_ids({ request_id }) {
    return this.tables.map((t) => t.blocks.get(request_id) ?? []);
  }

  take_events() {
    return this.pool.take_events();
  }

  make_prefix_cache_stats() {
    const stats = this.stats;
    if (stats !== null) this.stats = KVCacheManager.freshStats();
    return stats;
  }

  usage() {
    return this.pool.get_usage();
  }

  num_free_blocks() {
    return this.pool.get_num_free_blocks();
  }

  block_hashes({ request }) {
    return blockHashes(request);
  }

  snapshot() {
    return {
      pool: this.pool.snapshot(),
      groups: this.tables.map((t) =>
        [...t.blocks.keys()].sort().map((rid) => ({
          request_id: rid,
          blocks: t.blocks.get(rid),
          num_cached_blocks: t.cached.get(rid) ?? 0,
        })),
      ),
      stats: this.stats,
    };
  }

  // ------------------------------------------------------ single-type parts

  verifyRequest(g, rid) {
    if (!this.tables[g].blocks.has(rid)) {
      throw new PoolError("UnknownRequest", `request ${rid} holds no blocks in group ${g}`);
    }
  }

  numBlocksToAllocate(g, rid, numTokens, hits) {
    const held = (this.tables[g].blocks.get(rid) ?? []).length;
    const lacking = Math.max(0, cdiv(numTokens, this.specs[g].block_size) - hits.length - held);
    const evictable = hits.filter((b) => b !== NULL_BLOCK_ID && this.pool.blocks[b].refCnt === 0);
    return lacking + evictable.length;
  }

  saveNewComputedBlocks(g, rid, hits) {
    const table = this.tables[g];
    if (table.blocks.has(rid)) return;
    table.blocks.set(rid, [...hits]);
    table.cached.set(rid, hits.length);
  }

  allocateNewBlocks(g, rid, numTokens) {
    const table = this.tables[g];
    const blocks = table.blocks.get(rid);
    const lacking = cdiv(numTokens, this.specs[g].block_size) - blocks.length;
    if (lacking <= 0) return [];
    const fresh = this.pool.get_new_blocks({ num_blocks: lacking });
    table.blocks.set(rid, [...blocks, ...fresh]);
    return fresh;
  }

  // With several groups no hit ends past the last multiple of the scheduler block size.
  cacheable(numTokens) {
    return this.specs.length > 1 ? alignDown(numTokens, this.scheduler) : numTokens;
  }

  // Which of blocks first..stop a sliding-window group caches: within each scheduler-block
  // segment only the run of blocks before its end can serve a hit (null: every block).
  windowMask(spec, first, stop) {
    if (spec.attention !== "sliding_window" || this.scheduler % spec.block_size !== 0) return null;
    const perSegment = this.scheduler / spec.block_size;
    const need = Math.max(1, cdiv(spec.sliding_window - 1, spec.block_size)) + (this.eagle ? 1 : 0);
    if (need >= perSegment) return null;
    const shift = this.eagle ? 1 : 0;
    const mask = [];
    for (let i = first; i < stop; i++) mask.push(i >= shift && (i - shift) % perSegment >= perSegment - need);
    return mask;
  }

  cacheGroup(g, r, numTokens) {
    const spec = this.specs[g];
    const table = this.tables[g];
    if (spec.attention === "mamba") return;
    const numCached = table.cached.get(r.request_id);
    const numHashed = r.hashes.length * this.hbs;
    const numFull = Math.floor(Math.min(numTokens, numHashed) / spec.block_size);
    const request = {
      block_hashes: r.hashes,
      all_token_ids: r.tokens,
      lora_id: r.lora === null ? null : r.lora.lora_id,
      lora_name: r.lora === null ? null : r.lora.name,
    };
    if (numCached < numFull) {
      this.pool.cache_full_blocks({
        request,
        block_ids: table.blocks.get(r.request_id),
        num_cached_blocks: numCached,
        num_full_blocks: numFull,
        block_size: spec.block_size,
        kv_cache_group_id: g,
        block_mask: this.windowMask(spec, numCached, numFull),
      });
      table.cached.set(r.request_id, numFull);
    }
    if (spec.attention === "full" && spec.block_size > this.hbs) {
      this.cachePromptTail(g, r, request, numTokens);
    }
  }

  // The prompt's last hit-able hash boundary, when it falls inside a block whose
  // caching a block-aligned hit could use (kvpool.model.single_type._cache_prompt_tail).
  cachePromptTail(g, r, request, numTokens) {
    const size = this.specs[g].block_size;
    const limit = r.prompt_token_ids.length - (this.eagle ? 0 : 1);
    const boundary = Math.min(Math.floor(limit / this.hbs), r.hashes.length) * this.hbs;
    const cacheable = this.eagle ? numTokens : Math.floor(numTokens / size) * size;
    if (boundary === 0 || boundary > cacheable || boundary % size === 0) return;
    const blocks = this.tables[g].blocks.get(r.request_id);
    const index = Math.floor(boundary / size);
    if (index >= blocks.length) return;
    this.pool.cache_partial_block({
      request,
      block_id: blocks[index],
      num_tokens: boundary,
      kv_cache_group_id: g,
      block_size: size,
    });
  }

  freeGroup(g, rid) {
    const table = this.tables[g];
    if (!table.blocks.has(rid)) return;
    this.pool.free_blocks({ block_ids: [...table.blocks.get(rid)].reverse() });
    table.blocks.delete(rid);
    table.cached.delete(rid);
  }

  removeSkippedBlocks(g, rid, numComputed) {
    const spec = this.specs[g];
    const table = this.tables[g];
    if (!table.blocks.has(rid)) return;
    const blocks = [...table.blocks.get(rid)];
    let firstUseful;
    if (spec.attention === "sliding_window") {
      firstUseful = Math.floor(Math.max(0, numComputed - spec.sliding_window + 1) / spec.block_size);
    } else if (spec.attention === "chunked_local") {
      const chunk = spec.attention_chunk_size;
      // every block of an earlier chunk goes, the last cached one too (vLLM 0.33.0)
      firstUseful = Math.floor((Math.floor(numComputed / chunk) * chunk) / spec.block_size);
    } else {
      return;
    }
    const removed = [];
    for (let i = Math.min(firstUseful, blocks.length) - 1; i >= 0; i--) {
      if (blocks[i] === NULL_BLOCK_ID) break;
      removed.push(blocks[i]);
      blocks[i] = NULL_BLOCK_ID;
    }
    if (removed.length === 0) return;
    this.pool.free_blocks({ block_ids: removed });
    table.blocks.set(rid, blocks);
  }
}

// ------------------------------------------------------------------ protocol

const OPERATIONS = new Set([
  "get_computed_blocks",
  "allocate_slots",
  "free",
  "cache_blocks",
  "evict_blocks",
  "reset_prefix_cache",
  "get_num_common_prefix_blocks",
  "get_block_ids",
  "take_events",
  "make_prefix_cache_stats",
  "usage",
  "num_free_blocks",
  "snapshot",
  "block_hashes",
]);

let manager = null;

function handle(request) {
  const { id, op } = request;
  const args = request.args || {};
  try {
    if (op === "hello") {
      return {
        id,
        ok: {
          protocol: PROTOCOL_VERSION,
          layer: "request",
          name: "node-manager",
          levels: [1, 2],
          profiles: Object.keys(PROFILES),
          snapshot: true,
          hasher: "kvpool",
        },
      };
    }
    if (op === "new_manager") {
      manager = null;
      manager = new KVCacheManager(args);
      return { id, ok: null };
    }
    if (op === "none_hash") return { id, ok: hex(noneHash(args.seed)) };
    if (op === "block_hashes" && manager === null) return { id, ok: blockHashes(args.request) };
    if (!OPERATIONS.has(op)) return { id, error: "ProtocolError", message: `unknown op ${op}` };
    if (manager === null) return { id, error: "ProtocolError", message: `${op} before new_manager` };
    return { id, ok: manager[op](args) };
  } catch (error) {
    if (error instanceof PoolError) return { id, error: error.errorName, message: error.message };
    throw error;
  }
}

// Answer requests from stdin on stdout until stdin closes.
function serve() {
  const lines = readline.createInterface({ input: process.stdin, terminal: false });
  lines.on("line", (line) => {
    if (line.trim() === "") return;
    let request;
    try {
      request = JSON.parse(line);
    } catch (error) {
      process.stdout.write(
        JSON.stringify({ id: null, error: "ProtocolError", message: "not JSON" }) + "\n",
      );
      return;
    }
    process.stdout.write(JSON.stringify(handle(request)) + "\n");
  });
}

module.exports = { KVCacheManager, blockHashes, noneHash, handle, serve };

if (require.main === module) serve();
