"""Curves a person can look at: reads a run's `metrics.jsonl` (one JSON object per line, `{"step": int, "<metric>":
number, ...}` with verl's metric names) and writes PNG panels (reward/score, KL, response length, entropy, throughput,
validation) plus an overview of all of them; `compare_runs` overlays one metric of several runs (hfjax vs a peer);
`plot_timeline` draws a run's `timeline.jsonl` (spans of work per worker group, `hfjax.trainer.timeline`) as a Gantt
chart.
Backs `hfjax plot RUN_DIR [--out DIR]`. Renders with matplotlib's Agg canvas (no pyplot, no global backend state). A PNG
that cannot be written (a full or read-only disk) raises `DiskWriteError` naming it."""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from hfjax.records.run_dir import DiskWriteError, writing

METRICS_FILE = "metrics.jsonl"
PANEL_SIZE = (6.0, 4.0)  # inches per panel
DPI = 100
OVERVIEW_COLUMNS = 3
TIMELINE_FILE = "timeline.jsonl"
TIMELINE_WIDTH = 12.0  # inches
TIMELINE_HEIGHT = (1.8, 0.5)  # inches: fixed + per lane
TIMELINE_STEP_LABELS = 20  # at most this many step numbers along the top
TIMELINE_STEP_LINES = 200  # a line at every step up to this many steps, else only at the labelled ones
_TIMELINE_EXAMPLE = '{"step": 1, "group": "rollout", "name": "generate", "start": 0.0, "end": 2.5}'

Series = tuple[np.ndarray, np.ndarray]  # (steps, values), sorted by step


log = logging.getLogger(__name__)


class PlotError(ValueError):
    """A metrics or timeline file that is missing or malformed, or a metric a comparison asks for that a run lacks."""


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
    Panel("throughput", "Throughput", "tokens / s", keys=("perf/throughput", "perf/tokens_per_s")),
    Panel("train_loss", "Training loss (SFT, reward model)", "loss", keys=("train/loss",)),
    Panel("agent", "Agent turns", "per trajectory", keys=("agent/turns_mean", "agent/tool_calls_mean")),
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


def _step_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """(`file:line`, row) of every non-blank line of a JSONL file whose rows are objects with an integer `step`;
    `PlotError` naming the line otherwise."""
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
            yield where, row


def load_metrics(run: str | Path) -> dict[str, Series]:
    """Every metric of a run's metrics file as (steps, values) sorted by step. A step logged twice (a resumed run)
    keeps its last value; null values are NaN (a gap in the curve). Blank lines are skipped."""
    path = metrics_path(run)
    if not path.is_file():
        raise PlotError(f"{path}: no such file; expected the {METRICS_FILE} a training run writes")
    points: dict[str, dict[int, float]] = {}
    for where, row in _step_rows(path):
        for key, value in row.items():
            if key != "step":
                points.setdefault(key, {})[row["step"]] = _number(value, where, key)
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
    with writing(path, "writing the plot"):
        fig.savefig(path, dpi=DPI, format="png")
    return path


def _make_dir(out: Path) -> Path:
    with writing(out, "creating the plots' directory"):
        out.mkdir(parents=True, exist_ok=True)
    return out


def timeline_path(run: str | Path) -> Path:
    """The timeline file of `run`: the path itself when it is a file, else `run/timeline.jsonl`."""
    run = Path(run)
    return run if run.is_file() else run / TIMELINE_FILE


def load_timeline(run: str | Path) -> list[dict]:
    """The spans of a run's timeline file in file order, each `{"step": int, "group": str, "name": str, "start":
    float, "end": float}` (seconds since the run's start). Blank lines are skipped."""
    path = timeline_path(run)
    if not path.is_file():
        raise PlotError(f"{path}: no such file; expected the {TIMELINE_FILE} a training run writes")
    spans = []
    for where, row in _step_rows(path):
        for key in ("group", "name"):
            if not isinstance(row.get(key), str) or not row[key]:
                raise PlotError(f"{where}: field '{key}': expected a non-empty string, got {row.get(key)!r}")
        start, end = (_number(row.get(k), where, k) for k in ("start", "end"))
        if not (math.isfinite(start) and math.isfinite(end) and start <= end):
            raise PlotError(f"{where}: expected finite 'start' <= 'end', got {start!r} and {end!r}")
        spans.append({"step": row["step"], "group": row["group"], "name": row["name"], "start": start, "end": end})
    return spans


