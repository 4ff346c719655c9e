"""GRPO iterations on long trajectories, with and without the `sequence` (context-parallel) mesh axis on the actor's
training layout: seconds per step, per stage, tokens per second, and the rollout engine's decode programs and mean
decode step, per trajectory length and layout.

Workload: the reference checkpoint, 2 prompts x 2 samples of the shared GRPO prompts (scripts/bench/peers/workload.py,
at most `--prompt-tokens` tokens each, left-padded to that width) with responses of `length - prompt_tokens` tokens
(eos ignored, so every response runs to its full length and each row is `length` positions), the digits reward of
scripts/bench/peers/reward.py, GRPO without a KL loss (no reference pass; one optimizer step per iteration, so the
update's own forward gives the old log probs), one micro-batch of all rows, in this process on 8 fake CPU devices.
Each length runs once per `--meshes` training layout (`fsdp` rules; generation keeps its default data-parallel
layout, which has no sequence axis). A micro-batch's rows split over `data x fsdp x expert`; fewer rows than that
(4 rows over fsdp 8) do not split, so every device computes every row: the sequence axis lets few long rows split
over the devices by position instead.

The reference checkpoint has 1,024 positions in its config, and hfjax refuses a run whose prompt + response is
longer (`max_position_embeddings` check before start). Its positions are RoPE (nothing learned per position), so the
long-context reference is a copy of the checkpoint directory with `max_position_embeddings` set to the longest
length (the weights linked, not copied), written beside it once.

Per run: the median seconds of the steps after the first (which compiles), the stage timings of those steps
(`timing_s/gen`, `timing_s/old_log_prob`, `timing_s/update_actor`, ...), tokens per second (`perf/total_num_tokens`
over the step), the decode programs the engine used (`rollout/decode_programs`: traced by it, or by an earlier run's
engine of the same generation settings in this process), and the mean decode step of the
steps after the first: the generator's seconds over its decode steps (read from `OfflineGenerator.last_stats`, which
the step metrics do not carry; the short prompts' prefill is inside those seconds), and the peak resident memory of
the run (this process, reset before each run). A run that raises (hfjax refuses it, XLA fails to allocate) is a row
with its error, and the script exits with status 1 after writing the table; a process that the kernel kills for
memory ends the script.
Usage:
    python scripts/bench/bench_long_context.py [--lengths 1024,4096,8192] [--meshes fsdp=8 fsdp=4,sequence=2]
        [--steps 3] [--out runs/bench/long_context.json] [--tiny]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "bench" / "peers")]
DEVICES = 8
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from bench_common import default_checkpoint, parse_args, report, workload_dir  # noqa: E402

TABLE_STAGES = ("gen", "old_log_prob", "update_actor", "reshard")  # the JSON has every `timing_s/` key


def long_context_checkpoint(ckpt: Path, positions: int) -> Path:
    """A copy of `ckpt` beside it with `max_position_embeddings` set to `positions` (its other files linked), built
    once (also when `ckpt` has more positions, as the tiny one has: every run takes the same path)."""
    config = json.loads((ckpt / "config.json").read_text())
    out = ckpt.parent / f"{ckpt.name}-positions-{positions}"
    if (out / "config.json").is_file():
        return out
    staging = Path(tempfile.mkdtemp(prefix=f"{out.name}-", dir=ckpt.parent))
    for item in ckpt.iterdir():
        if item.name != "config.json":
            (staging / item.name).symlink_to(item.resolve())
    (staging / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}, indent=2))
    try:
        staging.rename(out)
    except OSError:  # another process finished first
        for item in staging.iterdir():
            item.unlink()
        staging.rmdir()
    return out


def parse_mesh(text: str) -> dict[str, int]:
    """`fsdp=4,sequence=2` as mesh sizes."""
    return {axis: int(size) for axis, size in (item.split("=") for item in text.split(","))}


def config(ckpt: Path, workload: Path, run_dir: Path, args: argparse.Namespace, length: int, mesh: str) -> dict:
    rows = args.prompts * args.samples
    return {
        "model_path": str(ckpt),
        "data": {
            "train_files": [str(workload)],
            "max_prompt_length": args.prompt_tokens,
            "train_batch_size": args.prompts,
        },
        "actor": {
            "ppo_mini_batch_size": rows,
            "micro_batch_size": rows,
            "use_kl_loss": False,
            "optim": {"lr": 1e-5},
            "remat": args.remat,
            "train_layout": {"mesh": parse_mesh(mesh), "rules": "fsdp"},
        },
        "rollout": {
            "n": args.samples,
            "response_length": length - args.prompt_tokens,
            "slots": max(rows, DEVICES),
            "ignore_eos": True,
        },
        "reward": {"function": f"{ROOT / 'scripts' / 'bench' / 'peers' / 'reward.py'}:compute_score"},
        "algorithm": {"name": "grpo"},
        "trainer": {
            "run_dir": str(run_dir / f"{length}-{mesh.replace(',', '-').replace('=', '')}"),
            "total_steps": args.steps,
            "backend": "local",
            "devices_per_host": DEVICES,
            "resume": "never",
            "logger": ["jsonl"],
            "progress": False,
            "plot": False,
        },
    }


class DecodeStats:
    """The `last_stats` of every `OfflineGenerator.generate` call made while installed (the actor's generator runs
    in this process with the local backend): decode steps and seconds per call."""

    def __init__(self) -> None:
        from hfjax.rollout import OfflineGenerator

        self.calls: list[dict[str, float]] = []
        self._cls, self._original = OfflineGenerator, OfflineGenerator.generate
        original, calls = self._original, self.calls

        def generate(generator: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(generator, *args, **kwargs)
            calls.append(dict(generator.last_stats))
            return out

        OfflineGenerator.generate = generate

    def close(self) -> None:
        self._cls.generate = self._original


def reset_peak_memory() -> None:
    """Resets this process's peak resident memory (VmHWM) to its current size (Linux; nothing elsewhere)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_gib() -> float:
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmHWM")), 0) / 2**20
    except OSError:
        return 0.0


