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


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups into the node ids
def pytest_collection_modifyitems(items: list) -> None:
    """With `pytest -n N` (pytest-xdist, `--dist loadgroup` as scripts/test.sh runs it) each file's tests stay on one
    worker, so a module's fixtures (tiny models, compiled programs) are built once. The Ray tests of different files
    may run on different workers, each starting its own session cluster (`ray_cluster`): one more cluster start-up is
    cheaper than running every Ray test, the longest ones, on one worker while the other idles. A file whose tests
    share nothing (`SPREAD_TESTS = True` in it: each runs a script in a process of its own) spreads its tests over
    the workers."""
    for item in items:
        spread = getattr(getattr(item, "module", None), "SPREAD_TESTS", False)
        item.add_marker(pytest.mark.xdist_group(item.nodeid if spread else item.nodeid.split("::")[0]))
    # Workers take the files in this order: the files that take minutes (`SCHEDULE_FIRST = <minutes>` in them) go
    # first, longest first, so that the run does not end with one worker busy on a long file while the other idles.
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
