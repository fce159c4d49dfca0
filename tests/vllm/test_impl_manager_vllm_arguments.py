"""kvpool.impl.KVCacheManager takes vLLM 0.33's constructor arguments, vLLM's config included."""

import pytest

from kvpool.impl import KVCacheManager
from kvpool.model.errors import InvalidManagerConfig
from kvpool.model.request import new_request
from kvpool.model.single_type import AttentionType

pytestmark = pytest.mark.usefixtures("require_vllm")


def vllm_config(*specs: object, num_blocks: int = 16) -> object:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)],
    )


def full(block_size: int) -> object:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )


def window(block_size: int, size: int) -> object:
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=size
    )


def test_the_manager_is_built_as_vllms_tests_build_it_and_allocates() -> None:
    manager = KVCacheManager(
        vllm_config(full(4)),
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=4,
        scheduler_block_size=4,
        log_stats=True,
    )
    blocks = manager.allocate_slots(new_request("r", list(range(9)), 4), 9)
    assert blocks is not None and blocks.get_block_ids() == ([1, 2, 3],)


def test_positional_arguments_are_vllms() -> None:
    manager = KVCacheManager(vllm_config(full(2), window(2, 4)), 64, 2, 2)
    kinds = [s.attention for s in manager.specs]
    assert kinds == [AttentionType.FULL, AttentionType.SLIDING_WINDOW]
    assert manager.specs[1].sliding_window == 4


@pytest.mark.parametrize(
    "argument", [{"watermark": 0.1}, {"enable_mamba_shared_prefix_checkpoint": True}]
)
def test_an_unmodelled_argument_is_refused_by_name(argument: dict[str, object]) -> None:
    with pytest.raises(InvalidManagerConfig):
        KVCacheManager(vllm_config(full(4)), 64, 4, 4, **argument)  # type: ignore[arg-type]


def test_context_parallel_world_sizes_are_taken_as_vllms() -> None:
    """Modelled since the block geometry (docs/semantics.md): a sharded full-attention group's
    blocks hold dcp_world_size times its tokens, so the scheduler block must cover them."""
    manager = KVCacheManager(vllm_config(full(4)), 64, 8, 4, dcp_world_size=2, pcp_world_size=2)
    assert [s.block_size for s in manager.specs] == [8]
    with pytest.raises(InvalidManagerConfig):
        KVCacheManager(vllm_config(full(4)), 64, 4, 4, dcp_world_size=2)


def test_an_unmodelled_attention_type_is_refused_by_name() -> None:
    import torch
    from vllm.v1.kv_cache_interface import CrossAttentionSpec

    spec = CrossAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32)
    with pytest.raises(InvalidManagerConfig):
        KVCacheManager(vllm_config(spec), 64, 4, 4)


def test_eagle_on_a_vllm_hybrid_and_a_lookahead_are_taken() -> None:
    manager = KVCacheManager(
        vllm_config(full(4), window(4, 8)), 64, 4, 4, use_eagle=True, num_prefill_lookahead=3
    )
    assert manager.use_eagle and manager.num_prefill_lookahead == 3


def test_eagle_flagged_on_some_vllm_groups_only_runs_there() -> None:
    config = vllm_config(full(4), window(4, 8))
    config.kv_cache_groups[1].is_eagle_group = True  # type: ignore[attr-defined]
    manager = KVCacheManager(config, 64, 4, 4, use_eagle=True)
    assert [m.use_eagle for m in manager.managers] == [False, True]


def test_a_window_keeping_extra_tokens_is_refused_by_name() -> None:
    from dataclasses import replace

    spec = replace(window(4, 8), extra_retained_tokens=2)  # type: ignore[type-var]
    with pytest.raises(InvalidManagerConfig, match="extra_retained_tokens"):
        KVCacheManager(vllm_config(full(4), spec), 64, 4, 4, num_prefill_lookahead=3)
