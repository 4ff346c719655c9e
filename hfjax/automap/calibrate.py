"""Fitting the cost model to what a sweep measured (`hfjax automap --calibrate SWEEP.json`).

A sweep (`hfjax sweep`) records, per candidate, the run config as it loaded and the measured seconds of each stage
(generation, inference, training), with the cluster its predictions were for. Calibration re-predicts every
candidate under a profile whose speeds are the sweep's profile times a factor each (matmul FLOP/s with its narrow
points, memory bandwidth, intra- and inter-host link bandwidth) and whose fixed costs are fitted (collective
latency, decode overhead per layer, overhead per worker call), and chooses them to minimise the mean squared log
error between predicted and measured stage seconds, plus a small pull of each rate towards the sweep's (a rate the
measurements do not depend on, such as FLOP/s where fixed costs dominate, stays as it was); a pattern search in log
space, since the model is a sum of maxima, not smooth. The result is a cluster file with the fitted profile, which
`hfjax automap --cluster` and `hfjax sweep --cluster` read as any other."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hfjax.config.rl import load_rl_config
from hfjax.predict.cluster import GIB, ClusterSpec, DeviceProfile
from hfjax.predict.cost import CostModel, DeviceMapping, InfeasibleError
from hfjax.predict.dataflow import STAGES, Dataflow, ModelShape, role_shapes
from hfjax.predict.run_config import run_cost_options, run_dataflow, run_models, run_workload
from hfjax.predict.run_mapping import config_mapping
from hfjax.typed_config import ConfigError

RATES = ("matmul_flops", "memory_bandwidth", "intra_host_bandwidth", "inter_host_bandwidth")  # scaled by a factor
FIXED_COSTS = ("collective_latency_s", "decode_layer_overhead_s", "call_overhead_s")  # fitted in seconds
RIDGE = 1e-5  # weight of the squared log factors of the rates in the fit (module docstring)
FLOOR_S = 1e-4  # stage seconds below this are compared as this (log error of near-zero stages is noise)


def cluster_dict(cluster: ClusterSpec) -> dict[str, Any]:
    """A cluster as the mapping `ClusterSpec.from_dict` reads (its profile's every field written out)."""
    profile = dataclasses.asdict(cluster.profile)
    profile["narrow_matmul_flops"] = [list(point) for point in cluster.profile.narrow_matmul_flops]
    return {
        "hosts": cluster.hosts,
        "devices_per_host": cluster.devices_per_host,
        "device_memory_gib": cluster.device_memory_bytes / GIB,
        "profile": profile,
    }


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One candidate of a sweep: what the cost model needs to predict it, its measured stage seconds and its
    measured seconds per step (the whole iteration as timed, which the sweep's rank correlation uses too)."""

    name: str
    flow: Dataflow
    shapes: Mapping[str, ModelShape]
    mapping: DeviceMapping
    config: Any
    seconds: dict[str, float]
    step_seconds: float


def measurements(sweep: Mapping[str, Any]) -> list[Measurement]:
    """The candidates of a sweep's JSON that ran, were predicted and kept their config (failed ones, and those the
    cost model does not price, e.g. an asynchronous disaggregated run, are left out). A row that is not what
    `hfjax sweep` writes raises ConfigError naming it."""
    rows = sweep.get("candidates", [])
    if not isinstance(rows, list):
        raise ConfigError(f"candidates: expected a list of the sweep's rows, got {type(rows).__name__}")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ConfigError(f"candidates[{i}]: expected a mapping (a row of the sweep), got {type(row).__name__}")
        if row.get("error") or row.get("prediction_error") or not row.get("config") or not row.get("measured"):
            continue
        measured = row["measured"]
        stages = {s: measured.get(s) for s in (*STAGES, "step_s")} if isinstance(measured, Mapping) else {}
        numbers = all(isinstance(stages.get(s), int | float) for s in STAGES)
        if not numbers or not isinstance(stages["step_s"], int | float | None):
            raise ConfigError(f"candidates[{i}].measured: expected the seconds of {', '.join(STAGES)}, got {measured}")
        try:
            cfg = load_rl_config(row["config"])
        except ValueError as exc:
            raise ConfigError(f"candidates[{i}].config: {exc}") from exc
        flow = run_dataflow(cfg)
        shapes = role_shapes(flow, run_models(cfg))
        mapping = config_mapping(row["config"], tuple(r for r in flow.roles if r in shapes))
        seconds = {s: float(stages[s]) for s in STAGES}
        step = float(stages["step_s"] or sum(seconds.values()))
        out.append(Measurement(str(row.get("name", f"candidates[{i}]")), flow, shapes, mapping, cfg, seconds, step))
    if len(out) < 2:
        raise ConfigError(
            f"calibration needs at least 2 candidates that ran and were predicted; the sweep has {len(out)}"
        )
    return out


def predict(cluster: ClusterSpec, m: Measurement) -> dict[str, float] | None:
    """The stage seconds the cost model predicts for `m` on `cluster`, or None where it cannot price it."""
    actor = m.mapping.layouts["actor"]
    model = CostModel(cluster, m.flow, run_workload(m.config, actor.batch_parts), run_cost_options(m.config))
    try:
        return model.predict(m.shapes, m.mapping).stage_seconds
    except InfeasibleError:
        return None


def log_error(cluster: ClusterSpec, ms: Sequence[Measurement]) -> float:
    """Mean squared log error of predicted against measured stage seconds over the candidates and stages."""
    errors = []
    for m in ms:
        predicted = predict(cluster, m)
        if predicted is None:
            return math.inf
        errors += [math.log(max(predicted[s], FLOOR_S) / max(m.seconds[s], FLOOR_S)) ** 2 for s in STAGES]
    return float(np.mean(errors))


def _profile(base: DeviceProfile, x: np.ndarray) -> DeviceProfile:
    """`base` with its rates times exp(x[:4]) and its fixed costs exp(x[4:]) seconds."""
    rates = {name: getattr(base, name) * math.exp(v) for name, v in zip(RATES, x[: len(RATES)], strict=True)}
    narrow = tuple((w, f * math.exp(x[0])) for w, f in base.narrow_matmul_flops)
    fixed = {name: math.exp(v) for name, v in zip(FIXED_COSTS, x[len(RATES) :], strict=True)}
    source = f"calibrated on a sweep ({base.name}: {base.source})" if base.source else "calibrated on a sweep"
    return dataclasses.replace(base, **rates, **fixed, narrow_matmul_flops=narrow, source=source)


@dataclasses.dataclass(frozen=True)
class Calibration:
    cluster: ClusterSpec
    error_before: float
    error_after: float


def calibrate(cluster: ClusterSpec, ms: Sequence[Measurement], max_rounds: int = 400) -> Calibration:
    """The profile of `cluster` fitted to `ms` (module docstring), with the log error before and after."""
    base = cluster.profile
    start = [0.0] * len(RATES) + [math.log(max(getattr(base, n), FLOOR_S / 100)) for n in FIXED_COSTS]
    x = np.array(start)

    def error(v: np.ndarray) -> float:  # a small pull towards the sweep's rates: those the data leave free stay
        ridge = RIDGE * float(np.sum(v[: len(RATES)] ** 2))
        return log_error(dataclasses.replace(cluster, profile=_profile(base, v)), ms) + ridge

    best = error(x)
    before = log_error(cluster, ms)
    rounds = 0
    for step in (2.0, 1.0, 0.5, 0.25, 0.1, 0.05, 0.02, 0.01, 0.005):
        improved = True
        while improved and rounds < max_rounds:
            improved, rounds = False, rounds + 1
            for i in range(len(x)):
                for sign in (1.0, -1.0):
                    trial = x.copy()
                    trial[i] = np.clip(trial[i] + sign * step, -25.0, 25.0)
                    value = error(trial)
                    if value < best - 1e-12:
                        x, best, improved = trial, value, True
    fitted = dataclasses.replace(cluster, profile=_profile(base, x))
    after = log_error(fitted, ms)
    if before <= after:  # the sweep's own profile already fits as well: keep it
        return Calibration(cluster, before, before)
    return Calibration(fitted, before, after)


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation of `a` and `b` (tied values share their mean rank); None for fewer than two
    pairs or a constant side."""

    def ranks(x: Sequence[float]) -> np.ndarray:
        values = np.asarray(x, dtype=float)
        order = np.argsort(values, kind="stable")
        out = np.empty(len(values))
        out[order] = np.arange(1, len(values) + 1)
        for value in np.unique(values):
            tied = values == value
            out[tied] = out[tied].mean()
        return out

    if len(a) != len(b) or len(a) < 2:
        return None
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def iteration_spearman(cluster: ClusterSpec, ms: Sequence[Measurement]) -> float | None:
    """Spearman's rho of predicted seconds per iteration (the sum of the predicted stages) against the measured
    seconds per step over `ms`: the sweep's own rank correlation (`spearman_step_s`), under `cluster`'s profile."""
    predicted = [predict(cluster, m) for m in ms]
    if any(p is None for p in predicted):
        return None
    return spearman([sum(p.values()) for p in predicted], [m.step_seconds for m in ms])


def calibrate_run(sweep_path: str, out: str) -> int:
    """`hfjax automap --calibrate`: fits the sweep's profile, prints the fit and the rank correlation before and
    after, and writes the cluster file with the fitted profile to `out`."""
    import json
    from pathlib import Path

    import yaml

    expected = "expected the sweep.json that `hfjax sweep` writes"
    try:
        sweep = json.loads(Path(sweep_path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{sweep_path}: not a readable JSON file ({exc}); {expected}") from exc
    if not isinstance(sweep, dict) or "cluster" not in sweep:
        raise ConfigError(f"{sweep_path}: no 'cluster' key; {expected}")
    cluster = ClusterSpec.from_dict(sweep["cluster"], f"{sweep_path}: cluster")
    try:
        ms = measurements(sweep)
    except ConfigError as exc:
        raise ConfigError(f"{sweep_path}: {exc}") from exc
    fit = calibrate(cluster, ms)
    before, after = iteration_spearman(cluster, ms), iteration_spearman(fit.cluster, ms)
    print(f"calibrated on {len(ms)} candidates of {sweep_path}")
    print(f"mean squared log error of stage seconds: {fit.error_before:.3f} -> {fit.error_after:.3f}")
    print(f"Spearman rho of seconds per iteration: {format_rho(before)} -> {format_rho(after)}")
    for name in (*RATES, *FIXED_COSTS):
        print(f"  {name}: {getattr(cluster.profile, name):.4g} -> {getattr(fit.cluster.profile, name):.4g}")
    Path(out).write_text(yaml.safe_dump(cluster_dict(fit.cluster), sort_keys=False))
    print(f"wrote the calibrated cluster to {out} (use it with: hfjax automap --cluster {out} --config RUN.yaml)")
    return 0


def format_rho(value: float | None) -> str:
    """A rank correlation as printed (3 decimals), `-` where there is none."""
    return "-" if value is None else f"{value:.3f}"
