"""Radix caches with one bug each, built on the model target: the machine must find every one."""

from collections.abc import Sequence
from dataclasses import replace

from kvpool.model import BlockRemoved
from kvpool.model import radix as model
from kvpool.model.radix import EvictResult, MatchResult, Path
from kvpool.model.radix_errors import NotLocked
from kvpool.specs.radix.model_target import ModelRadixTarget


class SplitAnnouncesRemoval(ModelRadixTarget):
    """A match that splits a node also queues a removal of the split node's pages (#14934)."""

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        before = set(self.state.nodes)
        hit = super().match_prefix(tokens)
        if set(self.state.nodes) - before:
            lower = next(p for p in self.state.nodes if self.state.nodes[p].parent == hit.path)
            hashes = model.page_hashes(lower, self.state.config.page_size)
            if self.state.config.enable_events:
                removed = BlockRemoved(hashes, "GPU", 0)
                events = (*self.state.pending_events, removed)
                self.state = replace(self.state, pending_events=events)
        return hit


class EvictsLockedLeaves(ModelRadixTarget):
    """Eviction ignores locks: a request's prefix can be freed under it."""

    def evict(self, num_tokens: int) -> EvictResult:
        nodes = {p: replace(n, lock_ref=0) for p, n in self.state.nodes.items()}
        locks = {p: n.lock_ref for p, n in self.state.nodes.items()}
        self.state = replace(self.state, nodes=nodes)
        result = super().evict(num_tokens)
        kept = {p: replace(n, lock_ref=locks[p]) for p, n in self.state.nodes.items()}
        self.state = replace(self.state, nodes=kept)
        return result


class ServesTheCallersSlots(ModelRadixTarget):
    """A duplicate insert keeps the caller's slots in the tree and hands back its own."""

    def insert(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        prev_prefix_len: int,
        priority: int,
        inserted_len: int,
    ) -> model.InsertResult:
        result = super().insert(tokens, slots, prev_prefix_len, priority, inserted_len)
        if result.prefix_len and result.duplicates and result.path in self.state.nodes:
            node = self.state.nodes[result.path]
            own = node.slots
            start = len(result.path) - len(own)
            mine = tuple(slots[start : start + len(own)])
            if len(mine) == len(own) and set(mine).isdisjoint(own):
                nodes = {**self.state.nodes, result.path: replace(node, slots=mine)}
                self.state = replace(self.state, nodes=nodes)
        return result


class ForgetsPendingEventsOnReset(ModelRadixTarget):
    """A reset drops the events still queued, stores a router never heard of."""

    def reset(self) -> None:
        super().reset()
        self.state = replace(self.state, pending_events=self.state.pending_events[-1:])


class UnlockReleasesTheNodeOnly(ModelRadixTarget):
    """unlock decrements the node but not its ancestors: the prefix stays protected for ever."""

    def unlock(self, path: Path) -> None:
        if path == ():
            return
        node = self.state.nodes[path]
        if node.lock_ref == 0:
            raise NotLocked("not locked")
        nodes = {**self.state.nodes, path: replace(node, lock_ref=node.lock_ref - 1)}
        self.state = replace(self.state, nodes=nodes)
