"""Controller overhead against raw Ray, in the same run: the round-trip latency of a no-op DP_COMPUTE_PROTO call and
the throughput of a 64 MB DataProto sent to 2 workers and back, beside plain Ray actors that receive the same
per-worker halves and return them (the controller concatenating the results in both cases). Also the controller's
peak Python/numpy allocation during one call (tracemalloc): the concatenated result is the one copy either path
makes on the controller. Usage:
    python scripts/bench/bench_controller.py [--mb 64] [--repeats 20] [--out runs/bench/controller.json] [--tiny]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import interleaved_medians, parse_args, report

from hfjax.controller import Dispatch, RayWorkerGroup, ResourcePool, Worker, register
from hfjax.protocol import DataProto

MB = 1e6


class EchoWorker(Worker):
    @register(Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data: DataProto) -> DataProto:
        return data


class RawEcho:
    def echo(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return arrays


def make_batch(nbytes: float, rng: np.random.Generator) -> DataProto:
    """Token ids and log-probs, [rows, 1024] each, `nbytes` in total."""
    rows = max(2, int(nbytes // (2 * 1024 * 4)))
    return DataProto.from_dict(
        {
            "input_ids": rng.integers(1, 32_000, (rows, 1024), dtype=np.int32),
            "old_log_probs": rng.standard_normal((rows, 1024), dtype=np.float32),
        }
    )


def raw_round_trip(actors: list[Any], arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What DP_COMPUTE_PROTO does, with plain Ray: one half per actor, results concatenated."""
    half = len(next(iter(arrays.values()))) // len(actors)
    refs = [a.echo.remote({k: v[i * half : (i + 1) * half] for k, v in arrays.items()}) for i, a in enumerate(actors)]
    outs = ray.get(refs)
    return {k: np.concatenate([o[k] for o in outs]) for k in arrays}


def peak_alloc_mb(fn: Any) -> float:
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / MB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=64.0, help="DataProto size for the throughput case")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/controller.json"))
    args = parse_args(parser, tiny={"mb": 1.0, "repeats": 2})
    with tempfile.TemporaryDirectory(prefix="ray", dir="/tmp") as temp_dir:  # short: Ray's socket paths are limited
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir)
        try:
            run(args)
        finally:
            ray.shutdown()


def run(args: argparse.Namespace) -> None:
    group = RayWorkerGroup(ResourcePool([1, 1]), EchoWorker)
    actors = [ray.remote(num_cpus=0)(RawEcho).remote() for _ in range(2)]
    rng = np.random.default_rng(0)
    rows = []
    for case, data in (
        ("no-op round trip, 2 rows", make_batch(16 * 1024, rng)),
        (f"{args.mb:g} MB", make_batch(args.mb * MB, rng)),
    ):
        nbytes = sum(v.nbytes for v in data.batch.values())
        out = group.echo(data)
        assert all(np.array_equal(out.batch[k], v) for k, v in data.batch.items()), "echo changed the batch"
        times = interleaved_medians(
            {"hfjax": lambda data=data: group.echo(data), "raw": lambda data=data: raw_round_trip(actors, data.batch)},
            repeats=args.repeats,
        )
        alloc = {
            "hfjax": peak_alloc_mb(lambda data=data: group.echo(data)),
            "raw": peak_alloc_mb(lambda data=data: raw_round_trip(actors, data.batch)),
        }
        rows.append(
            [
                case,
                nbytes / MB,
                times["hfjax"] * 1e3,
                times["raw"] * 1e3,
                times["hfjax"] / times["raw"],
                nbytes / MB / times["hfjax"],
                nbytes / MB / times["raw"],
                alloc["hfjax"],
                alloc["raw"],
            ]
        )
    report(
        "DP_COMPUTE_PROTO over 2 Ray workers vs raw Ray actor calls (median round trip, same run)",
        [
            "case",
            "payload MB",
            "hfjax ms",
            "raw Ray ms",
            "hfjax / raw",
            "hfjax MB/s",
            "raw Ray MB/s",
            "hfjax controller peak MB",
            "raw controller peak MB",
        ],
        rows,
        args.out,
        {"repeats": args.repeats, "workers": 2},
    )
    group.shutdown()


if __name__ == "__main__":
    main()
