"""Every runnable script under `scripts/` runs end to end in its `--tiny` mode (issue 39: a config key rename broke
three benchmarks silently), and no new script can be added without a tiny run here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
REPORT_KEYS = {"title", "rows", "machine"}  # what `bench_common.report` writes

# script (relative to scripts/; benchmarks and their peers under bench/) -> (its arguments besides --out, the output
# file, the top-level keys it must hold)
TINY_RUNS: dict[str, tuple[list[str], str, set[str]]] = {
    "bench/automap_cpu_check.py": (["--tiny"], "out.json", REPORT_KEYS | {"spearman", "chosen_over_best", "profile"}),
    "bench/automap_paper_check.py": (["--tiny"], "out.json", set()),  # a JSON list of cells, checked below
    "bench/bench_agent.py": (["--tiny"], "out.json", REPORT_KEYS | {"speedup_extend_vs_reprefill", "medians", "runs"}),
    "bench/bench_controller.py": (["--tiny"], "out.json", REPORT_KEYS | {"repeats", "workers"}),
    "bench/bench_forward.py": (["--tiny"], "out.json", REPORT_KEYS | {"relative_error", "params"}),
    "bench/bench_generate.py": (["--tiny"], "out.json", REPORT_KEYS | {"decode_steps", "floor_step_ms"}),
    "bench/bench_load.py": (["--tiny"], "out.json", REPORT_KEYS | {"checkpoint_bytes", "raw"}),
    "bench/bench_long_context.py": (["--tiny"], "out.json", REPORT_KEYS | {"runs", "checkpoint", "steps", "devices"}),
    "bench/bench_moe.py": (["--tiny"], "out.json", REPORT_KEYS | {"replay_off", "replay_on", "expert-parallel"}),
    "bench/bench_packing.py": (["--tiny"], "out.json", REPORT_KEYS | {"same_loss", "real_tokens", "sequences"}),
    "bench/bench_prompt_kv.py": (["--tiny"], "out.json", REPORT_KEYS | {"block", "copied_kv_bytes"}),
    "bench/bench_real_size.py": (["--tiny"], "out.json", REPORT_KEYS | {"parity", "grpo", "weight_sync"}),
    "bench/bench_reshard.py": (["--tiny"], "out.json", REPORT_KEYS | {"memcpy_bytes_per_s", "rows_raw"}),
    "bench/bench_rl_step.py": (["--tiny"], "out.json", REPORT_KEYS | {"summaries", "peak_host_gib", "backend"}),
    "bench/bench_serve.py": (["--tiny"], "out.json", REPORT_KEYS | {"rank", "new_tokens"}),
    "bench/bench_sampler.py": (["--tiny"], "out.json", REPORT_KEYS | {"same_tokens", "slots", "vocab"}),
    "bench/bench_sweep.py": (["--tiny"], "out.json", REPORT_KEYS | {"spearman_before", "fsdp_inside_a_host"}),
    "bench/bench_transport.py": (["--tiny"], "out.json", {"rows", "floor", "params", "api"}),
    "bench/bench_weight_sync.py": (["--tiny"], "out.json", REPORT_KEYS | {"runs"}),
    "bench/peers/compare_grpo.py": (["--tiny", "--run"], "out.json", REPORT_KEYS | {"inputs", "left_out"}),
    "bench/peers/trl_grpo.py": (["--tiny"], "out.json", {"peer"}),
    "bench/peers/tunix_grpo.py": (["--tiny"], "out.json", {"peer"}),
    "bench/peers/workload.py": (["--tiny"], "out.jsonl", {"data_source", "prompt", "reward_model", "extra_info"}),
    "bench/quickstart_seeds.py": (
        ["--tiny", "--algorithms", "grpo", "--lora-rank", "2"],
        "out.json",
        REPORT_KEYS | {"runs", "gain_spread"},
    ),
}
# Scripts with no tiny run here, and why.
NOT_RUN = {
    "bench/bench_common.py": "a library of the benchmarks, no command",
    "compile_configs.py": "its --tiny and --guard runs are in scripts/test_compile_targets.sh",
    "gpu_check_table.py": "its --tiny runs in tests/test_gpu_check.py",
    "bench/make_reference_ckpt.py": "run by every tiny benchmark above (bench_common.default_checkpoint)",
    "bench/peers/peer_run.py": "a library of the peer scripts, no command",
    "bench/peers/reward.py": "a library of the peer scripts, no command",
}


@pytest.mark.parametrize("peer", ["trl", "tunix"])
def test_a_peer_keeps_its_virtualenv_under_the_repository_runs_folder(peer: str) -> None:
    where = subprocess.run(
        ["bash", str(SCRIPTS / "bench" / "peers" / f"setup_{peer}.sh"), "--where"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(where.stdout.strip()) == ROOT / "runs" / "peers" / f"{peer}-venv"


def test_every_script_is_covered() -> None:
    found = {str(p.relative_to(SCRIPTS)) for p in SCRIPTS.rglob("*.py")}
    assert found - TINY_RUNS.keys() - NOT_RUN.keys() == set(), "add the new script's --tiny run to TINY_RUNS"
    assert (TINY_RUNS.keys() | NOT_RUN.keys()) - found == set(), "a listed script no longer exists"


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(TINY_RUNS))
def test_script_runs_tiny(script: str, tmp_path: Path) -> None:
    args, output, keys = TINY_RUNS[script]
    out = tmp_path / output
    env = os.environ | {"JAX_PLATFORMS": "cpu"}  # and conftest's XLA_FLAGS: 8 devices, no LLVM optimisation
    started = time.time()
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args, "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, f"{script} --tiny failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    strays = [
        p for p in SCRIPTS.rglob("*") if p.is_file() and p.stat().st_mtime >= started and "__pycache__" not in p.parts
    ]
    assert not strays, f"{script} wrote files under scripts/ (a root computed from the wrong folder?): {strays}"
    if out.suffix == ".jsonl":  # a dataset: every row holds the keys
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert rows and all(keys <= row.keys() for row in rows), f"{script}: rows without {sorted(keys)}"
        return
    written = json.loads(out.read_text())
    if isinstance(written, list):
        assert written and all({"size", "gpus", "kind", "verdict"} <= cell.keys() for cell in written)
        return
    assert keys <= written.keys(), f"{script}: missing {sorted(keys - written.keys())}"
