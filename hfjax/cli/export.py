"""`hfjax export RUN_DIR --out DIR [--adapters]`: a run's actor checkpoint as a Hugging Face model, or a LoRA actor's
adapters as a PEFT adapter directory."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    export = sub.add_parser("export", help="write a run's actor checkpoint as a Hugging Face model")
    export.add_argument("run_dir")
    export.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    export.add_argument("--out", required=True)
    export.add_argument(
        "--adapters",
        action="store_true",
        help="a LoRA actor: write its adapters as a PEFT adapter directory instead of merged weights",
    )
    export.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hfjax.trainer.launch import export_run

    step = export_run(args.run_dir, args.step, args.out, adapters=args.adapters)
    print(f"exported step {step} of {args.run_dir} to {args.out}")
    return 0
