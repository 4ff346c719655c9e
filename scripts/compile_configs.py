"""Compiles every shipped `configs/gsm8k/*` and `configs/long/*` config for its hardware target (`hfjax compile`)
and prints one table: the compiler's step peak per device beside the cost model's, and whether it fits (at most 90%
of usable memory).

Needs the `compile` extra (libtpu and the CUDA compiler plugin; the GPU configs' cuDNN attention also needs the
`nvidia-cudnn-cu12` wheel). Each config runs in its own process (libtpu and the CUDA plugin hold their state per
process). `--tiny` compiles one config at small shapes; `--only NAME` picks configs by substring, `--skip NAME`
leaves them out. `--guard` compiles at full size only the programs of the configs with the least room (`GUARDED`),
scheduled at their leanest on TPU (`hfjax compile --lean`: what each program needs, not what libtpu's default
schedule fills when memory is free), and also fails where the cost model's peak is more than `COST_MODEL_TOLERANCE`
off the compiler's peak of those programs.
CI runs `--tiny`, then `--guard`. `--markdown FILE` writes the rows as docs/hardware.md's compiled table, headed by
the commit they were compiled at and the compiler packages' versions (every row of one run is of one commit).

    python scripts/compile_configs.py [--tiny | --guard] [--lean] [--only v5e] [--out runs/compile_configs] \
        [--markdown runs/compile_configs/table.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from hfjax.automap.compiled.report import FIT_FRACTION
from hfjax.automap.compiled.targets import parse_target

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
    "long/qwen2.5-1.5b-grpo-32k-tpu-v5e-8": "v5e:2x4",
    "long/llama-3.1-8b-grpo-lora-16k-tpu-v5e-8": "v5e:2x4",
    "long/llama-3.1-8b-grpo-32k-tpu-v5p-8": "v5p:2x2x1",
    "vision/gemma-3-4b-grpo-lora-tpu-v5e-8": "v5e:2x4",
}
TINY = (  # one config at small shapes: the same programs, compiled in seconds
    "qwen2.5-0.5b-grpo-tpu-v5e-8",
    ["actor.model_path=bench-25m", "data.max_prompt_length=64", "rollout.response_length=64", "rollout.slots=64"],
)


# The shipped configs whose step peak is closest to the limit (docs/hardware.md), the two dense v5e-8 ones and an
# 8-GPU one, and the programs that carry it: the update and the largest prefill call. `--guard` compiles these alone,
# at full size.
GUARDED = {
    "qwen2.5-0.5b-grpo-tpu-v5e-8": ("actor loss+grad", "rollout prefill"),
    "llama-3.2-1b-grpo-tpu-v5e-8": ("actor loss+grad", "rollout prefill"),
    "qwen2.5-1.5b-grpo-8gpu": ("actor loss+grad", "rollout prefill"),
}
COST_MODEL_TOLERANCE = 0.15  # `--guard`: the cost model's peak within this fraction of the compiled programs' peak
COMPILER_PACKAGES = ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cudnn-cu12")
GIB = 1024**3


def compile_one(
    name: str, target: str, overrides: list[str], out: Path, programs: tuple[str, ...] = (), lean: bool = False
) -> dict:
    """Runs `hfjax compile` on one config (`programs`: only those; `lean`: TPU programs scheduled at their leanest)
    in its own process; returns its JSON report plus wall time and status."""
    report = out / f"{name.replace('/', '-')}.json"
    config = ROOT / "configs" / f"{name if '/' in name else 'gsm8k/' + name}.yaml"  # gsm8k/ unless named
    command = [sys.executable, "-m", "hfjax.cli.main", "compile", str(config)]
    command += [*overrides, "--target", target, "--json", str(report)]
    command += ["--programs", *programs] if programs else []
    command += ["--lean"] if lean and parse_target(target).platform == "tpu" else []  # a libtpu option
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - started
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if not report.is_file():
        return {"config": name, "target": target, "error": (done.stderr or done.stdout).strip()[-600:], "s": seconds}
    data = json.loads(report.read_text())
    peak_line = next((line for line in lines if line.startswith("step peak")), "")
    return {"config": name, "target": target, "s": seconds, "summary": peak_line, **data}


def cost_model_gap(row: dict) -> float | None:
    """How far the cost model's peak is from the compiled programs' largest peak, as a fraction of the latter (None:
    the cost model gave no figure, or no program compiled)."""
    predicted, peaks = row["cost_model_peak"], [p["peak"] for p in row["programs"]]
    return None if predicted is None or not peaks else predicted / max(peaks) - 1


def problems(row: dict, guard: bool) -> list[str]:
    """Why a config's row fails: an error, a program that failed to compile or does not fit, and with `guard` a cost
    model further off the compiler than `COST_MODEL_TOLERANCE` (or with no figure)."""
    if "error" in row:
        return ["ERROR"]
    out = [f"{len(row['failed'])} FAILED TO COMPILE"] if row["failed"] else []
    out += ["DOES NOT FIT"] if row["problems"] else []
    gap = cost_model_gap(row)
    if guard and (gap is None or abs(gap) > COST_MODEL_TOLERANCE):
        off = "no figure" if gap is None else f"{gap:+.1%} off"
        out.append(f"COST MODEL {off} (tolerance {COST_MODEL_TOLERANCE:.0%})")
    return out


def provenance() -> str:
    """Where a table's rows come from: the commit (with `+local changes` when the tree differs from it), the date, the
    machine's cores and the installed compiler packages' versions."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=ROOT
    )
    sha = commit.stdout.strip() or "unknown"
    sha += " + local changes" if dirty.stdout.strip() else ""
    versions = []
    for package in COMPILER_PACKAGES:
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            continue
    today = datetime.date.today().isoformat()
    return f"commit {sha}, {today}, {os.cpu_count()} CPU cores; {', '.join(versions)}"


