"""Test set-up: 8 fake CPU devices, set before JAX is imported anywhere."""

import os
import tempfile

import pytest
from support.settings import TEST_XLA_FLAGS

from hfjax.xla_settings import enable_compilation_cache

# XLA's settings for tests (cheap compiles on 8 fake CPU devices; tests/support/settings.py says why): set before JAX
# is imported; Ray workers and scripts started by tests inherit them (`ResourcePool.process_env`).
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *TEST_XLA_FLAGS]).strip()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Tests build the same small programs many times (each worker, engine and trainer compiles its own): a persistent
# compilation cache for the session turns repeats into cache hits, here and in Ray worker processes (which inherit
# this environment).
os.environ.setdefault("HFJAX_COMPILATION_CACHE", tempfile.mkdtemp(prefix="hfjax-test-xla-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# no size bound: with one, every write locks the directory and lists all of its entries to evict the oldest, which
# over a session's thousands of small programs doubled the time of compile-bound test files (tests/test_attention.py,
# tests/test_packing.py, tests/test_algos_verl_losses.py on 2 workers: 48-64 s -> 30 s). The directory holds only
# this session's programs.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")
enable_compilation_cache()  # the command line's cache settings, in a directory of this session's own

import jax  # noqa: E402 (after the environment above)

jax.config.update("jax_default_matmul_precision", "highest")

if os.environ.get(
    "HFJAX_TEST_COMPILE_REPORT"
):  # where the compiles come from, per test (tests/support/compile_report.py)
    pytest_plugins = ["support.compile_report"]


@pytest.fixture
def one_device_xla_flags() -> str:
    """The session's XLA flags without its 8 fake devices, for processes a test starts with one device."""
    return " ".join(flag for flag in TEST_XLA_FLAGS if not flag.startswith("--xla_force_host_platform_device_count"))


def pytest_collection_modifyitems(items: list) -> None:
    """Workers take the tests in this order (`scripts/test.sh`: each test a unit of work of its own): the files that
    take minutes (`SCHEDULE_FIRST = <minutes>` in them) first, longest first, so that the run does not end with one
    worker busy on a long test while the other idles."""
    items.sort(key=lambda item: -getattr(getattr(item, "module", None), "SCHEDULE_FIRST", 0))


@pytest.fixture
def previous_handler(monkeypatch):
    """A handler of SIGTERM that a guard under test must put back (and that fails the test if a signal reaches it).
    The guards' timers still running when the test ends are cancelled: an abandoned run keeps its hard-exit timer to
    bound its exit, which would otherwise fire seconds later into whichever test runs then."""
    import signal

    from hfjax.trainer import preemption

    timers = []
    start_timer = preemption._start_timer

    def recorded(seconds: float, action):
        timers.append(start_timer(seconds, action))
        return timers[-1]

    monkeypatch.setattr(preemption, "_start_timer", recorded)
    reached: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: reached.append(signum))
    yield signal.getsignal(signal.SIGTERM)
    for timer in timers:
        timer.cancel()
    signal.signal(signal.SIGTERM, before)
    assert not reached, "a SIGTERM reached the handler outside the guard"
