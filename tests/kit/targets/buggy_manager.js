#!/usr/bin/env node
// The Node.js reference manager with one planted bug: a finished request's
// blocks are freed first block first, so the prefix's head is evicted before
// its tail (kvpool.model.single_type.free frees the last block first).
"use strict";

const path = require("path");
const reference = require(path.join(__dirname, "..", "..", "..", "examples", "node-manager", "manager.js"));

reference.KVCacheManager.prototype.freeGroup = function freeInOrder(g, rid) {
  const table = this.tables[g];
  if (!table.blocks.has(rid)) return;
  this.pool.free_blocks({ block_ids: [...table.blocks.get(rid)] });
  table.blocks.delete(rid);
  table.cached.delete(rid);
};
reference.serve();
