"""`hfjax data TASK --out DIR`: a built-in task's prompts (and SFT rows) in the prompt schema."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    data = sub.add_parser("data", help="write a built-in task's prompts (and SFT rows) in the prompt schema")
    data.add_argument("task", choices=["gsm8k", "addition"])
    data.add_argument("--out", required=True, help="folder to write the parquet files to")
    data.add_argument(
        "--from",
        dest="source",
        help="a local copy of the raw files (default: the Hub dataset, from the local cache or downloaded when online)",
    )
    data.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hfjax.data.records import read_rows
    from hfjax.data.tasks import prepare_task

    for name, path in prepare_task(args.task, args.out, args.source).items():
        print(f"{name}: {len(read_rows(path))} rows -> {path}")
    return 0
