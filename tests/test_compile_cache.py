"""The compilation cache the command line turns on: its settings, and a second process loading its programs."""

import json
import os
import subprocess
import sys
from pathlib import Path

from hfjax.xla_settings import JAX_VARIABLES, MAX_BYTES, cache_directory, cache_environment

PROGRAM = """
import json
from hfjax.xla_settings import enable_compilation_cache
enable_compilation_cache()
import jax, jax.numpy as jnp
hits = []
jax.monitoring.register_event_listener(lambda name, **_: hits.append(name == "/jax/compilation_cache/cache_hits"))
x = jnp.arange(64.0).reshape(8, 8) / 64
value = jax.jit(lambda x: jnp.tanh(x @ x.T).sum() + jnp.sin(x).prod())(x)
print(json.dumps({"hits": sum(hits), "value": float(value)}))
"""


def test_settings_choose_the_directory_and_keep_the_users_jax_values():
    assert cache_directory({"HOME": "/home/u"}) == Path("/home/u/.cache/hfjax/xla")
    assert cache_directory({"HOME": "/home/u", "XDG_CACHE_HOME": "/c"}) == Path("/c/hfjax/xla")
    assert cache_directory({"HFJAX_COMPILATION_CACHE": "/data/xla"}) == Path("/data/xla")
    for off in ("off", "OFF", "0", "false", "none", ""):
        assert cache_directory({"HFJAX_COMPILATION_CACHE": off}) is None
        assert cache_environment({"HFJAX_COMPILATION_CACHE": off}) == {}
    env = cache_environment({"HFJAX_COMPILATION_CACHE": "/data/xla", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "3"})
    assert env == {
        "JAX_COMPILATION_CACHE_DIR": "/data/xla",
        "JAX_COMPILATION_CACHE_MAX_SIZE": str(MAX_BYTES),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "3",
    }


def _run(tmp_path: Path, setting: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in JAX_VARIABLES}  # drop the test session's own cache
    env.update(HFJAX_COMPILATION_CACHE=setting, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", HOME=str(tmp_path))
    env.pop("XDG_CACHE_HOME", None)
    done = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_compiled_program_from_the_cache(tmp_path):
    cache = tmp_path / "xla"
    first = _run(tmp_path, str(cache))
    entries = sorted(p.name for p in cache.iterdir() if not p.name.startswith("."))
    second = _run(tmp_path, str(cache))
    assert first["hits"] == 0 and entries and second["hits"] >= 1
    assert second["value"] == first["value"]
    off = _run(tmp_path, "off")
    assert off["hits"] == 0 and off["value"] == first["value"]
    assert not (tmp_path / ".cache").exists()  # off writes nowhere, not even the default directory
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == entries
