"""`hfjax automap --cluster C --config R`: the auto-mapper's best placements and layouts for an RL run
(`hfjax.automap.run_config`)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    automap = sub.add_parser("automap", help="choose placement and layouts for an RL run from a cost model")
    automap.add_argument("--cluster", required=True, help="cluster YAML (hosts, devices, memory, profile)")
    automap.add_argument("--config", required=True, help="the RL run config (the YAML `hfjax train` reads)")
    automap.add_argument("--out", help="write the best mapping here, as that run config with it filled in")
    automap.add_argument("--top", type=int, default=10)
    automap.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hfjax.automap.run_config import automap_run

    return automap_run(args.cluster, args.config, args.out, args.top)
