#!/usr/bin/env node
// A v1 KV-cache block pool in plain Node.js, speaking kvpool's JSON-lines
// protocol (docs/formats.md) on stdin/stdout. It is the reference for
// writing a conformance target in a language other than Python:
//
//   kvpool check --target "cmd:node examples/node-pool/pool.js" --level 2
//
// Semantics: kvpool.model (model/pool.py), all three free-order profiles,
// level 1 and level 2 (every rejection the model makes, with the model's
// exception names), and the optional whole-state snapshot. No npm packages.

"use strict";

const readline = require("readline");

const PROTOCOL_VERSION = 1;
const PROFILES = {
  // profile name -> [free order with caching on, free order with caching off]
  "hashless-first": ["hashless-first", "hashless-first"],
  append: ["append", "append"],
  "hashless-first-append-uncached": ["hashless-first", "append"],
};
const NULL_BLOCK_ID = 0;

// A rejection: `name` is the model's exception class (kvpool.model.errors).
class PoolError extends Error {
  constructor(name, message) {
    super(message);
    this.errorName = name;
  }
}

const keyOf = (hash, group) => `${hash}/${group}`;

class BlockPool {
  constructor({ num_blocks, enable_caching, hash_block_size, enable_events, profile }) {
    // Verify that the pool has room for the null block
    if (!(num_blocks >= 1)) throw new PoolError("InvalidConfig", "num_blocks must be at least 1");
    // Verify that hashes cover a positive number of tokens
    if (!(hash_block_size >= 1)) {
      throw new PoolError("InvalidConfig", "hash_block_size must be at least 1");
    }
    if (!(profile in PROFILES)) throw new PoolError("InvalidConfig", `unknown profile ${profile}`);
    this.numBlocks = num_blocks;
    this.caching = enable_caching;
    this.hashBlockSize = hash_block_size;
    this.events = enable_events;
    this.freeOrder = PROFILES[profile][enable_caching ? 0 : 1];
    // blocks[i]: ref count, primary key {hash, group} or null, its token count, partial keys.
    this.blocks = [];
    for (let i = 0; i < num_blocks; i++) {
      this.blocks.push({ refCnt: 0, primary: null, numTokens: null, partial: [] });
    }
    this.freeQueue = [];
    for (let i = 1; i < num_blocks; i++) this.freeQueue.push(i);
    // "hash/group" -> {hash, group, ids: [block ids, oldest insertion first]}
    this.cached = new Map();
    this.pending = [];
  }

  // ---------------------------------------------------------------- helpers

  verifyKnown(ids) {
    for (const id of ids) {
      if (!Number.isInteger(id) || id < 0 || id >= this.numBlocks) {
        throw new PoolError("UnknownBlock", `block id ${id} is not in 0..${this.numBlocks - 1}`);
      }
    }
  }

  static verifyGroup(group) {
    if (group < 0) throw new PoolError("InvalidGroup", `group id ${group} is negative`);
  }

  verifyBlockSize(blockSize, atLeast) {
    if (blockSize < atLeast || blockSize % this.hashBlockSize !== 0) {
      throw new PoolError("InvalidBlockSize", `block_size ${blockSize} is not allowed`);
    }
  }

  emit(event) {
    if (this.events) this.pending.push(event);
  }

  keysOf(block) {
    return block.primary === null ? [] : [block.primary, ...block.partial];
  }

  // Remove every key that points at the block, one BlockRemoved per key.
  dropKeys(id) {
    const block = this.blocks[id];
    for (const key of this.keysOf(block)) {
      const k = keyOf(key.hash, key.group);
      const entry = this.cached.get(k);
      entry.ids = entry.ids.filter((b) => b !== id);
      if (entry.ids.length === 0) this.cached.delete(k);
      this.emit({ type: "BlockRemoved", block_hashes: [key.hash], medium: "GPU", group_idx: key.group });
    }
    block.primary = null;
    block.numTokens = null;
    block.partial = [];
  }

  insertKey(hash, group, id, numTokens) {
    const block = this.blocks[id];
    if (block.primary === null) {
      block.primary = { hash, group };
      block.numTokens = numTokens;
    } else {
      block.partial.push({ hash, group });
    }
    const k = keyOf(hash, group);
    if (!this.cached.has(k)) this.cached.set(k, { hash, group, ids: [] });
    this.cached.get(k).ids.push(id);
  }

  // ------------------------------------------------------------- operations

  get_new_blocks({ num_blocks }) {
    // Verify that the count is not negative
    if (num_blocks < 0) throw new PoolError("InvalidBlockCount", `cannot get ${num_blocks} blocks`);
    // Verify that the free queue holds enough blocks
    if (num_blocks > this.freeQueue.length) {
      throw new PoolError("NotEnoughFreeBlocks", `only ${this.freeQueue.length} blocks are free`);
    }
    const taken = this.freeQueue.splice(0, num_blocks);
    for (const id of taken) {
      this.dropKeys(id);
      this.blocks[id].refCnt = 1;
    }
    return taken;
  }

