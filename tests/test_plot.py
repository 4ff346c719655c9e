"""Plots: a synthetic metrics.jsonl with random values reads back exactly (re-logged steps keep their last value), the
PNG panels written are exactly those whose metrics are present, each is a real PNG of the expected size with something
drawn on it, run comparisons draw, a run's timeline.jsonl is drawn as a Gantt chart, and malformed files fail naming
the file and line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from hfjax.records.plot import (
    DPI,
    PANEL_SIZE,
    PlotError,
    compare_runs,
    load_metrics,
    load_timeline,
    plot_main,
    plot_run,
    plot_timeline,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# metric name -> the panel that must draw it (by hand from verl's metric names, not read from hfjax.records.plot)
METRIC_PANEL = {
    "critic/score/mean": "reward",
    "critic/rewards/mean": "reward",
    "actor/ppo_kl": "kl",
    "actor/kl_loss": "kl",
    "response_length/mean": "response_length",
    "actor/entropy": "entropy",
    "perf/throughput": "throughput",
    "val/test_score/gsm8k": "validation",
    "val/test_score/addition": "validation",
}
UNPLOTTED = ("actor/pg_loss", "timing_s/gen")


def _write_run(run: Path, rng: np.random.Generator, names: list[str], steps: int) -> dict[str, np.ndarray]:
    """Writes metrics.jsonl with random values (validation metrics every other step, on their own lines); returns
    the values written per metric, indexed by step (NaN where a metric was not logged)."""
    written = {name: np.full(steps, np.nan) for name in names}
    lines = []
    for step in range(steps):
        train = {n: float(rng.normal()) for n in names if not n.startswith("val/")}
        val = {n: float(rng.uniform()) for n in names if n.startswith("val/")} if step % 2 == 0 else {}
        for row in (train, val):
            if row:
                lines.append(json.dumps({"step": step, **row}))
                for n, v in row.items():
                    written[n][step] = v
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return written


def _check_png(path: Path, size_inches: tuple[float, float]) -> np.ndarray:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000, path
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (round(size_inches[1] * DPI), round(size_inches[0] * DPI)), (path, image.shape)
    assert image[..., :3].std() > 0.05, f"{path} looks blank"
    return image


def test_load_metrics_round_trip(tmp_path):
    rng = np.random.default_rng()
    names = list(METRIC_PANEL)
    written = _write_run(tmp_path, rng, names, steps=7)
    loaded = load_metrics(tmp_path)
    assert set(loaded) == set(names)
    for name, values in written.items():
        steps, got = loaded[name]
        want_steps = np.flatnonzero(~np.isnan(values))
        np.testing.assert_array_equal(steps, want_steps)
        np.testing.assert_array_equal(got, values[want_steps])


def test_relogged_step_keeps_last_value_and_null_is_gap(tmp_path):
    rng = np.random.default_rng()
    a, b, c = rng.normal(size=3)
    rows = [{"step": 1, "actor/entropy": a}, {"step": 2, "actor/entropy": b}, {"step": 1, "actor/entropy": c}]
    rows.append({"step": 3, "actor/entropy": None})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    steps, values = load_metrics(tmp_path / "metrics.jsonl")["actor/entropy"]
    np.testing.assert_array_equal(steps, [1, 2, 3])
    np.testing.assert_array_equal(values[:2], [c, b])
    assert np.isnan(values[2])


@pytest.mark.parametrize("seed", range(3))
def test_plot_run_writes_the_panels_present(tmp_path, seed):
    rng = np.random.default_rng()
    subset = [n for n in METRIC_PANEL if rng.random() < 0.5] or [str(rng.choice(list(METRIC_PANEL)))]
    _write_run(tmp_path / "run", rng, subset + list(UNPLOTTED), steps=int(rng.integers(2, 40)))
    paths = plot_run(tmp_path / "run", tmp_path / "out")
    want = {METRIC_PANEL[n] for n in subset}
    assert [p.parent for p in paths] == [tmp_path / "out"] * len(paths)
    assert paths[-1].name == "overview.png"
    assert {p.stem for p in paths[:-1]} == want and len(paths) == len(want) + 1
    for path in paths[:-1]:
        _check_png(path, PANEL_SIZE)
    cols = min(3, len(want))
    rows = -(-len(want) // cols)
    _check_png(paths[-1], (PANEL_SIZE[0] * cols, PANEL_SIZE[1] * rows))


def test_plot_main_default_out_dir(tmp_path, capsys):
    _write_run(tmp_path, np.random.default_rng(), ["critic/score/mean", "perf/throughput"], steps=5)
    assert plot_main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    want = [tmp_path / "plots" / f"{n}.png" for n in ("reward", "throughput", "overview")]
    assert printed == [str(p) for p in want]
    assert all(p.is_file() for p in want)


def test_compare_runs(tmp_path):
    rng = np.random.default_rng()
    _write_run(tmp_path / "a", rng, ["critic/score/mean"], steps=4)
    _write_run(tmp_path / "b", rng, ["critic/score/mean", "actor/entropy"], steps=6)
    out = compare_runs([tmp_path / "a", tmp_path / "b" / "metrics.jsonl"], ["hfjax", "trl"], "critic/score/mean",
                       tmp_path / "cmp" / "reward.png")  # fmt: skip
    _check_png(out, PANEL_SIZE)
    with pytest.raises(PlotError, match=r"a/metrics.jsonl: no metric 'actor/entropy'"):
        compare_runs([tmp_path / "b", tmp_path / "a"], ["b", "a"], "actor/entropy", tmp_path / "x.png")
    with pytest.raises(PlotError, match="one label per run"):
        compare_runs([tmp_path / "a"], ["a", "b"], "critic/score/mean", tmp_path / "x.png")


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"step": 2, "actor/entropy": }', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"actor/entropy": 0.3}', "field 'step': expected an integer"),
        ('{"step": "2", "actor/entropy": 0.3}', "field 'step': expected an integer"),
        ('{"step": 2, "actor/entropy": "high"}', "metric 'actor/entropy': expected a number"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    rng = np.random.default_rng()
    good = [json.dumps({"step": s, "actor/entropy": float(rng.normal())}) for s in range(2)]
    bad_at = int(rng.integers(0, 3))
    lines = [*good[:bad_at], bad_line, *good[bad_at:]]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PlotError, match=rf"{re.escape(str(path))}:{bad_at + 1}: .*{re.escape(message)}"):
        plot_run(tmp_path)
    with pytest.raises(SystemExit, match=rf"{re.escape(str(path))}:{bad_at + 1}"):
        plot_main([str(tmp_path)])


def test_missing_or_unplottable_file(tmp_path):
    with pytest.raises(PlotError, match=rf"{re.escape(str(tmp_path / 'metrics.jsonl'))}: no such file"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "timing_s/gen": 1.5}) + "\n")
    with pytest.raises(PlotError, match=r"none of its metrics \['timing_s/gen'\] is plotted"):
        plot_run(tmp_path)


# two groups over 3 steps: rollout's generate spans overlap each other (async generation) and train's updates
TIMELINE = [
    {"step": 1, "group": "rollout", "name": "generate", "start": 0.0, "end": 4.0},
    {"step": 1, "group": "rollout", "name": "reward", "start": 3.5, "end": 4.5},
    {"step": 2, "group": "rollout", "name": "generate", "start": 2.0, "end": 7.0},
    {"step": 1, "group": "train", "name": "update_actor", "start": 4.5, "end": 8.0},
    {"step": 3, "group": "rollout", "name": "generate", "start": 7.0, "end": 11.0},
    {"step": 2, "group": "train", "name": "update_actor", "start": 8.0, "end": 11.5},
    {"step": 3, "group": "train", "name": "update_actor", "start": 11.5, "end": 14.25},
]


def _write_timeline(run: Path, spans: list[dict]) -> Path:
    path = run / "timeline.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in spans))
    return path


def test_plot_run_draws_the_timeline(tmp_path):
    _write_run(tmp_path, np.random.default_rng(), ["critic/score/mean"], steps=3)
    _write_timeline(tmp_path, TIMELINE)
    assert load_timeline(tmp_path) == TIMELINE
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["reward.png", "overview.png", "timeline.png"]
    assert paths[-1] == tmp_path / "plots" / "timeline.png"
    # 12 inches wide, 1.8 inches + 0.5 per lane (two groups) high
    image = _check_png(paths[-1], (12.0, 2.8))
    # the bars are coloured: some pixels are far from grey
    rgb = image[..., :3]
    assert (rgb.max(axis=-1) - rgb.min(axis=-1) > 0.3).mean() > 0.02
    # the timeline file alone, into another folder
    out = plot_timeline(tmp_path / "timeline.jsonl", tmp_path / "elsewhere")
    assert out == tmp_path / "elsewhere" / "timeline.png"
    _check_png(out, (12.0, 2.8))


def test_timeline_with_many_steps_and_one_group(tmp_path):
    spans = [{"step": s, "group": "all", "name": n, "start": 2.0 * s + i, "end": 2.0 * s + i + 0.9}
             for s in range(500) for i, n in enumerate(("generate", "update_actor"))]  # fmt: skip
    _write_timeline(tmp_path, spans)
    _check_png(plot_timeline(tmp_path), (12.0, 2.3))


def test_empty_or_missing_timeline(tmp_path):
    _write_run(tmp_path, np.random.default_rng(), ["critic/score/mean"], steps=3)
    assert [p.name for p in plot_run(tmp_path)] == ["reward.png", "overview.png"]  # no timeline file
    with pytest.raises(PlotError, match=rf"{re.escape(str(tmp_path / 'timeline.jsonl'))}: no such file"):
        plot_timeline(tmp_path)
    (tmp_path / "timeline.jsonl").write_text("\n")
    assert [p.name for p in plot_run(tmp_path)] == ["reward.png", "overview.png"]  # an empty one is skipped
    with pytest.raises(PlotError, match="no spans found"):
        plot_timeline(tmp_path)


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"step": 2, "group": "train", ', "not valid JSON"),
        ('"span"', "expected a JSON object"),
        ('{"step": 2.0, "group": "train", "name": "x", "start": 0, "end": 1}', "field 'step': expected an integer"),
        ('{"step": 2, "group": 3, "name": "x", "start": 0, "end": 1}', "field 'group': expected a non-empty string"),
        ('{"step": 2, "group": "train", "start": 0, "end": 1}', "field 'name': expected a non-empty string"),
        ('{"step": 2, "group": "train", "name": "x", "start": "0", "end": 1}', "metric 'start': expected a number"),
        ('{"step": 2, "group": "train", "name": "x", "start": 2, "end": 1}', "expected finite 'start' <= 'end'"),
    ],
)
def test_malformed_timeline_line_names_file_and_line(tmp_path, bad_line, message):
    _write_run(tmp_path, np.random.default_rng(), ["critic/score/mean"], steps=3)
    bad_at = int(np.random.default_rng().integers(0, len(TIMELINE) + 1))
    lines = [json.dumps(s) for s in TIMELINE]
    lines.insert(bad_at, bad_line)
    path = tmp_path / "timeline.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PlotError, match=rf"{re.escape(str(path))}:{bad_at + 1}: .*{re.escape(message)}"):
        plot_run(tmp_path)
    with pytest.raises(SystemExit, match=rf"{re.escape(str(path))}:{bad_at + 1}"):
        plot_main([str(tmp_path)])
