"""`hfjax automap --cluster C --config R`: the auto-mapper's best placements and layouts for an RL run
(`hfjax.automap.run_search`); `hfjax automap --calibrate SWEEP.json --out C`: a cluster file whose profile is fitted
to what `hfjax sweep` measured (`hfjax.automap.calibrate`)."""

from __future__ import annotations

import argparse
from typing import Any

from hfjax.typed_config import ConfigError


def add_parser(sub: Any) -> None:
    automap = sub.add_parser("automap", help="choose placement and layouts for an RL run from a cost model")
    automap.add_argument("--cluster", help="cluster YAML (hosts, devices, memory, profile)")
    automap.add_argument("--config", help="the RL run config (the YAML `hfjax train` reads)")
    automap.add_argument(
        "--out", help="write the best mapping here as that run config with it filled in (--calibrate: the cluster)"
    )
    automap.add_argument("--top", type=int, default=10)
    automap.add_argument(
        "--keep-batch-settings",
        action="store_true",
        help="price the config's own micro-batch sizes and rematerialisation instead of searching them",
    )
    automap.add_argument(
        "--target",
        help="compile the best mappings for this TPU/GPU target (as `hfjax compile`; needs the compile extra) in "
        "ranked order and write the first that the compiler says fits",
    )
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
    from hfjax.automap.run_search import automap_run

    check = _compiler_check(args.target, args.cluster) if args.target else None
    return automap_run(args.cluster, args.config, args.out, args.top, not args.keep_batch_settings, check)


def check_target_devices(name: str, target: Any, hosts: int, devices_per_host: int, what: str) -> None:
    """`--target name` (the parsed `target`) has the `hosts` x `devices_per_host` devices of `what` (a cluster file,
    a run config); ConfigError otherwise, before anything compiles."""
    if target.num_devices != hosts * devices_per_host:
        raise ConfigError(
            f"--target {name}: has {target.num_devices} devices, but {what} has {hosts} x {devices_per_host} = "
            f"{hosts * devices_per_host}"
        )


def _compiler_check(name: str, cluster_path: str) -> Any:
    """A check of a mapped run config: compiled for the target `name`, None where every program fits, else the
    compiler's reasons. The target and the cluster are checked against each other before anything compiles."""
    from hfjax.automap import ClusterSpec
    from hfjax.automap.compiled import parse_target, target_devices
    from hfjax.automap.compiled.report import compiled_memory
    from hfjax.predict.cluster import GIB

    target = parse_target(name)
    cluster = ClusterSpec.from_yaml(cluster_path)
    check_target_devices(name, target, cluster.hosts, cluster.devices_per_host, f"the cluster {cluster_path}")
    target_devices(target)  # a missing compiler plugin, before the search

    def check(cfg: Any) -> str | None:
        compiled = compiled_memory(cfg, target)
        peak = f"compiled peak {compiled['peak_bytes'] / GIB:.2f} GiB per device on {target.name}"
        return None if compiled["fits"] else f"{peak}; " + "; ".join(compiled["problems"])

    return check
