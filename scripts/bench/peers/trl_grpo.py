"""TRL's `GRPOTrainer` on CPU with the workload of hfjax's GRPO benchmark: the peer side of the side-by-side.

Workload (the project's standard "one RL step"): the reference checkpoint (fp32), the 64 prompts of
`workload.py` (<= 64 tokens, seed 0), 4 samples per prompt (group size 4), responses of exactly 128 tokens
(`--min-new-tokens` defaults to the maximum, so every step does the same work whatever the random model samples),
temperature 1.0 with no top-k/top-p, the rule reward of `reward.py` (fraction of digits), a reference model with
k3 ("low_var_kl") KL loss `--beta`, token-mean loss, group-normalized advantages, clip 0.2, one AdamW update per step
over all 256 samples (gradient accumulation over `--micro-batch`), constant learning rate, grad clip 1.0, no gradient
checkpointing, no dropout.

Timing: wall time of each optimizer step (generation, reference and policy log-probs, backward, update), taken by a
trainer callback, split into verl's `timing_s/{gen,reward,ref,update_actor}` from TRL's own profiling sections.
`seconds_per_step` is the median over the steps after the first (the first when only one ran); `tokens_per_s`
divides the tokens of those steps (prompt + response tokens, verl's `perf/throughput`) by their time.
Writes the summary JSON (`--out`) and the per-step metrics with verl's names as JSONL (`--metrics`), which
`hfjax.records.plot.compare_runs` draws. Run in the TRL virtualenv (`bash scripts/bench/peers/setup_trl.sh` makes it):
    runs/peers/trl-venv/bin/python scripts/bench/peers/trl_grpo.py [--ckpt DIR] [--steps 2] [--tiny]
With `--tiny` and no TRL installed, only the workload is built and the summary says why training was skipped.
Imports torch, transformers, datasets and trl, and `workload.py`/`reward.py` beside it; never hfjax's JAX code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from bench_common import parse_args as parse_with_tiny  # noqa: E402
from bench_common import peak_rss_bytes  # noqa: E402
from reward import trl_reward  # noqa: E402
from workload import DEFAULT_OUT, ROOT, checkpoint, write_workload  # noqa: E402

# TRL's logged metric -> verl's name (the names hfjax logs and hfjax.records.plot draws)
TRL_TO_VERL = {
    "reward": "critic/score/mean",
    "reward_std": "critic/score/std",
    "kl": "actor/kl_loss",
    "entropy": "actor/entropy",
    "policy_loss": "actor/pg_loss",
    "grad_norm": "actor/grad_norm",
    "learning_rate": "actor/lr",
    "clip_ratio/region_mean": "actor/pg_clipfrac",
    "completions/mean_length": "response_length/mean",
    "completions/max_length": "response_length/max",
    "completions/min_length": "response_length/min",
    "completions/clipped_ratio": "response_length/clip_ratio",
}
WORKLOAD_ARGS = (
    "prompts",
    "group",
    "max_prompt_tokens",
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "beta",
    "lr",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, help="policy/reference checkpoint (default: the benchmark reference one)")
    parser.add_argument("--workload", type=Path, help=f"verl-schema prompts (default: rebuilt at {DEFAULT_OUT})")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--min-new-tokens", type=int, help="default: --max-new-tokens (fixed-length responses)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--beta", type=float, default=0.001, help="KL loss coefficient (> 0: a reference model)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--micro-batch", type=int, default=32, help="samples per forward/backward pass")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "peers" / "trl_grpo.json")
    parser.add_argument("--metrics", type=Path, default=ROOT / "runs" / "peers" / "trl" / "metrics.jsonl")
    tiny = {"steps": 1, "prompts": 2, "max_new_tokens": 8, "micro_batch": 8}
    args = parse_with_tiny(parser, tiny=tiny)
    if args.min_new_tokens is None:
        args.min_new_tokens = args.max_new_tokens
    samples = args.prompts * args.group
    if args.steps < 1 or args.beta <= 0 or samples % args.micro_batch:
        parser.error(
            f"expected --steps >= 1, --beta > 0, and --micro-batch ({args.micro_batch}) dividing prompts x group "
            f"({samples})"
        )
    return args


def load_prompts(path: Path, n: int) -> Any:
    """The first `n` rows of a verl-schema parquet as a `datasets.Dataset` (conversational `prompt` column)."""
    import datasets
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    if len(rows) < n:
        raise SystemExit(f"{path}: {len(rows)} prompts, expected at least --prompts {n}")
    return datasets.Dataset.from_list(rows[:n])


def grpo_config(args: argparse.Namespace, output_dir: Path) -> Any:
    """The `GRPOConfig` of the workload in the module docstring."""
    from trl import GRPOConfig

    samples = args.prompts * args.group
    return GRPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        model_init_kwargs={"dtype": "float32"},
        gradient_checkpointing=False,
        disable_dropout=True,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=samples // args.micro_batch,
        num_generations=args.group,
        max_completion_length=args.max_new_tokens,
        generation_kwargs={"min_new_tokens": args.min_new_tokens},
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        beta=args.beta,
        num_iterations=1,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=args.steps,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        dataloader_num_workers=0,
    )


def phase_seconds(profiled: dict[str, float], step_seconds: float) -> dict[str, float]:
    """verl's timing names from TRL's profiled sections of one step: generation, the reward function, the reference
    log-probs with the batch's bookkeeping (the rest of `_prepare_inputs`), and the policy update (the rest)."""
    gen = profiled.get("GRPOTrainer.transformers.generate", 0.0)
    reward = profiled.get("GRPOTrainer.trl_reward", 0.0)
    prepare = profiled.get("GRPOTrainer._prepare_inputs", 0.0)
    return {
        "timing_s/gen": gen,
        "timing_s/reward": reward,
        "timing_s/ref": prepare - gen - reward,
        "timing_s/update_actor": step_seconds - prepare,
        "timing_s/step": step_seconds,
    }


