"""The Ray cluster of the tests marked `ray`: a simulated cluster of `HOSTS` nodes on this machine
(`ray.cluster_utils.Cluster`, each node with its own raylet, as separate hosts would have), started once per test
session with its temp dir under /tmp, shut down at the end. Worker processes get `tests/` and the
repository root on PYTHONPATH, so that they can import worker classes defined in test modules."""

import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

TESTS = Path(__file__).resolve().parent.parent
HOSTS = 4


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
            head_node_args={"num_cpus": 2, "resources": {"host0": 1}, "temp_dir": str(temp_dir)},
        )
        for host in range(1, HOSTS):
            cluster.add_node(num_cpus=1, resources={f"host{host}": 1})
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
