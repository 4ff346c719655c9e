"""Per-step timelines of an asynchronous RL run: which worker group ran what, when, for which step.

This module owns the `Span` record, the `Timeline` that collects spans (in memory and, optionally, appended to a
JSONL file one span a line: `{"step", "group", "name", "start", "end"}`, seconds since the timeline's origin), the
measures derived from them (busy seconds as the union of a group's spans, idle fractions, the seconds during which
two or more groups were busy at once) as the `timeline/...` step metrics, and `truncate`, which cuts a timeline file
back to a checkpointed step when a run resumes. `hfjax plot` draws the file as a Gantt chart (`hfjax.records.plot`).

"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

IDLE_PREFIX = "timeline/idle_frac/"
OVERLAP_KEY = "timeline/overlap_s"
DECIMALS = 6  # the file's stamps are rounded to 1e-6 s


@dataclass(frozen=True)
class Span:
    """One block of work: worker group `group` ran `name` for step `step` from `start` to `end` (seconds since the
    timeline's origin)."""

    group: str
    name: str
    step: int
    start: float
    end: float


def _check(group: str, name: str, step: int, start: float, end: float) -> None:
    what = f"span {name!r} of group {group!r} at step {step}"
    if not (math.isfinite(start) and math.isfinite(end)):
        raise ValueError(f"{what}: start {start} and end {end} must be finite")
    if end < start:
        raise ValueError(f"{what}: end {end} is before start {start}")


def _union(intervals: Iterable[tuple[float, float]], since: float, until: float) -> list[tuple[float, float]]:
    """The union of `intervals` clipped to [since, until], as disjoint intervals sorted by start."""
    clipped = sorted((max(s, since), min(e, until)) for s, e in intervals if min(e, until) > max(s, since))
    merged: list[tuple[float, float]] = []
    for s, e in clipped:
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _length(intervals: Sequence[tuple[float, float]]) -> float:
    return float(sum(e - s for s, e in intervals))


class Timeline:
    """Spans of work per worker group. `record` takes absolute `time.time()` stamps and keeps them relative to
    `origin` (default: now); every other time here (`Span.start`, `since`, `until`) is relative to `origin`. With a
    `path`, each span is also appended to that JSONL file and flushed. Safe to record from several threads."""

    def __init__(self, path: Path | None, origin: float | None = None):
        self.path = Path(path) if path is not None else None
        self.origin = time.time() if origin is None else float(origin)
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def now(self) -> float:
        """Seconds since the origin (the clock `since` and `until` are on)."""
        return time.time() - self.origin

    def record(self, group: str, name: str, step: int, start: float, end: float) -> Span:
        """Records that `group` ran `name` for `step` from `start` to `end` (absolute `time.time()` stamps)."""
        _check(group, name, step, start, end)
        span = Span(group, name, int(step), start - self.origin, end - self.origin)
        with self._lock:
            self._spans.append(span)
            if self.path is not None:
                row = {
                    "step": span.step,
                    "group": group,
                    "name": name,
                    "start": round(span.start, DECIMALS),
                    "end": round(span.end, DECIMALS),
                }
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
                    f.flush()
        return span

    @contextmanager
    def span(self, group: str, name: str, step: int) -> Iterator[None]:
        """Times the block (also when it raises) and records it as a span."""
        start = time.time()
        try:
            yield
        finally:
            self.record(group, name, step, start, time.time())

    def spans(self) -> list[Span]:
        """The spans recorded so far, in the order they were recorded."""
        with self._lock:
            return list(self._spans)

    def groups(self) -> list[str]:
        """The groups with at least one span, sorted."""
        return sorted({s.group for s in self.spans()})

    def _busy(self, group: str, since: float, until: float) -> list[tuple[float, float]]:
        return _union(((s.start, s.end) for s in self.spans() if s.group == group), since, until)

    def busy_seconds(self, group: str, since: float, until: float) -> float:
        """Seconds of [since, until] during which `group` ran at least one span (overlapping spans count once)."""
        return _length(self._busy(group, since, until))

    def idle_fraction(self, group: str, since: float, until: float) -> float:
        """The fraction of [since, until] during which `group` ran nothing; 0 for an empty window."""
        if until <= since:
            return 0.0
        return 1.0 - self.busy_seconds(group, since, until) / (until - since)

    def overlap_seconds(self, groups: Sequence[str], since: float, until: float) -> float:
        """Seconds of [since, until] during which at least two of `groups` were busy at once."""
        busy = [iv for g in set(groups) for iv in self._busy(g, since, until)]
        events = [(s, 1) for s, _ in busy] + [(e, -1) for _, e in busy]
        if not events:
            return 0.0
        events.sort()  # at a tie, an end (-1) sorts before a start (+1): touching intervals do not overlap
        stamps = np.array([t for t, _ in events])
        running = np.cumsum([d for _, d in events])  # busy groups on [stamps[i], stamps[i + 1])
        return float(np.sum(np.diff(stamps)[running[:-1] >= 2]))

    def step_window(self, step: int) -> tuple[float, float]:
        """[first start, last end] of the spans of `step`; ValueError when it has none."""
        of_step = [s for s in self.spans() if s.step == step]
        if not of_step:
            raise ValueError(f"timeline: no spans recorded for step {step}")
        return min(s.start for s in of_step), max(s.end for s in of_step)

    def step_metrics(
        self, step: int, since: float | None = None, until: float | None = None, groups: Sequence[str] | None = None
    ) -> dict[str, float]:
        """`timeline/idle_frac/<group>` for each of `groups` (default: every group seen) and `timeline/overlap_s`
        over the window [since, until] (default: `step_window(step)`). Every span in the window counts, whatever
        its step: with asynchronous RL a group may be working on another step."""
        if since is None or until is None:
            first, last = self.step_window(step)
            since = first if since is None else since
            until = last if until is None else until
        groups = self.groups() if groups is None else list(groups)
        metrics = {f"{IDLE_PREFIX}{g}": self.idle_fraction(g, since, until) for g in groups}
        metrics[OVERLAP_KEY] = self.overlap_seconds(groups, since, until)
        return metrics


def load_spans(path: Path) -> list[Span]:
    """The spans of a timeline file, in file order (blank lines skipped); ValueError naming the line if malformed."""
    spans = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                row = _parse(line, f"{path}:{lineno}")
                spans.append(Span(row["group"], row["name"], row["step"], float(row["start"]), float(row["end"])))
    return spans


def _parse(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"{where}: field 'step': expected an integer, got {step!r}")
    for key in ("group", "name"):
        if not isinstance(row.get(key), str):
            raise ValueError(f"{where}: field {key!r}: expected a string, got {row.get(key)!r}")
    for key in ("start", "end"):
        if isinstance(row.get(key), bool) or not isinstance(row.get(key), int | float):
            raise ValueError(f"{where}: field {key!r}: expected a number, got {row.get(key)!r}")
    return row


def truncate(path: Path, last_step: int) -> int:
    """Rewrites the timeline file `path` keeping only the spans of steps <= `last_step` (for a run resuming from
    that step's checkpoint); returns how many it kept. Atomic: a temporary file replaces `path`. A missing file is
    left missing (0 kept); a torn last line (a crash mid-write) is dropped; any other malformed line raises
    ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        return 0
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        torn = lineno == len(lines) and not line.endswith("\n")
        try:
            row = _parse(line, f"{path}:{lineno}")
        except ValueError:
            if torn:
                break
            raise
        if row["step"] <= last_step:
            kept.append(line if line.endswith("\n") else line + "\n")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(kept)
