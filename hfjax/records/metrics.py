"""Metrics of a run: one JSON line per logged step in `run_dir/metrics.jsonl` (the record plots and tests read),
TensorBoard scalars under `run_dir/tb` (tensorboardX), and a compact console line of the headline keys.

A resumed run passes `start_step` (the restored step): records after it, from the interrupted run, are dropped from
the JSONL file and hidden in TensorBoard, so the files read as one uninterrupted run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from tqdm.auto import tqdm

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tb"
HEADLINE_KEYS = (
    "train/loss",
    "train/accuracy",
    "val/loss",
    "val/accuracy",
    "critic/score/mean",
    "actor/pg_loss",
    "actor/ppo_kl",
    "actor/entropy",
    "critic/vf_loss",
    "response_length/mean",
    "train/grad_norm",
    "train/lr",
)
FALLBACK_KEYS = 6  # keys shown when none of HEADLINE_KEYS is logged


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of `run_dir/metrics.jsonl` in order (a last line cut off by a crash is ignored)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number < len(lines):
                raise ValueError(f"{path}:{number}: not a JSON record ({e})") from e
    return records


def _number(key: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"metric {key!r}: expected a number, got {value!r}") from e


class MetricsSink(Protocol):
    """Another destination of the metrics (e.g. `hfjax.records.wandb_sink.WandbSink`)."""

    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class MetricsLogger:
    """Writes each `log(step, metrics)` to JSONL, TensorBoard, the console and any further `sinks`, each optional.

    `console_keys` chooses the console columns (default: the `HEADLINE_KEYS` present, else the first few keys).
    With `write=False` (processes other than the first of a multi-host run) nothing is written.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        console: bool = True,
        jsonl: bool = True,
        tensorboard: bool = True,
        sinks: Sequence[MetricsSink] = (),
        console_keys: Sequence[str] | None = None,
        start_step: int | None = None,
        write: bool = True,
    ):
        self.run_dir = Path(run_dir)
        self.console_keys = tuple(console_keys) if console_keys is not None else None
        self.write = write
        self._console = Console(highlight=False) if console and write else None
        self._tb = None
        self._sinks = list(sinks) if write else []
        self._file = None
        if not write:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if start_step is not None:
            self._drop_after(start_step)
        if jsonl:
            self._file = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        if tensorboard:
            from tensorboardX import SummaryWriter

            purge = None if start_step is None else start_step + 1
            self._tb = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR), purge_step=purge, flush_secs=10)

    def _drop_after(self, step: int) -> None:
        kept = [r for r in read_metrics(self.run_dir) if r.get("step", 0) <= step]
        path = self.run_dir / METRICS_FILE
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, path)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Appends `{"step": step, **metrics}` (values as floats) and writes the scalars at `step`."""
        if not self.write:
            return
        values = {key: _number(key, value) for key, value in metrics.items()}
        if self._file is not None:
            self._file.write(json.dumps({"step": int(step), **values}) + "\n")
            self._file.flush()
        for sink in self._sinks:
            sink.log(int(step), values)
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, global_step=int(step))
        if self._console is not None:
            self._print(step, values)

    def _print(self, step: int, values: Mapping[str, float]) -> None:
        keys = self.console_keys or tuple(k for k in HEADLINE_KEYS if k in values) or tuple(values)[:FALLBACK_KEYS]
        cells = [f"[bold]step {step}[/bold]"]
        cells += [f"{key} [cyan]{values[key]:.4g}[/cyan]" for key in keys if key in values]
        assert self._console is not None
        with self._console.capture() as captured:
            self._console.print(" | ".join(cells), soft_wrap=True)
        tqdm.write(captured.get().rstrip("\n"))  # above any progress bar instead of through it

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
