"""`hfjax compile CONFIG --target T`: compile every program of a run for a TPU or GPU target on this machine and
print memory per device against the target's; exit 1 when it does not fit or a program fails to compile (that
program is a row of the report, the others are still compiled; `hfjax --debug compile` logs its traceback)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    compile_ = sub.add_parser(
        "compile", help="compile a run's programs for a TPU or GPU target on this machine; print memory per device"
    )
    compile_.add_argument("config", help="YAML config (see configs/)")
    compile_.add_argument("overrides", nargs="*", help="key=value overrides, e.g. actor.micro_batch_size=8")
    compile_.add_argument("--target", required=True, help="v5e:2x4, v5p:2x2x1, v6e:2x4, h100, h100x8, a100-80gbx8, ...")
    compile_.add_argument("--json", help="also write the table as JSON to this file")
    compile_.add_argument(
        "--programs",
        nargs="+",
        default=(),
        metavar="NAME",
        help='compile only the programs whose "group program" name starts with one of these, e.g. "actor loss+grad" '
        '"rollout prefill" (the step peak is then theirs)',
    )
    compile_.add_argument(
        "--lean",
        action="store_true",
        help="TPU targets: schedule each program at its leanest (libtpu's scheduler then prefetches nothing ahead "
        "of need): the memory a program needs rather than what the default schedule fills when it has room",
    )
    compile_.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hfjax.automap.compiled import parse_target

    target = parse_target(args.target)  # before any config work: a bad name is the first error
    if args.lean:
        from hfjax.automap.compiled.targets import TargetError, schedule_lean

        if target.platform != "tpu":
            raise TargetError(f"--lean: a TPU target's option (libtpu's scheduler), got {target.name!r}")
        schedule_lean()
    from hfjax.automap.compiled.report import compile_run, fits, format_report, predicted_peak, remat_settings
    from hfjax.cli.runner import debugging
    from hfjax.config.rl import load_rl_config

    if debugging(getattr(args, "debug", False)):  # the tracebacks of programs that fail to compile
        logging.getLogger("hfjax.automap.compiled").setLevel(logging.DEBUG)
    cfg = load_rl_config(args.config, args.overrides)
    programs, failed = compile_run(cfg, target, programs=args.programs)
    predicted, predicted_error = predicted_peak(cfg, target)
    if args.lean:
        print("scheduled lean: each program's memory is what it needs, with nothing scheduled ahead of need")
    print(format_report(programs, target, predicted, predicted_error, failed))
    problems = fits(programs, target, remat_settings(cfg))
    for line in problems:
        print(line)
    if args.json:
        rows = [{**dataclasses.asdict(p), "peak": p.peak} for p in programs]
        Path(args.json).write_text(
            json.dumps(
                {
                    "target": target.name,
                    "schedule": "lean" if args.lean else "default",
                    "only": list(args.programs),
                    "programs": rows,
                    "failed": [dataclasses.asdict(f) for f in failed],
                    "problems": problems,
                    "fits": not problems and not failed,
                    "cost_model_peak": predicted,
                    "cost_model_error": predicted_error,
                },
                indent=1,
            )
        )
    return 1 if problems or failed else 0
