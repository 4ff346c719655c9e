"""`hfjax quickstart [CONFIG] [key=value ...]`: the parser; the pipeline (`hfjax.cli.quickstart`) loads only when
the command runs, so that `hfjax` starts without importing JAX (`--devices` must come first)."""

from __future__ import annotations

import argparse
from typing import Any

QUICKSTART_CONFIG = "quickstart.yaml"  # the shipped config `hfjax quickstart` runs by default


def add_parser(sub: Any) -> None:
    """`hfjax quickstart [CONFIG] [key=value ...]`."""
    quickstart = sub.add_parser("quickstart", help="SFT then RL on a synthetic addition task, built locally")
    quickstart.add_argument(
        "config",
        nargs="?",
        default=QUICKSTART_CONFIG,
        help="YAML config (default: the shipped one); an argument with '=' is an override, not a config",
    )
    quickstart.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rl.algorithm.name=ppo")
    quickstart.set_defaults(run=run, default_config=QUICKSTART_CONFIG)


def run(args: argparse.Namespace) -> int:
    from hfjax.cli.quickstart import quickstart_main

    return quickstart_main(args.config, args.overrides)
