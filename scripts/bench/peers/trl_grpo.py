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
Imports torch, transformers, datasets and trl, and `workload.py`, `reward.py`, `peer_run.py` beside it; never
hfjax's JAX code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from bench_common import parse_args as parse_with_tiny  # noqa: E402
from peer_run import TINY, prepare, workload_parser, write_summary  # noqa: E402
from reward import trl_reward  # noqa: E402
from workload import checkpoint  # noqa: E402

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


def parse_args() -> argparse.Namespace:
    parser = workload_parser(__doc__, "trl")
    parser.add_argument("--min-new-tokens", type=int, help="default: --max-new-tokens (fixed-length responses)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    args = parse_with_tiny(parser, tiny=TINY)
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


def main() -> None:
    args = parse_args()
    ckpt = checkpoint(args.ckpt, args.tiny)
    workload = prepare(args, ckpt, "TRL", "trl")
    if workload is None:
        return
    import torch
    import transformers
    import trl

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
    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    write_summary(args, "TRL", recorder, ckpt, workload, started, load_before, versions=versions,
                  torch_threads=torch.get_num_threads())  # fmt: skip


if __name__ == "__main__":
    main()
