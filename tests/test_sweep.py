"""`hfjax sweep`: its pieces against hand-written references (stage sums and medians of a trainer history, Spearman's
rho by its textbook formula, candidate files and their errors), and (slow) a sweep of six layouts and two broken ones
of a tiny GRPO run on 8 fake CPU devices, through the command line: every candidate's row holds every field, measured
beside predicted, and each broken one its reason."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from support.rl_setup import build_run_inputs, rl_config
from support.settings import user_env

from hfjax.automap import BUILTIN, ClusterSpec, dataflow, role_shapes
from hfjax.automap.calibrate import calibrate, iteration_spearman, log_error, measurements, predict, spearman
from hfjax.automap.run_search import run_candidates
from hfjax.automap.sweep import MEASURED_KEYS, auto_candidates, measured, read_candidates, stage_of
from hfjax.automap.trainer_runs import run_config
from hfjax.cli.main import main
from hfjax.cli.quickstart_models import BaseModelSection, build_base_model
from hfjax.config.rl import load_rl_config
from hfjax.data.synthetic import AdditionTask, build_addition_tokenizer, write_addition_task
from hfjax.predict.cluster import GIB
from hfjax.predict.dataflow import STAGES
from hfjax.predict.run_config import predict_run, run_models
from hfjax.predict.run_mapping import config_mapping
from hfjax.typed_config import to_dict


def test_stage_of_every_timing_the_trainer_writes():
    timings = {
        "generation": ("gen", "gen_max"),
        "inference": ("reward", "cost", "old_log_prob", "ref", "values", "values_cost_critic"),
        "training": ("update_actor", "update_critic", "update_cost_critic"),
        None: ("adv", "step", "reshard", "weight_sync"),  # controller work, the total, part of gen or beside it
    }
    for stage, names in timings.items():
        assert [stage_of(n) for n in names] == [stage] * len(names)


def test_measured_sums_stages_and_takes_medians_after_the_warmup():
    history = [
        {"timing_s/step": 9.0, "timing_s/gen": 5.0, "perf/throughput": 1.0},  # the warm-up: compiles
        {"timing_s/step": 3.0, "timing_s/gen": 1.5, "timing_s/reshard": 0.5, "timing_s/ref": 0.25},
        {"timing_s/step": 2.0, "timing_s/gen": 0.5, "timing_s/update_actor": 1.0, "timing_s/adv": 0.1},
        {"timing_s/step": 4.0, "timing_s/gen": 2.0, "timing_s/values": 0.5, "timing_s/update_critic": 0.5},
    ]
    for m, tokens in zip(history, (10, 30, 40, 20), strict=True):
        m["perf/throughput"] = float(tokens)
    out = measured(history, warmup=1)
    assert set(out) == set(MEASURED_KEYS)
    assert out["step_s"] == 3.0 and out["tokens_per_s"] == 30.0
    assert out["generation"] == 1.5  # median of 1.5, 0.5, 2.0
    assert out["inference"] == 0.25  # median of 0.25, 0, 0.5
    assert out["training"] == 0.5  # median of 0, 1.0, 0.5
    assert out["device_peak_bytes"] is None  # CPU devices keep no count
    history[2]["perf/device_peak_bytes"] = 7.0
    history[0]["perf/device_peak_bytes"] = 9.0
    assert measured(history, warmup=1)["device_peak_bytes"] == 9.0  # the run's largest, warm-up included
    with pytest.raises(ValueError, match="no iteration after the 4 warm-up iterations"):
        measured(history, warmup=4)


def test_spearman_is_the_textbook_formula_without_ties_and_mean_ranks_with_them():
    rng = np.random.default_rng(0)
    for n in (2, 5, 9):
        a, b = rng.permutation(n).astype(float), rng.permutation(n).astype(float)
        d = a - b  # the values are their own ranks minus one
        assert spearman(a, b) == pytest.approx(1 - 6 * np.sum(d**2) / (n * (n**2 - 1)))
    # ties: ranks of [1, 2, 2, 3] are [1, 2.5, 2.5, 4]; Pearson's r of the ranks against [1, 2, 3, 4]
    ra, rb = np.array([1, 2.5, 2.5, 4]), np.arange(1, 5.0)
    expected = np.sum((ra - ra.mean()) * (rb - rb.mean())) / np.sqrt(
        np.sum((ra - ra.mean()) ** 2) * np.sum((rb - rb.mean()) ** 2)
    )
    assert spearman([1, 2, 2, 3], [10, 20, 30, 40]) == pytest.approx(expected)
    assert spearman([1.0], [2.0]) is None and spearman([1, 1, 1], [1, 2, 3]) is None


def test_candidate_files_and_their_errors(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(
        "candidates:\n"
        "  - {name: fsdp8, overrides: [actor.train_layout.mesh.fsdp=8]}\n"
        "  - {name: t2, overrides: {actor.train_layout: {mesh: {fsdp: 4, tensor: 2}}, rollout.slots: 4}}\n"
    )
    base = {"trainer": {"total_steps": 1}}
    first, second = read_candidates(good, base)
    assert (first.name, first.overrides, first.config) == ("fsdp8", ("actor.train_layout.mesh.fsdp=8",), base)
    assert second.overrides == ('actor.train_layout={"mesh": {"fsdp": 4, "tensor": 2}}', "rollout.slots=4")
    assert yaml.safe_load(second.overrides[0].partition("=")[2]) == {"mesh": {"fsdp": 4, "tensor": 2}}
    bad = {
        "[]": r"expected a non-empty list of candidates",
        "[{overrides: [a=1]}]": r"candidates\[0\]: expected a mapping with a non-empty name",
        "[{name: a}, {name: a}]": r"candidates\[1\]\.name: 'a' names another candidate too",
        "[{name: a, overides: [x=1]}]": r"candidates\[0\]: unknown keys \['overides'\]",
        "[{name: a, overrides: [x]}]": r"candidates\[0\]\.overrides: expected a list of key=value strings",
    }
    for text, message in bad.items():
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_candidates(path, base)


def test_calibrating_a_file_that_is_not_a_sweep_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"candidates": []}))
    assert main(["automap", "--calibrate", str(path), "--out", str(tmp_path / "out.yaml")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"hfjax automap: {path}: no 'cluster' key; expected the sweep.json that `hfjax sweep` writes"
    )
    cluster = {"hosts": 1, "devices_per_host": 8, "profile": "h100"}
    path.write_text(json.dumps({"cluster": cluster, "candidates": [{"name": "a", "error": "ConfigError: x"}]}))
    assert main(["automap", "--calibrate", str(path), "--out", str(tmp_path / "out.yaml")]) == 2
    assert (
        "calibration needs at least 2 candidates that ran and were predicted; the sweep has 0"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "out.yaml").exists()


H100_CLUSTER = {"hosts": 1, "devices_per_host": 8, "profile": "h100"}
ROW = {"name": "a", "config": {"model_path": "m"}, "measured": {"generation": 1.0}}  # no inference or training


@pytest.mark.parametrize(
    ("command", "text", "expected"),
    [
        ("sweep", "[{name: a", r"not a readable YAML file \(while parsing .*\); expected a list of candidates"),
        ("sweep", "[]", r"expected a non-empty list of candidates \(\{name, overrides\}\), or candidates: \[\.\.\.\]"),
        ("sweep", "[{name: a, overrides: x}]", r"candidates\[0\]\.overrides: expected a list of key=value strings"),
        ("automap", "{not json", r"not a readable JSON file \(Expecting property name .*\); expected the sweep\.json"),
        ("automap", "[1, 2]", r"no 'cluster' key; expected the sweep\.json that `hfjax sweep` writes"),
        ("automap", json.dumps({"cluster": 5}), r"cluster: expected a mapping with 'hosts' and 'profile', got int"),
        ("automap", json.dumps({"cluster": {**H100_CLUSTER, "hosts": "two"}}), r"cluster: hosts, .* must be numbers"),
        ("automap", json.dumps({"cluster": H100_CLUSTER, "candidates": {}}), r"candidates: expected a list"),
        ("automap", json.dumps({"cluster": H100_CLUSTER, "candidates": [3]}), r"candidates\[0\]: expected a mapping"),
        (
            "automap",
            json.dumps({"cluster": H100_CLUSTER, "candidates": [ROW]}),
            r"candidates\[0\]\.measured: expected the seconds of generation, inference, training, got",
        ),
    ],
)
def test_a_malformed_candidates_or_sweep_file_is_one_line_naming_it(tmp_path, capsys, command, text, expected):
    """`hfjax sweep --candidates FILE` and `hfjax automap --calibrate FILE` with a file that does not parse or is not
    what they read: exit code 2 and one line naming the file and what was expected (before any device work)."""
    inputs = {"policy": str(tmp_path / "policy"), "train": "train.jsonl", "test": "test.jsonl"}
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(rl_config(inputs, tmp_path / "unused", "grpo")))
    path = tmp_path / ("candidates.yaml" if command == "sweep" else "sweep.json")
    path.write_text(text)
    if command == "sweep":
        argv = ["sweep", str(run), "--candidates", str(path), "--out", str(tmp_path / "out")]
    else:
        argv = ["automap", "--calibrate", str(path), "--out", str(tmp_path / "calibrated.yaml")]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(rf"hfjax {command}: {re.escape(str(path))}: {expected}.*", line), line
    assert not (tmp_path / "out").exists() and not (tmp_path / "calibrated.yaml").exists()


def test_a_target_of_another_device_count_than_the_run_is_refused(tmp_path, capsys):
    """`hfjax sweep --target` compiles for the run's own devices: a target with another count is one line (exit code
    2) before anything runs, as `hfjax automap --target` says for a cluster of another count; neither needs the
    target's compiler plugin to say so."""
    inputs = {"policy": str(tmp_path / "policy"), "train": "train.jsonl", "test": "test.jsonl"}
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(rl_config(inputs, tmp_path / "unused", "grpo", trainer={"devices_per_host": 2})))
    candidates = tmp_path / "candidates.yaml"
    candidates.write_text(yaml.safe_dump([{"name": "d2", "overrides": ["actor.train_layout.mesh={data: 2}"]}]))
    out = tmp_path / "out"
    argv = ["sweep", str(run), "--candidates", str(candidates), "--target", "v5e:2x4", "--out", str(out)]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"hfjax sweep: --target v5e:2x4: has 8 devices, but the run config {run} has 1 x 2 = 2"
    )
    assert not out.exists()
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(H100_CLUSTER))
    assert main(["automap", "--cluster", str(cluster), "--config", str(run), "--target", "v5e:2x2"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"hfjax automap: --target v5e:2x2: has 4 devices, but the cluster {cluster} has 1 x 8 = 8"
    )


def test_auto_candidates_are_the_automappers_best_as_run_configs_that_load(tmp_path):
    """`--candidates auto`: the `top` mappings `run_candidates` ranks first (micro-batch sizes and remat searched),
    each the run config `run_config` writes, that `hfjax train` would load: the mapping, micro-batch sizes and remat
    read back from it are the ranked ones, and the cost model predicts the written config as it ranked it."""
    inputs = build_run_inputs(tmp_path)
    base = rl_config(inputs, tmp_path / "run", "ppo", trainer={"backend": "ray"})
    cluster = ClusterSpec(1, 8, 8 * GIB, BUILTIN["h100"][0])
    candidates = auto_candidates(base, cluster, top=3)
    cfg = load_rl_config(base)
    flow = dataflow("ppo")
    shapes = role_shapes(flow, run_models(cfg))
    ranked = run_candidates(cfg, cluster)
    assert len(candidates) == 3 and len({c.name for c in candidates}) == 3
    for candidate, expected in zip(candidates, ranked, strict=False):
        assert candidate.name.startswith(f"auto{candidates.index(candidate) + 1} ")
        loaded = load_rl_config(candidate.config, list(candidate.overrides))
        assert config_mapping(to_dict(loaded), tuple(r for r in flow.roles if r in shapes)) == expected.mapping
        settings = dict(expected.settings)
        assert settings.keys() == {f"{r}.{k}" for r in ("actor", "critic") for k in ("micro_batch_size", "remat")}
        for key, value in settings.items():
            section, name = key.split(".")
            assert getattr(getattr(loaded, section), name) == value
        assert predict_run(loaded, cluster).iteration_seconds == pytest.approx(expected.iteration_seconds, rel=1e-12)


def test_calibration_recovers_the_profile_that_made_the_measurements(tmp_path):
    """Stage seconds "measured" by predicting six mappings under a known profile (an H100's rates times factors,
    fixed costs of its own) are fitted from the plain H100 profile: the fit reproduces every stage within 3%, and
    the overhead per call, which every stage of this tiny model depends on, is the known one within 5%."""
    inputs = build_run_inputs(tmp_path)
    base = rl_config(inputs, tmp_path / "run", "ppo", trainer={"backend": "ray"})
    h100 = BUILTIN["h100"][0]
    cluster = ClusterSpec(1, 8, 8 * GIB, h100)
    truth = ClusterSpec(
        1,
        8,
        8 * GIB,
        dataclasses.replace(
            h100,
            matmul_flops=h100.matmul_flops * 0.02,
            memory_bandwidth=h100.memory_bandwidth * 0.1,
            collective_latency_s=2e-4,
            call_overhead_s=5e-3,
        ),
    )
    rows = []
    for candidate in auto_candidates(base, cluster, top=6):
        config = to_dict(load_rl_config(candidate.config))
        rows.append({"name": candidate.name, "config": config, "measured": dict.fromkeys(STAGES, 1.0), "error": None})
    ms = measurements({"candidates": rows})
    for row, m in zip(rows, ms, strict=True):
        row["measured"] = predict(truth, m)
    ms = measurements({"candidates": rows})
    fit = calibrate(cluster, ms)
    assert fit.error_before > 1.0 and fit.error_after < 1e-3
    for m in ms:
        assert predict(fit.cluster, m) == pytest.approx(m.seconds, rel=0.03), m.name
    assert fit.cluster.profile.call_overhead_s == pytest.approx(5e-3, rel=0.05)


def test_sweep_and_automap_on_one_cpu_device(tmp_path, one_device_xla_flags):
    """In a process with one CPU device (a profile measured on it has no link to time: its memory bandwidth stands
    in), `hfjax automap` with a `profile: cpu` cluster ranks the mappings of a one-device run, and `hfjax sweep`
    measures its cluster there and predicts a candidate, which fails at the run's preflight (no data file: the row's
    reason, exit code 1, nothing compiled)."""
    inputs = build_run_inputs(tmp_path / "inputs")
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(rl_config(inputs, tmp_path / "unused", "grpo", trainer={"devices_per_host": 1})))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"hosts": 1, "profile": "cpu"}))
    candidates = tmp_path / "candidates.yaml"
    layouts = ["actor.train_layout.mesh={fsdp: 1}", "rollout.gen_layout.mesh={data: 1}"]
    overrides = [*layouts, f"data.train_files=[{tmp_path}/x.jsonl]"]
    candidates.write_text(yaml.safe_dump([{"name": "no-data", "overrides": overrides}]))
    env = user_env() | {"XLA_FLAGS": one_device_xla_flags, "JAX_PLATFORMS": "cpu"}

    def hfjax(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "hfjax.cli.main", *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)

    mapped = hfjax("automap", "--cluster", str(cluster), "--config", str(run), "--out", str(tmp_path / "mapped.yaml"))
    assert mapped.returncode == 0, mapped.stderr[-3000:]
    assert "grpo on 1x1 devices" in mapped.stdout
    assert yaml.safe_load((tmp_path / "mapped.yaml").read_text())["trainer"]["devices_per_host"] == 1
    out = tmp_path / "sweep"
    swept = hfjax("sweep", str(run), "--candidates", str(candidates), "--steps", "1", "--out", str(out))
    assert swept.returncode == 1, swept.stderr[-3000:]
    result = json.loads((out / "sweep.json").read_text())
    profile = result["cluster"]["profile"]
    assert profile["name"] == "cpu-1dev" and profile["intra_host_bandwidth"] == profile["memory_bandwidth"] > 0
    (row,) = result["candidates"]
    assert row["predicted"]["step_s"] > 0 and row["prediction_error"] is None
    assert "data.train_files[0]: no such file" in row["error"], row["error"]


