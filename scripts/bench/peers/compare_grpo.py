"""One table of GRPO speed on the same CPU, hfjax against Tunix and TRL, and their reward curves in one plot.

With `--run`, the three runs happen first, back to back in this one command on this machine, each in its own
virtualenv: hfjax's `scripts/bench/bench_rl_step.py --algorithms grpo` in this Python's, Tunix's
`tunix_grpo.py` in `setup_tunix.sh`'s and TRL's `trl_grpo.py` in `setup_trl.sh`'s (both made when missing, which
installs from the package index once; with `--tiny` a missing one is not made and that peer's run only builds the
workload and says so). Without it, the summaries already written are read.
Each summary JSON needs `seconds_per_step`, `tokens_per_s` (prompt + response tokens per second, verl's
`perf/throughput`), `steps` and `metrics_jsonl` (per-step metrics with verl's names); `first_step_seconds` (or
`first_step_s`), `response_tokens_per_s`, `peak_rss_bytes` and a `workload` mapping are shown or checked when present
(workload settings that differ from hfjax's are printed as a warning). A summary that says its training was skipped
(`skipped`), or a peer file that is absent, leaves that peer out of the table with a line saying why. Usage:
    python scripts/bench/peers/compare_grpo.py [--run] [--steps 10] [--tiny]
Writes `--out` (JSON: the table rows plus the inputs) and `--plot` (the reward curves of the runs in the table).
Imports rich (via `bench_common.report`) and `hfjax.records.plot` (matplotlib); the runs are subprocesses.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts" / "bench")]
from bench_common import parse_args, report  # noqa: E402

from hfjax.records.plot import compare_runs  # noqa: E402

REQUIRED = ("seconds_per_step", "tokens_per_s", "steps", "metrics_jsonl")
REWARD = "critic/score/mean"
SHAPE = ("prompts", "group", "max_prompt_tokens", "max_new_tokens", "beta")
PEERS = ("hfjax", "Tunix", "TRL")
SETUP = {"Tunix": HERE / "setup_tunix.sh", "TRL": HERE / "setup_trl.sh"}
SCRIPT = {"Tunix": HERE / "tunix_grpo.py", "TRL": HERE / "trl_grpo.py"}
COLUMNS = ["run", "steps", "s / step", "first step s", "tokens / s", "response tokens / s", "peak RSS GiB",
           "hfjax speed-up"]  # fmt: skip


def read_summary(path: Path) -> dict[str, Any]:
    """A run's summary JSON (or the GRPO summary of a bench_rl_step.py output), checked to have the fields of the
    module docstring; a skipped run's summary is returned as it is."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"{path}: cannot read a JSON summary ({exc})") from exc
    if isinstance(summary, dict) and "grpo" in (summary.get("summaries") or {}):
        summary = summary["summaries"]["grpo"]
    if isinstance(summary, dict) and "skipped" in summary:
        return summary
    missing = [k for k in REQUIRED if k not in summary] if isinstance(summary, dict) else list(REQUIRED)
    if missing:
        raise SystemExit(f"{path}: missing {missing}; expected a JSON object with {list(REQUIRED)}")
    return summary


def workload_differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Workload settings present in both summaries whose values differ."""
    wa, wb = a.get("workload") or {}, b.get("workload") or {}
    return {k: (wa[k], wb[k]) for k in sorted(wa.keys() & wb.keys()) if wa[k] != wb[k]}


def table_rows(runs: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """One row per run; the last column is its seconds per step over hfjax's (how many times faster hfjax is)."""
    ours = runs["hfjax"]["seconds_per_step"]
    return [
        [
            name,
            s["steps"],
            float(s["seconds_per_step"]),
            float(s.get("first_step_seconds", s.get("first_step_s", "nan"))),
            float(s["tokens_per_s"]),
            float(s["response_tokens_per_s"]) if "response_tokens_per_s" in s else "-",
            s["peak_rss_bytes"] / 2**30 if "peak_rss_bytes" in s else "-",
            f"{s['seconds_per_step'] / ours:.2f}x",
        ]
        for name, s in runs.items()
    ]


