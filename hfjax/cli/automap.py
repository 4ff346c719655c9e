"""`hfjax automap --cluster C --config R`: the auto-mapper's best placements and layouts for an RL run
(`hfjax.automap.run_config`); `hfjax automap --calibrate SWEEP.json --out C`: a cluster file whose profile is fitted
to what `hfjax sweep` measured (`hfjax.automap.calibrate`)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    automap = sub.add_parser("automap", help="choose placement and layouts for an RL run from a cost model")
    automap.add_argument("--cluster", help="cluster YAML (hosts, devices, memory, profile)")
    automap.add_argument("--config", help="the RL run config (the YAML `hfjax train` reads)")
    automap.add_argument(
        "--out", help="write the best mapping here as that run config with it filled in (--calibrate: the cluster)"
    )
    automap.add_argument("--top", type=int, default=10)
    automap.add_argument(
        "--calibrate",
        metavar="SWEEP_JSON",
        help="fit the cost model's profile to a sweep's measurements (hfjax sweep's sweep.json); write the cluster "
        "file with it to --out",
    )
    automap.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        if not args.out or args.cluster or args.config:
            raise SystemExit("hfjax automap --calibrate SWEEP_JSON: takes --out C.yaml and no --cluster or --config")
        from hfjax.automap.calibrate import calibrate_run

        return calibrate_run(args.calibrate, args.out)
    if not args.cluster or not args.config:
        raise SystemExit("hfjax automap: --cluster and --config are required (or --calibrate SWEEP_JSON --out C.yaml)")
    from hfjax.automap.run_config import automap_run

    return automap_run(args.cluster, args.config, args.out, args.top)