TOP_LEVEL_TIMINGS = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor")  # of a GRPO step
LAYOUTS = {  # name: (actor training layout, generation layout), on 8 devices
    "fsdp8": ({"fsdp": 8}, {"data": 8}),
    "fsdp8-gen-t2": ({"fsdp": 8}, {"data": 4, "tensor": 2}),
    "d2-fsdp4": ({"data": 2, "fsdp": 4}, {"data": 8}),
    "fsdp4-t2": ({"fsdp": 4, "tensor": 2}, {"data": 4, "tensor": 2}),
    "d4-t2": ({"data": 4, "tensor": 2}, {"data": 4, "tensor": 2}),
    "d8": ({"data": 8}, {"data": 8}),
}
UNEVEN = {  # 6 devices generate and 2 train, on groups of their own, in turn (synchronous)
    "name": "rollout6-trainer2",
    "overrides": {
        "trainer.placement": "disaggregated",
        "trainer.backend": "ray",
        "trainer.group_devices": [6, 2],
        "actor.train_layout": {"mesh": {"fsdp": 2}},
        "rollout.gen_layout": {"mesh": {"data": 6}},
    },
}
BROKEN = {  # name: (overrides, what its row's error says)
    "fsdp3": (["actor.train_layout.mesh={fsdp: 3}"], r"ConfigError: actor\.train_layout: mesh\(fsdp=3\) has 3 devices"),
    "fsdp2-t4": (
        ["actor.train_layout.mesh={fsdp: 2, tensor: 4}"],
        r"ConfigError: .*'kv_heads'.* is not divisible by mesh axes",
    ),
}


