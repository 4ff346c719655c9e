"""Worker groups of several processes, one per simulated host (a Ray cluster of separate nodes on this machine, 4
fake CPU devices per process, gloo between them): GRPO and PPO over 2 hosts x 4 devices equal 1 host x 8 devices
with the same seeds and layouts (metrics and final weights), generation splits prompts over the hosts and returns
what one host generates, dispatch padding never reaches a loss, and bad host/device combinations are clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from rl_setup import build_run_inputs, rl_config
from safetensors.numpy import load_file

from hfjax.config import load_rl_config
from hfjax.trainer.launch import export_run, run_rl

pytest_plugins = ["ray_cluster"]
VARIABLE = ("timing_s/", "perf/throughput", "perf/worker_seconds")
# the same global layouts on 1 x 8 and 2 x 4 devices: FSDP training, generation as 4 replicas of tensor 2
LAYOUTS = {
    "actor": {"train_layout": {"mesh": {"fsdp": 8}, "rules": "fsdp"}, "ppo_mini_batch_size": 8, "micro_batch_size": 8},
    "rollout": {"gen_layout": {"mesh": {"data": 4, "tensor": 2}, "rules": "dp_tp_gen"}},
    "critic": {"layout": {"mesh": {"fsdp": 8}, "rules": "fsdp"}, "ppo_mini_batch_size": 8, "micro_batch_size": 8},
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    varied = root / "distinct_characters.py"  # a reward that differs between random samples: advantages != 0
    varied.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(set(solution_str)))\n"
    )
    return {**build_run_inputs(root), "reward": f"{varied}:compute_score"}


def _config(inputs, run_dir, algorithm, hosts, **trainer):
    trainer = {"backend": "ray", "hosts": hosts, "devices_per_host": 8 // hosts, **trainer}
    config = rl_config(inputs, run_dir, algorithm, **LAYOUTS, trainer=trainer)
    config["reward"] = {"function": inputs["reward"]}
    return load_rl_config(config)


def _weights(run_dir, out):
    export_run(run_dir, None, out)
    return load_file(str(next(out.glob("*.safetensors"))))


@pytest.mark.ray
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_two_hosts_equal_one_host(ray_cluster, inputs, tmp_path, algorithm):
    runs = {}
    for hosts in (1, 2):
        history = run_rl(_config(inputs, tmp_path / f"h{hosts}", algorithm, hosts))
        runs[hosts] = ([{k: v for k, v in m.items() if not k.startswith(VARIABLE)} for m in history], hosts)
    one, two = runs[1][0], runs[2][0]
    assert len(one) == len(two) == 3
    assert one[0]["critic/advantages/max"] > 0  # the updates learn something, so equal weights mean equal updates
    for step, (a, b) in enumerate(zip(one, two, strict=True)):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (step, key)
    w1, w2 = _weights(tmp_path / "h1", tmp_path / "hf1"), _weights(tmp_path / "h2", tmp_path / "hf2")
    assert w1.keys() == w2.keys()
    for name in w1:
        np.testing.assert_allclose(w2[name], w1[name], rtol=1e-4, atol=1e-5, err_msg=name)
