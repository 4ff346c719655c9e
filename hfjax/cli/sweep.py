"""`hfjax sweep CONFIG --candidates FILE|auto`: train each candidate layout of an RL config for a few steps on this
cluster and compare what it measured with what the cost model predicted (`hfjax.automap.sweep`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    sweep = sub.add_parser("sweep", help="measure candidate layouts of an RL config, beside the cost model's figures")
    sweep.add_argument("config", help="the RL run config (the YAML `hfjax train` reads)")
    sweep.add_argument("overrides", nargs="*", help="key=value overrides of the config, for every candidate")
    sweep.add_argument(
        "--candidates",
        required=True,
        help="a YAML list of {name, overrides} (each a list of key=value or a mapping), or `auto`: the auto-mapper's "
        "best --top mappings on --cluster",
    )
    sweep.add_argument("--top", type=int, default=6, help="with --candidates auto: how many mappings")
    sweep.add_argument("--steps", type=int, default=3, help="iterations measured per candidate (medians)")
    sweep.add_argument("--warmup", type=int, default=1, help="iterations first run and left out (compiles)")
    sweep.add_argument(
        "--cluster",
        help="cluster YAML for the predictions (as `hfjax automap`); default on CPU: this host's devices, with a "
        "profile measured now",
    )
    sweep.add_argument(
        "--target",
        help="also compile each candidate for this TPU/GPU target (as `hfjax compile`; needs the compile extra) and "
        "report the compiler's peak per device",
    )
    sweep.add_argument("--out", default="runs/sweep", help="directory for sweep.json, sweep.png and the runs")
    sweep.add_argument("--devices", type=int, help="on CPU: number of fake devices of this process")
    sweep.set_defaults(run=run)


def _cluster(path: str | None) -> Any:
    from hfjax.automap import ClusterSpec, local_cpu

    if path:
        return ClusterSpec.from_yaml(path)
    import jax

    if jax.default_backend() != "cpu":
        raise ValueError(f"--cluster: needed on {jax.default_backend()} (the cost model's profile of its devices)")
    return local_cpu()


def run(args: argparse.Namespace) -> int:
    import yaml
    from tqdm import tqdm

    from hfjax.automap.sweep import auto_candidates, read_candidates, run_sweep
    from hfjax.automap.sweep_report import print_sweep, write_sweep
    from hfjax.config.rl import RLConfig, load_rl_config
    from hfjax.typed_config import to_dict

    raw = yaml.safe_load(Path(args.config).read_text()) or {}
    base = to_dict(load_rl_config(raw, args.overrides))  # checked once, before any candidate
    candidates = None  # over the config as written, so that a candidate's keys go into sections it leaves unset
    if args.candidates != "auto":  # a bad file before the cluster is measured
        candidates = read_candidates(args.candidates, raw, args.overrides)
    compile_for = None
    if args.target:
        from hfjax.automap.compiled import parse_target, target_devices
        from hfjax.automap.compiled.report import compiled_memory
        from hfjax.cli.automap import check_target_devices

        target = parse_target(args.target)  # a bad name, another device count or a missing plugin: before any run
        trainer = base["trainer"]
        check_target_devices(
            args.target, target, trainer["hosts"], trainer["devices_per_host"], f"the run config {args.config}"
        )
        target_devices(target)

        def compile_for(cfg: RLConfig) -> dict[str, Any]:
            where = "the candidate's trainer.hosts x trainer.devices_per_host"
            check_target_devices(args.target, target, cfg.trainer.hosts, cfg.trainer.devices_per_host, where)
            return compiled_memory(cfg, target)

    cluster = _cluster(args.cluster)
    if candidates is None:
        candidates = auto_candidates(base, cluster, args.top)
    out = Path(args.out)
    bar = tqdm(total=len(candidates), desc="sweep", unit="candidate")

    def done(row: Any) -> None:
        state = f"{row.measured['step_s']:.3g} s/iteration" if row.ok else f"failed: {row.error}"
        bar.write(f"{row.name}: {state}")
        bar.update()

    result = run_sweep(candidates, cluster, args.steps, args.warmup, out, done, compile_for, args.target)
    bar.close()
    print_sweep(result, f"hfjax sweep of {args.config}: {len(candidates)} candidates, {args.steps} steps each")
    json_path, png_path = write_sweep(result, out)
    print(f"wrote {json_path} and {png_path}")
    (out / "config.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    return 0 if any(row.ok for row in result.rows) else 1
