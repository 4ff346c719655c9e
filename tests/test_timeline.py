"""Timelines: busy seconds are the union of a group's spans clipped to the window, idle fractions and the overlap of
groups match values computed by hand, spans are stored relative to the origin and round-trip through the JSONL
file, `truncate` keeps exactly the earlier steps (atomically, dropping a torn last line), bad spans are refused."""

from __future__ import annotations

import json
import time

import pytest

from hfjax.trainer.timeline import Span, Timeline, load_spans, truncate

T0 = 1_700_000_000.0  # an absolute origin, as time.time() gives


def _timeline(spans, path=None) -> Timeline:
    """A timeline with `spans` given as (group, name, step, start, end) relative to T0."""
    tl = Timeline(path, origin=T0)
    for group, name, step, start, end in spans:
        tl.record(group, name, step, T0 + start, T0 + end)
    return tl


# rollout: [0, 4] and [2, 6] overlap (union [0, 6]), then [8, 10]; train: [5, 9]
SPANS = [
    ("rollout", "generate", 1, 0.0, 4.0),
    ("rollout", "generate", 2, 2.0, 6.0),
    ("rollout", "generate", 3, 8.0, 10.0),
    ("train", "update_actor", 1, 5.0, 9.0),
]


def test_spans_are_relative_to_the_origin():
    tl = _timeline(SPANS)
    assert tl.spans() == [Span(g, n, s, a, b) for g, n, s, a, b in SPANS]
    assert tl.groups() == ["rollout", "train"]


def test_overlapping_spans_of_one_group_count_once():
    tl = _timeline(SPANS)
    assert tl.busy_seconds("rollout", 0.0, 10.0) == pytest.approx(8.0)  # [0, 6] + [8, 10]
    assert tl.idle_fraction("rollout", 0.0, 10.0) == pytest.approx(0.2)
    # a span nested inside another adds nothing
    tl.record("rollout", "reward", 1, T0 + 1.0, T0 + 3.0)
    assert tl.busy_seconds("rollout", 0.0, 10.0) == pytest.approx(8.0)


def test_spans_crossing_the_window_are_clipped():
    tl = _timeline(SPANS)
    # window [3, 9]: rollout [3, 6] + [8, 9] = 4 s; train [5, 9] = 4 s
    assert tl.busy_seconds("rollout", 3.0, 9.0) == pytest.approx(4.0)
    assert tl.idle_fraction("rollout", 3.0, 9.0) == pytest.approx(1 - 4 / 6)
    assert tl.busy_seconds("train", 3.0, 9.0) == pytest.approx(4.0)
    # window [6.5, 7.5] lies in rollout's gap and inside train's span
    assert tl.idle_fraction("rollout", 6.5, 7.5) == pytest.approx(1.0)
    assert tl.idle_fraction("train", 6.5, 7.5) == pytest.approx(0.0)
    # a window past every span, and an empty or inverted window
    assert tl.busy_seconds("train", 20.0, 30.0) == 0.0
    assert tl.idle_fraction("train", 4.0, 4.0) == 0.0
    assert tl.idle_fraction("train", 5.0, 4.0) == 0.0


def test_step_metrics_idle_and_overlap():
    tl = _timeline(SPANS)
    # both busy on [5, 6] (rollout's union [0, 6] with train [5, 9]) and [8, 9] (rollout [8, 10]): 2 s
    metrics = tl.step_metrics(2, 0.0, 10.0, ["rollout", "train", "critic"])
    assert metrics == pytest.approx(
        {
            "timeline/idle_frac/rollout": 0.2,
            "timeline/idle_frac/train": 0.6,
            "timeline/idle_frac/critic": 1.0,  # no spans at all
            "timeline/overlap_s": 2.0,
        }
    )
    # clipped window [5.5, 8.5]: overlap [5.5, 6] + [8, 8.5] = 1 s
    assert tl.step_metrics(2, 5.5, 8.5, ["rollout", "train"])["timeline/overlap_s"] == pytest.approx(1.0)
    # one group cannot overlap with itself, however its spans overlap
    assert tl.step_metrics(2, 0.0, 10.0, ["rollout"])["timeline/overlap_s"] == 0.0
    # default window: step 1 runs from 0 (generate) to 9 (update_actor); default groups: all seen
    defaults = tl.step_metrics(1)
    assert set(defaults) == {"timeline/idle_frac/rollout", "timeline/idle_frac/train", "timeline/overlap_s"}
    assert defaults["timeline/idle_frac/rollout"] == pytest.approx(1 - 7 / 9)  # [0, 6] + [8, 9]
    assert defaults["timeline/overlap_s"] == pytest.approx(2.0)


