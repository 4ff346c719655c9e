"""Time of one GRPO and one PPO iteration on the reference checkpoint, per stage, with the share of time spent
outside model compute (controller work, dispatch, data movement, resharding).

Workload (standard RL step): 64 prompts x 4 samples, prompts up to 64 tokens, responses of 128 tokens
(eos ignored, so the work is fixed), the shared digits reward of scripts/bench/peers/reward.py, a reference model (GRPO:
KL loss; PPO: a critic). Each algorithm runs `--steps` iterations; the table reports the last one (the first
includes compiles); the JSON summaries (read by scripts/bench/peers/compare_grpo.py) take, as the TRL peer does, the
median step time and the tokens per second of the steps after the first. Model compute = time inside the
workers' methods minus resharding; overhead = step - that.
With `--placements colocate,disaggregated:0,disaggregated:1` each algorithm runs once per placement (`name:staleness`
sets `async.max_staleness`; a disaggregated run gives half the devices to the rollout group), side by side in one
run; the table adds the trainer group's idle share and the seconds both groups were busy at once (whole run).
With `--hosts 1,2` each algorithm runs once per host count on a Ray cluster of simulated hosts on this machine
(one raylet and one JAX process per host, `--devices` fake devices in all, gloo collectives between the processes),
side by side in one run, and the table adds each host's share of the bytes the controller sent to and received
from the worker groups per step.
Usage:
    python scripts/bench/bench_rl_step.py [--backend local|ray] [--steps 2] [--out runs/bench/rl_step.json] [--tiny]
    python scripts/bench/bench_rl_step.py --hosts 1,2 [--devices 8]
    python scripts/bench/bench_rl_step.py --backend ray --devices 8 --placements
        colocate,disaggregated:0,disaggregated:1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "bench" / "peers")]
from bench_common import default_checkpoint, parse_args, peak_rss_bytes, report, workload_dir  # noqa: E402

STAGES = (
    "gen",
    "reward",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
    "reshard",
    "weight_sync",
)


def config(
    ckpt: Path, workload: Path, run_dir: Path, algorithm: str, args: argparse.Namespace, hosts: int, placement: str
) -> dict:
    name, _, staleness = placement.partition(":")
    return {
        "async": {"max_staleness": int(staleness or 0)},
        "model_path": str(ckpt),
        "data": {"train_files": [str(workload)], "max_prompt_length": 64, "train_batch_size": args.prompts},
        "actor": {
            "ppo_mini_batch_size": args.prompts * 4,
            "micro_batch_size": args.micro_batch,
            "use_kl_loss": algorithm == "grpo",
            "optim": {"lr": args.lr},
            "trim_padding": args.trim_padding,
            "train_layout": train_layout(args.train_mesh),
        },
        "critic": {
            "ppo_mini_batch_size": args.prompts * 4,
            "micro_batch_size": args.micro_batch,
            "trim_padding": args.trim_padding,
            "layout": train_layout(args.train_mesh),
        },
        "rollout": {"n": 4, "response_length": args.response_length, "slots": args.prompts * 4, "ignore_eos": True},
        "reward": {"function": f"{ROOT / 'scripts' / 'bench' / 'peers' / 'reward.py'}:compute_score"},
        "algorithm": {"name": algorithm},
        "trainer": {
            "run_dir": str(run_dir / f"{algorithm}-{hosts}-{placement.replace(':', '')}"),
            "placement": name,
            "total_steps": args.steps,
            "backend": "ray" if args.hosts or name == "disaggregated" else args.backend,
            "resume": "never",
            "logger": ["console", "jsonl"],
            "plot": not args.tiny,  # a smoke run draws no PNGs
            "hosts": hosts,
            "devices_per_host": args.devices // hosts,
        },
    }


def train_layout(mesh: str | None) -> dict | None:
    """`data=2,fsdp=4` as a training layout config (`fsdp_tp` rules: rows over data and fsdp, weights over fsdp,
    heads, MLP and vocabulary over tensor); None keeps the default."""
    if not mesh:
        return None
    sizes = {axis: int(size) for axis, size in (item.split("=") for item in mesh.split(","))}
    return {"mesh": sizes, "rules": "fsdp_tp"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, help="reference checkpoint (built under a temp dir when omitted)")
    parser.add_argument("--backend", choices=["local", "ray"], default="local")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument(
        "--lr", type=float, default=1e-5, help="actor learning rate (scripts/bench/peers/trl_grpo.py --lr)"
    )
    parser.add_argument(
        "--trim-padding",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="actor/critic.trim_padding: micro-batches drop their all-padding columns",
    )
    parser.add_argument("--algorithms", default="grpo,ppo")
    parser.add_argument("--hosts", help="host counts to compare on simulated hosts, e.g. 1,2 (default: one process)")
    parser.add_argument(
        "--devices",
        type=int,
        help="devices in all (default: 8 with --hosts; with the local backend this process's, which it needs; else 1)",
    )
    parser.add_argument(
        "--train-mesh",
        help="training mesh of actor, reference and critic, e.g. data=2,fsdp=4 (default: fsdp over all devices)",
    )
    parser.add_argument(
        "--placements",
        default="colocate",
        help="trainer.placement[:async.max_staleness] list, e.g. colocate,disaggregated:0,disaggregated:1",
    )
    parser.add_argument("--response-length", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/rl_step.json"))
    # tiny: one GRPO step (the script runs every algorithm alike; its config holds the critic's keys either way)
    tiny = {"prompts": 2, "micro_batch": 8, "response_length": 8, "steps": 1, "algorithms": "grpo"}
    args = parse_args(parser, tiny=tiny)
    if not args.devices and not args.hosts and args.backend == "local":
        import jax

        args.devices = jax.local_device_count()  # backend local runs on every device of this process
    args.devices = args.devices or (8 if args.hosts else 1)
    host_counts = [int(h) for h in args.hosts.split(",")] if args.hosts else [1]
    if args.hosts:
        simulated_cluster(max(host_counts))
    ckpt = default_checkpoint(args.ckpt, args.tiny)

    import psutil
    from workload import write_workload

    from hfjax.config.rl import load_rl_config
    from hfjax.trainer.launch import run_rl

    workload = write_workload(ckpt, workload_dir(args) / "workload.parquet", n=args.prompts)
    run_dir = Path(tempfile.mkdtemp(prefix="hfjax-bench-rl-"))
    rows, summaries = [], {}
    placements = args.placements.split(",")
    runs = [(a, h, p) for a in args.algorithms.split(",") for h in host_counts for p in placements]
    for algorithm, hosts, placement in runs:
        run_config = config(ckpt, workload, run_dir, algorithm, args, hosts, placement)
        history = run_rl(load_rl_config(run_config))
        last = history[-1]
        step = last["timing_s/step"]
        compute = last.get("perf/worker_seconds", 0.0) - last.get("timing_s/reshard", 0.0)
        overhead = (step - compute) / step
        tokens = last["perf/total_num_tokens"]
        stages = {s: last.get(f"timing_s/{s}", 0.0) for s in STAGES}
        moved = [last[f"perf/dispatch_bytes_{d}"] / hosts / 2**20 for d in ("sent", "received")]
        steady = history[1:] or history  # as trl_grpo.py: the steps after the first (compiles), when there are any
        trainer_lane = "+".join(n for n in load_rl_config(run_config).worker_groups()[-1])
        idle = last.get(f"timeline/run_idle_frac/{trainer_lane}", 0.0)  # over the whole run
        overlap = last.get("timeline/run_overlap_s", 0.0)
        rows.append(
            [
                algorithm,
                placement,
                f"{hosts}x{args.devices // hosts}",
                step,
                *stages.values(),
                tokens / step,
                100 * overhead,
                100 * idle,
                overlap,
                *moved,
            ]
        )
        group, response_length = run_config["rollout"]["n"], run_config["rollout"]["response_length"]
        steady_s = statistics.median(h["timing_s/step"] for h in steady)
        steady_rate = sum(h["perf/total_num_tokens"] for h in steady) / sum(h["timing_s/step"] for h in steady)
        key = f"{algorithm}-{hosts}x{args.devices // hosts}" if args.hosts else algorithm
        summaries[key if placement == "colocate" else f"{key}-{placement}"] = {
            "seconds_per_step": steady_s,
            "tokens_per_s": steady_rate,
            "response_tokens_per_s": args.prompts * group * response_length / steady_s,
            "overhead_share": overhead,
            "first_step_s": history[0]["timing_s/step"],
            "metrics_jsonl": str(Path(run_config["trainer"]["run_dir"]) / "metrics.jsonl"),
            "steps": args.steps,
            "peak_rss_bytes": peak_rss_bytes(),  # of this process so far (the local backend's workers are in it)
            "workload": {
                "prompts": args.prompts,
                "group": group,
                "max_prompt_tokens": run_config["data"]["max_prompt_length"],
                "max_new_tokens": response_length,
                "lr": run_config["actor"]["optim"]["lr"],
            },
        }
    peak_gib = psutil.Process().memory_info().rss / 2**30
    hwm = peak_rss_bytes() / 2**30
    report(
        f"one RL iteration: {args.prompts} prompts x 4 samples x {args.response_length} tokens, {args.backend} backend "
        f"(peak host memory of this process {hwm:.2f} GiB, now {peak_gib:.2f} GiB)",
        [
            "algorithm",
            "placement",
            "hosts x devices",
            "step s",
            *[f"{s} s" for s in STAGES],
            "tokens/s",
            "outside model compute %",
            "trainer idle % (run)",
            "overlap s (run)",
            "MiB sent/host",
            "MiB received/host",
        ],
        rows,
        args.out,
        {"summaries": summaries, "peak_host_gib": hwm, "backend": "ray" if args.hosts else args.backend},
    )


def simulated_cluster(hosts: int) -> None:
    """A Ray cluster of `hosts` nodes on this machine (each its own raylet), connected to as the driver."""
    import os

    import ray
    from ray.cluster_utils import Cluster

    Path(tempfile.gettempdir(), "ray").mkdir(exist_ok=True)  # Cluster writes its address file there
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"host0": 1}})
    for host in range(1, hosts):
        cluster.add_node(num_cpus=1, resources={f"host{host}": 1})
    os.environ["RAY_ADDRESS"] = cluster.address
    ray.init(address=cluster.address, log_to_driver=False)


if __name__ == "__main__":
    main()
