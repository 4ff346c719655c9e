"""Weight sync of the disaggregated placement on the reference checkpoint: the trainer's actor (float32 master,
fsdp over its devices) sends its weights in the rollout's dtype to a rollout group on other devices (generation
layout), through Ray's object store, and switches in two phases (`hfjax.trainer.rollout_stream.sync_weights`).
Reports bytes per sync, the seconds of each part (the trainer's cast and device to host copy; the rollout's check,
shard building and placement, both phases) and end to end as the controller sees it, against the floor of the link
on one machine: host memory copies of the same bytes (`bench_common.copy_times`, median), one into the object store
plus one per full copy the generation layout keeps (its `data` replicas; a `tensor` layout keeps one copy spread
over its devices).
Each (generation mesh, dtype, swap mode: `async.weight_swap`) starts its two groups (`--devices` fake CPU devices
each, one Ray process per group), syncs once to warm up, then `--repeats` times. The last sync's weights are checked
against the trainer's (bitwise, in the rollout's dtype) before the groups stop.
Usage:
    python scripts/bench/bench_weight_sync.py [--ckpt DIR] [--dtypes float32,bfloat16] [--gen-meshes data,tensor]
        [--swaps atomic,in_place] [--repeats 5] [--devices 4] [--tiny]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "bench" / "peers")]
from bench_common import copy_times, default_checkpoint, parse_args, report, start_ray, workload_dir  # noqa: E402


def sync_times(trainer, repeats: int) -> tuple[list[float], list[dict]]:
    """End-to-end seconds of `repeats` blocking syncs, and the rollout's report of each."""
    from hfjax.trainer.rollout_stream import sync_weights

    actor, rollout = trainer.roles["actor"], trainer.roles["rollout"]
    walls, reports = [], []
    for version in range(repeats + 1):  # the first warms up (compiles the casts)
        started = time.perf_counter()
        shards = actor.weights_for_rollout()
        out = sync_weights(rollout, version, shards.parts).get()
        if version:
            walls.append(time.perf_counter() - started)
            reports.append(out[0])
    return walls, reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, help="reference checkpoint (built under a temp dir when omitted)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="rollout (compute) dtypes to compare")
    parser.add_argument("--gen-meshes", default="data,tensor", help="generation mesh axes holding all the devices")
    parser.add_argument("--swaps", default="atomic,in_place", help="async.weight_swap modes to compare")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--devices", type=int, default=4, help="devices of each group (trainer and rollout)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/weight_sync.json"))
    parser.add_argument("--prompts", type=int, default=64, help="prompts of the run's workload (its batch size)")
    tiny = {"dtypes": "float32", "gen_meshes": "data", "swaps": "atomic", "repeats": 1, "devices": 2, "prompts": 4}
    args = parse_args(parser, tiny=tiny)
    ckpt = default_checkpoint(args.ckpt, args.tiny)

    import ray
    from workload import write_workload

    from hfjax.config.rl import load_rl_config
    from hfjax.trainer.launch import pin_controller_to_cpu
    from hfjax.trainer.rl import RLTrainer

    pin_controller_to_cpu()
    start_ray(Path(tempfile.mkdtemp(prefix="hfjax-ray-")), args.tiny)
    workload = write_workload(ckpt, workload_dir(args) / "workload.parquet", n=args.prompts)
    rows, runs = [], {}
    runs_of = [
        (a, d, s) for a in args.gen_meshes.split(",") for d in args.dtypes.split(",") for s in args.swaps.split(",")
    ]
    for axis, dtype, swap in runs_of:
        cfg = load_rl_config(
            {
                "model_path": str(ckpt),
                "data": {"train_files": [str(workload)], "max_prompt_length": 64, "train_batch_size": args.prompts},
                "actor": {"dtype": dtype, "train_layout": {"mesh": {"fsdp": args.devices}, "rules": "fsdp"}},
                "rollout": {"n": 4, "gen_layout": {"mesh": {axis: args.devices}, "rules": "dp_tp_gen"}},
                "async": {"weight_swap": swap},
                "trainer": {
                    "run_dir": tempfile.mkdtemp(prefix="hfjax-bench-sync-"),
                    "backend": "ray",
                    "placement": "disaggregated",
                    "devices_per_host": 2 * args.devices,
                    "resume": "never",
                    "logger": ["console", "jsonl"],
                },
            }
        )
        trainer = RLTrainer(cfg)
        try:
            walls, reports = sync_times(trainer, args.repeats)
            check_weights(trainer, dtype)
        finally:
            trainer.close()
        nbytes = int(reports[0]["bytes"])
        copies = 1 + (args.devices if axis == "data" else 1)
        floor = copies * statistics.median(copy_times(nbytes, 2 * args.repeats))
        wall = statistics.median(walls)
        export = statistics.median(r["export_seconds"] for r in reports)
        receive = statistics.median(r["receive_seconds"] for r in reports)
        mesh = f"{axis}={args.devices}"
        rows.append([mesh, dtype, swap, nbytes / 2**20, export, receive, wall, copies, floor, wall / floor])
        runs[f"{mesh}/{dtype}/{swap}"] = {
            "bytes": nbytes,
            "sync_s": walls,
            "export_s": export,
            "receive_s": receive,
            "floor_s": floor,
        }
    ray.shutdown()
    report(
        f"weight sync, trainer fsdp {args.devices} (float32 master) -> rollout group of {args.devices} devices, "
        f"reference checkpoint, median of {args.repeats}",
        [
            "gen mesh",
            "rollout dtype",
            "swap",
            "MiB sent",
            "export s",
            "receive s",
            "sync s",
            "copies",
            "floor s",
            "x floor",
        ],
        rows,
        args.out,
        {"runs": runs},
    )


def check_weights(trainer, dtype: str) -> None:
    """The rollout's weights equal a fresh export of the trainer's master in `dtype`, bit for bit (exits otherwise)."""
    import numpy as np

    rollout = trainer.roles["rollout"].rollout_params()[0]
    for part in trainer.roles["actor"].weights_for_rollout().get():
        for path, index, block in part.blocks:
            held = np.asarray(rollout[path][tuple(slice(start, stop) for start, stop in index)])
            if not np.array_equal(held.view(np.uint8), np.asarray(block).view(np.uint8)):
                raise SystemExit(f"weight sync check failed: {path} differs from the trainer's {dtype} copy")


if __name__ == "__main__":
    main()
