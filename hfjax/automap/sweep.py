"""Measured layout comparison (`hfjax sweep`): each candidate (one RL run config with its own placement, layouts,
micro-batch sizes, rematerialisation or packing) trains `warmup + steps` iterations in fresh worker groups on the
current cluster. Its row holds, measured after the warm-up (medians over the steps), the seconds of each stage of the
cost model (generation, inference, training) and of the whole iteration, tokens per second and the peak device memory
(where the platform counts it), with the cost model's prediction beside each, and with a target (`hfjax sweep
--target`) the compiler's peak per device of the candidate compiled for it. A candidate that does not load, fit or
run is a row with its reason, and the sweep goes on. Candidates come from a YAML file (`read_candidates`) or are the
auto-mapper's best (`auto_candidates`)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from hfjax.automap.calibrate import cluster_dict, spearman
from hfjax.automap.run_search import run_candidates
from hfjax.automap.trainer_runs import run_config
from hfjax.config.rl import RLConfig, load_rl_config
from hfjax.predict.cluster import ClusterSpec
from hfjax.predict.dataflow import STAGES
from hfjax.predict.run_config import predict_run
from hfjax.predict.run_mapping import without_mapping
from hfjax.trainer.launch import ray_session, run_rl
from hfjax.typed_config import ConfigError, to_dict

MEASURED_KEYS = ("step_s", *STAGES, "tokens_per_s", "device_peak_bytes")


def stage_of(timing: str) -> str | None:
    """The cost model's stage of the trainer's `timing_s/<timing>`: generation, inference passes, updates; None
    for controller work the model does not price, a total, and times inside or beside another (`reshard` is part of
    `gen`; an asynchronous run's `weight_sync` runs beside the step, whose `gen` is its wait for the rollout)."""
    if timing in ("gen", "gen_max"):
        return "generation"
    if timing in ("reward", "cost", "old_log_prob", "ref") or timing.startswith("values"):
        return "inference"
    return "training" if timing.startswith("update_") else None


@dataclasses.dataclass(frozen=True)
class SweepCandidate:
    """One run to measure: a raw run config and `key=value` overrides applied over it when it loads."""

    name: str
    config: dict[str, Any]
    overrides: tuple[str, ...] = ()


@dataclasses.dataclass
class SweepRow:
    """A candidate's measurement (`MEASURED_KEYS`; None where not measured), prediction (seconds per stage and
    `step_s`, `device_peak_bytes`) and, with a target, its compiled memory (`target`, `peak_bytes`, `fits`,
    `problems`); or the reason it failed (`error`), could not be predicted (`prediction_error`) or compiled
    (`compile_error`)."""

    name: str
    overrides: list[str]
    measured: dict[str, float | None] = dataclasses.field(default_factory=dict)
    predicted: dict[str, float] = dataclasses.field(default_factory=dict)
    error: str | None = None
    prediction_error: str | None = None
    compiled: dict[str, Any] = dataclasses.field(default_factory=dict)
    compile_error: str | None = None
    run_dir: str | None = None
    config: dict[str, Any] | None = None  # the run config as it loaded (what `hfjax automap --calibrate` re-predicts)

    @property
    def ok(self) -> bool:
        return self.error is None


def read_candidates(path: str | Path, base: Mapping[str, Any], common: Sequence[str] = ()) -> list[SweepCandidate]:
    """The candidates of a YAML file: a list (or `candidates:` holding one) of `{name, overrides}`, each
    `overrides` a list of `key=value` strings or a mapping of dotted keys to values, applied over `base` after the
    `common` overrides of every candidate. A file that is not such a list raises ConfigError naming it."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        reason = " ".join(str(exc).split())
        raise ConfigError(f"{path}: not a readable YAML file ({reason}); expected a list of candidates") from exc
    if isinstance(data, Mapping):
        data = data.get("candidates")
    if not isinstance(data, list) or not data:
        raise ConfigError(
            f"{path}: expected a non-empty list of candidates ({{name, overrides}}), or candidates: [...]"
        )
    out, names = [], set()
    for i, item in enumerate(data):
        where = f"{path}: candidates[{i}]"
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str) or not item["name"].strip():
            raise ConfigError(f"{where}: expected a mapping with a non-empty name and overrides, got {item!r}")
        if item["name"] in names:
            raise ConfigError(f"{where}.name: {item['name']!r} names another candidate too; names must be unique")
        names.add(item["name"])
        unknown = sorted(set(item) - {"name", "overrides"})
        if unknown:
            raise ConfigError(f"{where}: unknown keys {unknown}; expected name and overrides")
        overrides = item.get("overrides") or []
        if isinstance(overrides, Mapping):
            overrides = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]  # JSON: YAML that loads back as is
        if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
            raise ConfigError(
                f"{where}.overrides: expected a list of key=value strings or a mapping, got {overrides!r}"
            )
        out.append(SweepCandidate(item["name"], copy.deepcopy(dict(base)), (*common, *overrides)))
    return out


def auto_candidates(base: Mapping[str, Any], cluster: ClusterSpec, top: int) -> list[SweepCandidate]:
    """The auto-mapper's `top` mappings of `base` on `cluster` that the trainer runs (with their micro-batch sizes
    and rematerialisation, `run_candidates`), best predicted first."""
    ranked = run_candidates(load_rl_config(without_mapping(base)), cluster)
    out = []
    for rank, candidate in enumerate(ranked[:top], 1):
        groups = "|".join(f"{'+'.join(g)}:{n}" for g, n in candidate.mapping.groups)
        layouts = " ".join(f"{r}:{s.describe()}" for r, s in candidate.mapping.layouts.items() if r != "ref")
        settings = " ".join(f"{key.replace('_size', '')}={value}" for key, value in candidate.settings)
        name = f"auto{rank} {groups} {layouts} gen:t{candidate.mapping.gen_layout.tensor} {settings}"
        out.append(SweepCandidate(name, run_config(candidate, base, cluster)))
    return out


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")[:80] or "candidate"


def measured(history: Sequence[Mapping[str, float]], warmup: int) -> dict[str, float | None]:
    """Medians over the iterations after the first `warmup` (compiles): seconds per stage and per iteration,
    tokens per second; the largest peak device memory of the run (None where no device counts it)."""
    steps = history[warmup:]
    if not steps:
        raise ValueError(f"no iteration after the {warmup} warm-up iterations to measure")
    stages = [{s: 0.0 for s in STAGES} for _ in steps]
    for seconds, metrics in zip(stages, steps, strict=True):
        for key, value in metrics.items():
            stage = stage_of(key.removeprefix("timing_s/")) if key.startswith("timing_s/") else None
            if stage is not None:
                seconds[stage] += value
    out: dict[str, float | None] = {s: statistics.median(x[s] for x in stages) for s in STAGES}
    out["step_s"] = statistics.median(m["timing_s/step"] for m in steps)
    out["tokens_per_s"] = statistics.median(m["perf/throughput"] for m in steps)
    peaks = [m["perf/device_peak_bytes"] for m in history if "perf/device_peak_bytes" in m]
    out["device_peak_bytes"] = max(peaks) if peaks else None
    return out


def _predicted(cfg: RLConfig, cluster: ClusterSpec) -> dict[str, float]:
    prediction = predict_run(cfg, cluster)
    return {
        **prediction.stage_seconds,
        "step_s": prediction.iteration_seconds,
        "device_peak_bytes": max(prediction.group_peak_bytes),
    }


def _reason(error: BaseException) -> str:
    """An error as one line: its class and message (the last 600 characters)."""
    return " ".join(f"{type(error).__name__}: {error}".split())[-600:]


CompileFor = Callable[[RLConfig], dict[str, Any]]  # a run config -> its compiled memory (`SweepRow.compiled`)


def sweep_one(
    candidate: SweepCandidate,
    cluster: ClusterSpec,
    steps: int,
    warmup: int,
    run_dir: Path,
    compile_for: CompileFor | None = None,
) -> SweepRow:
    """Trains `candidate` for `warmup + steps` iterations into `run_dir` (no validation, checkpoints or plots) and
    measures it beside its prediction on `cluster`, and first compiles it with `compile_for` when given. Never raises
    for the candidate's own failures: they are the row's `error` (or `compile_error`)."""
    row = SweepRow(candidate.name, list(candidate.overrides), run_dir=str(run_dir))
    settings = [
        f"trainer.total_steps={warmup + steps}",
        f"trainer.run_dir={run_dir}",
        "trainer.resume=never",
        "trainer.save_freq=0",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.plot=false",
        "trainer.progress=false",
        "trainer.logger=[jsonl]",
    ]
    try:
        cfg = load_rl_config(candidate.config, [*candidate.overrides, *settings])
    except Exception as error:  # a candidate's bad config is its row's reason
        row.error = f"config: {_reason(error)}"
        return row
    row.config = to_dict(cfg)
    try:
        row.predicted = _predicted(cfg, cluster)
    except Exception as error:  # a mapping the cost model cannot price still runs
        row.prediction_error = _reason(error)
    if compile_for is not None:
        try:
            row.compiled = compile_for(cfg)
        except Exception as error:  # what does not compile for the target may still run here
            row.compile_error = _reason(error)
    try:
        row.measured = measured(run_rl(cfg), warmup)
    except Exception as error:  # a candidate that does not fit or fails is a row, the sweep goes on
        row.error = _reason(error)
    return row


@dataclasses.dataclass
class SweepResult:
    """Every candidate's row, the iterations each ran, the cluster its predictions are for, and the target its
    candidates were compiled for (None: not compiled)."""

    rows: list[SweepRow]
    steps: int
    warmup: int
    cluster: ClusterSpec
    target: str | None = None

    @property
    def rank_correlation(self) -> float | None:
        """Spearman's rho between predicted and measured iteration seconds over the rows that have both."""
        both = [r for r in self.rows if r.ok and "step_s" in r.predicted]
        return spearman([r.predicted["step_s"] for r in both], [r.measured["step_s"] for r in both])

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "warmup": self.warmup,
            "spearman_step_s": self.rank_correlation,
            "cluster": cluster_dict(self.cluster),
            "target": self.target,
            "candidates": [dataclasses.asdict(r) for r in self.rows],
        }