def test_touching_spans_do_not_overlap():
    tl = _timeline([("a", "x", 0, 0.0, 1.0), ("b", "y", 0, 1.0, 2.0)])
    assert tl.step_metrics(0)["timeline/overlap_s"] == 0.0
    assert tl.step_metrics(0)["timeline/idle_frac/a"] == pytest.approx(0.5)


def test_bad_span_is_refused_naming_it():
    tl = Timeline(None, origin=T0)
    with pytest.raises(ValueError, match=r"span 'update_actor' of group 'train' at step 3: end .* before start"):
        tl.record("train", "update_actor", 3, T0 + 2.0, T0 + 1.0)
    with pytest.raises(ValueError, match=r"'generate'.*finite"):
        tl.record("rollout", "generate", 0, T0, float("nan"))
    assert tl.spans() == []
    with pytest.raises(ValueError, match="no spans recorded for step 7"):
        tl.step_metrics(7)


def test_span_context_manager_times_the_block(tmp_path):
    tl = Timeline(tmp_path / "timeline.jsonl")
    with tl.span("rollout", "generate", 4):
        time.sleep(0.02)
    with pytest.raises(RuntimeError), tl.span("train", "update_actor", 4):
        raise RuntimeError("boom")  # still recorded
    (gen, upd) = tl.spans()
    assert (gen.group, gen.name, gen.step) == ("rollout", "generate", 4)
    assert 0.02 <= gen.end - gen.start < 1.0 and 0.0 <= gen.start < 1.0
    assert (upd.group, upd.name, upd.step) == ("train", "update_actor", 4) and upd.start >= gen.end
    assert len((tmp_path / "timeline.jsonl").read_text().splitlines()) == 2


def test_file_lines_round_trip(tmp_path):
    path = tmp_path / "run" / "timeline.jsonl"
    tl = _timeline([*SPANS, ("train", "update_actor", 2, 9.123456789, 11.0000004)], path)
    lines = path.read_text().splitlines()
    assert len(lines) == 5
    assert json.loads(lines[0]) == {"step": 1, "group": "rollout", "name": "generate", "start": 0.0, "end": 4.0}
    assert json.loads(lines[-1]) == {
        "step": 2,
        "group": "train",
        "name": "update_actor",
        "start": pytest.approx(9.123457, abs=1e-9),
        "end": pytest.approx(11.0, abs=1e-9),
    }
    loaded = load_spans(path)
    assert [(s.group, s.name, s.step) for s in loaded] == [(s.group, s.name, s.step) for s in tl.spans()]
    for got, want in zip(loaded, tl.spans(), strict=True):
        assert got.start == pytest.approx(want.start, abs=1e-6) and got.end == pytest.approx(want.end, abs=1e-6)
    # a second timeline on the same file appends (a resumed run)
    _timeline([("train", "update_actor", 3, 12.0, 13.0)], path)
    assert [s.step for s in load_spans(path)] == [1, 2, 3, 1, 2, 3]


def test_truncate_keeps_earlier_steps(tmp_path):
    path = tmp_path / "timeline.jsonl"
    _timeline([*SPANS, ("train", "update_actor", 2, 10.0, 12.0), ("train", "update_actor", 3, 12.0, 14.0)], path)
    before = path.read_text().splitlines()
    assert truncate(path, 2) == 4
    after = path.read_text().splitlines()
    assert after == [line for line in before if json.loads(line)["step"] <= 2]
    assert [s.step for s in load_spans(path)] == [1, 2, 1, 2]
    assert truncate(path, 0) == 0 and path.read_text() == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timeline.jsonl"]  # no temporary file left behind
    assert truncate(tmp_path / "missing.jsonl", 3) == 0 and not (tmp_path / "missing.jsonl").exists()


def test_truncate_drops_a_torn_last_line_but_refuses_other_garbage(tmp_path):
    path = tmp_path / "timeline.jsonl"
    good = [json.dumps({"step": s, "group": "g", "name": "n", "start": s, "end": s + 1}) for s in range(3)]
    path.write_text("\n".join(good) + '\n{"step": 3, "gro')
    assert truncate(path, 5) == 3
    assert path.read_text().splitlines() == good
    path.write_text(good[0] + "\nnot json\n" + good[1] + "\n")
    with pytest.raises(ValueError, match=r"timeline.jsonl:2: not valid JSON"):
        truncate(path, 5)
    assert path.read_text() == good[0] + "\nnot json\n" + good[1] + "\n"  # untouched
