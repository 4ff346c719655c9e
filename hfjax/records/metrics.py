"""Metrics of a run: one JSON line per logged step in `run_dir/metrics.jsonl` (the record plots and tests read),
TensorBoard scalars under `run_dir/tb` (tensorboardX's event files), and a compact console line of the headline keys.

A resumed run passes `start_step` (the restored step): records after it, from the interrupted run, are dropped from
the JSONL file and hidden in TensorBoard, so the files read as one uninterrupted run.

Every destination writes in the caller's thread (no writer thread that could die and leave the caller waiting). One
that fails (a full or read-only disk) is closed and raises `DiskWriteError` naming its path, the step and the reason.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from tqdm.auto import tqdm

from hfjax.records.run_dir import DiskWriteError, write_failed, writing

log = logging.getLogger(__name__)

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
    """A destination of the metrics (e.g. `hfjax.records.wandb_sink.WandbSink`); `path` is where it writes, which a
    failure names."""

    path: Path

    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends `{"step": step, **values}` to the JSONL file `path`, one flushed line per step."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars as a TensorBoard event file under the directory `path`, flushed at each step. With `purge_step`,
    TensorBoard hides what earlier files of the directory logged from that step on (the events tensorboardX's
    `SummaryWriter` writes for its `purge_step`)."""

    def __init__(self, path: Path, purge_step: int | None = None):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self._writer = EventsWriter(str(path / "events"))
        if purge_step is not None:
            self._writer.write_event(Event(step=purge_step, file_version="brain.Event:2"))
            self._writer.write_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self._writer.flush()

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar

        now = time.time()
        for key, value in values.items():
            self._writer.write_event(Event(wall_time=now, step=step, summary=scalar(key, value)))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _close_failed(sink: MetricsSink) -> None:
    """Closes a sink that failed; a second failure while closing it is only logged (the first is what is reported)."""
    try:
        sink.close()
    except Exception as exc:
        log.debug("closing the failed metrics destination %s also failed: %s", sink.path, exc)


class MetricsLogger:
    """Writes each `log(step, metrics)` to JSONL, TensorBoard, the console and any further `sinks`, each optional.

    `console_keys` chooses the console columns (default: the `HEADLINE_KEYS` present, else the first few keys).
    With `write=False` (processes other than the first of a multi-host run) nothing is written. The logger owns
    `sinks` (closes them). A destination that cannot be opened or written raises `DiskWriteError`; one that fails
    while logging is closed first, and the others stay open until `close()`.
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
        self._sinks: list[MetricsSink] = list(sinks) if write else []
        if not write:
            return
        try:
            self._open(jsonl, tensorboard, start_step)
        except BaseException:
            for sink in self._sinks:
                _close_failed(sink)
            raise

    def _open(self, jsonl: bool, tensorboard: bool, start_step: int | None) -> None:
        path = self.run_dir / METRICS_FILE
        with writing(self.run_dir, "creating the run directory"):
            self.run_dir.mkdir(parents=True, exist_ok=True)
        if start_step is not None:
            with writing(path, f"rewinding the metrics to step {start_step}"):
                self._drop_after(start_step)
        if jsonl:
            with writing(path, "opening the metrics file"):
                self._sinks.insert(0, JsonlSink(path))
        if tensorboard:
            purge = None if start_step is None else start_step + 1
            with writing(self.run_dir / TENSORBOARD_DIR, "opening TensorBoard's event file"):
                self._sinks.append(TensorBoardSink(self.run_dir / TENSORBOARD_DIR, purge))

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
        for sink in list(self._sinks):
            try:
                sink.log(int(step), values)
            except Exception as exc:
                self._sinks.remove(sink)
                _close_failed(sink)
                raise write_failed(sink.path, f"writing the metrics of step {step}", exc) from exc
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
        """Closes every destination; the first that fails raises `DiskWriteError` once all are closed."""
        sinks, self._sinks = self._sinks, []
        failed: DiskWriteError | None = None
        for sink in sinks:
            try:
                sink.close()
            except Exception as exc:
                failed = failed or write_failed(sink.path, "closing the metrics", exc)
        if failed is not None:
            raise failed

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