def run_one(run_config: dict[str, Any], length: int, mesh: str) -> dict[str, Any]:
    """One GRPO run; its summary (or its error)."""
    from hfjax.config.rl import load_rl_config
    from hfjax.trainer.launch import run_rl

    reset_peak_memory()
    probe = DecodeStats()
    started = time.perf_counter()
    try:
        history = run_rl(load_rl_config(run_config))
    except Exception as exc:  # a refused or failed run is a row of the table, the others still run
        return {"length": length, "mesh": mesh, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    finally:
        probe.close()
    steady = history[1:] or history  # the steps after the first (compiles), when there are any
    gen_steady = probe.calls[1:] or probe.calls
    decode_steps = sum(c["decode_steps"] for c in gen_steady)
    last = history[-1]
    return {
        "length": length,
        "mesh": mesh,
        "seconds_per_step": statistics.median(h["timing_s/step"] for h in steady),
        "first_step_s": history[0]["timing_s/step"],
        "run_s": time.perf_counter() - started,
        "stages_s": {
            key.removeprefix("timing_s/"): statistics.median(h.get(key, 0.0) for h in steady)
            for key in sorted(set().union(*steady))
            if key.startswith("timing_s/") and key != "timing_s/step"
        },
        "tokens_per_s": sum(h["perf/total_num_tokens"] for h in steady) / sum(h["timing_s/step"] for h in steady),
        "tokens_per_step": last["perf/total_num_tokens"],
        "response_length_mean": last.get("response_length/mean"),
        "decode_programs": last.get("rollout/decode_programs"),
        "prefill_programs": last.get("rollout/prefill_programs"),
        "decode_steps_per_step": decode_steps / max(1, len(gen_steady)),
        "decode_step_ms": 1e3 * sum(c["seconds"] for c in gen_steady) / max(1, decode_steps),
        "peak_host_gib": peak_memory_gib(),
        "steps": len(history),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, help="reference checkpoint (built under a temp dir when omitted)")
    parser.add_argument("--lengths", default="1024,4096,8192", help="tokens per trajectory (prompt + response)")
    parser.add_argument(
        "--meshes",
        nargs="+",
        default=["fsdp=8", "fsdp=4,sequence=2"],
        help="actor.train_layout meshes (fsdp rules), over the 8 devices",
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2, help="rollout.n")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="data.max_prompt_length (prompts are shorter)")
    parser.add_argument("--remat", choices=["none", "full", "dots"], default="full", help="actor.remat")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/long_context.json"))
    tiny = {"lengths": "64,128", "steps": 2}
    args = parse_args(parser, tiny=tiny)
    lengths = [int(n) for n in args.lengths.split(",")]
    if min(lengths) <= args.prompt_tokens:
        parser.error(f"--lengths: each must exceed --prompt-tokens {args.prompt_tokens} (room for a response)")
    ckpt = long_context_checkpoint(default_checkpoint(args.ckpt, args.tiny), max(lengths))

    from workload import write_workload

    workload = write_workload(
        ckpt, workload_dir(args) / "long_context_workload.parquet", n=args.prompts, max_prompt_tokens=args.prompt_tokens
    )
    run_dir = Path(tempfile.mkdtemp(prefix="hfjax-bench-long-context-"))
    runs = []
    for length in lengths:
        for mesh in args.meshes:
            result = run_one(config(ckpt, workload, run_dir, args, length, mesh), length, mesh)
            print(json.dumps(result))
            runs.append(result)
    rows = []
    for r in runs:
        if "error" in r:
            rows.append([r["length"], r["mesh"], *["-"] * (5 + len(TABLE_STAGES)), r["error"]])
            continue
        stages = [r["stages_s"].get(s, 0.0) for s in TABLE_STAGES]
        rows.append(
            [
                r["length"],
                r["mesh"],
                r["seconds_per_step"],
                *stages,
                r["tokens_per_s"],
                int(r["decode_programs"] or 0),
                r["decode_step_ms"],
                r["peak_host_gib"],
                "",
            ]
        )
    rows_per_batch = args.prompts * args.samples
    report(
        f"GRPO on long trajectories: {args.prompts} prompts x {args.samples} samples, prompt <= {args.prompt_tokens} "
        f"tokens, response = length - {args.prompt_tokens}, {rows_per_batch} rows in one micro-batch, "
        f"{DEVICES} CPU devices, remat {args.remat}; medians of steps 2..{args.steps}",
        [
            "tokens/trajectory",
            "actor mesh",
            "step s",
            *[f"{s} s" for s in TABLE_STAGES],
            "tokens/s",
            "decode programs",
            "decode step ms",
            "peak host GiB",
            "error",
        ],
        rows,
        args.out,
        {"runs": runs, "checkpoint": str(ckpt), "steps": args.steps, "devices": DEVICES},
    )
    failed = [f"{r['length']} {r['mesh']}" for r in runs if "error" in r]
    if failed:  # after the table: the other runs' figures stay
        raise SystemExit(f"failed runs: {', '.join(failed)}")


if __name__ == "__main__":
    main()
