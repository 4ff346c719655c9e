"""Curves a person can look at: reads a run's `metrics.jsonl` (one JSON object per line, `{"step": int, "<metric>":
number, ...}` with verl's metric names) and writes PNG panels (reward/score, KL, response length, entropy, throughput,
validation) plus an overview of all of them; `compare_runs` overlays one metric of several runs (hfjax vs a peer).
Backs `hfjax plot RUN_DIR [--out DIR]`. Renders with matplotlib's Agg canvas (no pyplot, no global backend state).
Imports matplotlib, numpy and the standard library only: never JAX or other hfjax modules."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

METRICS_FILE = "metrics.jsonl"
PANEL_SIZE = (6.0, 4.0)  # inches per panel
DPI = 100
OVERVIEW_COLUMNS = 3

Series = tuple[np.ndarray, np.ndarray]  # (steps, values), sorted by step


class PlotError(ValueError):
    """A metrics file that is missing or malformed, or a metric a comparison asks for that a run lacks."""


@dataclass(frozen=True)
class Panel:
    """One plot: the metrics it draws, named exactly (`keys`) or by prefix (`prefixes`)."""

    name: str
    title: str
    ylabel: str
    keys: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()

    def select(self, names: Sequence[str]) -> list[str]:
        """The metrics of `names` this panel draws: its exact keys in their listed order, then prefix matches sorted."""
        present = set(names)
        matched = sorted(n for n in present if self.prefixes and n.startswith(self.prefixes) and n not in self.keys)
        return [k for k in self.keys if k in present] + matched


PANELS = (
    Panel("reward", "Reward / score", "mean per sequence", keys=("critic/score/mean", "critic/rewards/mean")),
    Panel("kl", "KL", "KL", keys=("actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty")),
    Panel("response_length", "Response length", "tokens", keys=("response_length/mean",)),
    Panel("entropy", "Entropy", "nats / token", keys=("actor/entropy",)),
    Panel("throughput", "Throughput", "tokens / s", keys=("perf/throughput",)),
    Panel("validation", "Validation", "score", prefixes=("val/", "val-core/", "val-aux/")),
)


def metrics_path(run: str | Path) -> Path:
    """The metrics file of `run`: the path itself when it is a file, else `run/metrics.jsonl`."""
    run = Path(run)
    return run if run.is_file() else run / METRICS_FILE


def _number(value: object, where: str, key: str) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PlotError(f"{where}: metric '{key}': expected a number or null, got {value!r}")
    return float(value)


def load_metrics(run: str | Path) -> dict[str, Series]:
    """Every metric of a run's metrics file as (steps, values) sorted by step. A step logged twice (a resumed run)
    keeps its last value; null values are NaN (a gap in the curve). Blank lines are skipped."""
    path = metrics_path(run)
    if not path.is_file():
        raise PlotError(f"{path}: no such file; expected the {METRICS_FILE} a training run writes")
    points: dict[str, dict[int, float]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PlotError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
            if not isinstance(row, dict):
                raise PlotError(f"{where}: expected a JSON object, got {type(row).__name__}")
            step = row.get("step")
            if isinstance(step, bool) or not isinstance(step, int):
                raise PlotError(f"{where}: field 'step': expected an integer, got {step!r}")
            for key, value in row.items():
                if key != "step":
                    points.setdefault(key, {})[step] = _number(value, where, key)
    if not points:
        raise PlotError(f'{path}: no metrics found; expected lines like {{"step": 1, "critic/score/mean": 0.5}}')
    series = {}
    for key, by_step in points.items():
        steps = np.array(sorted(by_step), dtype=np.int64)
        series[key] = (steps, np.array([by_step[s] for s in steps], dtype=np.float64))
    return series


def _style(ax, title: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _draw(ax, panel: Panel, keys: list[str], metrics: dict[str, Series]) -> None:
    for key in keys:
        steps, values = metrics[key]
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
    _style(ax, panel.title, panel.ylabel)


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, format="png")
    return path


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Writes `<panel>.png` for each panel with at least one metric present, then `overview.png` with all of them,
    into `out_dir` (default `run_dir/plots`); returns the paths in that order."""
    metrics = load_metrics(run_dir)
    out = Path(out_dir) if out_dir is not None else metrics_path(run_dir).parent / "plots"
    out.mkdir(parents=True, exist_ok=True)
    drawn = [(p, keys) for p in PANELS if (keys := p.select(list(metrics)))]
    if not drawn:
        known = [k for p in PANELS for k in p.keys] + [f"{x}*" for p in PANELS for x in p.prefixes]
        raise PlotError(f"{metrics_path(run_dir)}: none of its metrics {sorted(metrics)} is plotted; expected {known}")
    paths = []
    for panel, keys in drawn:
        fig = Figure(figsize=PANEL_SIZE)
        _draw(fig.add_subplot(), panel, keys, metrics)
        paths.append(_save(fig, out / f"{panel.name}.png"))
    cols = min(OVERVIEW_COLUMNS, len(drawn))
    rows = math.ceil(len(drawn) / cols)
    fig = Figure(figsize=(PANEL_SIZE[0] * cols, PANEL_SIZE[1] * rows))
    for i, (panel, keys) in enumerate(drawn, start=1):
        _draw(fig.add_subplot(rows, cols, i), panel, keys, metrics)
    paths.append(_save(fig, out / "overview.png"))
    return paths


def compare_runs(
    run_dirs: Sequence[str | Path], labels: Sequence[str], metric: str, out: str | Path, title: str | None = None
) -> Path:
    """Overlays `metric` of several runs (each a run directory or its metrics file) on one plot, saved as PNG `out`."""
    if len(run_dirs) != len(labels) or not run_dirs:
        raise PlotError(f"compare_runs: expected one label per run, got {len(run_dirs)} runs and {len(labels)} labels")
    fig = Figure(figsize=PANEL_SIZE)
    ax = fig.add_subplot()
    for run, label in zip(run_dirs, labels, strict=True):
        metrics = load_metrics(run)
        if metric not in metrics:
            raise PlotError(f"{metrics_path(run)}: no metric '{metric}'; it has {sorted(metrics)}")
        steps, values = metrics[metric]
        ax.plot(steps, values, marker="o", markersize=3, label=label)
    _style(ax, title or metric, metric)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, out)


def add_plot_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds `RUN_DIR [--out DIR]` to `parser` (for `hfjax plot`)."""
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help=f"a run directory holding {METRICS_FILE}")
    parser.add_argument("--out", type=Path, default=None, help="where to write the PNGs (default RUN_DIR/plots)")
    return parser


def plot_command(args: argparse.Namespace) -> int:
    """`hfjax plot` on parsed arguments: writes the PNGs and prints their paths; a bad file exits with its error."""
    try:
        paths = plot_run(args.run_dir, args.out)
    except PlotError as exc:
        raise SystemExit(f"hfjax plot: {exc}") from exc
    for path in paths:
        print(path)
    return 0


def plot_main(argv: Sequence[str] | None = None) -> int:
    """`hfjax plot RUN_DIR [--out DIR]` as a function of its arguments."""
    parser = add_plot_arguments(argparse.ArgumentParser(prog="hfjax plot", description=plot_run.__doc__))
    return plot_command(parser.parse_args(argv))
