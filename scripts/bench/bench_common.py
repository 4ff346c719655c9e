"""Shared pieces of the benchmark scripts: the reference checkpoint (25.8M-parameter Llama), timing, table and JSON."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TINY_HELP = "CI smoke run: the same code path end to end at tiny shapes (tiny model, few steps and tokens)"
REFERENCE_CKPT_DIRS = {False: "hfjax-reference-ckpt", True: "hfjax-reference-ckpt-tiny"}


def parse_args(parser: argparse.ArgumentParser, tiny: dict[str, Any]) -> argparse.Namespace:
    """Parses the command line with a `--tiny` flag added; with it, `tiny`'s values replace the parser's defaults
    (options given on the command line still win) and the run uses the persistent compilation cache as the `hfjax`
    command line does (`HFJAX_COMPILATION_CACHE`, which CI sets; the scripts call this before importing JAX). Full
    runs keep the environment's settings, so that their first-call timings include the compiles."""
    unknown = sorted(set(tiny) - {action.dest for action in parser._actions})
    if unknown:
        raise ValueError(f"tiny defaults {unknown}: {parser.prog} has no such options")
    parser.add_argument("--tiny", action="store_true", help=TINY_HELP)
    args = parser.parse_args()
    if args.tiny:
        from hfjax.xla_settings import enable_compilation_cache

        enable_compilation_cache()
        parser.set_defaults(**tiny)
        args = parser.parse_args()
    return args


def start_ray(temp_dir: Path, tiny: bool) -> None:
    """Starts a Ray of this machine alone (no dashboard, workers' output kept off the console, its files under
    `temp_dir`). `tiny`: one logical CPU and no idle workers started ahead (every worker group starts processes of its
    own, with its devices in their environment), so that a smoke run on a small machine spends its CPU on the run."""
    import ray

    small = {"num_cpus": 1, "_system_config": {"prestart_worker_first_driver": False}} if tiny else {}
    ray.init(include_dashboard=False, log_to_driver=False, _temp_dir=str(temp_dir), **small)


def reference_checkpoint(out_dir: Path, tiny: bool = False) -> Path:
    """Builds (once) the benchmark reference checkpoint with `scripts/bench/make_reference_ckpt.py`; returns its
    directory. Built beside `out_dir` and renamed into place, so concurrent callers never see a partial one."""
    if (out_dir / "config.json").is_file():
        return out_dir
    from make_reference_ckpt import build

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}-", dir=out_dir.parent))
    build(staging, tiny=tiny)
    try:
        staging.rename(out_dir)
    except OSError:  # another process finished first
        shutil.rmtree(staging)
    return out_dir


def default_checkpoint(ckpt: Path | None, tiny: bool) -> Path:
    """`ckpt`, or the shared reference checkpoint (`tiny`: its 2-layer variant), built once under the temp dir."""
    if ckpt is not None:
        return ckpt
    return reference_checkpoint(Path(tempfile.gettempdir()) / REFERENCE_CKPT_DIRS[tiny], tiny)


def workload_dir(args: argparse.Namespace) -> Path:
    """Where a benchmark writes the shared GRPO workload (`scripts/bench/peers/workload.py`): `runs/peers`, or beside
    its
    output with `--tiny` (so a smoke run never replaces the standard prompts)."""
    return args.out.parent if args.tiny else Path(__file__).resolve().parents[2] / "runs" / "peers"


def peak_rss_bytes() -> int:
    """This process's resident-memory high-water mark (VmHWM; 0 where /proc is absent). Unlike `ru_maxrss` it is
    the process image's own, not inherited from a parent at fork."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("VmHWM")), 0)


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