  touch({ block_ids }) {
    this.verifyKnown(block_ids);
    for (const id of block_ids) {
      if (id === NULL_BLOCK_ID) continue;
      const block = this.blocks[id];
      if (block.refCnt === 0) this.freeQueue = this.freeQueue.filter((b) => b !== id);
      block.refCnt += 1;
    }
    return null;
  }

  free_blocks({ block_ids }) {
    this.verifyKnown(block_ids);
    // Verify that no block is released more times than it is held
    const releases = new Map();
    for (const id of block_ids) {
      if (id !== NULL_BLOCK_ID) releases.set(id, (releases.get(id) || 0) + 1);
    }
    for (const [id, count] of releases) {
      const held = this.blocks[id].refCnt;
      if (held === 0) throw new PoolError("BlockNotHeld", `block ${id} is free`);
      if (count > held) throw new PoolError("OverFree", `block ${id} is freed ${count} times`);
    }
    const newlyFree = [];
    for (const id of block_ids) {
      if (id === NULL_BLOCK_ID) continue;
      const block = this.blocks[id];
      block.refCnt -= 1;
      if (block.refCnt === 0) newlyFree.push(id);
    }
    if (this.freeOrder === "hashless-first") {
      const hashless = newlyFree.filter((id) => this.blocks[id].primary === null);
      const hashed = newlyFree.filter((id) => this.blocks[id].primary !== null);
      this.freeQueue = [...hashless, ...this.freeQueue, ...hashed];
    } else {
      this.freeQueue.push(...newlyFree);
    }
    return null;
  }

  cache_full_blocks(args) {
    const { request, block_ids, num_cached_blocks, num_full_blocks, block_size } = args;
    const group = args.kv_cache_group_id;
    const mask = args.block_mask;
    // Verify that prefix caching is enabled
    if (!this.caching) throw new PoolError("CachingDisabled", "caching is disabled");
    BlockPool.verifyGroup(group);
    this.verifyBlockSize(block_size, this.hashBlockSize);
    // Verify that the range to cache is a slice of the request's blocks
    if (num_cached_blocks < 0 || num_full_blocks > block_ids.length) {
      throw new PoolError("InvalidBlockRange", "the range is not a slice of the blocks");
    }
    const numNew = Math.max(0, num_full_blocks - num_cached_blocks);
    // Verify that the mask, if any, has one entry per block to cache
    if (mask !== null && mask !== undefined && mask.length !== numNew) {
      throw new PoolError("InvalidBlockMask", `mask has ${mask.length} entries for ${numNew}`);
    }
    if (numNew === 0) return null;
    // Verify that every block to cache is a block of the pool (the others are not read)
    this.verifyKnown(block_ids.slice(num_cached_blocks, num_full_blocks));

    // The request's hashes for blocks of block_size tokens: every factor-th hash.
    const factor = block_size / this.hashBlockSize;
    const hashes = request.block_hashes.filter((_, i) => (i + 1) % factor === 0);
    // Verify that the request has a hash for every block up to num_full_blocks
    if (hashes.length < num_full_blocks) {
      throw new PoolError("NotEnoughHashes", `${hashes.length} hashes, ${num_full_blocks} needed`);
    }
    const positions = [];
    for (let i = num_cached_blocks; i < num_full_blocks; i++) {
      const masked = mask !== null && mask !== undefined && !mask[i - num_cached_blocks];
      if (block_ids[i] !== NULL_BLOCK_ID && !masked) positions.push(i);
    }
    // Verify that no physical block stands at two positions
    const seen = new Set();
    for (const i of positions) {
      if (seen.has(block_ids[i])) {
        throw new PoolError("DuplicateBlock", `block ${block_ids[i]} stands twice`);
      }
      seen.add(block_ids[i]);
    }
    for (const i of positions) {
      const block = this.blocks[block_ids[i]];
      // Verify that each block to cache is held by someone
      if (block.refCnt === 0) throw new PoolError("BlockNotHeld", `block ${block_ids[i]} is free`);
      // Verify that a hashed block is only ever promoted to a longer prefix
      if (block.numTokens !== null && block.numTokens >= (i + 1) * block_size) {
        throw new PoolError("AlreadyCached", `block ${block_ids[i]} is cached already`);
      }
    }
    for (const i of positions) {
      this.dropKeys(block_ids[i]);
      this.insertKey(hashes[i], group, block_ids[i], (i + 1) * block_size);
    }
    this.emit({
      type: "BlockStored",
      block_hashes: positions.map((i) => hashes[i]),
      parent_block_hash: num_cached_blocks > 0 ? hashes[num_cached_blocks - 1] : null,
      token_ids: (request.all_token_ids || []).slice(
        num_cached_blocks * block_size,
        num_full_blocks * block_size,
      ),
      block_size,
      lora_id: request.lora_id ?? null,
      medium: "GPU",
      lora_name: request.lora_name ?? null,
      extra_keys: positions.length > 0 ? positions.map(() => null) : null,
      group_idx: group,
    });
    return null;
  }

