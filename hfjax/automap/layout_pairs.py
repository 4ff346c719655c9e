"""Measured comparison of (train layout, gen layout) pairs for one parameter tree: per-device bytes of each layout,
bytes moved (from the shardings, beside the paper's Table 2 formula, `hfjax.predict.transition`), redundancy, peak,
and measured transition times. This is what `hfjax layouts --pairs` and `scripts/bench/bench_reshard.py` print."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from hfjax.parallel.hybrid_engine import HybridEngine, block_count
from hfjax.parallel.layout import is_param_leaf
from hfjax.predict.transition import table2_moved_bytes


def per_parameter_moved_bytes(engine: HybridEngine) -> int:
    """Sum over parameters of bytes/gen_parts - bytes/train_parts: exact when every shard is contained."""
    total = 0
    for shape, itemsize, ts, gs in zip(
        engine.shapes, engine.itemsizes, engine.train_shardings, engine.gen_shardings, strict=True
    ):
        nbytes = math.prod(shape) * itemsize
        total += nbytes // block_count(gs) - nbytes // block_count(ts)
    return total


def materialize(engine: HybridEngine, abstract_params: Any) -> Any:
    """Filler parameters (a ramp pattern, cheap to make) placed directly in the train layout."""
    leaves = jax.tree.leaves(abstract_params, is_leaf=is_param_leaf)
    arrays = []
    for leaf, sharding in zip(leaves, engine.train_shardings, strict=True):
        host = (np.arange(math.prod(leaf.shape), dtype=np.float32) % 251 / 251).astype(leaf.dtype).reshape(leaf.shape)
        arrays.append(jax.make_array_from_callback(leaf.shape, sharding, lambda idx, host=host: host[idx]))
    return jax.tree.unflatten(jax.tree.structure(abstract_params, is_leaf=is_param_leaf), arrays)


def compare_layouts(
    abstract_params: Any,
    pairs: Sequence[Mapping[str, Any]],
    *,
    modes: Sequence[str] = ("zero_redundancy", "naive"),
    repeats: int = 0,
    gen_dtypes: Sequence[str | None] = (None,),
    stationary: Sequence[bool] | None = None,
) -> list[dict[str, Any]]:
    """One row per (pair, mode, generation dtype; None: the parameters' own), and with `stationary` (flags per
    parameter, e.g. a LoRA base's) each of those again with the flagged parameters kept in the generation layout
    (`HybridEngine(stationary=...)`; the row's `stationary` is True). `pairs`: [{"name", "train", "gen"}].
    With `repeats` > 0, runs to_gen/to_train that many times after one warm-up on filler parameters and reports
    median times. A pair's variants take turns, one to_gen/to_train cycle each, so that none of them is always the
    first one timed (in one process the first transitions run slower while the process's memory grows). A row with
    stationary parameters gives Table 2's figure of the parameters that move."""
    sizes = [
        math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        for leaf in jax.tree.leaves(abstract_params, is_leaf=is_param_leaf)
    ]
    total = sum(sizes)
    kept_bytes = sum(n for n, still in zip(sizes, stationary, strict=True) if still) if stationary is not None else 0
    rows = []
    for pair in pairs:
        kept = (None,) if stationary is None else (None, stationary)
        variants = [(mode, dtype, still) for mode in modes for dtype in gen_dtypes for still in kept]
        engines = [
            HybridEngine(pair["train"], pair["gen"], abstract_params, mode=mode, gen_dtype=dtype, stationary=still)
            for mode, dtype, still in variants
        ]
        for (mode, _, still), engine in zip(variants, engines, strict=True):
            stats = engine.stats()
            rows.append(
                {
                    "pair": pair.get("name", f"{engine.train_layout.describe()} -> {engine.gen_layout.describe()}"),
                    "mode": mode,
                    "stationary": still is not None,
                    "param_bytes": total,
                    **{k: v for k, v in stats.items() if k not in ("to_gen_s", "to_train_s")},
                    "table2_moved_bytes": table2_moved_bytes(
                        total - (kept_bytes if still is not None else 0), engine.train_layout, engine.gen_layout
                    ),
                    "per_parameter_moved_bytes": per_parameter_moved_bytes(engine) if stats["contained"] else None,
                    "table2_peak_bytes": total
                    // (engine.gen_layout.axis_size("fsdp") * engine.gen_layout.axis_size("tensor")),
                }
            )
        if repeats:
            timed = rows[-len(engines) :]
            params = [materialize(engine, abstract_params) for engine in engines]
            for _ in range(repeats + 1):
                params = [engine.to_train(engine.to_gen(p)) for engine, p in zip(engines, params, strict=True)]
            for row, engine, p in zip(timed, engines, params, strict=True):
                times = engine.stats()
                row["to_gen_s"] = statistics.median(times["to_gen_s"][1:])
                row["to_train_s"] = statistics.median(times["to_train_s"][1:])
                jax.tree.map(lambda x: x.delete(), p)
    return rows