def markdown_row(row: dict) -> str:
    """One config's row of docs/hardware.md's compiled table."""
    target = parse_target(row["target"])
    limit = f"{FIT_FRACTION * target.usable_bytes / GIB:.2f}"
    if "error" in row or not row["programs"]:
        reason = row.get("error", "no program compiled").splitlines()[-1][:200].replace("|", "/")
        return f"| {row['config']} | {row['target']} | | not compiled: {reason} | | | {limit} | | | {row['s']:.0f} |"
    largest = max(row["programs"], key=lambda p: p["peak"])
    predicted = row["cost_model_peak"]
    gap = cost_model_gap(row)
    cells = [
        row["config"],
        row["target"],
        row["schedule"],
        f"{largest['peak'] / GIB:.2f}" + (" (does not fit)" if row["problems"] else ""),
        f"{largest['group']} {largest['program']}",
        f"{largest['temporaries'] / GIB:.2f}",
        limit,
        "" if predicted is None else f"{predicted / GIB:.2f}",
        "" if gap is None else f"{gap:+.0%}",
        f"{row['s']:.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


def markdown_table(rows: list[dict], source: str) -> str:
    """docs/hardware.md's compiled table of `rows`, its first line naming `source` (`provenance()`)."""
    header = (
        "| config | target | schedule | step peak GiB (compiler) | largest program | its temporaries GiB | "
        "limit GiB (90% usable) | cost model GiB (predicted) | cost model off by | compile s |"
    )
    lines = [f"Compiled at {source}:", "", header, "|" + "---|" * 10]
    return "\n".join([*lines, *(markdown_row(row) for row in rows)]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--tiny", action="store_true", help="one config at small shapes (CI)")
    mode.add_argument("--guard", action="store_true", help="the programs with the least room, at full size (CI)")
    parser.add_argument("--only", help="compile the configs whose name contains this")
    parser.add_argument("--skip", action="append", default=[], help="leave out the configs whose name contains this")
    parser.add_argument("--lean", action="store_true", help="TPU configs: `hfjax compile --lean` (--guard: always)")
    parser.add_argument("--out", default="runs/compile_configs")
    parser.add_argument("--markdown", help="also write the rows as docs/hardware.md's table (with their commit) here")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        jobs = [(TINY[0], TARGETS[TINY[0]], TINY[1], ())]
    else:
        chosen = GUARDED if args.guard else dict.fromkeys(TARGETS, ())
        wanted = [name for name in chosen if (args.only or "") in name and not any(s in name for s in args.skip)]
        jobs = [(name, TARGETS[name], [], chosen[name]) for name in wanted]
    rows, source = [], provenance()  # the commit and packages before the first compile: every row is of them
    for name, target, overrides, programs in jobs:
        row = compile_one(name, target, overrides, out, programs, lean=args.lean or args.guard)
        rows.append(row)
        status = "; ".join(problems(row, args.guard)) or "fits"
        gap = cost_model_gap(row) if "error" not in row else None
        detail = row.get("summary", row.get("error", "")) + ("" if gap is None else f" ({gap:+.1%})")
        only = f" [{', '.join(programs)}]" if programs else ""
        print(f"{name:<30} {target:<10} {status:<13} {detail}{only}  ({row['s']:.0f} s)", flush=True)
        (out / "compile_configs.json").write_text(json.dumps(rows, indent=1))  # after each: a long run keeps its rows
        if args.markdown:
            Path(args.markdown).write_text(markdown_table(rows, source))
    return 1 if any(problems(row, args.guard) for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
