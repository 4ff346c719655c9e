"""Shared prompt KV: generation time and KV-cache memory when the samples of a prompt share its keys and values.

Workload (standard): 16 prompts of 512 tokens (seed 0), 8 samples each (GRPO-like), 64 new tokens sampled at
temperature 1 with no stop tokens, 64 slots, on the reference checkpoint (25.8M-parameter Llama), fp32. Rows: the
copied layout that the engine had before (every slot holds its own copy of its prompt: `max_concurrent_decodes` x
(prompt + response) positions; it no longer exists, so its bytes come from that formula and it is not timed), and
the shared layout with its prompt pool sized two ways: the default (a prompt per slot, the copied layout's memory)
and slots / samples prompts (what 8 samples of each prompt need). Both shared rows run the same code; the time
column is the median wall time of a whole `generate` (prefill, inserts, decode). Usage:
    python scripts/bench/bench_prompt_kv.py [--ckpt DIR] [--repeats 3] [--out runs/bench/prompt_kv.json] [--tiny]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import default_checkpoint, interleaved_medians, parse_args, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, help="reference checkpoint (built under a temp dir when omitted)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-length", type=int, default=512)
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (sampling n)")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/prompt_kv.json"))
    tiny = {"prompts": 2, "prompt_length": 32, "samples": 4, "slots": 8, "new_tokens": 4, "repeats": 1}
    args = parse_args(parser, tiny=tiny)
    ckpt = default_checkpoint(args.ckpt, args.tiny)

    import jax
    import numpy as np
    from flax import nnx

    from hfjax.models import load_hf
    from hfjax.rollout import JaxEngine, OfflineGenerator, SamplingParams

    model = load_hf(ckpt)
    cfg = model.config
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, args.prompt_length).tolist() for _ in range(args.prompts)]
    _, params, _ = nnx.split(model, nnx.Param, ...)
    sampling = SamplingParams(
        n=args.samples, max_new_tokens=args.new_tokens, temperature=1.0, stop_token_ids=(), seed=0
    )
    shape = {
        "max_concurrent_decodes": args.slots,
        "max_prefill_length": args.prompt_length,
        "max_new_tokens": args.new_tokens,
    }
    default = JaxEngine(model, **shape)
    groups = max(1, args.slots // args.samples)  # prompts that run at once with all their samples
    pool_tokens = groups * default.prompt_blocks * default.block * default.cache.pool_parts
    generators = {
        "shared, pool of one prompt per slot (default)": OfflineGenerator(default, params, progress=False),
        f"shared, pool of {groups} prompts (slots / samples)": OfflineGenerator(
            JaxEngine(model, **shape, prompt_cache_tokens=pool_tokens), params, progress=False
        ),
    }
    medians = interleaved_medians(
        {name: lambda g=g: g.generate(prompts, sampling) for name, g in generators.items()}, args.repeats, warmup=1
    )
    response_tokens = args.prompts * args.samples * args.new_tokens
    copied = default.cache.copied_bytes()
    rows = [["copied prompt per sample (formula; layout removed, not run)", "-", "-", copied, 1.0, "-"]]
    for name, generator in generators.items():
        engine, seconds = generator.engine, medians[name]
        kv = engine.kv_cache_bytes_per_device()
        peak = generator.last_stats["prompt_pool_blocks_peak"]
        rows.append([name, seconds, response_tokens / seconds, kv, copied / kv, peak * engine.block])
    report(
        f"shared prompt KV: {args.prompts} prompts x {args.prompt_length} tokens, {args.samples} samples each, "
        f"{args.new_tokens} new tokens, {args.slots} slots, {cfg.num_params / 1e6:.1f}M params, fp32, "
        f"{jax.default_backend()}",
        ["layout", "median s", "response tokens/s", "KV cache bytes", "copied / this", "pool positions in use (peak)"],
        rows,
        args.out,
        {
            "block": default.block,
            "prompt_blocks": default.prompt_blocks,
            "own_blocks": default.blocks,
            "copied_kv_bytes": copied,
            "compiles": {name: dict(g.engine.compiles) for name, g in generators.items()},
        },
    )


if __name__ == "__main__":
    main()
