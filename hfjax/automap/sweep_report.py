"""What `hfjax sweep` shows: a console table of every candidate (measured beside predicted, or its reason), the
JSON of the whole sweep, and a PNG (measured against predicted seconds per iteration; measured and predicted seconds
per stage for each candidate)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from hfjax.automap.sweep import SweepResult, SweepRow
from hfjax.predict.dataflow import STAGES

GIB = 2**30


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.3g}"


def _pair(row: SweepRow, key: str, show=_seconds) -> str:
    """`measured / predicted` of one quantity ('-' for a side that has none)."""
    return f"{show(row.measured.get(key))} / {show(row.predicted.get(key))}"


def _compiled(row: SweepRow) -> str:
    """The compiler's peak GiB per device of a candidate, marked when it does not fit ('-': not compiled)."""
    if not row.compiled:
        return "-"
    peak = _gib(row.compiled["peak_bytes"])
    return peak if row.compiled["fits"] else f"[red]{peak} (does not fit)[/red]"


def print_sweep(result: SweepResult, title: str) -> None:
    """The sweep as a table: per candidate, measured / predicted seconds per stage and per iteration, tokens per
    second, peak GiB per device (and the compiler's, with a target), the measured and predicted ranks, or the reason
    it failed."""
    from rich.console import Console
    from rich.table import Table

    ok = [r for r in result.rows if r.ok]
    measured_rank = {id(r): i for i, r in enumerate(sorted(ok, key=lambda r: r.measured["step_s"]), 1)}
    priced = [r for r in ok if "step_s" in r.predicted]
    predicted_rank = {id(r): i for i, r in enumerate(sorted(priced, key=lambda r: r.predicted["step_s"]), 1)}
    table = Table(title=title)
    compiled = result.target is not None
    columns = ("#", "candidate", *(f"{s} s" for s in STAGES), "iteration s", "tokens/s", "peak GiB/device")
    columns += (f"compiled GiB ({result.target})",) * compiled + ("rank",)
    for column in columns:
        table.add_column(column, justify="left" if column == "candidate" else "right")
    for row in result.rows:
        if not row.ok:
            table.add_row("", row.name, f"[red]failed: {row.error}[/red]", *[""] * (len(columns) - 3))
            continue
        rank = f"{measured_rank[id(row)]} / {predicted_rank.get(id(row), '-')}"
        table.add_row(
            str(ok.index(row) + 1),  # the number of its point and bars in sweep.png
            row.name,
            *(_pair(row, s) for s in STAGES),
            _pair(row, "step_s"),
            f"{row.measured['tokens_per_s']:.4g}",
            _pair(row, "device_peak_bytes", _gib),
            *([_compiled(row)] if compiled else []),
            rank,
        )
    Console(width=220).print(table)
    print("cells: measured / predicted (the cost model); rank: measured / predicted, 1 = fastest")
    for row in result.rows:
        if row.prediction_error:
            print(f"{row.name}: not predicted: {row.prediction_error}")
        if row.compile_error:
            print(f"{row.name}: not compiled for {result.target}: {row.compile_error}")
        for problem in row.compiled.get("problems", []):
            print(f"{row.name}: {problem}")
    rho = result.rank_correlation
    print(
        f"Spearman rank correlation of predicted and measured seconds per iteration: "
        f"{'-' if rho is None else f'{rho:.3f}'} over {len(priced)} candidates"
    )


def write_sweep(result: SweepResult, out_dir: Path) -> tuple[Path, Path]:
    """Writes `sweep.json` and `sweep.png` into `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "sweep.json"
    json_path.write_text(json.dumps(result.to_json(), indent=1))
    png_path = out_dir / "sweep.png"
    _plot(result, png_path)
    return json_path, png_path


def _plot(result: SweepResult, path: Path) -> None:
    rows = [r for r in result.rows if r.ok]
    figure = Figure(figsize=(13, 5), dpi=100)
    FigureCanvasAgg(figure)
    scatter, bars = figure.subplots(1, 2, width_ratios=(1, 1.6))
    priced = [r for r in rows if "step_s" in r.predicted]
    if priced:
        x = [r.predicted["step_s"] for r in priced]
        y = [r.measured["step_s"] for r in priced]
        scatter.scatter(x, y)
        for i, (a, b) in enumerate(zip(x, y, strict=True), 1):
            scatter.annotate(str(i), (a, b), textcoords="offset points", xytext=(4, 4))
        scatter.set_xlabel("predicted s / iteration")
        scatter.set_ylabel("measured s / iteration")
        rho = result.rank_correlation
        scatter.set_title(f"Spearman rho {'-' if rho is None else f'{rho:.2f}'}")
    positions = np.arange(len(rows))
    width = 0.4
    for offset, side, hatch in ((-width / 2, "measured", ""), (width / 2, "predicted", "//")):
        bottom = np.zeros(len(rows))
        for stage, color in zip(STAGES, ("tab:blue", "tab:orange", "tab:green"), strict=True):
            heights = np.array([getattr(r, side).get(stage, 0.0) or 0.0 for r in rows])
            label = f"{stage} ({side})"
            bars.bar(positions + offset, heights, width, bottom=bottom, color=color, hatch=hatch, label=label)
            bottom += heights
    bars.set_xticks(positions, [str(i) for i in range(1, len(rows) + 1)])
    bars.set_xlabel("candidate (# of the table)")
    bars.set_ylabel("s / iteration")
    bars.set_title("stages: measured (plain) and predicted (hatched)")
    bars.legend(fontsize="small", ncols=2)
    figure.tight_layout()
    figure.savefig(path)
