"""Compiles every shipped `configs/gsm8k/*` config for its hardware target (`hfjax compile`) and prints one table:
the compiler's step peak per device beside the cost model's, and whether it fits (at most 90% of usable memory).

Needs the `compile` extra (libtpu and the CUDA compiler plugin; the GPU configs' cuDNN attention also needs the
`nvidia-cudnn-cu12` wheel). Each config runs in its own process (libtpu and the CUDA plugin hold their state per
process). `--tiny` compiles one config at small shapes (what CI runs); `--only NAME` picks configs by substring.

    python scripts/compile_configs.py [--tiny] [--only v5e] [--out runs/compile_configs]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {  # each shipped config and the hardware its header names
    "qwen2.5-0.5b-grpo-tpu-v5e-8": "v5e:2x4",
    "llama-3.2-1b-grpo-tpu-v5e-8": "v5e:2x4",
    "llama-3.1-8b-grpo-tpu-v5p-8": "v5p:2x2x1",
    "llama-3.1-8b-grpo-lora-tpu-v5e-8": "v5e:2x4",
    "qwen2.5-0.5b-grpo-1gpu": "h100",
    "qwen2.5-0.5b-ppo-1gpu": "h100",
    "qwen2.5-1.5b-grpo-8gpu": "h100x8",
    "qwen2.5-1.5b-remax-8gpu": "h100x8",
    "llama-3.2-1b-safe_rlhf-8gpu": "h100x8",
    "llama-3.1-8b-ppo-8gpu": "h100x8",
    "gemma-3-1b-grpo-tpu-v5e-8": "v5e:2x4",
    "gemma-3-1b-grpo-1gpu": "h100",
    "qwen3-30b-a3b-grpo-tpu-v5p-32": "v5p:2x2x4",
    "qwen3-30b-a3b-grpo-lora-8gpu": "h100x8",
}
TINY = (  # one config at small shapes: the same programs, compiled in seconds
    "qwen2.5-0.5b-grpo-tpu-v5e-8",
    ["actor.model_path=bench-25m", "data.max_prompt_length=64", "rollout.response_length=64", "rollout.slots=64"],
)


def compile_one(name: str, target: str, overrides: list[str], out: Path) -> dict:
    """Runs `hfjax compile` on one config in its own process; returns its JSON report plus wall time and status."""
    report = out / f"{name}.json"
    command = [sys.executable, "-m", "hfjax.cli.main", "compile", str(ROOT / "configs/gsm8k" / f"{name}.yaml")]
    command += [*overrides, "--target", target, "--json", str(report)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - started
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if not report.is_file():
        return {"config": name, "target": target, "error": (done.stderr or done.stdout).strip()[-600:], "s": seconds}
    data = json.loads(report.read_text())
    peak_line = next((line for line in lines if line.startswith("step peak")), "")
    return {"config": name, "target": target, "s": seconds, "summary": peak_line, **data}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="one config at small shapes (CI)")
    parser.add_argument("--only", help="compile the configs whose name contains this")
    parser.add_argument("--out", default="runs/compile_configs")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        jobs = [(TINY[0], TARGETS[TINY[0]], TINY[1])]
    else:
        jobs = [(name, target, []) for name, target in TARGETS.items() if not args.only or args.only in name]
    rows = []
    for name, target, overrides in jobs:
        row = compile_one(name, target, overrides, out)
        rows.append(row)
        status = "ERROR" if "error" in row else ("fits" if row["fits"] else "DOES NOT FIT")
        print(f"{name:<30} {target:<10} {status:<13} {row.get('summary', row.get('error', ''))}  ({row['s']:.0f} s)")
    (out / "compile_configs.json").write_text(json.dumps(rows, indent=1))
    return 0 if all("error" not in r and r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
