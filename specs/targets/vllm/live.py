"""Serve a seeded workload on a live vLLM engine (the CPU build) and record its history.

    python -m kvpool.specs.targets.vllm.live --requests 40 --blocks 20 --seed 0 --out h.jsonl

(``kvpool record --engine vllm`` runs this.) The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with a tiny random-weight model written
to a temporary directory: no download, no GPU. The workload shares prefixes
across requests and the cache is small, so the engine hits, evicts, refuses
admissions and preempts. Prints one ``RESULT {json}`` line of measurements.

``--plant MODULE:FUNCTION`` calls ``FUNCTION()`` before recording (a test's
planted bug); it may return pool subclasses the recorder must also wrap.
"""

import argparse
import importlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

MODELS: dict[str, dict[str, Any]] = {
    "llama": TINY_LLAMA,
    # One sliding-window layer (window 64) and one full-attention layer: two KV cache groups.
    "hybrid": {
        **TINY_LLAMA,
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    # Both layers sliding: one sliding-window group.
    "swa": {
        **TINY_LLAMA,
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "sliding_attention"],
    },
}


def workload(seed: int, requests: int, vocab: int = 500) -> list[list[int]]:
    """Prompts over four shared prefixes (64 to 160 tokens) plus 10 to 89 random tokens."""
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(3, vocab) for _ in range(rng.choice([64, 96, 128, 160]))] for _ in range(4)
    ]
    return [
        rng.choice(prefixes) + [rng.randrange(3, vocab) for _ in range(rng.randrange(10, 90))]
        for _ in range(requests)
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpool record --engine vllm")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", choices=sorted(MODELS), default="llama")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--batched-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--keep", default=None, help="comma-separated request numbers to serve")
    parser.add_argument("--snapshots", action="store_true", help="pool state after each call")
    parser.add_argument(
        "--retention",
        choices=["dense", "sparse"],
        default="dense",
        help="sliding-window blocks cached densely (checkable) or vLLM's default sparse retention",
    )
    parser.add_argument(
        "--plant", action="append", default=[], help="MODULE:FUNCTION to call first"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from kvpool.specs.targets.vllm.recorder import Recorder, RecorderError

    extra: list[type] = []
    for spec in args.plant:
        module, _, function = spec.partition(":")
        extra += list(getattr(importlib.import_module(module), function)() or ())
    recorder = Recorder(snapshots=args.snapshots, extra_pool_classes=tuple(extra))
    try:
        recorder.install()
    except RecorderError as error:
        print(f"kvpool record: {error}", file=sys.stderr)
        return 2
    vllm = importlib.import_module("vllm")
    LLM, SamplingParams = vllm.LLM, vllm.SamplingParams

    prompts = workload(args.seed, args.requests)
    chosen = range(len(prompts)) if args.keep is None else [int(k) for k in args.keep.split(",")]
    with tempfile.TemporaryDirectory(prefix="kvpool-tiny-") as model_dir:
        Path(model_dir, "config.json").write_text(json.dumps(MODELS[args.model]))
        options: dict[str, Any] = {}
        if args.retention == "dense":
            options["prefix_cache_retention_interval"] = None
        started = time.perf_counter()
        llm = LLM(
            model=model_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            enable_prefix_caching=True,
            block_size=32,
            max_model_len=args.max_model_len,
            num_gpu_blocks_override=args.blocks,
            max_num_batched_tokens=args.batched_tokens,
            enable_chunked_prefill=True,
            enforce_eager=True,
            dtype="float32",
            seed=args.seed,
            gpu_memory_utilization=0.2,
            **options,
        )
        built = time.perf_counter() - started
        recorder.capture_engine(
            llm,
            workload={
                "requests": args.requests,
                "served": len(chosen),
                "blocks": args.blocks,
                "seed": args.seed,
                "model": args.model,
                "max_tokens": args.max_tokens,
                "max_model_len": args.max_model_len,
                "planted": args.plant,
            },
        )
        sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompts[i]} for i in chosen], sampling, use_tqdm=False)
        served = time.perf_counter() - started
    recorder.uninstall()
    try:
        calls = recorder.dump(args.out)
    except RecorderError as error:
        print(f"kvpool record: {error}", file=sys.stderr)
        return 2
    print(
        "RESULT "
        + json.dumps({"calls": calls, "build_s": round(built, 2), "serve_s": round(served, 3)})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
