"""Test set-up: 8 fake CPU devices, set before JAX is imported anywhere."""

import os
import tempfile

import pytest

from hfjax.compile_cache import enable_compilation_cache

# Deterministic GPU reductions, so that bitwise comparisons also hold where the tests run with JAX_PLATFORMS=cuda.
# No LLVM optimisation of the CPU code: tests compile thousands of small programs and run each a few times, so the
# optimiser costs more than it saves (an actor-update test: compile 20.2 s -> 11.5 s, the test 39 s -> 27 s). XLA's
# own HLO passes still run; Ray workers inherit these flags (`ResourcePool.process_env`).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_gpu_deterministic_ops=true --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Tests build the same small programs many times (each worker, engine and trainer compiles its own): a persistent
# compilation cache for the session turns repeats into cache hits, here and in Ray worker processes (which inherit
# this environment).
os.environ.setdefault("HFJAX_COMPILATION_CACHE", tempfile.mkdtemp(prefix="hfjax-test-xla-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
enable_compilation_cache()  # the command line's cache settings, in a directory of this session's own

import jax  # noqa: E402 (after the environment above)

jax.config.update("jax_default_matmul_precision", "highest")

if os.environ.get("HFJAX_TEST_COMPILE_REPORT"):  # where the compiles come from, per test (tests/compile_report.py)
    pytest_plugins = ["compile_report"]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups into the node ids
def pytest_collection_modifyitems(items: list) -> None:
    """With `pytest -n N` (pytest-xdist, `--dist loadgroup` as scripts/test.sh runs it) each file's tests stay on one
    worker, so a module's fixtures (tiny models, compiled programs) are built once, and every test that uses the
    session's Ray cluster runs on the same worker, so one cluster serves them all."""
    for item in items:
        group = "ray" if "ray_cluster" in getattr(item, "fixturenames", ()) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
