"""Generation throughput of hfjax (`OfflineGenerator` over `JaxEngine`) vs transformers `generate` (PyTorch CPU) on
the reference checkpoint, same process, and the decode step time against its memory and compute floors.

Workload (standard): 64 prompts (lengths 16..48, seed 0), 128 new tokens, temperature 1.0 (sampled,
no top-k/top-p) and greedy; no stop tokens, so every sample has exactly 128 tokens. Two floors of a decode step:
memory, the bytes it must read (every weight but the embedding table, plus the KV cache up to the current length) /
the memory bandwidth measured here (a large numpy copy); compute, its FLOPs (2 per weight and token, plus attention
over the mean cache length) / the rate of a jitted fp32 matmul of the decode step's MLP shape, compiled as the engine
compiles. The step's floor is the larger. With `--lora-rank R` hfjax also generates from the checkpoint with
rank-R LoRA adapters on every projection, unmerged as a LoRA policy's rollout runs them (random B, so they compute);
merged adapters are the plain model's weights, so the plain row is the merged one. Usage:
    python scripts/bench/bench_generate.py [--ckpt DIR] [--repeats 3] [--out runs/bench/generate.json]
        [--lora-rank 16] [--tiny]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import copy_times, default_checkpoint, interleaved_medians, parse_args, report


def memory_bandwidth(n_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s moved (read + write) by a large numpy copy, best of `repeats`."""
    return 2 * n_bytes / min(copy_times(n_bytes, repeats))


