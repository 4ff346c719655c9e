"""Train <-> gen resharding on 8 fake CPU devices for a ~200M-parameter bfloat16 model (the `llama-200m` shape):
bytes moved and peak bytes per device against the paper's Table 2, and to_gen time against the memcpy floor
(bytes received summed over devices / this machine's memcpy bandwidth, measured in the same run), and against a
write floor: every gen byte copied at that bandwidth (on CPU a device's own share is copied too: CPU devices share
host memory, and each gen shard is a new buffer). Usage:
    python scripts/bench/bench_reshard.py [--pairs configs/layout_pairs.yaml] [--repeats 5] [--out
        runs/bench/reshard.json]
        [--lora-rank 16] [--tiny]
With `--param-dtype float32 --gen-dtype bfloat16` the training copy is float32 master weights and each pair also runs
with a bfloat16 generation copy (cast where the master lies, then moved; the master stays), beside float32 ones.
With `--lora-rank R` the model carries float32 LoRA adapters of rank R on every projection, and each pair also runs
with the frozen base kept in the generation layout (`rollout.lora_base_layout: gen`: only the adapters move) beside
the base moved with them (`train`).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import copy_times, parse_args, report

from hfjax.automap.layout_pairs import compare_layouts
from hfjax.cli.model_args import abstract_params_for
from hfjax.models.lora import LoraParam
from hfjax.optim.train_state import frozen_flags

MIB = 2**20


def memcpy_bandwidth(nbytes: int, repeats: int = 7) -> float:
    """Bytes per second of one host memcpy into an already-touched buffer (median of `repeats`)."""
    return nbytes / statistics.median(copy_times(nbytes, repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-200m")
    parser.add_argument(
        "--pairs", type=Path, default=Path(__file__).resolve().parents[2] / "configs" / "layout_pairs.yaml"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/reshard.json"))
    parser.add_argument("--param-dtype", default="bfloat16", help="dtype of the training copy")
    parser.add_argument("--gen-dtype", default=None, help="also run each pair with the generation copy cast to this")
    parser.add_argument("--probe-mib", type=int, default=256, help="size of the memcpy bandwidth probe")
    parser.add_argument("--max-pairs", type=int, help="compare only the first N pairs of --pairs")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank; the base moved or kept")
    args = parse_args(parser, tiny={"model": "bench-25m", "repeats": 1, "probe_mib": 8, "max_pairs": 2, "lora_rank": 4})
    pairs = yaml.safe_load(args.pairs.read_text())["pairs"][: args.max_pairs]
    params = abstract_params_for(args.model, args.param_dtype, args.lora_rank)
    bandwidth = memcpy_bandwidth(args.probe_mib * MIB)
    gen_dtypes = (None, args.gen_dtype) if args.gen_dtype else (None,)
    frozen = frozen_flags(params, LoraParam) if args.lora_rank else None
    rows = compare_layouts(params, pairs, repeats=args.repeats, gen_dtypes=gen_dtypes, stationary=frozen)
    bandwidth = (bandwidth + memcpy_bandwidth(args.probe_mib * MIB)) / 2  # before and after, to smooth machine noise
    table = []
    for r in rows:
        floor, write_floor = r["received_bytes_total"] / bandwidth, r["gen_bytes_total"] / bandwidth
        table.append(
            [
                r["pair"],
                r["mode"],
                ("kept in gen" if r["stationary"] else "moved") if args.lora_rank else "-",
                f"{r['param_dtype']}->{r['gen_dtype']}",
                "yes" if r["contained"] else "no",
                r["train_bytes_per_device"] / MIB,
                r["gen_bytes_per_device"] / MIB,
                r["received_bytes_per_device"] / MIB,
                r["table2_moved_bytes"] / MIB,
                r["redundant_bytes_per_device"] / MIB,
                r["peak_param_bytes_per_device"] / MIB,
                r["table2_peak_bytes"] / MIB,
                r["to_gen_s"] * 1e3,
                floor * 1e3,
                r["to_gen_s"] / floor,
                write_floor * 1e3,
                r["to_gen_s"] / write_floor,
                r["to_train_s"] * 1e3,
            ]
        )
    report(
        f"{args.model} {args.param_dtype} (M = {rows[0]['param_bytes'] / MIB:.1f} MiB) on 8 CPU devices, "
        "per-device MiB, "
        f"memcpy {bandwidth / 1e9:.2f} GB/s",
        [
            "pair",
            "mode",
            "LoRA base",
            "dtypes",
            "contained",
            "train",
            "gen",
            "moved",
            "Table 2 moved",
            "redundant",
            "peak",
            "Table 2 peak",
            "to_gen ms",
            "floor ms",
            "to_gen / floor",
            "write floor ms",
            "to_gen / write floor",
            "to_train ms",
        ],
        table,
        args.out,
        {"memcpy_bytes_per_s": bandwidth, "rows_raw": rows},
    )


if __name__ == "__main__":
    main()
