"""`hfjax layouts`: the rule presets, or the train <-> generation transitions of layout pairs for a model
(`hfjax.automap.layout_pairs`) as a console table and JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hfjax.cli.model_args import abstract_params_for

MIB = 2**20


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:,.2f}"


def print_layout_rows(rows: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    timed = "to_gen_s" in rows[0] if rows else False
    table = Table(title=f"{title}: M = {_mib(rows[0]['param_bytes']) if rows else '-'} MiB, per-device MiB")
    lora = any(r.get("stationary") for r in rows)
    columns = ["pair", "mode"] + (["LoRA base"] if lora else [])
    columns += ["contained", "train", "gen", "moved", "Table 2", "per-param", "redundant", "peak"]
    columns += ["to_gen ms", "to_train ms"] if timed else []
    for col in columns:
        table.add_column(col)
    for r in rows:
        cells = [r["pair"], r["mode"]] + (["kept in gen" if r["stationary"] else "moved"] if lora else [])
        cells += [
            "yes" if r["contained"] else "no",
            _mib(r["train_bytes_per_device"]),
            _mib(r["gen_bytes_per_device"]),
            _mib(r["received_bytes_per_device"]),
            _mib(r["table2_moved_bytes"]),
            _mib(r["per_parameter_moved_bytes"]),
            _mib(r["redundant_bytes_per_device"]),
            _mib(r["peak_param_bytes_per_device"]),
        ]
        if timed:
            cells += [f"{r['to_gen_s'] * 1e3:,.1f}", f"{r['to_train_s'] * 1e3:,.1f}"]
        table.add_row(*cells)
    Console(width=180).print(table)


def write_rows(rows: list[dict[str, Any]], path: str | Path, extra: dict[str, Any] | None = None) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, **(extra or {})}, indent=2))
    print(f"wrote {out}")


def add_parser(sub: Any) -> None:
    layouts = sub.add_parser("layouts", help="list rule presets, or compare (train, gen) layout pairs for a model")
    layouts.add_argument("--model", help="Hugging Face model directory or a named size (e.g. llama-200m)")
    layouts.add_argument("--pairs", help="YAML file with 'pairs: [{name, train, gen}, ...]'")
    layouts.add_argument("--devices", type=int, help="on CPU: number of fake devices to create")
    layouts.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    layouts.add_argument("--repeats", type=int, default=0, help="also time to_gen/to_train this many times")
    layouts.add_argument(
        "--lora-rank", type=int, default=0, help="LoRA adapters of this rank; each pair with the base moved, and kept"
    )
    layouts.add_argument("--out", help="write the rows as JSON here")
    layouts.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hfjax.parallel import RULE_PRESETS

    if not args.pairs:
        for name, rules in RULE_PRESETS.items():
            print(f"{name:10s} " + ", ".join(f"{logical}->{'x'.join(axes)}" for logical, axes in rules))
        return 0
    if not args.model:
        raise SystemExit("hfjax layouts --pairs needs --model (a Hugging Face directory or a named size)")
    import yaml

    from hfjax.automap.layout_pairs import compare_layouts
    from hfjax.models.lora import LoraParam
    from hfjax.optim.train_state import frozen_flags

    with open(args.pairs) as f:
        pairs = (yaml.safe_load(f) or {}).get("pairs")
    if not isinstance(pairs, list) or not all(isinstance(p, dict) and {"train", "gen"} <= set(p) for p in pairs):
        raise SystemExit(f"{args.pairs}: expected 'pairs:' as a list of {{name, train, gen}} layout entries")
    params = abstract_params_for(args.model, args.dtype, args.lora_rank)
    frozen = frozen_flags(params, LoraParam) if args.lora_rank else None
    rows = compare_layouts(params, pairs, repeats=args.repeats, stationary=frozen)
    print_layout_rows(rows, f"{args.model} ({args.dtype}) on {args.devices or 'all'} devices")
    if args.out:
        write_rows(rows, args.out)
    return 0
