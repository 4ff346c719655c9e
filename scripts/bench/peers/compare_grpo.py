"""One table of GRPO speed, hfjax vs TRL on the same CPU, from the two runs' JSON summaries, and their reward curves.

Each JSON needs `seconds_per_step`, `tokens_per_s` (prompt + response tokens per second, verl's `perf/throughput`),
`steps` and `metrics_jsonl` (per-step metrics with verl's names); `first_step_seconds` (or `first_step_s`),
`response_tokens_per_s` and a `workload` mapping are shown or checked when present (workload settings that differ
are printed as a warning). TRL's comes from `trl_grpo.py`; hfjax's from `scripts/bench/bench_rl_step.py` (its
`summaries.grpo` is used) or any JSON of that shape. Usage:
    python scripts/bench/peers/compare_grpo.py [--hfjax runs/bench/rl_step.json] [--trl runs/peers/trl_grpo.json]
Writes `--out` (JSON: the table rows plus both inputs) and `--plot` (the reward curves of both runs).
Imports rich (via `bench_common.report`) and `hfjax.records.plot` (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts" / "bench")]
from bench_common import report  # noqa: E402

from hfjax.records.plot import compare_runs  # noqa: E402

REQUIRED = ("seconds_per_step", "tokens_per_s", "steps", "metrics_jsonl")
REWARD = "critic/score/mean"
SHAPE = ("prompts", "group", "max_prompt_tokens", "max_new_tokens", "beta")
COLUMNS = ["run", "steps", "s / step", "first step s", "tokens / s", "response tokens / s", "tokens/s vs TRL"]


def read_summary(path: Path) -> dict[str, Any]:
    """A run's summary JSON (or the GRPO summary of a bench_rl_step.py output), checked to have the fields of the
    module docstring."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"{path}: cannot read a JSON summary ({exc})") from exc
    if isinstance(summary, dict) and "grpo" in (summary.get("summaries") or {}):
        summary = summary["summaries"]["grpo"]
    missing = [k for k in REQUIRED if k not in summary] if isinstance(summary, dict) else list(REQUIRED)
    if missing:
        raise SystemExit(f"{path}: missing {missing}; expected a JSON object with {list(REQUIRED)}")
    return summary


def workload_differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Workload settings present in both summaries whose values differ."""
    wa, wb = a.get("workload") or {}, b.get("workload") or {}
    return {k: (wa[k], wb[k]) for k in sorted(wa.keys() & wb.keys()) if wa[k] != wb[k]}


def table_rows(runs: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """One row per run; the last column is its tokens/s over TRL's."""
    trl_rate = runs["TRL"]["tokens_per_s"]
    return [
        [
            name,
            s["steps"],
            float(s["seconds_per_step"]),
            float(s.get("first_step_seconds", s.get("first_step_s", "nan"))),
            float(s["tokens_per_s"]),
            float(s["response_tokens_per_s"]) if "response_tokens_per_s" in s else "-",
            f"{s['tokens_per_s'] / trl_rate:.2f}x",
        ]
        for name, s in runs.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hfjax", type=Path, default=ROOT / "runs" / "bench" / "rl_step.json", help="hfjax's GRPO")
    parser.add_argument("--trl", type=Path, default=ROOT / "runs" / "peers" / "trl_grpo.json")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "peers" / "compare_grpo.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "runs" / "peers" / "reward_hfjax_vs_trl.png")
    args = parser.parse_args()
    runs = {"hfjax": read_summary(args.hfjax), "TRL": read_summary(args.trl)}
    differences = workload_differences(runs["hfjax"], runs["TRL"])
    for key, (ours, theirs) in differences.items():
        print(f"warning: workload '{key}' differs: hfjax {ours!r}, TRL {theirs!r}")
    workload = runs["TRL"].get("workload") or {}
    shape = ", ".join(f"{k} {workload[k]}" for k in SHAPE if k in workload)
    report(
        f"GRPO step on CPU, hfjax vs TRL, same workload ({shape})",
        COLUMNS,
        table_rows(runs),
        args.out,
        {"inputs": {"hfjax": str(args.hfjax), "trl": str(args.trl)}, "workload_differences": differences},
    )
    plot = compare_runs([s["metrics_jsonl"] for s in runs.values()], list(runs), REWARD, args.plot,
                        title="GRPO reward (fraction of digits), hfjax vs TRL")  # fmt: skip
    print(f"wrote {plot}")


if __name__ == "__main__":
    main()
