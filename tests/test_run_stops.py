"""A run stops in one line, with its exit code and nothing left hanging, when the disk is full or read-only (a
metrics destination, a plot, the run directory at start: exit code 2) and when SIGTERM comes at any moment (start-up,
a step wrapped by Ray's `SystemError`, the grace period running out or a grace of 0: exit code 143). The driver's
pieces run in this process with fakes: a file whose writes find the disk full, tensorboardX's record writer patched
likewise, a trainer that blocks as Ray's calls do. Tiny runs (slow) check that a run whose metrics cannot be written
resumes with each step logged once, and that `hfjax train` on Ray exits 143 on SIGTERM while its workers start and
mid-step with a grace of 0."""

from __future__ import annotations

import builtins
import errno
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from support.rl_setup import build_run_inputs, rl_config

from hfjax.cli.runner import run_command
from hfjax.config import SFTConfig
from hfjax.config.rl import load_rl_config
from hfjax.records import metrics, read_metrics
from hfjax.records.metrics import MetricsLogger
from hfjax.records.plot import plot_main
from hfjax.records.run_dir import DiskWriteError, RunDirLock
from hfjax.trainer import launch, supervised
from hfjax.trainer.preemption import EXIT_PREEMPTED, SigtermGuard, StepAbandoned, installed_guard
from hfjax.trainer.rl import RLTrainer
from hfjax.trainer.sft import run_sft
from hfjax.typed_config import load_config

NO_SPACE = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
WITHIN_S = 10.0  # a command that meets a full disk ends within this


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_run_inputs(tmp_path_factory.mktemp("run_stops"))


def _command(run: Callable[[], int], within_s: float = WITHIN_S) -> int:
    """`hfjax train`'s exit code for `run`, run on a thread that must end within `within_s` (a hung driver fails)."""
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(run_command("train", run, debug=False)), daemon=True)
    thread.start()
    thread.join(within_s)
    assert not thread.is_alive(), f"the command still runs after {within_s} s"
    return codes[0]


def _raises(error: BaseException) -> Callable[..., None]:
    def fail(*args, **kwargs) -> None:
        raise error

    return fail


def _one_line(err: str) -> str:
    """The one line of the command's report in `err`, besides hfjax's own log records (a run's warnings reach stderr
    where an earlier command of the process configured logging)."""
    lines = [line for line in err.strip().splitlines() if not re.match(r"(DEBUG|INFO|WARNING) hfjax\.", line)]
    assert len(lines) == 1, err
    return lines[0]


class _FullDiskFile:
    """A text file whose writes of a line of step `full_at` (or any line, when it is None) find the disk full."""

    def __init__(self, full_at: int | None, *args, **kwargs):
        self._file = builtins.open(*args, **kwargs)  # noqa: SIM115 (closed by close())
        self._full_at = full_at

    def write(self, text: str) -> int:
        if self._full_at is None or text.startswith(f'{{"step": {self._full_at},'):
            raise NO_SPACE
        return self._file.write(text)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _disk_full_for_jsonl(monkeypatch, full_at: int | None = None) -> None:
    monkeypatch.setattr(metrics, "open", functools.partial(_FullDiskFile, full_at), raising=False)


# --- a full disk while logging ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("sink", ["jsonl", "tensorboard"])
def test_a_full_disk_under_a_metrics_destination_ends_the_command_in_one_line(tmp_path, monkeypatch, capsys, sink):
    """The destination that fails is closed and named with the step and the reason; TensorBoard's writer used to
    die on its thread and leave the driver waiting on its queue for good."""
    if sink == "jsonl":
        _disk_full_for_jsonl(monkeypatch)
    logger = MetricsLogger(tmp_path, console=False, jsonl=sink == "jsonl", tensorboard=sink == "tensorboard")
    if sink == "tensorboard":
        from tensorboardX.record_writer import RecordWriter

        monkeypatch.setattr(RecordWriter, "write", _raises(NO_SPACE))

    def log_steps() -> int:
        with logger:
            for step in range(1, 20):
                logger.log(step, {f"metric/{i}": float(i) for i in range(20)})
        return 0

    assert _command(log_steps) == 2
    path = tmp_path / ("metrics.jsonl" if sink == "jsonl" else "tb")
    assert _one_line(capsys.readouterr().err) == (
        f"hfjax train: {path}: writing the metrics of step 1 failed (No space left on device, errno 28)"
    )


