"""vLLM's msgspec KV events read as the model's events, for the pool and request adapters.

Both adapters read the same classes (``vllm/distributed/kv_events.py``); they differ in
what they let through: the manager annotates ``BlockStored`` with its group's spec
(``KVCacheManager.take_events``, 0.33.0), and the request layer does not model the
values of ``extra_keys``. Releases before a field was added have no attribute for it:
each is read with ``getattr`` and a default of None.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.model.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

MODEL_ONLY_EVENT_FIELDS = (
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
)
"""Fields vLLM's events carry that the model's do not; None at the pool layer."""


@dataclass(frozen=True)
class UnmappedEvent:
    """An event of vLLM's the model has no equivalent for; never equal to a model event."""

    description: str


def model_event(
    event: Any,
    model_hash: Callable[[Any], bytes],
    expected: Mapping[str, Any] | None = None,
    extra_key_values: bool = True,
) -> KVCacheEvent:
    """``event`` as the model's event, or an ``UnmappedEvent`` that never compares equal.

    Each field of ``MODEL_ONLY_EVENT_FIELDS`` must be None or, where ``expected``
    names it, that value; an event where one is something else, or of a kind the
    model lacks, is unmapped. ``extra_key_values=False`` keeps ``extra_keys``' shape
    (one None per block) and drops the values.
    """
    expected = expected or {}
    kind = type(event).__name__
    unexpected = {
        name: getattr(event, name)
        for name in MODEL_ONLY_EVENT_FIELDS
        if getattr(event, name, None) not in (None, expected.get(name))
    }
    if unexpected or kind not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        return UnmappedEvent(f"{event!r}")  # type: ignore[return-value]
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    medium = getattr(event, "medium", None)
    group_idx: Any = getattr(event, "group_idx", None)  # None in releases before groups
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=tuple(model_hash(h) for h in event.block_hashes),
            medium=medium,
            group_idx=group_idx,
        )
    extra_keys = getattr(event, "extra_keys", None)
    if extra_keys is not None:
        extra_keys = tuple(extra_keys) if extra_key_values else tuple(None for _ in extra_keys)
    parent = event.parent_block_hash
    lookahead = getattr(event, "lookahead_token_ids", None)
    return BlockStored(
        block_hashes=tuple(model_hash(h) for h in event.block_hashes),
        parent_block_hash=None if parent is None else model_hash(parent),
        token_ids=tuple(event.token_ids),
        block_size=event.block_size,
        lora_id=event.lora_id,
        medium=medium,
        lora_name=getattr(event, "lora_name", None),
        extra_keys=extra_keys,
        group_idx=group_idx,
        lookahead_token_ids=None if lookahead is None else tuple(tuple(t) for t in lookahead),
    )
