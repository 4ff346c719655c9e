"""Jitted forward throughput of hfjax vs transformers (PyTorch CPU) on the reference checkpoint, same process.

Workload: batch 8 x 256 tokens, float32, after warm-up, median of repeats. Usage:
    python scripts/bench/bench_forward.py [--ckpt DIR] [--repeats 10] [--out runs/bench/forward.json] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import default_checkpoint, interleaved_medians, parse_args, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, help="reference checkpoint (built under a temp dir when omitted)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/forward.json"))
    args = parse_args(parser, tiny={"batch": 2, "length": 16, "repeats": 1})
    ckpt = default_checkpoint(args.ckpt, args.tiny)

    import jax
    import numpy as np
    import torch
    import transformers as tf
    from flax import nnx

    from hfjax.models import load_hf

    rng = np.random.default_rng(0)
    model = load_hf(ckpt)
    ids = rng.integers(3, model.config.vocab_size, (args.batch, args.length)).astype(np.int32)
    mask = np.ones_like(ids)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, i, m: nnx.merge(graphdef, s)(i, m))
    ids_dev, mask_dev = jax.device_put(ids), jax.device_put(mask)
    reference = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids_t, mask_t = torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask)
    with torch.inference_mode():
        medians = interleaved_medians(
            {
                "hfjax": lambda: forward(state, ids_dev, mask_dev).block_until_ready(),
                "torch": lambda: reference(input_ids=ids_t, attention_mask=mask_t).logits,
            },
            args.repeats,
        )
        theirs = reference(input_ids=ids_t, attention_mask=mask_t).logits.numpy()
    ours = np.asarray(forward(state, ids_dev, mask_dev))
    hfjax_s, torch_s = medians["hfjax"], medians["torch"]
    rel = float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))

    tokens = args.batch * args.length
    n_params = sum(p.numel() for p in reference.parameters())
    flops = 2 * n_params * tokens  # matmul floor, attention excluded
    rows = [
        ["transformers (PyTorch CPU)", torch_s * 1e3, tokens / torch_s, flops / torch_s / 1e9, 1.0],
        ["hfjax (jax.jit)", hfjax_s * 1e3, tokens / hfjax_s, flops / hfjax_s / 1e9, torch_s / hfjax_s],
    ]
    report(
        f"forward {args.batch}x{args.length}, {n_params / 1e6:.1f}M params, fp32, {jax.default_backend()}, "
        f"torch threads {torch.get_num_threads()}, logits rel err {rel:.1e}",
        ["system", "median ms", "tokens/s", "GFLOP/s (2*N*T)", "speed-up"],
        rows,
        args.out,
        {
            "relative_error": rel,
            "batch": args.batch,
            "length": args.length,
            "params": n_params,
            "cpu_count": os.cpu_count(),
        },
    )


if __name__ == "__main__":
    main()
