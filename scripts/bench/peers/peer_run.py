"""What the peer scripts (`trl_grpo.py`, `tunix_grpo.py`) share: the workload file of a run, the summary JSON a
run writes (the schema `compare_grpo.py` reads) and the skipped summary of a tiny run without the peer installed.
Imports only the standard library, `workload.py` and `bench_common.py`."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench_common import peak_rss_bytes
from workload import DEFAULT_OUT, ROOT, write_workload

# the workload settings every summary records (`compare_grpo.py` warns where two runs differ)
WORKLOAD_ARGS = ("prompts", "group", "max_prompt_tokens", "max_new_tokens", "min_new_tokens", "temperature", "beta",
                 "lr")  # fmt: skip


TINY = {"steps": 1, "prompts": 2, "max_new_tokens": 8, "micro_batch": 8}  # the `--tiny` defaults of every peer


def workload_parser(description: str, peer: str) -> argparse.ArgumentParser:
    """The options every peer takes (the workload's, `--out` and `--metrics` under `runs/peers/`, named by `peer`);
    each script adds its own and parses with `bench_common.parse_args(parser, tiny=TINY)`."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, help="policy/reference checkpoint (default: the benchmark reference one)")
    parser.add_argument("--workload", type=Path, help=f"verl-schema prompts (default: rebuilt at {DEFAULT_OUT})")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--beta", type=float, default=0.001, help="KL loss coefficient (> 0: a reference model)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--micro-batch", type=int, default=32, help="samples per forward/backward pass")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "peers" / f"{peer}_grpo.json")
    parser.add_argument("--metrics", type=Path, default=ROOT / "runs" / "peers" / peer / "metrics.jsonl")
    return parser


def prepare(args: argparse.Namespace, ckpt: Path, peer: str, module: str) -> Path | None:
    """The run's prompts file (`--workload`, else built: beside `--out` with `--tiny`, else the standard one), or
    None after writing the skipped summary when `module` (the peer's package) is not importable in a tiny run (CI
    runs the peers' tiny modes in hfjax's own virtualenv); a full run without it raises."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    prompts_file = args.out.parent / "workload.parquet" if args.tiny else DEFAULT_OUT
    workload = args.workload or write_workload(ckpt, prompts_file, args.prompts, args.max_prompt_tokens)
    try:
        importlib.import_module(module)
    except ImportError as exc:
        if not args.tiny:
            raise
        skipped = {"peer": peer, "skipped": f"training skipped: {exc}", "workload": str(workload)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(skipped, indent=2))
        print(f"{skipped['skipped']}; wrote {args.out}")
        return None
    return workload


def write_summary(
    args: argparse.Namespace,
    peer: str,
    recorder: Any,
    ckpt: Path,
    workload: Path,
    started: float,
    load_before: tuple[float, ...],
    **extra: Any,
) -> dict[str, Any]:
    """Writes and returns the run's summary: seconds per step (the median) and tokens/s over the steady steps (all
    but the first, when more than one ran) of `recorder` (`seconds`, `tokens`, `response_tokens`, `phases` per
    step), the peak RSS, the load averages, the workload and `extra` (versions, notes)."""
    steady = slice(1, None) if len(recorder.seconds) > 1 else slice(None)
    seconds, tokens = recorder.seconds[steady], recorder.tokens[steady]
    result = {
        "peer": peer,
        "seconds_per_step": statistics.median(seconds),
        "tokens_per_s": sum(tokens) / sum(seconds),
        "response_tokens_per_s": sum(recorder.response_tokens[steady]) / sum(seconds),
        "first_step_seconds": recorder.seconds[0],
        "step_seconds": recorder.seconds,
        "step_tokens": recorder.tokens,
        "step_phase_seconds": recorder.phases,
        "steps": len(recorder.seconds),
        "metrics_jsonl": str(args.metrics),
        "train_seconds": time.perf_counter() - started,
        "peak_rss_bytes": peak_rss_bytes(),
        **extra,
        "cpus": os.cpu_count(),
        "load_average_1_5_15min": {"before": load_before, "after": os.getloadavg()},
        "workload": {
            "ckpt": str(ckpt.resolve()),
            "prompts_file": str(workload.resolve()),
            **{k: getattr(args, k) for k in WORKLOAD_ARGS},
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{peer} GRPO: {result['seconds_per_step']:.1f} s/step, {result['tokens_per_s']:,.0f} tokens/s "
          f"(first step {result['first_step_seconds']:.1f} s); wrote {args.out} and {args.metrics}")  # fmt: skip
    return result
