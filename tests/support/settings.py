"""The XLA settings of the test session and of a user's command. Tests compile thousands of small programs and run
each a few times, so on CPU they compile cheaply rather than run fast (`TEST_XLA_FLAGS`, set by conftest.py before
JAX is imported). A learning claim runs hundreds of training steps of one program, so it runs as the user's command
does, in a process of its own with the user's settings (`user_env`): optimised CPU code on the host's own devices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ON_CPU = os.environ.setdefault("JAX_PLATFORMS", "cpu") == "cpu"
# on CPU: 8 fake devices; no LLVM optimisation of the CPU code (an actor-update test: compile 20.2 s -> 11.5 s, the
# test 39 s -> 27 s); XLA's classic CPU fusion emitters instead of the MLIR ones (tests/test_trim_padding.py: 43.6 ->
# 27.4 s of CPU time); each program's machine code emitted as one module, not split for parallel code generation
# (tests/test_rollout.py and tests/test_attention.py: backend compiles 67.7 -> 59.7 s, the files 144 -> 138 s). With
# JAX_PLATFORMS=cuda (scripts/gpu_check.sh) the CPU flags stay out (a newer XLA that no longer knows one exits at
# start-up) and GPU reductions are deterministic, so that bitwise comparisons hold there too.
TEST_XLA_FLAGS = (
    (
        "--xla_force_host_platform_device_count=8",
        "--xla_backend_optimization_level=0",
        "--xla_cpu_use_fusion_emitters=false",
        "--xla_cpu_parallel_codegen_split_count=1",
    )
    if ON_CPU
    else ("--xla_gpu_deterministic_ops=true",)
)


def user_env() -> dict[str, str]:
    """This process's environment as a user's shell would give it to a command: without the session's XLA flags
    and without the session's Ray cluster (the command starts its own), keeping the session's compilation cache."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f not in TEST_XLA_FLAGS)
    return env


def run_command(args: list[str], log: Path, timeout_s: float) -> None:
    """Runs `hfjax ARGS` from the repository root in a process of its own with the user's settings (`user_env`),
    its output into `log`; fails with the log's tail if it exits non-zero."""
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "hfjax.cli.main", *args],
            cwd=REPO,
            env=user_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
        )
    assert done.returncode == 0, f"hfjax {' '.join(args)} exited {done.returncode}:\n{log.read_text()[-4000:]}"