@pytest.mark.slow  # two tiny runs, 20 to 30 s
def test_a_run_whose_metrics_find_the_disk_full_stops_and_resumes_with_each_step_logged_once(
    inputs, tmp_path, monkeypatch
):
    """The disk fills up at step 3, when no checkpoint is due: the run stops naming the file and the checkpoint of
    step 2, and the resumed run redoes step 3."""
    run_dir = tmp_path / "run"
    trainer = {"total_steps": 4, "save_freq": 2, "logger": ["jsonl"]}
    config = rl_config(inputs, run_dir, "grpo", trainer=trainer)
    _disk_full_for_jsonl(monkeypatch, full_at=3)
    with pytest.raises(DiskWriteError) as failed:
        launch.run_rl(load_rl_config(config))
    assert str(failed.value) == (
        f"{run_dir / 'metrics.jsonl'}: writing the metrics of step 3 failed (No space left on device, errno 28); the "
        f"run stopped and step 2 is the last checkpoint: free space (or fix the permissions) under {run_dir}, then "
        "run the same command"
    )
    monkeypatch.undo()
    assert sorted(p.name for p in (run_dir / "checkpoints" / "trainer").iterdir()) == ["2"]
    assert len(launch.run_rl(load_rl_config(config))) == 2  # steps 3 and 4, from step 2; the lock was released
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4]


def test_a_plot_that_finds_the_disk_full_is_one_line(tmp_path, monkeypatch, capsys):
    from matplotlib.figure import Figure

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 1.0}\n{"step": 2, "train/loss": 0.5}\n')
    monkeypatch.setattr(Figure, "savefig", _raises(NO_SPACE))
    assert run_command("plot", lambda: plot_main([str(tmp_path)]), debug=False) == 2
    assert _one_line(capsys.readouterr().err) == (
        f"hfjax plot: {tmp_path / 'plots' / 'train_loss.png'}: writing the plot failed (No space left on device, "
        "errno 28)"
    )


# --- a run directory that cannot take the run's files ---------------------------------------------------------------


@pytest.mark.parametrize("fault", ["under a file", "read-only", "full"])
def test_a_run_directory_that_cannot_take_files_stops_in_one_line_before_ray(
    inputs, tmp_path, monkeypatch, capsys, fault
):
    """Tests run as root, whom permissions do not stop: a path under a file, a read-only file system (patched: the
    directory refuses new files) and a full one (patched: 1 MiB free)."""
    run_dir = tmp_path / "run"
    if fault == "under a file":
        (tmp_path / "file").write_text("")
        run_dir = tmp_path / "file" / "run"
    elif fault == "read-only":
        monkeypatch.setattr("tempfile.mkstemp", _raises(OSError(errno.EROFS, os.strerror(errno.EROFS))))
    else:
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr("shutil.disk_usage", lambda path: usage._replace(free=2**20))
    cfg = load_rl_config(rl_config(inputs, run_dir, "grpo", trainer={"backend": "ray"}))
    started = []
    monkeypatch.setattr(launch, "ray_session", lambda cfg: started.append(cfg))
    assert _command(lambda: launch.run_rl(cfg)) == 2
    reason = {
        "under a file": "cannot take the run's files (Not a directory, errno 20): free space or fix the permissions",
        "read-only": "cannot take the run's files (Read-only file system, errno 30): free space or fix the permissions",
        "full": "has 1.0 MiB free, and a run needs at least 64 MiB to start: free space",
    }[fault]
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"hfjax train: trainer.run_dir: {run_dir} {reason}"), line
    assert started == []  # before Ray


# --- SIGTERM at any moment -------------------------------------------------------------------------------------------


def _sigterm_soon() -> None:
    """SIGTERM to this process in 0.05 s, from another thread: it reaches the main thread inside its next wait."""
    threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()


def _ray_wait(seconds: float) -> None:
    """Blocks like `ray.wait`, which reports an exception raised by a signal handler during its wait as a
    `SystemError` whose context is that exception."""
    try:
        time.sleep(seconds)
    except BaseException as exc:
        raise SystemError("<built-in function wait> returned a result with an exception set") from exc


