"""`scripts/gpu_check.sh --tiny --block-ray` end to end on the CPU: every check of the table reports ok, with
`import ray` failing in the generation and GRPO checks (the GPU machines have no Ray: the local backend must not
need it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXPECTED_CHECKS = {"environment", "parity tests", "generation vs transformers", "GRPO step (local backend)"}


@pytest.mark.slow
def test_tiny_gpu_check_reports_every_check_ok(tmp_path, one_device_xla_flags):
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this interpreter as `python`
    env["PYTHON"] = sys.executable
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = one_device_xla_flags  # the check's processes use one device (and the session's cache)
    out_dir = tmp_path / "gpu_check"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--tiny", "--block-ray", "--out-dir", str(out_dir)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    report = json.loads((out_dir / "gpu_check.json").read_text())
    assert report["ok"] and report["mode"] == "tiny" and report["backend"] == "cpu"
    assert report["jax_version"] and report["device_kind"]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    assert report["environment"]["commit"].split(" ")[0] == head.strip()  # every figure names the code it ran
    assert report["environment"]["versions"]["jax"] == report["jax_version"]
    rows = report["rows"]
    assert {row["check"] for row in rows} == EXPECTED_CHECKS
    assert all(row["status"] == "ok" for row in rows), rows
    parity = report["details"]["parity"]["files"]
    assert set(parity) == {"tests/test_model_parity.py", "tests/test_rollout.py"}
    assert all(c["passed"] >= 1 and c["failed"] == 0 for c in parity.values())
    generate = report["details"]["generate"]
    assert generate["sampled"]["hfjax"] > 0 and generate["sampled"]["transformers"] > 0
    grpo = report["details"]["grpo"]
    assert grpo["seconds_per_step"] > 0 and grpo["tokens_per_s"] > 0
    assert grpo["workload"]["backend"] == "local" and grpo["workload"]["dtype"] == "bfloat16"
    assert "gpu_check" in proc.stdout and "GRPO step (local backend)" in proc.stdout
