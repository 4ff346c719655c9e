"""`hfjax train CONFIG [key=value ...]`: run an RL config, or with `--dry-run` print the resolved run and start
nothing."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    train = sub.add_parser("train", help="run an RL config (PPO, GRPO, RLOO, REINFORCE++, ReMax, Safe-RLHF)")
    train.add_argument("config", help="YAML config (see configs/)")
    train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. actor.optim.lr=1e-5")
    train.add_argument("--devices", type=int, help="on CPU: number of fake devices of this process")
    train.add_argument(
        "--dry-run",
        "--print-config",
        action="store_true",
        help="print the resolved config, worker groups, layouts and the cost model's memory per device; start nothing",
    )
    train.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hfjax.config.rl import load_rl_config
    from hfjax.trainer.launch import run_rl

    cfg = load_rl_config(args.config, args.overrides)
    if args.dry_run:
        from hfjax.trainer.dry_run import describe_run

        print(describe_run(cfg))
        return 0
    history = run_rl(cfg)
    last = history[-1] if history else {}
    keys = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "timing_s/step")
    print("final step: " + ", ".join(f"{k}={last[k]:.4g}" for k in keys if k in last))
    return 0