@pytest.mark.slow
def test_a_sweep_of_six_layouts_and_two_broken_ones(tmp_path, capsys):
    inputs = build_run_inputs(tmp_path / "inputs")
    config = rl_config(inputs, tmp_path / "unused", "grpo")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    candidates = [
        {"name": name, "overrides": {"actor.train_layout": {"mesh": train}, "rollout.gen_layout": {"mesh": gen}}}
        for name, (train, gen) in LAYOUTS.items()
    ]
    candidates[2:2] = [{"name": name, "overrides": overrides} for name, (overrides, _) in BROKEN.items()]
    candidates.append(UNEVEN)
    (tmp_path / "candidates.yaml").write_text(yaml.safe_dump(candidates))
    out = tmp_path / "sweep"
    args = ["sweep", str(tmp_path / "run.yaml"), "--candidates", str(tmp_path / "candidates.yaml")]
    assert main([*args, "--steps", "2", "--warmup", "1", "--out", str(out)]) == 0
    result = json.loads((out / "sweep.json").read_text())
    assert (result["steps"], result["warmup"]) == (2, 1)
    rows = {row["name"]: row for row in result["candidates"]}
    assert list(rows) == [c["name"] for c in candidates]
    for name, (_, reason) in BROKEN.items():
        assert re.search(reason, rows.pop(name)["error"]), name
    uneven = rows.pop(UNEVEN["name"])
    assert uneven["error"] is None and uneven["measured"]["step_s"] > 0 and uneven["prediction_error"] is None
    rows[UNEVEN["name"]] = uneven
    for name, row in rows.items():
        assert row["error"] is None, (name, row["error"])
        assert set(row["measured"]) == set(MEASURED_KEYS)
        assert all(row["measured"][k] > 0 for k in ("step_s", "tokens_per_s", "generation", "training")), row
        assert row["measured"]["device_peak_bytes"] is None  # CPU devices keep no count
        assert set(row["predicted"]) == {*STAGES, "step_s", "device_peak_bytes"}
        assert row["predicted"]["step_s"] == pytest.approx(sum(row["predicted"][s] for s in STAGES))
        metrics = [json.loads(line) for line in (Path(row["run_dir"]) / "metrics.jsonl").open()]
        assert [m["step"] for m in metrics] == [1, 2, 3]  # warm-up + steps, no validation rows
        assert row["measured"]["step_s"] == np.median([m["timing_s/step"] for m in metrics[1:]])
        for m in metrics:  # the stages are parts of the step
            assert sum(m.get(f"timing_s/{k}", 0.0) for k in TOP_LEVEL_TIMINGS) < m["timing_s/step"]
    rho = result["spearman_step_s"]
    assert rho is not None and -1 <= rho <= 1
    assert (out / "sweep.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "Spearman rank correlation" in printed and "failed:" in printed
    # the cost model calibrated on this sweep: a cluster file that automap reads, with a smaller error
    cluster = ClusterSpec.from_dict(result["cluster"])
    assert main(["automap", "--calibrate", str(out / "sweep.json"), "--out", str(tmp_path / "calibrated.yaml")]) == 0
    calibrated = ClusterSpec.from_yaml(tmp_path / "calibrated.yaml")
    ms = measurements(result)
    assert len(ms) == len(LAYOUTS) + 1  # and the disaggregated candidate
    before, after = log_error(cluster, ms), log_error(calibrated, ms)
    print(capsys.readouterr().out)
    assert after < before
    assert iteration_spearman(cluster, ms) == pytest.approx(rho)  # one rank correlation: the sweep's and the fit's


def _inputs_without_torch(tmp_path: Path) -> dict[str, str]:
    """A one-layer policy, the addition task and its tokenizer, built without PyTorch (the compile virtualenv has
    none)."""
    tokenizer = build_addition_tokenizer()
    policy = build_base_model(
        tmp_path / "policy", BaseModelSection(hidden_size=32, intermediate_size=64, num_layers=1), tokenizer
    )
    files = write_addition_task(AdditionTask(min_digits=1, max_digits=2, num_train=16, num_test=8, num_sft=8), tmp_path)
    return {"policy": str(policy), "scorer": str(policy), "train": str(files["train"]), "test": str(files["test"])}


@pytest.mark.compile_target
def test_automap_with_a_target_writes_the_best_mapping_that_compiles_and_fits(tmp_path, capsys):
    """`hfjax automap --target`: the best mapping is compiled for the target and, fitting, written; its run config is
    the one `run_candidates` ranks first. A cluster of another device count than the target is an error before any
    compile."""
    run = rl_config(_inputs_without_torch(tmp_path), tmp_path / "unused", "grpo")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump({"hosts": 2, "devices_per_host": 4, "profile": "tpu-v5e"}))
    args = ["automap", "--cluster", str(tmp_path / "cluster.yaml"), "--config", str(tmp_path / "run.yaml")]
    assert main([*args, "--target", "v5e:2x4", "--out", str(tmp_path / "mapped.yaml")]) == 0
    assert "mapping 1 passes the check" in capsys.readouterr().out
    raw = yaml.safe_load((tmp_path / "run.yaml").read_text())
    cluster = ClusterSpec.from_yaml(tmp_path / "cluster.yaml")
    best = run_candidates(load_rl_config(raw), cluster)[0]
    assert yaml.safe_load((tmp_path / "mapped.yaml").read_text()) == run_config(best, raw, cluster)
    assert main([*args, "--target", "v5e:2x2"]) == 2
    assert "--target v5e:2x2: has 4 devices, but the cluster" in capsys.readouterr().err


