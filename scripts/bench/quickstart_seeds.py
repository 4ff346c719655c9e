"""The quickstart's learning claim over seeds: for each seed s, the addition quickstart with `task.seed=s` and
`model.seed=s` (another training set, held-out split and random base model), fine-tuned once, then RL from that SFT
checkpoint with each algorithm (GRPO and PPO by default). Prints held-out greedy accuracy after SFT and after RL per
seed and algorithm, and the smallest, median and largest gain per algorithm; writes them as JSON. `--lora-rank R`
also runs each algorithm with rank-R LoRA adapters on the actor (alpha 2R, learning rate 1e-3) from the same SFT
checkpoint, side by side, with the bytes a disaggregated weight sync sends per step (the policy in its compute dtype,
or the float32 adapters alone; from the parameter counts). Usage:
    python scripts/bench/quickstart_seeds.py [--seeds 0,1,2,3,4] [--algorithms grpo,ppo] [--lora-rank 16]
        [--config configs/quickstart.yaml]
        [--run-root runs/quickstart-seeds] [--out runs/bench/quickstart_seeds.json] [--tiny] [key=value ...]
The trailing `key=value` overrides reach every seed's quickstart config, as on the `hfjax quickstart` command line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "tests")]
from bench_common import parse_args, report  # noqa: E402


def seed_config(config: str, run_dir: Path, seed: int, overrides: list[str]) -> Any:
    from hfjax.cli.packaged import config_path
    from hfjax.cli.quickstart import QuickstartConfig
    from hfjax.typed_config import load_config

    return load_config(
        QuickstartConfig,
        str(config_path(config)),
        [f"run_dir={run_dir}", f"task.seed={seed}", f"model.seed={seed}", *overrides],
    )


def sync_bytes(cfg: Any) -> int:
    """Bytes a disaggregated weight sync of `cfg`'s actor sends per step: every weight in the compute dtype, or with
    LoRA the float32 adapters alone (`ActorRolloutRefWorker.weights_for_rollout`)."""
    import jax.numpy as jnp

    from hfjax.models.lora import lora_parameter_count
    from hfjax.trainer.preflight import model_config

    model = model_config(cfg.actor.model_path, "actor.model_path")
    if cfg.actor.lora.enabled:
        return 4 * lora_parameter_count(model, cfg.actor.lora)
    return jnp.dtype(cfg.actor.dtype).itemsize * model.num_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--algorithms", default="grpo,ppo")
    parser.add_argument("--lora-rank", type=int, default=0, help="also each algorithm with LoRA of this rank")
    parser.add_argument(
        "--config", default="configs/quickstart.yaml", help="a quickstart config (packaged name or path)"
    )
    parser.add_argument("--run-root", type=Path, default=None, help="default: a new temporary directory")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/quickstart_seeds.json"))
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the quickstart config")
    args = parse_args(parser, tiny={"seeds": "0"})
    overrides = list(args.overrides)
    if args.tiny:  # the tests' quickstart smoke run (tiny data and model, RL in this process); PPO's critic as actor
        import jax
        from support.rl_setup import QUICKSTART_SMOKE

        smoke = [*QUICKSTART_SMOKE, "rl.critic.ppo_mini_batch_size=16", "rl.critic.micro_batch_size=16"]
        overrides = [*smoke, f"rl.trainer.devices_per_host={jax.local_device_count()}", *overrides]

    from hfjax.cli.quickstart import fine_tune, prepare, reinforce

    root = args.run_root or Path(tempfile.mkdtemp(prefix="hfjax-quickstart-seeds-"))
    seeds = [int(s) for s in args.seeds.split(",")]
    algorithms = args.algorithms.split(",")
    runs: list[dict[str, Any]] = []
    rank = args.lora_rank
    lora = [f"rl.actor.lora.rank={rank}", f"rl.actor.lora.alpha={2 * rank}", "rl.actor.optim.lr=1e-3"]
    variants = [(algorithm, "", []) for algorithm in algorithms]
    variants += [(algorithm, f"+lora{rank}", lora) for algorithm in algorithms] if rank else []
    for seed in seeds:
        cfg = seed_config(args.config, root / f"seed{seed}", seed, overrides)
        files = prepare(cfg)
        fine_tune(cfg, files)
        for algorithm, suffix, extra in variants:
            algo_cfg = seed_config(
                args.config, root / f"seed{seed}", seed, [*overrides, f"rl.algorithm.name={algorithm}", *extra]
            )
            result, rl_cfg = reinforce(algo_cfg, files, part=f"rl-{algorithm}{suffix}")
            result["algorithm"] += suffix
            runs.append({"seed": seed, **result, "sync_bytes": sync_bytes(rl_cfg)})
            print(f"seed {seed} {result['algorithm']}: {100 * result['sft_accuracy']:.1f}% -> "
                  f"{100 * result['rl_accuracy']:.1f}%")  # fmt: skip

    rows = [
        [r["seed"], r["algorithm"], f"{100 * r['sft_accuracy']:.1f}%", f"{100 * r['rl_accuracy']:.1f}%",
         f"{r['gain_points']:+.1f}", f"{r['rl_seconds']:.0f}", f"{r['sync_bytes'] / 1e6:.3f}"]
        for r in runs
    ]  # fmt: skip
    spread = {}
    for algorithm in dict.fromkeys(r["algorithm"] for r in runs):
        gains = [r["gain_points"] for r in runs if r["algorithm"] == algorithm]
        spread[algorithm] = {"min": min(gains), "median": statistics.median(gains), "max": max(gains)}
        rows.append(
            ["all", algorithm, "", "", f"{min(gains):+.1f} / {statistics.median(gains):+.1f} / {max(gains):+.1f}", "",
             ""]
        )  # fmt: skip
    report(
        f"quickstart over seeds {args.seeds} ({args.config}); last rows: smallest / median / largest gain",
        ["seed", "algorithm", "after SFT", "after RL", "gain (points)", "RL seconds", "weight sync MB/step"],
        rows,
        args.out,
        {"runs": runs, "gain_spread": spread, "overrides": overrides, "run_root": str(root)},
    )


if __name__ == "__main__":
    main()
