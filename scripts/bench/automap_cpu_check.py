"""Issue 8's CPU check of the auto-mapper: on 8 fake CPU devices, does the cost model with the calibrated CPU
profile rank real PPO iterations of a small local model the way they measure, and is its choice near the best?

1. Builds a Llama policy (also the critic's and reference's checkpoint), the addition task and its tokenizer locally.
2. Calibrates the CPU profile (`local_cpu`) and ranks, as `hfjax automap` does, every mapping the trainer runs
   for PPO (actor, ref, critic; a rule reward) on the run's workload (`trainer_candidates`: `colocate` on all
   devices or `split` actor+ref | critic on half each; the reference shares the actor's layout). Picks `--mappings`
   of them spread over the predicted ranking; the first is the best predicted, the one `hfjax automap` writes.
3. Turns each into the run config (`run_config`, as `hfjax automap --out` writes it) and trains `--steps` PPO
   iterations through Ray as `hfjax train` does (`run_rl`). Measured s/iter: median `timing_s/step` after the first
   `--warmup` iterations (compiles; the second still compiles some), as `hfjax sweep` measures (`sweep_one`).
4. Prints predicted vs measured per mapping, Spearman's rho and chosen / best measured; exits 1 unless
   rho >= 0.8 and chosen <= 1.15 x best.
Run it alone on the machine (`flock /tmp/hfjax-cpu.lock python scripts/bench/automap_cpu_check.py`): concurrent load
changes both the calibration and the measurements. Usage:
    python scripts/bench/automap_cpu_check.py [--mappings 7] [--kind split] [--steps 7] [--out
        runs/bench/automap_cpu.json]
        [--tiny]
`--tiny` runs the best predicted `split` mapping (actor+ref | critic: two worker groups, the richer trainer path)
of a tiny model for one iteration, on a Ray of one logical CPU, and reports without the pass/fail check.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEVICES = 8
# the environment's XLA flags (the tests' compile-cheaply ones, say) with this check's fake devices last, so they win
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HFJAX_COMPILATION_CACHE", str(Path(tempfile.gettempdir()) / "hfjax-automap-xla-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "tests")]
from bench_common import parse_args, report, start_ray  # noqa: E402

from hfjax.xla_settings import enable_compilation_cache  # noqa: E402

enable_compilation_cache()  # before JAX is imported


def build_inputs(root: Path, args: argparse.Namespace) -> dict[str, str]:
    """Policy checkpoint with the addition tokenizer, and the task's prompts (two-digit operands: every prompt
    has the same length, so no iteration recompiles for a new shape)."""
    from support.checkpoints import save_hf_model

    from hfjax.data.synthetic import AdditionTask, build_addition_tokenizer, write_addition_task

    tokenizer = build_addition_tokenizer()
    _, policy = save_hf_model(
        root,
        "llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.mlp,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    tokenizer.save_pretrained(policy)
    files = write_addition_task(AdditionTask(min_digits=2, max_digits=2, num_train=256, num_test=8, num_sft=8), root)
    return {"policy": str(policy), "train": str(files["train"])}


def base_config(inputs: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """PPO with a KL reference in the reward, one mini-batch of one micro-batch per update (the cost model's
    micro-batches are per data-parallel rank, the trainer's global: with one of each they agree)."""
    seqs = args.prompts * args.n
    update = {"ppo_mini_batch_size": seqs, "micro_batch_size": seqs}
    return {
        "model_path": inputs["policy"],
        "data": {
            "train_files": [inputs["train"]],
            "max_prompt_length": args.prompt_len,
            "train_batch_size": args.prompts,
        },
        "actor": {**update, "optim": {"lr": 1e-5}},
        "critic": update,
        "rollout": {"n": args.n, "response_length": args.response_len, "slots": seqs, "ignore_eos": True},
        "algorithm": {"name": "ppo", "use_kl_in_reward": True},
        "trainer": {
            "backend": "ray",
            "total_steps": args.steps,
            "resume": "never",
            "logger": ["console", "jsonl"],
            "progress": False,
            "plot": not args.tiny,  # a smoke run draws no PNGs
            "devices_per_host": DEVICES,
        },
    }


def pick(ranked: list[Any], k: int, kind: str | None = None) -> list[int]:
    """Indices into `ranked` of `k` mappings of placement `kind` (None: any) spread evenly over their predicted
    ranking (the first is the best; `k` = 1: the best alone), with the best of each placement kind included."""
    runnable = [i for i, c in enumerate(ranked) if kind in (None, c.kind)]
    if not runnable:
        raise SystemExit(f"--kind {kind}: none of the {len(ranked)} mappings the trainer runs is of that kind")
    chosen = {runnable[round(j * (len(runnable) - 1) / max(k - 1, 1))] for j in range(k)}
    for each in {ranked[i].kind for i in runnable}:
        chosen.add(next(i for i in runnable if ranked[i].kind == each))
    return sorted(chosen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mappings", type=int, default=7, help="mappings to run (at least 6 for the check)")
    parser.add_argument("--steps", type=int, default=7, help="PPO iterations per mapping (median after --warmup)")
    parser.add_argument("--warmup", type=int, default=2, help="first iterations left out (compiles)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--mlp", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument(
        "--calibration-s", type=float, default=3.0, help="seconds the CPU profile measures (longer: less noise)"
    )
    parser.add_argument(
        "--kind", choices=["colocate", "split", "standalone"], help="run only mappings of this placement kind"
    )
    parser.add_argument("--predict-only", action="store_true", help="print the predicted ranking, run nothing")
    parser.add_argument("--work-dir", type=Path, help="inputs, mapped configs and runs (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "automap_cpu.json")
    tiny = {"mappings": 1, "kind": "split", "steps": 1, "warmup": 0, "prompts": 4, "prompt_len": 16, "response_len": 4}
    tiny |= {"hidden": 32, "mlp": 64, "layers": 1, "heads": 2, "calibration_s": 0.2}
    args = parse_args(parser, tiny=tiny)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="hfjax-automap-cpu-"))
    work.mkdir(parents=True, exist_ok=True)

    import ray

    from hfjax.automap import CostModel, CostOptions, MappingSearch, dataflow, local_cpu, role_shapes
    from hfjax.automap.calibrate import spearman
    from hfjax.automap.sweep import SweepCandidate, sweep_one
    from hfjax.automap.trainer_runs import run_config, trainer_candidates
    from hfjax.config.rl import load_rl_config
    from hfjax.predict.dataflow import STAGES
    from hfjax.predict.run_config import run_models, run_workload

    inputs = build_inputs(work / "inputs", args)
    base = base_config(inputs, args)
    cfg = load_rl_config(base)
    cluster = local_cpu(args.calibration_s)
    flow = dataflow("ppo")
    workload = run_workload(cfg)
    model = CostModel(cluster, flow, workload, CostOptions(param_bytes=4))  # as `hfjax automap` for float32 runs
    shapes = role_shapes(flow, run_models(cfg))
    searched = MappingSearch(model, shapes).run()
    ranked = trainer_candidates(model, shapes)  # what `hfjax automap` ranks; its first is what it writes
    print(f"profile: {cluster.profile}")
    print(
        f"search: best of {len(searched.candidates)} candidates {searched.candidates[0].iteration_seconds:.3f} s; "
        f"best the trainer runs {ranked[0].iteration_seconds:.3f} s (of {len(ranked)})"
    )

    if args.predict_only:
        from hfjax.automap import print_candidates

        picked = [ranked[i] for i in pick(ranked, args.mappings, args.kind)]
        print_candidates(picked, "picked mappings", args.mappings + 2)
        print_candidates(searched.candidates, "search (all placements)", 5)
        return 0
    start_ray(work / "ray", args.tiny)
    rows, results = [], []
    try:
        for index in pick(ranked, args.mappings, args.kind):
            candidate = ranked[index]
            config = run_config(candidate, base, cluster)
            config["trainer"]["run_dir"] = str(work / f"run-{index}")
            run = SweepCandidate(f"mapping {index}", config)
            row = sweep_one(run, cluster, args.steps - args.warmup, args.warmup, work / f"run-{index}")
            if not row.ok:
                raise SystemExit(f"mapping {index}: {row.error}")
            seconds, stages = row.measured["step_s"], row.measured
            results.append((index, candidate, seconds, stages))
            print(f"mapping {index}: predicted {candidate.iteration_seconds:.3f} s, measured {seconds:.3f} s")
    finally:
        ray.shutdown()

    predicted = [c.iteration_seconds for _, c, _, _ in results]
    measured = [s for _, _, s, _ in results]
    measured_rank = {i: r for r, i in enumerate(sorted(range(len(results)), key=lambda i: measured[i]), 1)}
    for j, (index, c, seconds, stages) in enumerate(results):
        layouts = c.mapping.layouts
        rows.append(
            [
                index + 1,
                c.kind,
                " | ".join(f"{'+'.join(g)}:{n}" for g, n in c.mapping.groups),
                f"actor {layouts['actor'].describe()} gen t{c.mapping.gen_layout.tensor}, "
                f"critic {layouts['critic'].describe()}",
                " / ".join(f"{c.prediction.stage_seconds[s]:.2f}" for s in STAGES),
                " / ".join(f"{stages[s]:.2f}" for s in STAGES),
                c.iteration_seconds,
                seconds,
                j + 1,
                measured_rank[j],
            ]
        )
    rho = spearman(predicted, measured)
    ratio = measured[0] / min(measured)
    ok = len(results) >= 6 and rho is not None and rho >= 0.8 and ratio <= 1.15
    rho_text = "-" if rho is None else f"{rho:.3f}"  # none for fewer than two mappings
    report(
        f"PPO on {DEVICES} fake CPU devices: predicted vs measured s/iter (Spearman rho {rho_text}, chosen / best "
        f"measured {ratio:.3f}: {'PASS' if ok else 'FAIL'})",
        [
            "#",
            "kind",
            "groups:devices",
            "layouts",
            "pred gen/inf/train s",
            "meas gen/inf/train s",
            "predicted s/iter",
            "measured s/iter",
            "predicted rank",
            "measured rank",
        ],
        rows,
        args.out,
        {
            "spearman": rho,
            "chosen_over_best": ratio,
            "pass": ok,
            "profile": repr(cluster.profile),
            "workload": repr(workload),
            "runnable_mappings": len(ranked),
            "args": {k: str(v) for k, v in vars(args).items()},
        },
    )
    return 0 if ok or args.tiny else 1


if __name__ == "__main__":
    sys.exit(main())
