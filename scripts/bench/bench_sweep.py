"""`hfjax sweep` of six training layouts of GRPO on the reference checkpoint, measured beside the cost model's
predictions, then the cost
model calibrated on what was measured (`hfjax automap --calibrate`), with Spearman's rank correlation of predicted
and measured seconds per iteration before and after, and the auto-mapper's choice under the calibrated profile.

`--hosts 2` runs the same sweep on a Ray cluster of 2 simulated hosts x 4 devices on this machine (one raylet and one
JAX process per host, gloo collectives between them), so that a layout whose FSDP group spans the hosts pays for the
cross-host link; the report says whether the auto-mapper, with the profile calibrated there, keeps FSDP (and tensor
parallelism) inside a host. Run it alone on the machine: concurrent load changes the measurements. Usage:
    python scripts/bench/bench_sweep.py [--hosts 1|2] [--steps 5] [--warmup 1] [--out runs/bench/sweep.json]
        [--tiny]
The batch is a quarter of the standard RL step's by default (16 prompts x 4 samples from its prompts of up to 64
tokens, responses of 32 tokens): on 8 fake devices of a 2-core machine one standard step under `fsdp=8` took 247 s,
which would make a sweep of six layouts take over an hour; `--prompts 64 --response-length 128` runs the standard one.
`--tiny`: two layouts of the tiny checkpoint, one iteration each, in this process (no Ray).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEVICES = 8
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "bench" / "peers")]
from bench_common import default_checkpoint, parse_args, report  # noqa: E402
from bench_rl_step import config, simulated_cluster, train_layout  # noqa: E402

# name -> (training mesh of actor and reference, generation mesh)
LAYOUTS = {
    "fsdp8": ("fsdp=8", "data=8"),
    "data2-fsdp4": ("data=2,fsdp=4", "data=8"),
    "data4-fsdp2": ("data=4,fsdp=2", "data=8"),
    "data8": ("data=8", "data=8"),
    "fsdp4-tensor2": ("fsdp=4,tensor=2", "data=4,tensor=2"),
    "data2-fsdp2-tensor2": ("data=2,fsdp=2,tensor=2", "data=4,tensor=2"),
}


def candidates(base: dict, names: list[str]) -> list:
    from hfjax.automap.sweep import SweepCandidate

    out = []
    for name in names:
        train, gen = LAYOUTS[name]
        cfg = copy.deepcopy(base)
        cfg["actor"]["train_layout"] = train_layout(train)
        cfg["rollout"]["gen_layout"] = {"mesh": train_layout(gen)["mesh"]}
        out.append(SweepCandidate(name, cfg))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, help="reference checkpoint (built under a temp dir when omitted)")
    parser.add_argument("--hosts", type=int, default=1, choices=[1, 2], help="simulated hosts (2: 2 x 4 devices)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"some of {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=5, help="iterations measured per layout (medians)")
    parser.add_argument("--warmup", type=int, default=1, help="iterations first run and left out (compiles)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--backend", choices=["local", "ray"], default="ray")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/sweep.json"))
    tiny = {"prompts": 2, "response_length": 8, "micro_batch": 8, "steps": 1, "warmup": 0, "backend": "local"}
    args = parse_args(parser, tiny={**tiny, "layouts": "fsdp8,data2-fsdp4"})
    names = args.layouts.split(",")
    unknown = sorted(set(names) - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"--layouts: unknown {unknown}; expected some of {sorted(LAYOUTS)}")
    if args.hosts > 1:
        simulated_cluster(args.hosts)
    ckpt = default_checkpoint(args.ckpt, args.tiny)

    import dataclasses

    from workload import write_workload

    from hfjax.automap import CostModel, local_cpu, role_shapes
    from hfjax.automap.calibrate import calibrate, format_rho, iteration_spearman, measurements, predict
    from hfjax.automap.sweep import run_sweep
    from hfjax.automap.sweep_report import print_sweep, write_sweep
    from hfjax.automap.trainer_runs import trainer_candidates
    from hfjax.config.rl import load_rl_config
    from hfjax.predict.run_config import run_cost_options, run_dataflow, run_models, run_workload

    work = Path(tempfile.mkdtemp(prefix="hfjax-bench-sweep-"))
    workload = write_workload(ckpt, work / "workload.parquet", n=args.prompts)  # not the shared standard prompts
    as_rl_step = {"hosts": str(args.hosts) if args.hosts > 1 else None, "algorithms": "grpo", "lr": 1e-5}
    as_rl_step |= {"trim_padding": True, "train_mesh": None, "devices": DEVICES}
    base = config(
        ckpt, workload, work, "grpo", argparse.Namespace(**{**vars(args), **as_rl_step}), args.hosts, "colocate"
    )
    measured_on = local_cpu(0.2 if args.tiny else 3.0)
    cluster = dataclasses.replace(measured_on, hosts=args.hosts, devices_per_host=DEVICES // args.hosts)
    result = run_sweep(
        candidates(base, names),
        cluster,
        args.steps,
        args.warmup,
        work / "sweep",
        lambda row: print(f"{row.name}: {row.measured.get('step_s') or row.error}", flush=True),
    )
    title = f"{len(names)} layouts of GRPO on {args.hosts} x {DEVICES // args.hosts} CPU devices"
    print_sweep(result, title)
    json_path, _ = write_sweep(result, work / "sweep")

    import json

    sweep = json.loads(json_path.read_text())
    ms = measurements(sweep)
    fit = calibrate(cluster, ms)
    before, after = iteration_spearman(cluster, ms), iteration_spearman(fit.cluster, ms)
    cfg = load_rl_config(base)
    flow = run_dataflow(cfg)
    model = CostModel(fit.cluster, flow, run_workload(cfg), run_cost_options(cfg))
    ranked = trainer_candidates(model, role_shapes(flow, run_models(cfg)))
    best = ranked[0]
    colocated = next(c for c in ranked if c.kind == "colocate").mapping.layouts["actor"]
    inside = colocated.fsdp * colocated.tensor <= cluster.devices_per_host
    groups = "+".join(str(n) for _, n in best.mapping.groups)
    choice = f"{best.kind} {groups} devices, actor {best.mapping.layouts['actor'].describe()}"
    calibrated = {m.name: predict(fit.cluster, m) for m in ms}
    profile = {k: (getattr(cluster.profile, k), getattr(fit.cluster.profile, k)) for k in _FITTED}
    rows = [
        [
            row.name,
            row.measured["step_s"] if row.ok else None,
            row.predicted.get("step_s") if row.predicted else None,
            sum(fitted.values()) if (fitted := calibrated.get(row.name)) else None,
            row.error or "",
        ]
        for row in result.rows
    ]
    report(
        f"{title}: seconds per iteration, measured / predicted before and after calibration "
        f"(Spearman {format_rho(before)} -> {format_rho(after)}; automap's choice after: {choice}; its best "
        f"colocated: actor {colocated.describe()}, FSDP x tensor {'inside' if inside else 'across'} a host)",
        ["layout", "measured s", "predicted s", "calibrated s", "error"],
        rows,
        args.out,
        {
            "spearman_before": before,
            "spearman_after": after,
            "log_error": [fit.error_before, fit.error_after],
            "profile_before_after": profile,
            "automap_choice": choice,
            "automap_colocated_actor_layout": colocated.describe(),
            "fsdp_inside_a_host": inside,
            "sweep_json": str(json_path),
        },
    )


_FITTED = ("matmul_flops", "memory_bandwidth", "intra_host_bandwidth", "inter_host_bandwidth", "call_overhead_s")


if __name__ == "__main__":
    main()
