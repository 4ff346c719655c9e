"""Shared pieces of the benchmark scripts: the reference checkpoint (25.8M-parameter Llama), timing, table and JSON."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def reference_checkpoint(out_dir: Path, tiny: bool = False) -> Path:
    """Builds (once) the benchmark reference checkpoint with `scripts/make_reference_ckpt.py`; returns its
    directory."""
    if (out_dir / "config.json").is_file():
        return out_dir
    from make_reference_ckpt import build

    return build(out_dir, tiny=tiny)


def interleaved_medians(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median wall time of each `fn()` (which must block until its result is ready), timed in turn round-robin
    after warm-up calls, so that machine noise falls on all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def copy_times(nbytes: int, repeats: int) -> list[float]:
    """Wall times of `repeats` numpy copies of `nbytes` into an already-touched buffer (memory bandwidth probes)."""
    import numpy as np

    src = np.ones(nbytes, np.uint8)
    dst = np.zeros_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return times


VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "sve")


def machine() -> dict[str, Any]:
    """The CPU a benchmark ran on (model name, cores, vector extensions): ratios against PyTorch move with it (on
    AVX-512 machines XLA's matmul library gains more over PyTorch's fp32 path than on AVX2 ones)."""
    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "vector": []}
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return info
    fields = {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in lines if ":" in line)}
    info["cpu"] = fields.get("model name", info["cpu"])
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    info["vector"] = [f for f in VECTOR_FLAGS if f in flags]
    return info


def report(title: str, columns: list[str], rows: list[list[Any]], out: Path, extra: dict[str, Any]) -> None:
    """Prints a rich table and the machine, and writes rows, `extra` and the machine as JSON."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*[f"{v:,.3f}" if isinstance(v, float) else str(v) for v in row])
    Console(width=160).print(table)
    host = machine()
    print(f"machine: {host['cpu']}, {host['cores']} cores, {' '.join(host['vector']) or 'no listed vector flags'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows_json = [dict(zip(columns, r, strict=True)) for r in rows]
    out.write_text(json.dumps({"title": title, "rows": rows_json, **extra, "machine": host}, indent=2))
    print(f"wrote {out}")