def timeline_figsize(groups: int) -> tuple[float, float]:
    """The size in inches of a timeline chart with `groups` lanes."""
    return TIMELINE_WIDTH, TIMELINE_HEIGHT[0] + TIMELINE_HEIGHT[1] * groups


def _draw_timeline(spans: list[dict], out: Path, title: str) -> Path:
    groups = sorted({s["group"] for s in spans})
    names = sorted({s["name"] for s in spans})
    cmap = colormaps["tab10" if len(names) <= 10 else "tab20"]
    colors = {name: cmap(i % cmap.N) for i, name in enumerate(names)}
    fig = Figure(figsize=timeline_figsize(len(groups)))
    ax = fig.add_subplot()
    for lane, group in enumerate(groups):
        for name in names:
            bars = [(s["start"], s["end"] - s["start"]) for s in spans if s["group"] == group and s["name"] == name]
            if bars:
                ax.broken_barh(bars, (lane - 0.4, 0.8), facecolors=colors[name], edgecolor="none", alpha=0.9)
    firsts: dict[int, float] = {}
    for s in spans:
        firsts[s["step"]] = min(firsts.get(s["step"], math.inf), s["start"])
    steps = sorted(firsts)
    labelled = set(steps[:: math.ceil(len(steps) / TIMELINE_STEP_LABELS)])
    for step in steps:
        if step in labelled or len(steps) <= TIMELINE_STEP_LINES:
            ax.axvline(firsts[step], color="0.3", linewidth=0.5, alpha=0.6)
        if step in labelled:
            x = firsts[step]
            ax.text(x, 1.01, str(step), transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=7)
    ax.set_yticks(range(len(groups)), groups)
    ax.set_ylim(len(groups) - 0.5, -0.5)  # the first group on top
    ax.set_xlim(min(0.0, min(s["start"] for s in spans)), max(s["end"] for s in spans))
    ax.set_xlabel("seconds since start")
    ax.set_title(f"{title} (step numbers at each step's first start)", pad=14)
    ax.grid(axis="x", alpha=0.3)
    rows = max(1, int(fig.get_figheight() / 0.25))
    ax.legend(handles=[Patch(facecolor=colors[n], label=n) for n in names], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize="small", ncols=math.ceil(len(names) / rows))  # fmt: skip
    return _save(fig, out)


def plot_timeline(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Writes `timeline.png`, a Gantt chart of the run's timeline file (one lane per worker group, one bar per span
    coloured by its name, a line at each step's first start), into `out_dir` (default `run_dir/plots`)."""
    path, spans = timeline_path(run_dir), load_timeline(run_dir)
    if not spans:
        raise PlotError(f"{path}: no spans found; expected lines like {_TIMELINE_EXAMPLE}")
    out = _make_dir(Path(out_dir) if out_dir is not None else path.parent / "plots")
    return _draw_timeline(spans, out / "timeline.png", f"Timeline of {path.parent.name}")


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Writes `<panel>.png` for each panel with at least one metric present, then `overview.png` with all of them,
    then `timeline.png` when the run has a non-empty timeline file, into `out_dir` (default `run_dir/plots`);
    returns the paths in that order."""
    metrics = load_metrics(run_dir)
    out = _make_dir(Path(out_dir) if out_dir is not None else metrics_path(run_dir).parent / "plots")
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
    timeline = metrics_path(run_dir).parent / TIMELINE_FILE
    if timeline.is_file() and (spans := load_timeline(timeline)):
        paths.append(_draw_timeline(spans, out / "timeline.png", f"Timeline of {timeline.parent.name}"))
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
    _make_dir(out.parent)
    return _save(fig, out)


def plot_finished_run(run_dir: str | Path) -> None:
    """Draws the PNGs of a run that just ended into `run_dir/plots` and logs where; metrics that cannot be drawn only
    give a warning (the run itself is done and saved), a PNG that cannot be written raises `DiskWriteError`."""
    try:
        paths = plot_run(run_dir)
    except PlotError as exc:
        log.warning("no plots drawn for %s: %s", run_dir, exc)
        return
    except DiskWriteError as exc:
        raise DiskWriteError(
            f"{exc}; the run itself finished and is saved: free space, then draw its plots with `hfjax plot {run_dir}`"
        ) from exc
    log.info("plots of %s: %s", run_dir, paths[0].parent)


def add_plot_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds `RUN_DIR [--out DIR]` to `parser` (for `hfjax plot`)."""
    where = f"a run directory holding {METRICS_FILE} (and {TIMELINE_FILE})"
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help=where)
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
