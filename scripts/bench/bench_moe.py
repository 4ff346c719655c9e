"""Mixture of experts: the rollout-vs-training log-prob mismatch with and without rollout routing replay (bfloat16),
and generation and one GRPO step under an expert-parallel layout against a data-parallel one.

Model: the reference checkpoint's shape and tokenizer (scripts/bench/make_reference_ckpt.py) with every MLP a
Qwen3-MoE layer of 8 experts, 2 per token, each half the reference MLP's width (a token's expert FLOPs are the
reference MLP's), random weights (the router's normal with std 1/sqrt(hidden), so its logits have unit scale, as a
trained router's roughly do). Workload: the standard RL step (64 prompts x 4 samples, prompts up to 64 tokens, 128
new tokens, eos ignored), GRPO with the reference's KL loss, local backend over this process's devices.
- mismatch: `--steps` GRPO steps in bfloat16 (float32 master weights), `actor.router_replay` off and on from the
  same checkpoint and seeds; per step the mean and max over response tokens of |log pi_train - log pi_rollout|
  (`rollout_corr/log_prob_abs_diff`, `_max`).
- layouts: the last of `--layout-steps` GRPO steps (the first compiles) with training and generation layouts
  `fsdp=N` / `data=N` against `expert=N` (N: the device count), float32: generation tokens/s and the step's
  seconds.
Usage (8 fake CPU devices):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/bench/bench_moe.py [--steps 3]
        [--layout-steps 2] [--out runs/bench/moe.json] [--tiny]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "bench" / "peers")]
from bench_common import default_checkpoint, parse_args, report, workload_dir  # noqa: E402

EXPERTS, PER_TOKEN = 8, 2


def moe_checkpoint(reference: Path, out: Path) -> Path:
    """The reference checkpoint's shape and tokenizer as a Qwen3-MoE (module docstring); returns its directory."""
    import json

    import torch
    import transformers as tf

    if (out / "config.json").is_file():
        return out
    dense = json.loads((reference / "config.json").read_text())
    config = tf.Qwen3MoeConfig(
        **{k: dense[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")},
        num_key_value_heads=dense["num_key_value_heads"],
        head_dim=dense["hidden_size"] // dense["num_attention_heads"],
        intermediate_size=dense["intermediate_size"],
        moe_intermediate_size=dense["intermediate_size"] // PER_TOKEN,
        num_experts=EXPERTS,
        num_experts_per_tok=PER_TOKEN,
        norm_topk_prob=True,
        bos_token_id=dense["bos_token_id"],
        eos_token_id=dense["eos_token_id"],
        pad_token_id=dense["pad_token_id"],
    )
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, config.hidden_size**-0.5)
    model.save_pretrained(out)
    tf.AutoTokenizer.from_pretrained(reference).save_pretrained(out)
    return out


def run_config(ckpt: Path, workload: Path, run_dir: Path, args: argparse.Namespace, **actor: object) -> dict:
    rows = args.prompts * 4
    return {
        "model_path": str(ckpt),
        "data": {"train_files": [str(workload)], "max_prompt_length": 64, "train_batch_size": args.prompts},
        "actor": {
            "ppo_mini_batch_size": rows,
            "micro_batch_size": args.micro_batch,
            "use_kl_loss": True,
            "optim": {"lr": 1e-5},
            **actor,
        },
        "rollout": {"n": 4, "response_length": args.response_length, "slots": rows, "ignore_eos": True},
        "reward": {"function": f"{ROOT / 'scripts' / 'bench' / 'peers' / 'reward.py'}:compute_score"},
        "algorithm": {"name": "grpo"},
        "trainer": {
            "run_dir": str(run_dir),
            "total_steps": args.steps,
            "backend": "local",
            "resume": "never",
            "logger": ["jsonl"],
            "plot": False,
            "progress": False,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layout-steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--response-length", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/moe.json"))
    tiny = {"steps": 1, "layout_steps": 1, "prompts": 2, "micro_batch": 8, "response_length": 8}
    args = parse_args(parser, tiny=tiny)

    import jax
    from workload import write_workload

    from hfjax.config.rl import load_rl_config
    from hfjax.trainer.launch import run_rl

    reference = default_checkpoint(None, args.tiny)
    root = Path(tempfile.mkdtemp(prefix="hfjax-bench-moe-"))
    ckpt = moe_checkpoint(reference, root / "moe")
    workload = write_workload(ckpt, workload_dir(args) / "workload.parquet", n=args.prompts)
    rows, results = [], {}
    for replay in (False, True):
        bf16 = {"dtype": "bfloat16", "router_replay": replay}
        history = run_rl(load_rl_config(run_config(ckpt, workload, root / f"replay-{replay}", args, **bf16)))
        means = [h["rollout_corr/log_prob_abs_diff"] for h in history]
        maxima = [h["rollout_corr/log_prob_abs_diff_max"] for h in history]
        results[f"replay_{'on' if replay else 'off'}"] = {"mean_abs_diff": means, "max_abs_diff": maxima}
        for step, (mean, top) in enumerate(zip(means, maxima, strict=True), start=1):
            rows.append([f"bf16 replay {'on' if replay else 'off'}", step, mean, top, "", ""])
    devices = jax.device_count()
    steps = dict(vars(args), steps=args.layout_steps)
    for name, mesh in (("data-parallel", {"fsdp": devices}), ("expert-parallel", {"expert": devices})):
        gen = {"data": devices} if "fsdp" in mesh else mesh
        layouts = {"train_layout": {"mesh": mesh, "rules": "fsdp_tp"}}
        config = run_config(ckpt, workload, root / name, argparse.Namespace(**steps), **layouts)
        config["rollout"]["gen_layout"] = {"mesh": gen, "rules": "dp_tp_gen"}
        last = run_rl(load_rl_config(config))[-1]
        tokens_per_s = args.prompts * 4 * args.response_length / last["timing_s/gen"]
        results[name] = {"gen_tokens_per_s": tokens_per_s, "step_s": last["timing_s/step"], "mesh": mesh}
        rows.append([f"{name} {mesh}", args.layout_steps, "", "", tokens_per_s, last["timing_s/step"]])
    report(
        f"mixture of experts ({EXPERTS} experts, {PER_TOKEN} per token, reference shape): rollout-vs-training "
        f"log-prob mismatch in bfloat16, and layouts over {devices} devices; {args.prompts} prompts x 4 samples x "
        f"{args.response_length} tokens",
        ["run", "step", "mean |dlogp|", "max |dlogp|", "gen tokens/s", "step s"],
        rows,
        args.out,
        results,
    )


if __name__ == "__main__":
    main()
