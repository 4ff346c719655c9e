"""`hfjax sft` and `hfjax rm`: supervised fine-tuning and reward-model training from a YAML config."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    for name, text in (("sft", "supervised fine-tuning"), ("rm", "Bradley-Terry reward-model training")):
        supervised = sub.add_parser(name, help=f"{text} from a YAML config")
        supervised.add_argument("config")
        supervised.add_argument("overrides", nargs="*", help="key=value overrides")
        supervised.add_argument("--devices", type=int, help="on CPU: number of fake devices of this process")
        supervised.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hfjax.trainer import rm_main, sft_main

    return (sft_main if args.command == "sft" else rm_main)(args.config, args.overrides)
