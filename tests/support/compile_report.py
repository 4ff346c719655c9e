"""A pytest plugin that records, per test, the XLA compiles it caused (count and seconds of tracing, lowering and
backend compile) and writes them as JSON when the session ends: `HFJAX_TEST_COMPILE_REPORT=DIR` (one file per
pytest-xdist worker). Where the suite's time goes is mostly compiles; this says which tests cause them."""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import jax
import pytest

EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
}
_current = ["(outside tests)"]
_totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def _record(event: str, duration: float, **_: object) -> None:
    name = EVENTS.get(event)
    if name is not None:
        totals = _totals[_current[0]]
        totals[name] += duration
        if name == "compile_s":
            totals["compiles"] += 1


jax.monitoring.register_event_duration_secs_listener(_record)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid
    yield
    _current[0] = "(outside tests)"


def pytest_sessionfinish(session):
    out = Path(os.environ["HFJAX_TEST_COMPILE_REPORT"])
    out.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (out / f"{worker}.json").write_text(json.dumps({k: dict(v) for k, v in _totals.items()}, indent=1))
