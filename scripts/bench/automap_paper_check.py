"""The auto-mapping search on the paper's PPO set-up (HybridFlow §8: actor, critic, reference and reward models of
the same Llama size; 1024 prompts, 1024-token prompts and responses, 1 PPO epoch of 8 mini-batches) with the
A100-80GB profile on 8-128 GPUs, checked against the paper's placement findings: colocating all models is best at
16-64 GPUs; split placements are best for 34B at 96-128 GPUs.

The built-in A100 profile has the DGX A100 network (one 200 Gb/s NIC per GPU). Placement choices depend mostly
on that inter-host bandwidth, so the search runs once per `--inter-host-gbps` value (per GPU, each way); 25 Gb/s
per GPU is a 200 Gb/s network shared by a host's 8 GPUs. Usage:
    python scripts/bench/automap_paper_check.py [--inter-host-gbps 200 50 25] [--out runs/automap/paper_check.json]
        [--tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import parse_args

from hfjax.automap import ClusterSpec, CostModel, MappingSearch, Workload, dataflow, role_shapes

SIZES = ("llama2-7b", "llama2-13b", "codellama-34b", "llama2-70b")
GPUS = (8, 16, 32, 64, 96, 128)
ROLES = ("actor", "critic", "ref", "reward")


def paper_expects(size: str, gpus: int) -> str | None:
    """The placement kind the paper found best, where it states one."""
    if gpus in (16, 32, 64):
        return "colocate"
    if size == "codellama-34b" and gpus in (96, 128):
        return "split"
    return None


def run_cell(size: str, gpus: int, inter_gbps: float) -> dict:
    cluster = ClusterSpec.builtin("a100-80gb", gpus // 8)
    profile = dataclasses.replace(cluster.profile, inter_host_bandwidth=inter_gbps * 1e9 / 8)
    flow = dataflow("ppo")
    model = CostModel(dataclasses.replace(cluster, profile=profile), flow, Workload())
    result = MappingSearch(model, role_shapes(flow, dict.fromkeys(ROLES, size))).run()
    cell = {"size": size, "gpus": gpus, "inter_host_gbps": inter_gbps, "search_s": result.seconds}
    best_of = {}
    for c in result.candidates:
        best_of.setdefault(c.kind, c)
    cell["best_s"] = {kind: round(c.iteration_seconds, 2) for kind, c in best_of.items()}
    colocated = [why for placement, why in result.rejected.items() if " | " not in placement]
    cell["colocate_reason"] = colocated[0] if colocated else ""
    if not result.candidates:
        cell.update(kind="infeasible", placement="-")
        return cell
    best = result.candidates[0]
    cell.update(
        kind=best.kind,
        placement=" | ".join(f"{'+'.join(g)}:{n}" for g, n in best.mapping.groups),
        layouts={r: s.describe() for r, s in best.mapping.layouts.items()},
        gen=best.mapping.gen_layout.describe(),
        iteration_s=round(best.iteration_seconds, 2),
        stages_s={k: round(v, 2) for k, v in best.prediction.stage_seconds.items()},
    )
    return cell


def verdict(cell: dict) -> str:
    expected = paper_expects(cell["size"], cell["gpus"])
    if expected is None:
        return "-"
    if cell["kind"] == expected:
        return "agrees"
    if cell["kind"] == "infeasible":
        return "n/a: nothing fits"
    other = cell["best_s"].get(expected)
    if other is None:
        return f"differs: no {expected} mapping fits"
    return f"differs: best {expected} is {100 * (other / cell['iteration_s'] - 1):.0f}% slower"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inter-host-gbps", type=float, nargs="+", default=[200.0, 50.0, 25.0])
    parser.add_argument("--out", type=Path, help="write every cell as JSON here")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=SIZES)
    parser.add_argument("--gpus", type=int, nargs="+", default=list(GPUS))
    args = parse_args(parser, tiny={"inter_host_gbps": [200.0], "sizes": ["llama2-7b"], "gpus": [8, 16]})
    console = Console(width=200)
    cells = []
    for gbps in args.inter_host_gbps:
        table = Table(title=f"PPO on A100-80GB, inter-host {gbps:g} Gb/s per GPU: best mapping per size and GPU count")
        for col in ("model", "GPUs", "best", "placement (devices)", "iteration s", "colocate s", "split s", "paper"):
            table.add_column(col)
        for size in args.sizes:
            for gpus in args.gpus:
                cell = run_cell(size, gpus, gbps)
                cell["verdict"] = verdict(cell)
                cells.append(cell)
                table.add_row(
                    size,
                    str(gpus),
                    cell["kind"],
                    cell["placement"],
                    str(cell.get("iteration_s", "-")),
                    str(cell["best_s"].get("colocate", "-")),
                    str(cell["best_s"].get("split", "-")),
                    cell["verdict"],
                )
        console.print(table)
    claims = [c for c in cells if c["verdict"] != "-"]
    agree = sum(c["verdict"] == "agrees" for c in claims)
    slowest = max(c["search_s"] for c in cells)
    print(f"{agree}/{len(claims)} cells agree with the paper; slowest search {slowest:.2f} s (limit 60 s)")
    for c in cells:
        if c["verdict"] != "-" and c["verdict"] != "agrees":
            why = f" Colocated: {c['colocate_reason'][:150]}" if c["colocate_reason"] else ""
            print(f"  {c['size']} on {c['gpus']} GPUs at {c['inter_host_gbps']:g} Gb/s: {c['verdict']}.{why}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(cells, indent=2))
        print(f"wrote {args.out}")
    if slowest >= 60:
        raise SystemExit("a search took a minute or more")


if __name__ == "__main__":
    main()