@pytest.mark.compile_target
def test_a_sweep_compiled_for_a_tpu_target(tmp_path, capsys):
    """With --target every candidate is also compiled for the target as it runs (its overrides applied): its row
    holds what `hfjax compile` of that run config reports. Built without PyTorch (the compile virtualenv has none)."""
    run = rl_config(_inputs_without_torch(tmp_path), tmp_path / "unused", "grpo")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    candidates = [
        {"name": "fsdp8", "overrides": {"actor.train_layout": {"mesh": {"fsdp": 8}}}},
        {"name": "data8 mb2", "overrides": {"actor.train_layout": {"mesh": {"data": 8}}, "actor.micro_batch_size": 2}},
    ]
    (tmp_path / "candidates.yaml").write_text(yaml.safe_dump(candidates))
    out = tmp_path / "sweep"
    args = ["sweep", str(tmp_path / "run.yaml"), "--candidates", str(tmp_path / "candidates.yaml"), "--out", str(out)]
    assert main([*args, "--steps", "1", "--warmup", "0", "--target", "v5e:2x4"]) == 0
    result = json.loads((out / "sweep.json").read_text())
    assert result["target"] == "v5e:2x4" and "compiled GiB (v5e:2x4)" in capsys.readouterr().out
    peaks = []
    for row in result["candidates"]:
        assert row["error"] is None and row["compile_error"] is None, row
        (tmp_path / "candidate.yaml").write_text(yaml.safe_dump(row["config"]))
        report = tmp_path / f"{len(peaks)}.json"
        assert main(["compile", str(tmp_path / "candidate.yaml"), "--target", "v5e:2x4", "--json", str(report)]) == 0
        alone = json.loads(report.read_text())
        assert row["compiled"] == {"target": "v5e:2x4", "peak_bytes": max(p["peak"] for p in alone["programs"]),
                                   "fits": True, "problems": []}  # fmt: skip
        peaks.append(row["compiled"]["peak_bytes"])
    assert peaks[0] != peaks[1]  # each candidate compiled as its own layout, not the base config
