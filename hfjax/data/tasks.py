"""The built-in tasks `hfjax data NAME --out DIR` writes in the prompt schema: `gsm8k` (from a local copy, or the Hub
dataset `openai/gsm8k` through the local cache or a download when online) and `addition` (the quickstart's synthetic
task, built locally)."""

from __future__ import annotations

from pathlib import Path

from hfjax.data.gsm8k import DATA_SOURCE, convert_gsm8k
from hfjax.data.records import DataError
from hfjax.data.synthetic import AdditionTask, write_addition_task

TASKS = ("gsm8k", "addition")


def prepare_task(name: str, out_dir: str | Path, source: str | Path | None = None) -> dict[str, Path]:
    """Writes task `name` under `out_dir`; returns the files by split. `source`: a local folder of the task's raw
    files (gsm8k: `train.jsonl`/`test.jsonl` or the Hub dataset's parquet shards), else the Hub's copy."""
    if name == "addition":
        if source is not None:
            raise DataError("--from: the addition task is generated, it reads no files")
        return write_addition_task(AdditionTask(), out_dir)
    if name == "gsm8k":
        from hfjax.models.hub import snapshot

        folder = Path(source) if source is not None else snapshot(DATA_SOURCE, "--from", "dataset", ["main/*"])
        return convert_gsm8k(folder, out_dir)
    raise DataError(f"task: expected one of {', '.join(TASKS)}, got {name!r}")
