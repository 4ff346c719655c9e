"""Converts GSM8K's JSONL files (train.jsonl, test.jsonl with question/answer, given as local files) to hfjax's
prompt schema (verl's) in parquet, plus SFT files. Nothing is downloaded.
Usage: python scripts/prepare_gsm8k.py IN_DIR OUT_DIR
Writes OUT_DIR/{train,test}.parquet and OUT_DIR/sft_{train,test}.parquet for each input present.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hfjax.data.gsm8k import convert_gsm8k
from hfjax.data.records import DataError, read_rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("in_dir", type=Path, help="folder with GSM8K's train.jsonl and/or test.jsonl")
    parser.add_argument("out_dir", type=Path, help="folder to write the parquet files to")
    args = parser.parse_args()
    try:
        written = convert_gsm8k(args.in_dir, args.out_dir)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, path in written.items():
        print(f"{name}: {len(read_rows(path))} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
