"""Console table and JSON of layout-pair comparison rows (`hfjax.parallel.layout_compare`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MIB = 2**20


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:,.2f}"


def print_layout_rows(rows: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    timed = "to_gen_s" in rows[0] if rows else False
    table = Table(title=f"{title}: M = {_mib(rows[0]['param_bytes']) if rows else '-'} MiB, per-device MiB")
    columns = ["pair", "mode", "contained", "train", "gen", "moved", "Table 2", "per-param", "redundant", "peak"]
    columns += ["to_gen ms", "to_train ms"] if timed else []
    for col in columns:
        table.add_column(col)
    for r in rows:
        cells = [
            r["pair"],
            r["mode"],
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
