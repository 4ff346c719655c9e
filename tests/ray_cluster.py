"""The Ray cluster of the tests marked `ray`: started once per test session, with its temp dir under pytest's tmp
path, shut down at the end. Worker processes get `tests/` and the repository root on PYTHONPATH, so that they can
import worker classes defined in test modules."""

import os
import warnings
from pathlib import Path

import pytest
import ray

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    temp_dir = tmp_path_factory.mktemp("ray")
    with warnings.catch_warnings():  # Ray starts its daemons with fork+exec, which Python flags once JAX has threads
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=str(temp_dir),
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}},
        )
    yield ray
    ray.shutdown()
    assert not ray.is_initialized()