@pytest.mark.parametrize("blocked_in", ["a wait", "ray.wait"])
def test_sigterm_while_the_workers_start_stops_the_run_at_once_with_143(
    inputs, tmp_path, monkeypatch, capsys, previous_handler, blocked_in
):
    exits: list[int] = []
    guard = functools.partial(SigtermGuard, hard_exit_margin_s=2.0, exit_process=exits.append)
    monkeypatch.setattr(launch, "SigtermGuard", guard)

    class StartingTrainer:
        def __init__(self, cfg, lock) -> None:  # the workers start: SIGTERM arrives while the driver waits on them
            _sigterm_soon()
            if blocked_in == "a wait":
                time.sleep(30)
            else:
                _ray_wait(30)

        def fit(self) -> list:
            pytest.fail("the run went on after SIGTERM")

    monkeypatch.setattr(launch, "RLTrainer", StartingTrainer)
    run_dir = tmp_path / "run"
    cfg = load_rl_config(rl_config(inputs, run_dir, "grpo", trainer={"preemption_grace_s": 0.5}))
    started = time.monotonic()
    assert run_command("train", lambda: launch.run_rl(cfg), debug=False) == EXIT_PREEMPTED == 143
    assert time.monotonic() - started < WITHIN_S
    assert _one_line(capsys.readouterr().err) == (
        "hfjax train: preempted (SIGTERM) during start-up: no step ran and the checkpoints are as they were; run the "
        "same command to resume"
    )
    assert signal.getsignal(signal.SIGTERM) == previous_handler
    RunDirLock(run_dir).acquire().release()  # released
    deadline = time.monotonic() + WITHIN_S  # the hard fallback still bounds the process's exit
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits == [143]


def test_sigterm_while_sft_loads_its_model_stops_the_run_at_once_with_143(
    inputs, tmp_path, monkeypatch, capsys, previous_handler
):
    exits: list[int] = []
    guard = functools.partial(SigtermGuard, hard_exit_margin_s=2.0, exit_process=exits.append)
    monkeypatch.setattr(supervised, "SigtermGuard", guard)

    def loading(*args, **kwargs) -> None:
        _sigterm_soon()
        _ray_wait(30)

    monkeypatch.setattr(supervised, "load_hf", loading)
    data = {"train_files": [str(Path(inputs["train"]).parent / "sft.parquet")], "max_length": 16, "batch_size": 8}
    trainer = {"run_dir": str(tmp_path / "run"), "total_steps": 2, "preemption_grace_s": 0.5}
    cfg = load_config(SFTConfig, {"model": {"path": inputs["policy"]}, "data": data, "trainer": trainer})
    assert run_command("sft", lambda: run_sft(cfg), debug=False) == 143
    assert _one_line(capsys.readouterr().err) == (
        "hfjax sft: preempted (SIGTERM) during start-up: no step ran and the checkpoints are as they were; run the "
        "same command to resume"
    )
    assert signal.getsignal(signal.SIGTERM) == previous_handler
    RunDirLock(tmp_path / "run").acquire().release()
    deadline = time.monotonic() + WITHIN_S
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits == [143]


@pytest.mark.parametrize("grace_s", [0.0, 0.3])
def test_a_step_abandoned_inside_ray_wait_is_preempted_with_143(inputs, tmp_path, capsys, previous_handler, grace_s):
    """A grace of 0 abandons the step on the first SIGTERM, a grace of 0.3 s when it runs out; either reaches the
    loop as `ray.wait`'s `SystemError`, and the run reports the step abandoned and the checkpoint kept."""
    cfg = load_rl_config(rl_config(inputs, tmp_path / "run", "grpo", trainer={"preemption_grace_s": grace_s}))
    trainer = RLTrainer.__new__(RLTrainer)  # the loop's pieces only: no workers
    trainer.cfg, trainer.step = cfg, 2
    trainer.state_checkpoints = SimpleNamespace(latest_step=lambda: 2)

    def step_3_waits_on_ray(sigterm: SigtermGuard) -> list:
        _sigterm_soon()
        _ray_wait(30)
        pytest.fail("SIGTERM did not abandon the step")

    trainer._fit = step_3_waits_on_ray
    exits: list[int] = []
    with SigtermGuard(grace_s, hard_exit_margin_s=30, exit_process=exits.append) as guard:
        assert installed_guard() is guard  # the run's guard, which the loop uses
        started = time.monotonic()
        assert run_command("train", trainer.fit, debug=False) == 143
    assert grace_s <= time.monotonic() - started < grace_s + 2
    reason = "trainer.preemption_grace_s=0" if grace_s == 0 else "the 0.3 s grace period ran out"
    assert _one_line(capsys.readouterr().err) == (
        f"hfjax train: preempted (SIGTERM): {reason}: step 3 abandoned; the previous checkpoint holds step 2; run the "
        "same command to resume"
    )
    assert exits == []  # the run ended: the hard fallback is off