def matmul_rate(rows: int, inner: int, outer: int, seconds: float = 1.0) -> float:
    """FLOP/s of a jitted fp32 [rows, inner] x [outer, inner]^T product, compiled with the engine's forward options,
    best over `seconds` of calls."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hfjax.xla_settings import FORWARD_COMPILER_OPTIONS

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, inner), np.float32))
    w = jnp.asarray(rng.standard_normal((outer, inner), np.float32))
    product = jax.jit(lambda a, b: a @ b.T).lower(x, w).compile(FORWARD_COMPILER_OPTIONS)
    product(x, w).block_until_ready()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        product(x, w).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * rows * inner * outer / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, help="reference checkpoint (built under a temp dir when omitted)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus filter of the sampled runs (both systems)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/generate.json"))
    parser.add_argument("--probe-mib", type=int, default=256, help="size of the memory bandwidth probe")
    parser.add_argument("--matmul-s", type=float, default=1.0, help="seconds the matmul rate probe runs")
    parser.add_argument("--lora-rank", type=int, default=0, help="also generate with unmerged adapters of this rank")
    tiny = {"prompts": 4, "new_tokens": 8, "repeats": 1, "probe_mib": 8, "matmul_s": 0.1, "lora_rank": 2}
    args = parse_args(parser, tiny=tiny)
    ckpt = default_checkpoint(args.ckpt, args.tiny)

    import jax
    import numpy as np
    import torch
    import transformers as tf
    from flax import nnx

    from hfjax.models import load_hf
    from hfjax.rollout import JaxEngine, OfflineGenerator, SamplingParams

    rng = np.random.default_rng(0)
    model = load_hf(ckpt)
    cfg = model.config
    lengths = rng.integers(16, 49, args.prompts)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in lengths]
    _, params, _ = nnx.split(model, nnx.Param, ...)
    engine = JaxEngine(
        model, max_concurrent_decodes=args.prompts, max_prefill_length=64, max_new_tokens=args.new_tokens
    )
    generator = OfflineGenerator(engine, params, progress=False)
    sampled = SamplingParams(
        max_new_tokens=args.new_tokens, temperature=1.0, top_p=args.top_p, stop_token_ids=(), seed=0
    )
    greedy = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, stop_token_ids=())
    started = time.perf_counter()
    generator.generate(prompts, sampled)
    first_call_s = time.perf_counter() - started
    runs = {}
    if args.lora_rank:
        adapted = lora_model(ckpt, args.lora_rank)
        lora_engine = JaxEngine(
            adapted, max_concurrent_decodes=args.prompts, max_prefill_length=64, max_new_tokens=args.new_tokens
        )
        lora_generator = OfflineGenerator(lora_engine, nnx.split(adapted, nnx.Param, ...)[1], progress=False)
        lora_generator.generate(prompts, sampled)  # compiles
        runs["hfjax LoRA sampled"] = lambda: lora_generator.generate(prompts, sampled)

    reference = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    width = int(lengths.max())
    ids = np.zeros((args.prompts, width), np.int64)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    ids_t, mask_t = torch.as_tensor(ids), torch.as_tensor(mask)

    def hf_generate(do_sample: bool) -> None:
        reference.generate(
            input_ids=ids_t,
            attention_mask=mask_t,
            do_sample=do_sample,
            temperature=1.0 if do_sample else None,
            top_k=0 if do_sample else None,
            top_p=args.top_p if do_sample else None,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            pad_token_id=0,
        )

    with torch.inference_mode():
        medians = interleaved_medians(
            {
                "hfjax sampled": lambda: generator.generate(prompts, sampled),
                "torch sampled": lambda: hf_generate(True),
                "hfjax greedy": lambda: generator.generate(prompts, greedy),
                "torch greedy": lambda: hf_generate(False),
                **runs,
            },
            args.repeats,
            warmup=1,
        )
    tokens = args.prompts * args.new_tokens

    # Decode-step floor: weights read (no embedding table) + mean KV cache read, over measured bandwidth.
    bandwidth = memory_bandwidth(args.probe_mib << 20)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params)) - cfg.padded_vocab_size * cfg.hidden_size * 4
    mean_cache_len = float(np.mean(lengths)) + args.new_tokens / 2
    kv_bytes = 2 * cfg.num_layers * args.prompts * mean_cache_len * cfg.num_kv_heads * cfg.head_dim * 4
    memory_floor_s = (param_bytes + kv_bytes) / bandwidth
    step_flops = (
        2 * args.prompts * (param_bytes / 4 + 2 * cfg.num_layers * mean_cache_len * cfg.num_heads * cfg.head_dim)
    )
    rate = matmul_rate(args.prompts, cfg.hidden_size, cfg.intermediate_size, args.matmul_s)
    compute_floor_s = step_flops / rate
    floor_step_s = max(memory_floor_s, compute_floor_s)
    generator.generate(prompts, sampled)
    decode_steps = generator.last_stats["decode_steps"]
    step_s = medians["hfjax sampled"] / decode_steps  # upper bound: includes prefill and host work

    rows = []
    for mode in ("sampled", "greedy"):
        ours, theirs = medians[f"hfjax {mode}"], medians[f"torch {mode}"]
        label = f"sampled, top_p {args.top_p}" if mode == "sampled" and args.top_p < 1 else mode
        rows.append([f"transformers generate ({label})", theirs, tokens / theirs, 1.0])
        rows.append([f"hfjax OfflineGenerator ({label})", ours, tokens / ours, theirs / ours])
        if f"hfjax LoRA {mode}" in medians:
            lora_s = medians[f"hfjax LoRA {mode}"]
            rows.append([f"hfjax, rank-{args.lora_rank} adapters unmerged ({label})", lora_s, tokens / lora_s,
                         theirs / lora_s])  # fmt: skip
    report(
        f"generate {args.prompts} prompts x {args.new_tokens} new tokens, {cfg.num_params / 1e6:.1f}M params, fp32, "
        f"{jax.default_backend()}, torch threads {torch.get_num_threads()}",
        ["system", "median s", "output tokens/s", "speed-up vs transformers"],
        rows,
        args.out,
        {
            "first_call_s_with_compiles": first_call_s,
            "compiles": dict(engine.compiles),
            "decode_steps": decode_steps,
            "step_ms_upper_bound": step_s * 1e3,
            "floor_step_ms": floor_step_s * 1e3,
            "memory_floor_step_ms": memory_floor_s * 1e3,
            "compute_floor_step_ms": compute_floor_s * 1e3,
            "step_gflop": step_flops / 1e9,
            "matmul_GFLOPps": rate / 1e9,
            "memory_bandwidth_GBps": bandwidth / 1e9,
            "bytes_per_step": param_bytes + kv_bytes,
        },
    )
    print(
        f"decode step: {step_s * 1e3:.2f} ms (whole run / steps, an upper bound) vs floor {floor_step_s * 1e3:.2f} ms "
        f"= max(memory {memory_floor_s * 1e3:.2f} ms: {(param_bytes + kv_bytes) / 1e6:.1f} MB at "
        f"{bandwidth / 1e9:.1f} GB/s, compute {compute_floor_s * 1e3:.2f} ms: {step_flops / 1e9:.2f} GFLOP at "
        f"{rate / 1e9:.0f} GFLOP/s): {step_s / floor_step_s:.1f}x; "
        f"first call with compiles {first_call_s:.1f} s; compiles {dict(engine.compiles)}"
    )


def lora_model(ckpt: Path, rank: int) -> Any:
    """The checkpoint with rank-`rank` adapters on every projection, B drawn at random (a fresh B is zero)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from hfjax.models import load_hf
    from hfjax.models.lora import LoraConfig, LoraParam, add_lora

    model = add_lora(load_hf(ckpt), LoraConfig(rank=rank, alpha=2.0 * rank), seed=0)
    rng = np.random.default_rng(1)
    for path, b in nnx.to_flat_state(nnx.state(model, LoraParam)):
        if path[-1] == "b":
            b[...] = jnp.asarray(rng.normal(0, 0.01, b.shape), jnp.float32)
    return model


if __name__ == "__main__":
    main()
