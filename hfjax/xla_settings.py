"""XLA settings of hfjax's programs: the compile options of its jitted model programs and the persistent cache of
compiled programs that the `hfjax` command line turns on.

Compile options: `GRADIENT_COMPILER_OPTIONS` for training's gradient step, `FORWARD_COMPILER_OPTIONS` for
forward-only programs (training's forward step, the workers' log-prob passes, the generation engine's prefill and
decode steps).

XLA:CPU hands dot products, and by default reductions too, to the YNNPACK library; its reductions run slower than
XLA's own loops on these programs, so neither set allows them. The gradient step fuses the elementwise work around
each dot into the library call (`DOT`); forward programs make each dot its own call (`INDIVIDUAL_DOT`), keeping the
small batched dots of decode attention in XLA's loops. The measurements behind both choices are in
docs/benchmarks.md ("XLA:CPU compile options"). These are fields of XLA's debug options that only its CPU compiler
reads.

The compilation cache: a run compiles its programs (training steps, log-prob passes, the generation engine's prefill and
decode steps) once per process; with the cache, a later run of the same programs on the same machine loads them from
disk instead (docs/benchmarks.md measures what that saves). `HFJAX_COMPILATION_CACHE` chooses the directory: unset means
`$XDG_CACHE_HOME/hfjax/xla` (`~/.cache/hfjax/xla`); `off` (or `0`, `false`, `none`, empty) turns the cache off; any
other value is the directory. The settings reach JAX as its own environment variables, so they must be in place before
JAX is imported (Ray worker processes started later inherit them); a `JAX_*` variable the user set already wins. The
size is bounded (least recently used entries are evicted), and eviction makes JAX lock the directory while it writes, so
concurrent processes share it safely.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

_LIBRARY_FUSIONS = "xla_cpu_experimental_ynn_fusion_type"
GRADIENT_COMPILER_OPTIONS: dict[str, str] = {_LIBRARY_FUSIONS: "LIBRARY_FUSION_TYPE_DOT"}
FORWARD_COMPILER_OPTIONS: dict[str, str] = {_LIBRARY_FUSIONS: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}

SETTING = "HFJAX_COMPILATION_CACHE"
OFF_VALUES = frozenset({"", "0", "off", "false", "none"})
MAX_BYTES = 4 << 30
MIN_COMPILE_SECONDS = 0.5  # programs that compile faster are not worth a disk entry
LIMITS = {
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(MAX_BYTES),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": str(MIN_COMPILE_SECONDS),
}
JAX_VARIABLES = ("JAX_COMPILATION_CACHE_DIR", *LIMITS)


def cache_directory(environ: Mapping[str, str]) -> Path | None:
    """The cache directory that `environ` asks for, or None when the cache is off."""
    value = environ.get(SETTING)
    if value is None:
        base = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME", str(Path.home()))) / ".cache")
        return Path(base) / "hfjax" / "xla"
    if value.strip().lower() in OFF_VALUES:
        return None
    return Path(value).expanduser()


def cache_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """JAX's cache variables for `environ` (none when the cache is off); a `JAX_*` value already in `environ` is
    kept."""
    directory = cache_directory(environ)
    if directory is None:
        return {}
    ours = {"JAX_COMPILATION_CACHE_DIR": str(directory), **LIMITS}
    return {name: environ.get(name, value) for name, value in ours.items()}


def enable_compilation_cache() -> None:
    """Puts the cache variables into this process's environment (before JAX is imported; child processes inherit
    them)."""
    os.environ.update(cache_environment(os.environ))
