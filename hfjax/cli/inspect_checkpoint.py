"""`hfjax inspect`: how a checkpoint's parameters shard under a layout (no weights are loaded)."""

from __future__ import annotations

import argparse
from typing import Any

from hfjax.cli.model_args import layout_config


def add_parser(sub: Any) -> None:
    inspect = sub.add_parser("inspect", help="show parameter shardings of a checkpoint under a layout")
    inspect.add_argument("model", help="Hugging Face model directory")
    inspect.add_argument("--mesh", default="fsdp=1", help="mesh axes and sizes, e.g. fsdp=4,tensor=2")
    inspect.add_argument("--rules", default="fsdp_tp", help="rule preset name or a JSON list of [logical, mesh]")
    inspect.add_argument("--devices", type=int, help="on CPU: number of fake devices to create")
    inspect.add_argument("--head", choices=["causal_lm", "seq_cls", "token_cls"], help="override the head kind")
    inspect.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    inspect.add_argument("--all", action="store_true", help="list every layer, not only layer 0")
    inspect.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
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
    layout = Layout.from_config(layout_config(args))
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