def step_recorder(metrics_path: Path) -> Any:
    """A trainer callback that times each optimizer step and its phases (from TRL's profiling sections, captured by
    replacing `ProfilingContext._log_metrics`, which otherwise only reports to wandb/mlflow/trackio) and appends the
    step's metrics with verl's names to `metrics_path`."""
    from transformers import TrainerCallback
    from trl.extras.profiling import ProfilingContext

    profiled: dict[str, float] = {}

    def capture(context: ProfilingContext, duration: float) -> None:
        profiled[context.name] = profiled.get(context.name, 0.0) + duration

    ProfilingContext._log_metrics = capture

    class StepRecorder(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.tokens: list[int] = []
            self.response_tokens: list[int] = []
            self.phases: list[dict[str, float]] = []
            self._started = 0.0
            self._tokens_seen = 0
            metrics_path.parent.mkdir(parents=True, exist_ok=True)
            metrics_path.write_text("")

        def on_step_begin(self, args, state, control, **kwargs):
            profiled.clear()
            self._started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self._started)
            self.phases.append(phase_seconds(profiled, self.seconds[-1]))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:
                return  # the end-of-training summary
            tokens = int(logs["num_tokens"]) - self._tokens_seen
            self._tokens_seen = int(logs["num_tokens"])
            samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
            self.tokens.append(tokens)
            self.response_tokens.append(round(logs["completions/mean_length"] * samples))
            row = {"step": state.global_step}
            row.update({verl: logs[trl] for trl, verl in TRL_TO_VERL.items() if trl in logs})
            row.update({"perf/throughput": tokens / self.seconds[-1], **self.phases[-1]})
            with open(metrics_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            phases = ", ".join(f"{k.split('/')[1]} {v:.1f} s" for k, v in self.phases[-1].items())
            print(f"step {state.global_step}: {tokens / self.seconds[-1]:,.0f} tokens/s, reward {logs['reward']:.4f}; "
                  f"{phases}", flush=True)  # fmt: skip

    return StepRecorder()


def summary(recorder: Any) -> dict[str, Any]:
    """Seconds per step and tokens/s over the steady steps (all but the first, when more than one ran)."""
    steady = slice(1, None) if len(recorder.seconds) > 1 else slice(None)
    seconds, tokens = recorder.seconds[steady], recorder.tokens[steady]
    return {
        "seconds_per_step": statistics.median(seconds),
        "tokens_per_s": sum(tokens) / sum(seconds),
        "response_tokens_per_s": sum(recorder.response_tokens[steady]) / sum(seconds),
        "first_step_seconds": recorder.seconds[0],
        "step_seconds": recorder.seconds,
        "step_tokens": recorder.tokens,
        "step_phase_seconds": recorder.phases,
    }


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ckpt = checkpoint(args.ckpt, args.tiny)
    prompts_file = args.out.parent / "workload.parquet" if args.tiny else DEFAULT_OUT
    workload = args.workload or write_workload(ckpt, prompts_file, args.prompts, args.max_prompt_tokens)
    try:
        import trl
    except ImportError as exc:
        if not args.tiny:
            raise
        skipped = {"peer": "trl", "skipped": f"training skipped: {exc}", "workload": str(workload)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(skipped, indent=2))
        print(f"{skipped['skipped']}; wrote {args.out}")
        return
    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    recorder = step_recorder(args.metrics)
    trainer = trl.GRPOTrainer(
        model=str(ckpt),
        reward_funcs=trl_reward,
        args=grpo_config(args, args.out.parent / "trl-trainer"),
        train_dataset=load_prompts(workload, args.prompts),
        callbacks=[recorder],
    )
    load_before = os.getloadavg()
    started = time.perf_counter()
    trainer.train()
    result = {
        "peer": "trl",
        **summary(recorder),
        "steps": len(recorder.seconds),
        "metrics_jsonl": str(args.metrics),
        "train_seconds": time.perf_counter() - started,
        "peak_rss_bytes": peak_rss_bytes(),
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_average_1_5_15min": {"before": load_before, "after": os.getloadavg()},
        "workload": {
            "ckpt": str(ckpt.resolve()),
            "prompts_file": str(workload.resolve()),
            **{k: getattr(args, k) for k in WORKLOAD_ARGS},
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"TRL GRPO: {result['seconds_per_step']:.1f} s/step, {result['tokens_per_s']:,.0f} tokens/s "
          f"(first step {result['first_step_seconds']:.1f} s); wrote {args.out} and {args.metrics}")  # fmt: skip


if __name__ == "__main__":
    main()