def run_sweep(
    candidates: Sequence[SweepCandidate],
    cluster: ClusterSpec,
    steps: int,
    warmup: int,
    out_dir: Path,
    progress: Callable[[SweepRow], None] | None = None,
    compile_for: CompileFor | None = None,
    target: str | None = None,
) -> SweepResult:
    """Measures every candidate in turn (`sweep_one`, compiled with `compile_for` for `target` when given), each
    into `out_dir/runs/<index>-<name>`, on one Ray session for all of them; `progress(row)` is called after each."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got steps={steps}, warmup={warmup}")
    rows: list[SweepRow] = []
    with _ray_session(candidates):
        for index, candidate in enumerate(candidates):
            run_dir = out_dir / "runs" / f"{index:02d}-{_slug(candidate.name)}"
            rows.append(sweep_one(candidate, cluster, steps, warmup, run_dir, compile_for))
            if progress is not None:
                progress(rows[-1])
    return SweepResult(rows, steps, warmup, cluster, target)


def _ray_session(candidates: Sequence[SweepCandidate]) -> contextlib.AbstractContextManager[None]:
    """One Ray session for every candidate that runs on Ray (worker groups start afresh per candidate; Ray itself
    starts once), as the first such candidate that loads would start it; nothing when none does."""
    for candidate in candidates:
        try:
            cfg = load_rl_config(candidate.config, list(candidate.overrides))
        except Exception:  # its row says why, in `sweep_one`
            continue
        if cfg.trainer.backend == "ray":
            return ray_session(cfg)
    return contextlib.nullcontext()
