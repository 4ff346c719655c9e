"""`hfjax plot RUN_DIR [--out DIR]`: PNG curves of a run's metrics.jsonl."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    plot = sub.add_parser("plot", help="PNG curves of a run's metrics.jsonl")
    plot.add_argument("plot_args", nargs=argparse.REMAINDER, metavar="RUN_DIR [--out DIR]")
    plot.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hfjax.records.plot import plot_main

    return plot_main(args.plot_args)