def peer_python(peer: str, tiny: bool) -> str:
    """The python of `peer`'s own virtualenv: made by its setup script, or with `tiny` this one when it is absent."""
    setup = ["bash", str(SETUP[peer])]
    if tiny:
        venv = Path(subprocess.run([*setup, "--where"], capture_output=True, text=True, check=True).stdout.strip())
        return str(venv / "bin" / "python") if (venv / "bin" / "python").is_file() else sys.executable
    return subprocess.run(setup, stdout=subprocess.PIPE, text=True, check=True).stdout.strip().splitlines()[-1]


def run_peers(args: argparse.Namespace) -> None:
    """Runs hfjax, Tunix and TRL one after another (their output on this console), writing `args.<peer>`."""
    tiny = ["--tiny"] if args.tiny else []
    commands = {
        "hfjax": [sys.executable, str(ROOT / "scripts" / "bench" / "bench_rl_step.py"), "--algorithms", "grpo"],
        **{peer: [peer_python(peer, args.tiny), str(SCRIPT[peer])] for peer in SCRIPT},
    }
    for peer, command in commands.items():
        out = getattr(args, peer.lower())
        if peer in SCRIPT:  # the peers' per-step metrics beside their summaries (hfjax's are in its run directory)
            command += ["--metrics", str(out.with_name(f"{peer.lower()}_metrics.jsonl"))]
        print(f"== {peer}: {' '.join(command[1:])}", flush=True)
        subprocess.run([*command, "--steps", str(args.steps), "--out", str(out), *tiny], cwd=ROOT, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runs_dir = ROOT / "runs" / "peers"
    parser.add_argument("--run", action="store_true", help="run the three peers first, back to back")
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps of each run (with --run)")
    parser.add_argument("--hfjax", type=Path, default=runs_dir / "hfjax_grpo.json", help="hfjax's GRPO summary")
    parser.add_argument("--tunix", type=Path, default=runs_dir / "tunix_grpo.json")
    parser.add_argument("--trl", type=Path, default=runs_dir / "trl_grpo.json")
    parser.add_argument("--out", type=Path, default=runs_dir / "compare_grpo.json")
    parser.add_argument("--plot", type=Path, help="default: reward.png beside --out")
    args = parse_args(parser, tiny={"steps": 1})
    if args.tiny:  # the runs' files beside the output, never over the standard ones
        for peer in PEERS:
            setattr(args, peer.lower(), args.out.parent / f"{peer.lower()}_grpo.json")
    if args.run:
        run_peers(args)
    runs, left_out = {}, {}
    for peer in PEERS:
        path = getattr(args, peer.lower())
        summary = read_summary(path) if path.is_file() or peer == "hfjax" else {"skipped": f"no summary at {path}"}
        if "skipped" in summary:
            left_out[peer] = summary["skipped"]
            print(f"{peer} left out: {summary['skipped']}")
        else:
            runs[peer] = summary
    for peer in list(runs)[1:]:
        for key, (ours, theirs) in workload_differences(runs["hfjax"], runs[peer]).items():
            print(f"warning: workload '{key}' differs: hfjax {ours!r}, {peer} {theirs!r}")
    workload = next((s["workload"] for s in reversed(runs.values()) if s.get("workload")), {})
    shape = ", ".join(f"{k} {workload[k]}" for k in SHAPE if k in workload)
    report(
        f"GRPO step on CPU, {' vs '.join(runs)}, same workload ({shape})",
        COLUMNS,
        table_rows(runs),
        args.out,
        {"inputs": {peer: str(getattr(args, peer.lower())) for peer in PEERS}, "left_out": left_out},
    )
    plot = args.plot or args.out.with_name("reward.png")
    compare_runs([s["metrics_jsonl"] for s in runs.values()], list(runs), REWARD, plot,
                 title=f"GRPO reward (fraction of digits), {', '.join(runs)}")  # fmt: skip
    print(f"wrote {plot}")


if __name__ == "__main__":
    main()
