"""Which devices each process uses: `trainer.device` resolution against the Ray cluster's resources, and the
controller's JAX kept on the CPU whatever the driver's environment asks for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.rl_setup import build_run_inputs, rl_config

from hfjax.controller.resource_pool import resolve_device

pytest_plugins = ["support.ray_cluster"]
ROOT = Path(__file__).resolve().parents[1]

DRIVER = """
import json, sys
import ray
from hfjax.config.rl import load_rl_config
from hfjax.trainer.launch import run_rl

config, address, path = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
ray.init(address=address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
history = run_rl(load_rl_config(config))
import jax
print(json.dumps({"platforms": jax.config.jax_platforms, "backend": jax.default_backend(),
                  "devices": sorted({d.platform for d in jax.devices()}), "steps": len(history)}))
"""


def test_auto_picks_the_clusters_accelerator_and_a_missing_one_is_an_error():
    assert resolve_device("auto", {"CPU": 16.0}) == "cpu"
    assert resolve_device("auto", {"CPU": 16.0, "GPU": 8.0}) == "gpu"
    assert resolve_device("auto", {"CPU": 16.0, "TPU": 4.0}) == "tpu"
    assert resolve_device("cpu", {"CPU": 16.0, "GPU": 8.0}) == "cpu"
    assert resolve_device("gpu", {"GPU": 1.0}) == "gpu"
    with pytest.raises(ValueError, match=r"trainer.device=gpu: the Ray cluster has no GPU resources .*'CPU': 16.0"):
        resolve_device("gpu", {"CPU": 16.0})
    with pytest.raises(ValueError, match=r"trainer.device: expected auto or one of \('cpu', 'gpu', 'tpu'\), got 'npu'"):
        resolve_device("npu", {})


@pytest.mark.ray
@pytest.mark.slow  # a whole driver process training a step on Ray: about a minute of the default suite's 10
def test_controller_jax_stays_on_cpu_when_the_driver_environment_names_an_accelerator(
    ray_cluster, tmp_path, one_device_xla_flags
):
    """A driver started with JAX_PLATFORMS=cuda (what a GPU host's environment may set) trains on the Ray backend:
    its own JAX computations run on the CPU (without the pin, its first array fails: there is no CUDA here), the
    workers get the device kind of `trainer.device` (auto: the cluster has no accelerator, so cpu)."""
    inputs = build_run_inputs(tmp_path)
    trainer = {"backend": "ray", "total_steps": 1, "devices_per_host": 2, "device": "auto"}
    config = rl_config(inputs, tmp_path / "run", "grpo", trainer=trainer)
    address = ray_cluster.get_runtime_context().gcs_address
    pythonpath = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
    env = {**os.environ, "JAX_PLATFORMS": "cuda", "PYTHONPATH": pythonpath}
    env["XLA_FLAGS"] = one_device_xla_flags
    run = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(config), address, pythonpath],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen == {"platforms": "cpu", "backend": "cpu", "devices": ["cpu"], "steps": 1}


def test_accelerator_extras_pin_the_jax_release_of_the_runtime_pins():
    """`pip install hfjax[cuda12|cuda13|tpu]` installs the accelerator build of exactly the JAX that
    requirements.txt pins (a mismatched jaxlib/plugin pair fails at import on the accelerator)."""
    import tomllib

    pins = dict(line.split("==") for line in (ROOT / "requirements.txt").read_text().split("\n") if "==" in line)
    jax_pin = pins["jax"].split()[0]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {name: reqs for name, reqs in extras.items() if name in ("cuda12", "cuda13", "tpu")} == {
        name: [f"jax[{name}]=={jax_pin}"] for name in ("cuda12", "cuda13", "tpu")
    }
