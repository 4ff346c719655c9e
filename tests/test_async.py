"""Asynchronous and disaggregated RL: the rollout on its own worker group fed the trainer's weights after every update.

`async.max_staleness: 0` on a disaggregated placement equals the synchronous colocated loop with the same layouts
(metrics and exported weights, exactly); a weight sync delivers exactly the trainer's weights cast to the rollout's
dtype, and a sync that fails leaves the rollout on its previous version and says so; staleness 1 overlaps generation
with training and trains on rollouts exactly one version old; the config refuses what cannot run."""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file
from support.rl_setup import build_run_inputs, rl_config, write_varied_reward

from hfjax.config.rl import load_rl_config
from hfjax.controller import WorkerError
from hfjax.models.hf import param_plan, read_config
from hfjax.predict.run_mapping import config_mapping
from hfjax.trainer.dry_run import describe_run
from hfjax.trainer.launch import export_run, run_rl
from hfjax.trainer.rl import RLTrainer
from hfjax.trainer.rollout_stream import sync_weights
from hfjax.typed_config import ConfigError, dump_yaml, to_dict
from hfjax.workers.weight_sync import WeightShards

SCHEDULE_FIRST = 6  # about this many minutes of tests in CI: started early on a worker (conftest.py)

pytest_plugins = ["support.ray_cluster"]
VARIABLE = ("timing_s/", "perf/", "timeline/", "async/", "sync/")
# the same layouts in both placements: the actor trains over 4 devices (fsdp) and generates over 4 (2 x tensor 2)
LAYOUTS = {
    "actor": {"train_layout": {"mesh": {"fsdp": 4}, "rules": "fsdp"}, "ppo_mini_batch_size": 8, "micro_batch_size": 8},
    "rollout": {"gen_layout": {"mesh": {"data": 2, "tensor": 2}, "rules": "dp_tp_gen"}},
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    return {**build_run_inputs(root), "reward": write_varied_reward(root)}


def _config(inputs, run_dir, placement, devices_per_host, staleness=0, steps=3, hosts=1, **actor):
    trainer = {"backend": "ray", "placement": placement, "hosts": hosts, "devices_per_host": devices_per_host}
    trainer["total_steps"] = steps
    sections = {**LAYOUTS, "actor": {**LAYOUTS["actor"], **actor}}
    config = rl_config(inputs, run_dir, "grpo", **sections, trainer=trainer)
    config["reward"] = {"function": inputs["reward"]}
    config["async"] = {"max_staleness": staleness}
    return load_rl_config(config)


def _deterministic(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith(VARIABLE)}


def _weights(run_dir, out):
    export_run(run_dir, None, out)
    return load_file(str(next(out.glob("*.safetensors"))))


@pytest.fixture(scope="module")
def synchronous(ray_cluster, inputs, tmp_path_factory):
    """The synchronous colocated run of the layouts (one host, 4 devices): its metrics and final weights."""
    root = tmp_path_factory.mktemp("sync")
    history = run_rl(_config(inputs, root / "run", "colocate", 4))
    assert history[0]["critic/advantages/max"] > 0  # the updates learn: equal weights mean equal updates
    return history, _weights(root / "run", root / "hf")


@pytest.mark.ray
def test_staleness_zero_on_its_own_devices_equals_the_synchronous_loop(synchronous, inputs, tmp_path):
    sync, w_sync = synchronous
    disaggregated = run_rl(_config(inputs, tmp_path / "async0", "disaggregated", 8))
    assert len(sync) == len(disaggregated) == 3
    for step, (want, got) in enumerate(zip(sync, disaggregated, strict=True)):
        assert _deterministic(got) == _deterministic(want), f"step {step + 1}"
        assert got["async/staleness"] == 0 and got["async/weights_version"] == step
        assert got["sync/bytes"] > 0
    w_async = _weights(tmp_path / "async0", tmp_path / "hf")
    assert w_sync.keys() == w_async.keys()
    for name in w_sync:
        np.testing.assert_array_equal(w_async[name], w_sync[name], err_msg=name)


@pytest.mark.ray
@pytest.mark.slow
def test_disaggregated_groups_of_two_hosts_each_equal_one_host(synchronous, inputs, tmp_path):
    """Trainer and rollout each on 2 simulated hosts x 2 devices: each trainer process sends the blocks it holds
    first, each rollout process assembles them from both; the run equals the one-host synchronous loop to float32
    rounding (reductions across processes add in another order)."""
    sync, w_sync = synchronous
    history = run_rl(_config(inputs, tmp_path / "hosts", "disaggregated", 2, hosts=4))
    assert len(history) == 3
    for step, (want, got) in enumerate(zip(sync, history, strict=True)):
        got, want = _deterministic(got), _deterministic(want)
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (step + 1, key)
    w_hosts = _weights(tmp_path / "hosts", tmp_path / "hf")
    for name in w_sync:
        np.testing.assert_allclose(w_hosts[name], w_sync[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.ray
@pytest.mark.slow
def test_six_rollout_and_two_trainer_devices_equal_the_synchronous_loop_on_two(ray_cluster, inputs, tmp_path):
    """An uneven split of one host (`trainer.group_devices: [6, 2]`): generation data parallel over 6 devices,
    training FSDP over the other 2. The run equals the synchronous loop on 2 devices (the same training layout) step
    for step: every metric but the engine's own log-prob gap to the trainer's (`rollout_corr/*`, float32 rounding)
    and the final weights, bit for bit."""

    def run(name: str, placement: str, gen_devices: int, **trainer) -> tuple[list[dict], dict]:
        config = rl_config(
            inputs,
            tmp_path / name,
            "grpo",
            actor={"train_layout": {"mesh": {"fsdp": 2}, "rules": "fsdp"}, "ppo_mini_batch_size": 8},
            rollout={"gen_layout": {"mesh": {"data": gen_devices}, "rules": "dp_tp_gen"}},
            trainer={"backend": "ray", "placement": placement, "total_steps": 2, **trainer},
        )
        config["reward"] = {"function": inputs["reward"]}
        return run_rl(load_rl_config(config)), _weights(tmp_path / name, tmp_path / f"{name}-hf")

    sync, w_sync = run("sync", "colocate", 2, devices_per_host=2)
    uneven, w_uneven = run("uneven", "disaggregated", 6, devices_per_host=8, group_devices=[6, 2])
    assert sync[0]["critic/advantages/max"] > 0  # the updates learn: equal weights mean equal updates
    for step, (want, got) in enumerate(zip(sync, uneven, strict=True)):
        # the engine's own log probs (`rollout_corr/`, against the trainer's) round differently with the rows spread
        # over 6 devices instead of 2 (about 1e-7 apart); the sampled tokens, the trainer's log probs and updates do
        # not
        assert got["rollout_corr/log_prob_abs_diff_max"] < 1e-5 and want["rollout_corr/log_prob_abs_diff_max"] < 1e-5
        skip = ("async/", "sync/", "rollout_corr/")
        got = {k: v for k, v in _deterministic(got).items() if not k.startswith(skip)}
        assert got == {k: v for k, v in _deterministic(want).items() if not k.startswith(skip)}, f"step {step + 1}"
    for name in w_sync:
        np.testing.assert_array_equal(w_uneven[name], w_sync[name], err_msg=name)


@pytest.mark.ray
def test_weight_sync_delivers_the_trainers_weights_and_a_failed_sync_keeps_the_old_version(
    ray_cluster, inputs, tmp_path
):
    cfg = _config(inputs, tmp_path / "run", "disaggregated", 8, steps=2, dtype="bfloat16")
    trainer = RLTrainer(cfg)
    try:
        rollout = trainer.roles["rollout"]
        before = rollout.rollout_params()[0]  # the checkpoint, loaded in bfloat16
        trainer.fit()
        assert rollout.weights_version() == [2]
        after = rollout.rollout_params()[0]  # every device's shard checked against the whole
        master = _weights(tmp_path / "run", tmp_path / "hf")  # the trainer's float32 master after 2 updates
        # the rollout holds the master cast to bfloat16, bit for bit, and it moved since the checkpoint
        config, _ = read_config(inputs["policy"])
        plan = param_plan(config, "causal_lm")
        assert len(plan) == len(after)
        moved = 0
        for mapping in plan:
            prefix = "".join(f"[{p!r}]" for p in mapping.path)
            path = next(k for k in after if k.startswith(prefix))
            got, want = mapping.to_hf(after[path]), master[mapping.hf_name].astype(ml_dtypes.bfloat16)
            assert got.dtype == ml_dtypes.bfloat16, path
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16), err_msg=path)
            moved += int(np.any(before[path] != after[path]))
        assert moved > len(after) // 2

        path = next(iter(after))
        shape, dtype = list(after[path].shape), after[path].dtype.name
        wrong_shape = WeightShards({path: ([n + 1 for n in shape], dtype)}, [])
        missing = WeightShards({}, [])  # nothing arrives for any parameter
        for bad, words in ((wrong_shape, "the rollout holds"), (missing, "no block of it arrived")):
            with pytest.raises(WorkerError, match="keeps serving version 2 on every process") as err:
                sync_weights(rollout, 3, [bad]).get()
            assert words in str(err.value)
            assert rollout.weights_version() == [2]
            for key, array in rollout.rollout_params()[0].items():
                np.testing.assert_array_equal(array.view(np.uint16), after[key].view(np.uint16), err_msg=key)
    finally:
        trainer.close()


@pytest.mark.ray
def test_staleness_one_overlaps_generation_with_training(ray_cluster, inputs, tmp_path):
    history = run_rl(_config(inputs, tmp_path / "async1", "disaggregated", 8, staleness=1, steps=4))
    assert [m["async/staleness"] for m in history] == [0, 1, 1, 1]
    assert [m["async/weights_version"] for m in history] == [0, 0, 1, 2]
    for metrics in history:
        assert all(math.isfinite(v) for v in metrics.values())
    # step 0 trains on its own policy's samples; later steps on samples of the policy one update back
    assert history[0]["rollout_corr/log_prob_abs_diff_max"] < 1e-5
    assert all(m["rollout_corr/log_prob_abs_diff"] > 1e-4 for m in history[1:])
    assert history[-1]["timeline/run_overlap_s"] > 0  # the rollout group generated while the trainer trained
    spans = [json.loads(line) for line in (tmp_path / "async1" / "timeline.jsonl").read_text().splitlines()]
    generated = sorted(s["step"] for s in spans if s["name"] == "generate_sequences" and s["group"] == "rollout")
    assert generated == [0, 1, 2, 3]
    # the rollout of step k+1 started before the trainer's update of step k ended
    start = {s["step"]: s["start"] for s in spans if s["name"] == "generate_sequences" and s["group"] == "rollout"}
    update_end = {s["step"]: s["end"] for s in spans if s["name"] == "update_actor"}
    assert any(start[k + 1] < update_end[k] for k in range(3))


def test_config_refuses_what_cannot_run_and_round_trips_the_async_section(inputs, tmp_path):
    with pytest.raises(ConfigError, match=r"trainer\.placement=disaggregated"):
        _config(inputs, tmp_path, "colocate", 8, staleness=1)
    with pytest.raises(ConfigError, match="max_staleness: expected >= 0"):
        _config(inputs, tmp_path, "disaggregated", 8, staleness=-1)
    local = rl_config(inputs, tmp_path, "grpo", trainer={"placement": "disaggregated"})
    with pytest.raises(ConfigError, match=r"needs trainer\.backend=ray"):
        load_rl_config(local)
    cfg = _config(inputs, tmp_path, "disaggregated", 8, staleness=2)
    assert cfg.worker_groups() == [["rollout"], ["actor"]]
    saved = dump_yaml(cfg, tmp_path / "config.yaml")
    assert "async:\n  max_staleness: 2" in saved.read_text()
    assert load_rl_config(saved).async_.max_staleness == 2
    assert load_rl_config(saved, ["async.max_staleness=0"]).async_.max_staleness == 0


def test_group_devices_split_one_host_unevenly_and_bad_splits_name_the_field(inputs, tmp_path):
    def config(placement="disaggregated", gen=6, train=2, **trainer):
        actor = {"train_layout": {"mesh": {"fsdp": train}, "rules": "fsdp"}}
        rollout = {"gen_layout": {"mesh": {"data": gen}, "rules": "dp_tp_gen"}}
        trainer = {"backend": "ray", "placement": placement, "group_devices": [6, 2], **trainer}
        return rl_config(inputs, tmp_path, "ppo", actor=actor, rollout=rollout, trainer=trainer)

    cfg = load_rl_config(config())
    assert cfg.worker_groups() == [["rollout"], ["actor", "critic"]]
    assert cfg.trainer.group_shapes(2) == [(1, 6), (1, 2)]
    assert (cfg.group_shape("rollout"), cfg.group_shape("critic")) == ((1, 6), (1, 2))
    report = describe_run(cfg)
    assert "group 0: rollout: 1 process(es) (one per host) x 6 devices = 6 devices" in report
    assert "group 1: actor + critic: 1 process(es) (one per host) x 2 devices = 2 devices" in report
    # the cost model places the split placement's groups as the trainer does: the actor's first
    split = load_rl_config(config("split", gen=6, train=6))
    mapping = config_mapping(to_dict(split), ("actor", "ref", "critic"))
    assert mapping.groups == ((("actor", "ref"), 6), (("critic",), 2))
    for bad, match in (
        (config(gen=4), r"rollout\.gen_layout: .* has 4 devices, but the rollout group has 6 devices"),
        (config(group_devices=[6, 3]), r"group_devices=\[6, 3\]: 9 devices in all, but trainer.devices_per_host=8"),
        (config(group_devices=[6, 0]), r"group_devices: expected a list of device counts >= 1"),
        (config(group_devices=[8]), r"group_devices=\[8\]: placement 'disaggregated' has 2 worker group\(s\)"),
        (config(group_devices=[2, 2], hosts=2, devices_per_host=2), r"on several hosts \(trainer.hosts=2\)"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_rl_config(bad)


def test_rollout_and_training_log_probs_agree_in_float32_and_correction_runs(inputs, tmp_path):
    """Colocated and synchronous, the engine's log probs of its samples equal the trainer's recomputed ones to
    float32 rounding: the `rollout_corr/*` metrics of the whole step batch, computed on the controller before the
    advantages (a correction is on, so the old log probs are a pass of their own), bound every token's difference.
    With token-level TIS and sequence rejection on, nothing is truncated or rejected then."""
    correction = {"rollout_is": "token", "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": 1.01}
    config = rl_config(inputs, tmp_path / "run", "grpo", trainer={"total_steps": 2})
    config["actor"]["rollout_correction"] = correction
    history = run_rl(load_rl_config(config))
    for metrics in history:
        assert "timing_s/old_log_prob" in metrics
        assert metrics["rollout_corr/log_prob_abs_diff_max"] < 1e-5  # the largest over the step's tokens
        assert abs(metrics["rollout_corr/kl"]) < 1e-5
        assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == 0
        assert metrics["rollout_corr/rollout_is_ratio_fraction_low"] == 0
        assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 0
        assert metrics["rollout_corr/ratio_mean"] == pytest.approx(1, abs=1e-5)


@pytest.mark.ray
@pytest.mark.slow
def test_partial_rollouts_take_newer_weights_as_they_appear(ray_cluster, inputs, tmp_path):
    cfg = _config(inputs, tmp_path / "partial", "disaggregated", 8, staleness=1, steps=4)
    cfg.async_.partial_rollout, cfg.async_.check_every = True, 1
    cfg.rollout.response_length, cfg.rollout.ignore_eos = 24, True  # generations long enough to overlap updates
    history = run_rl(cfg)
    assert len(history) == 4
    for step, metrics in enumerate(history):
        assert all(math.isfinite(v) for v in metrics.values())
        assert metrics["async/staleness"] <= 1  # no token older than max_staleness versions
        assert 0 <= metrics["async/token_staleness_mean"] <= metrics["async/staleness"]
        assert 0 <= metrics["async/partial_frac"] <= 1
        assert step - 1 <= metrics["async/weights_version"] <= step
    assert sum(m["sync/loads"] for m in history) >= 1  # the rollout took published weights itself
