"""The `hfjax` command. `hfjax inspect` shows how a checkpoint's parameters shard under a layout (no weights are
loaded); `hfjax layouts` lists the rule presets. Later issues add `train`, `generate` and friends here."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def _parse_mesh(text: str) -> dict[str, int]:
    mesh = {}
    for item in text.split(","):
        name, _, size = item.partition("=")
        if not size.isdigit():
            raise SystemExit(f"--mesh: expected AXIS=SIZE[,AXIS=SIZE...], e.g. fsdp=4,tensor=2; got {text!r}")
        mesh[name.strip()] = int(size)
    return mesh


def _layout_config(args: argparse.Namespace) -> dict[str, Any]:
    rules: Any = args.rules
    if rules.startswith("["):
        rules = json.loads(rules)
    return {"mesh": _parse_mesh(args.mesh), "rules": rules}


def cmd_inspect(args: argparse.Namespace) -> int:
    import math

    import jax
    import numpy as np
    from flax import nnx
    from rich.console import Console
    from rich.table import Table

    from hfjax.models.hf import abstract_model, read_config
    from hfjax.parallel import Layout

    cfg, head = read_config(args.model)
    model = abstract_model(cfg, args.head or head, args.dtype)
    layout = Layout.from_config(_layout_config(args))
    shardings = dict(nnx.to_flat_state(layout.shardings(nnx.state(model, nnx.Param))))
    table = Table(
        title=f"{args.model}: {cfg.num_params / 1e6:.1f}M parameters under {layout.describe()}, rules {args.rules}"
    )
    for col in ("parameter", "shape", "logical axes", "partition", "bytes / device"):
        table.add_column(col)
    total, per_device = 0, 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        sharding = shardings[path]
        nbytes = math.prod(var.shape) * np.dtype(var.dtype).itemsize
        local = math.prod(sharding.shard_shape(var.shape)) * np.dtype(var.dtype).itemsize
        total, per_device = total + nbytes, per_device + local
        if args.all or not any(isinstance(k, int) and k > 0 for k in path):
            table.add_row(
                "/".join(map(str, path)),
                str(var.shape),
                str(var.get_metadata()["logical_axes"]),
                str(tuple(sharding.spec)),
                f"{local:,}",
            )
    Console(width=160).print(table)
    print(
        f"parameters: {total / 2**20:.1f} MiB in all, {per_device / 2**20:.1f} MiB per device on "
        f"{jax.device_count()} devices{' (layer 0 shown; --all for every layer)' if not args.all else ''}"
    )
    return 0


def abstract_params_for(model: str, dtype: str) -> Any:
    """Abstract parameters (no memory) of a Hugging Face directory or a named size such as `llama-200m`."""
    from pathlib import Path

    from flax import nnx

    from hfjax.models.hf import abstract_model, read_config
    from hfjax.models.presets import named_config

    if Path(model).is_dir():
        cfg, head = read_config(model)
    else:
        cfg, head = named_config(model), "causal_lm"
    return nnx.state(abstract_model(cfg, head, dtype), nnx.Param)


def cmd_layouts(args: argparse.Namespace) -> int:
    from hfjax.parallel import RULE_PRESETS

    if not args.pairs:
        for name, rules in RULE_PRESETS.items():
            print(f"{name:10s} " + ", ".join(f"{logical}->{'x'.join(axes)}" for logical, axes in rules))
        return 0
    if not args.model:
        raise SystemExit("hfjax layouts --pairs needs --model (a Hugging Face directory or a named size)")
    import yaml

    from hfjax.layout_table import print_layout_rows, write_rows
    from hfjax.parallel.layout_compare import compare_layouts

    with open(args.pairs) as f:
        pairs = (yaml.safe_load(f) or {}).get("pairs")
    if not isinstance(pairs, list) or not all(isinstance(p, dict) and {"train", "gen"} <= set(p) for p in pairs):
        raise SystemExit(f"{args.pairs}: expected 'pairs:' as a list of {{name, train, gen}} layout entries")
    rows = compare_layouts(abstract_params_for(args.model, args.dtype), pairs, repeats=args.repeats)
    print_layout_rows(rows, f"{args.model} ({args.dtype}) on {args.devices or 'all'} devices")
    if args.out:
        write_rows(rows, args.out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hfjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="show parameter shardings of a checkpoint under a layout")
    inspect.add_argument("model", help="Hugging Face model directory")
    inspect.add_argument("--mesh", default="fsdp=1", help="mesh axes and sizes, e.g. fsdp=4,tensor=2")
    inspect.add_argument("--rules", default="fsdp_tp", help="rule preset name or a JSON list of [logical, mesh]")
    inspect.add_argument("--devices", type=int, help="on CPU: number of fake devices to create")
    inspect.add_argument("--head", choices=["causal_lm", "seq_cls", "token_cls"], help="override the head kind")
    inspect.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    inspect.add_argument("--all", action="store_true", help="list every layer, not only layer 0")
    inspect.set_defaults(run=cmd_inspect)
    layouts = sub.add_parser("layouts", help="list rule presets, or compare (train, gen) layout pairs for a model")
    layouts.add_argument("--model", help="Hugging Face model directory or a named size (e.g. llama-200m)")
    layouts.add_argument("--pairs", help="YAML file with 'pairs: [{name, train, gen}, ...]'")
    layouts.add_argument("--devices", type=int, help="on CPU: number of fake devices to create")
    layouts.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    layouts.add_argument("--repeats", type=int, default=0, help="also time to_gen/to_train this many times")
    layouts.add_argument("--out", help="write the rows as JSON here")
    layouts.set_defaults(run=cmd_layouts)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "devices", None):
        if "jax" in sys.modules:
            raise SystemExit("--devices must be set before JAX is imported")
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
        ).strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