def test_ray_starting_keeps_the_runs_sigterm_handler(previous_handler):
    """`ray.init` installs a SIGTERM handler that calls `sys.exit` (through `set_sigterm_handler`); while Ray starts
    for a run, the run's guard keeps SIGTERM."""
    from ray._private import utils as ray_utils

    rays: list[int] = []
    with SigtermGuard(1.0, starting=True) as guard, pytest.raises(StepAbandoned, match="during start-up"):
        with launch._sigterm_handler_kept():
            ray_utils.set_sigterm_handler(lambda signum, frame: rays.append(signum))  # what ray.init does
        assert installed_guard() is guard
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert rays == []


# --- SIGTERM to `hfjax train` on Ray ----------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def _sigterm_train(config: dict, tmp_path: Path, due: Callable[[Path], bool]) -> tuple[int, str]:
    """Runs `hfjax train` on `config` with a local Ray of its own, sends it SIGTERM once `due(ray_temp_dir)` and
    returns its exit code and stderr."""
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    ray_temp = Path(tempfile.mkdtemp(prefix="hfjax-ray-"))  # short: Ray's socket paths must fit AF_UNIX's 107 bytes
    driver = subprocess.Popen(
        [sys.executable, "-m", "hfjax.cli.main", "train", str(tmp_path / "run.yaml")],
        cwd=REPO,
        env={**os.environ, "HFJAX_RAY_TMPDIR": str(ray_temp)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not due(ray_temp):
            assert driver.poll() is None and time.monotonic() < deadline, "the run ended before the signal"
            time.sleep(0.01)
        driver.send_signal(signal.SIGTERM)
        _, stderr = driver.communicate(timeout=120)
        return driver.returncode, stderr
    finally:
        driver.kill()
        driver.wait()
        shutil.rmtree(ray_temp, ignore_errors=True)


def _last_line(stderr: str) -> str:
    assert "Traceback" not in stderr and "SIGABRT" not in stderr and "Fatal Python error" not in stderr, stderr[-3000:]
    return stderr.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.ray
def test_hfjax_train_on_ray_sigtermed_while_its_workers_start_exits_143(inputs, tmp_path):
    run_dir = tmp_path / "run"
    config = rl_config(inputs, run_dir, "grpo", trainer={"backend": "ray"})

    def workers_starting(ray_temp: Path) -> bool:
        return any(ray_temp.glob("session_*/logs/worker-*"))

    returncode, stderr = _sigterm_train(config, tmp_path, workers_starting)
    assert returncode == 143, stderr[-3000:]
    assert _last_line(stderr) == (
        "hfjax train: preempted (SIGTERM) during start-up: no step ran and the checkpoints are as they were; run the "
        "same command to resume"
    )
    assert not list((run_dir / "checkpoints").glob("*/[0-9]*"))  # nothing saved


@pytest.mark.slow
@pytest.mark.ray
def test_hfjax_train_on_ray_with_no_grace_abandons_the_step_exits_143_and_resumes(inputs, tmp_path):
    run_dir = tmp_path / "run"
    trainer = {"backend": "ray", "total_steps": 50, "save_freq": 1, "preemption_grace_s": 0}
    config = rl_config(inputs, run_dir, "grpo", trainer=trainer)

    def second_step_under_way(ray_temp: Path) -> bool:  # a span of step 2 (index 1) ended
        path = run_dir / "timeline.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        return any(line.endswith("}") and json.loads(line)["step"] == 1 for line in lines)

    returncode, stderr = _sigterm_train(config, tmp_path, second_step_under_way)
    assert returncode == 143, stderr[-3000:]
    abandoned = re.fullmatch(
        r"hfjax train: preempted \(SIGTERM\): trainer\.preemption_grace_s=0: step (\d+) abandoned; the previous "
        r"checkpoint holds step (\d+); run the same command to resume",
        _last_line(stderr),
    )
    assert abandoned, stderr[-3000:]
    kept = int(abandoned.group(2))
    assert kept == int(abandoned.group(1)) - 1
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints" / "trainer").iterdir() if p.name.isdigit())
    assert steps[-1] == kept
    local = {**config["trainer"], "backend": "local", "total_steps": kept + 1}
    assert len(launch.run_rl(load_rl_config({**config, "trainer": local}))) == 1
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, kept + 2))