  cache_partial_block(args) {
    const { request, block_id, num_tokens, block_size } = args;
    const group = args.kv_cache_group_id;
    const hbs = this.hashBlockSize;
    if (!this.caching) throw new PoolError("CachingDisabled", "caching is disabled");
    BlockPool.verifyGroup(group);
    this.verifyKnown([block_id]);
    if (block_id === NULL_BLOCK_ID) return null;
    const block = this.blocks[block_id];
    if (block.refCnt === 0) throw new PoolError("BlockNotHeld", `block ${block_id} is free`);
    this.verifyBlockSize(block_size, hbs + 1);
    // Verify that the prefix ends on a hash-block boundary inside a block
    if (num_tokens <= 0 || num_tokens % hbs !== 0 || num_tokens % block_size === 0) {
      throw new PoolError("InvalidPartialBlock", `num_tokens ${num_tokens} ends no partial block`);
    }
    const numHashBlocks = num_tokens / hbs;
    // Verify that the request has hashed that far
    if (numHashBlocks > request.block_hashes.length) {
      throw new PoolError("NotEnoughHashes", `${numHashBlocks} hashes are needed`);
    }
    const hash = request.block_hashes[numHashBlocks - 1];
    const key = { hash, group };
    if (this.keysOf(block).some((k) => k.hash === hash && k.group === group)) return key;
    if (block.numTokens !== null && block.numTokens < num_tokens) this.dropKeys(block_id);
    this.insertKey(hash, group, block_id, num_tokens);
    this.emit({
      type: "BlockStored",
      block_hashes: [hash],
      parent_block_hash: numHashBlocks > 1 ? request.block_hashes[numHashBlocks - 2] : null,
      token_ids: (request.all_token_ids || []).slice(num_tokens - hbs, num_tokens),
      block_size: hbs,
      lora_id: request.lora_id ?? null,
      medium: "GPU",
      lora_name: request.lora_name ?? null,
      extra_keys: [null],
      group_idx: group,
    });
    return key;
  }

  get_cached_block({ block_hash, kv_cache_group_ids }) {
    for (const group of kv_cache_group_ids) BlockPool.verifyGroup(group);
    const found = [];
    for (const group of kv_cache_group_ids) {
      const entry = this.cached.get(keyOf(block_hash, group));
      if (entry === undefined) return null;
      found.push(entry.ids[0]);
    }
    return found;
  }

  evict_blocks({ block_ids }) {
    const ids = [...new Set(block_ids)].sort((a, b) => a - b);
    this.verifyKnown(ids);
    for (const id of ids) this.dropKeys(id);
    return null;
  }

  reset_prefix_cache() {
    if (this.freeQueue.length !== this.numBlocks - 1) return false;
    for (const block of this.blocks) {
      block.primary = null;
      block.numTokens = null;
      block.partial = [];
    }
    this.cached.clear();
    this.emit({ type: "AllBlocksCleared" });
    return true;
  }

  get_num_free_blocks() {
    return this.freeQueue.length;
  }

  get_usage() {
    const usable = this.numBlocks - 1;
    return usable === 0 ? 0.0 : 1.0 - this.freeQueue.length / usable;
  }

  take_events() {
    const events = this.pending;
    this.pending = [];
    return events;
  }

  // The whole state in the protocol's canonical form.
  snapshot() {
    const entries = [...this.cached.values()].sort((a, b) =>
      a.hash < b.hash ? -1 : a.hash > b.hash ? 1 : a.group - b.group,
    );
    return {
      blocks: this.blocks.map((b) => ({
        ref_cnt: b.refCnt,
        block_hash: b.primary,
        hash_num_tokens: b.numTokens,
        partial_keys: b.partial,
      })),
      free_queue: this.freeQueue,
      cached: entries.map((e) => ({ hash: e.hash, group: e.group, blocks: e.ids })),
      pending_events: this.pending,
    };
  }
}

// ------------------------------------------------------------------ protocol

const OPERATIONS = new Set([
  "get_new_blocks",
  "touch",
  "free_blocks",
  "cache_full_blocks",
  "cache_partial_block",
  "get_cached_block",
  "evict_blocks",
  "reset_prefix_cache",
  "get_num_free_blocks",
  "get_usage",
  "take_events",
  "snapshot",
]);

let pool = null;

function handle(request) {
  const { id, op } = request;
  const args = request.args || {};
  try {
    if (op === "hello") {
      return {
        id,
        ok: {
          protocol: PROTOCOL_VERSION,
          name: "node-pool",
          levels: [1, 2],
          profiles: Object.keys(PROFILES),
          snapshot: true,
        },
      };
    }
    if (op === "new_pool") {
      pool = null;
      pool = new BlockPool(args);
      return { id, ok: null };
    }
    if (!OPERATIONS.has(op)) return { id, error: "ProtocolError", message: `unknown op ${op}` };
    if (pool === null) return { id, error: "ProtocolError", message: `${op} before new_pool` };
    return { id, ok: pool[op](args) };
  } catch (error) {
    if (error instanceof PoolError) return { id, error: error.errorName, message: error.message };
    throw error;
  }
}

// The block pool is also a module: examples/node-manager/manager.js builds on it.
module.exports = { BlockPool, PoolError, PROFILES, NULL_BLOCK_ID };

if (require.main === module) {
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
