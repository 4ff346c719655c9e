"""Faults a run must survive with nothing lost and nothing silent: two runs on one directory, an interrupt between
checkpoints, a rejected relaunch, a damaged latest step of each role, a driver killed during a save, runs that cannot
learn (NaN weights, flat rewards), and on Ray a killed, a stopped and a hung worker. Each test asserts what the user
gets: the error text, the time to detect, the checkpoints left, and resumed metrics equal to an uninterrupted run
with each step logged once (JSONL and TensorBoard)."""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import psutil
import pytest
import safetensors.numpy
import yaml
from support.checkpoints import flip_bytes
from support.rl_setup import build_run_inputs, deterministic, rl_config

from hfjax.cli.runner import user_errors
from hfjax.config.rl import load_rl_config
from hfjax.controller import Dispatch, RayWorkerGroup, ResourcePool, Worker, register
from hfjax.controller.liveness import LivenessConfig, WorkerHungError
from hfjax.controller.worker_group import WorkerDiedError
from hfjax.records import read_metrics
from hfjax.records.checkpoint import CheckpointError, CheckpointManager, CheckpointSaveError
from hfjax.records.checksums import MANIFEST
from hfjax.records.run_dir import RunDirLock, RunDirLockedError
from hfjax.trainer import launch
from hfjax.trainer.health import RunStalledError
from hfjax.trainer.launch import export_run, run_rl
from hfjax.trainer.preemption import HARD_EXIT_MARGIN_S
from hfjax.trainer.rl import RLTrainer

pytest_plugins = ["support.ray_cluster"]

REPO = Path(__file__).resolve().parents[1]
SCHEDULE_FIRST = 6  # about this many minutes of tests in CI: started early on a worker (conftest.py)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_run_inputs(tmp_path_factory.mktemp("faults"))


def _assert_same_steps(got: list[dict], want: list[dict]) -> None:
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for a, b in zip(got, want, strict=True):
        a, b = deterministic(a), deterministic(b)
        assert a.keys() == b.keys()
        for key in b:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (a.get("step"), key)


def _tensorboard_scalars(run_dir: Path, tag: str) -> dict[int, list[float]]:
    """The values of `tag` per step as TensorBoard shows them: event files in order, and a file that starts with a
    purge step (a restart) drops what earlier files logged at or after that step."""
    # imported here: tensorboardX imports PyTorch, and Ray workers of this module's `Napper` import the module
    from tensorboardX.proto.event_pb2 import Event

    values: dict[int, list[float]] = {}
    for path in sorted((run_dir / "tb").glob("events.out.tfevents.*")):
        data, offset, first = path.read_bytes(), 0, True
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            event = Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            if first and event.file_version and event.step:
                values = {s: v for s, v in values.items() if s < event.step}
            first = first and not event.summary.value
            for value in event.summary.value:
                if value.tag == tag:
                    values.setdefault(event.step, []).append(value.simple_value)
    return values


# --- the run directory ---------------------------------------------------------------------------------------------


def test_a_second_run_on_a_directory_refuses_and_a_dead_holders_lock_is_taken_over(
    inputs, tmp_path, caplog, monkeypatch
):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from hfjax.records.run_dir import RunDirLock; RunDirLock({str(run_dir)!r}).acquire()"
            "; print('held', flush=True); import time; time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        cfg = load_rl_config(rl_config(inputs, run_dir, "grpo", trainer={"total_steps": 1}))
        started = time.perf_counter()
        with pytest.raises(
            RunDirLockedError, match=rf"trainer.run_dir: {run_dir} is in use by pid {holder.pid} on host"
        ):
            RLTrainer(cfg)
        assert time.perf_counter() - started < 1  # before any worker or dataset
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]
        with monkeypatch.context() as patch:  # run_rl takes the lock before Ray starts
            patch.setattr(launch, "ray_session", lambda cfg: pytest.fail("started Ray for a locked run directory"))
            with pytest.raises(RunDirLockedError, match=r"trainer.run_dir: .* is in use by pid"):
                run_rl(load_rl_config(rl_config(inputs, run_dir, "grpo", trainer={"backend": "ray"})))
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(rl_config(inputs, run_dir, "grpo")))
        cli = subprocess.run(
            [sys.executable, "-m", "hfjax.cli.main", "train", str(tmp_path / "run.yaml")],
            capture_output=True,
            text=True,
        )
        assert cli.returncode == 2
        assert cli.stderr.strip().splitlines()[-1].startswith(f"hfjax train: trainer.run_dir: {run_dir} is in use by")
        assert "Traceback" not in cli.stderr
    finally:
        holder.kill()
        holder.wait()
    caplog.set_level("INFO")
    history = run_rl(cfg)  # the killed holder's lock is free: the run takes it over
    assert len(history) == 1
    assert f"taking over the lock of pid {holder.pid}" in caplog.text
    RunDirLock(run_dir).acquire().release()  # and released it at the end


def test_an_interrupt_between_checkpoints_then_resume_logs_every_step_once(inputs, tmp_path, monkeypatch):
    four = {"total_steps": 4, "save_freq": 2}
    run_rl(load_rl_config(rl_config(inputs, tmp_path / "full", "grpo", trainer=four)))
    save = RLTrainer.save

    def interrupted_save(self):
        if self.step == 4:  # steps 3 was logged after the checkpoint of step 2: Ctrl-C before step 4 is saved
            raise KeyboardInterrupt
        save(self)

    monkeypatch.setattr(RLTrainer, "save", interrupted_save)
    run_dir = tmp_path / "part"
    with pytest.raises(KeyboardInterrupt):
        run_rl(load_rl_config(rl_config(inputs, run_dir, "grpo", trainer=four)))
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]
    monkeypatch.setattr(RLTrainer, "save", save)
    resumed = run_rl(load_rl_config(rl_config(inputs, run_dir, "grpo", trainer=four)))
    assert len(resumed) == 2  # steps 3 and 4, from the checkpoint of step 2
    _assert_same_steps(read_metrics(run_dir), read_metrics(tmp_path / "full"))
    tb = _tensorboard_scalars(run_dir, "actor/pg_loss")
    assert sorted(tb) == [1, 2, 3, 4] and all(len(v) == 1 for v in tb.values())
    want = {m["step"]: m["actor/pg_loss"] for m in read_metrics(tmp_path / "full")}
    assert {s: v[0] for s, v in tb.items()} == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_a_rejected_relaunch_keeps_config_yaml_and_a_changed_config_keeps_the_previous_one(inputs, tmp_path):
    run_dir = tmp_path / "run"
    two = {"total_steps": 2, "save_freq": 1}
    run_rl(load_rl_config(rl_config(inputs, run_dir, "grpo", trainer=two)))
    first = (run_dir / "config.yaml").read_bytes()
    with pytest.raises(ValueError, match=r"trainer.resume=never but .* holds checkpoints"):
        RLTrainer(load_rl_config(rl_config(inputs, run_dir, "grpo", trainer={**two, "resume": "never"})))
    for step in (1, 2):  # every record damaged: resume must refuse rather than start over
        for file in (run_dir / "checkpoints" / "trainer" / str(step)).rglob("*"):
            if file.is_file():
                file.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no step can be restored by every role"):
        run_rl(load_rl_config(rl_config(inputs, run_dir, "grpo", trainer={**two, "total_steps": 3})))
    assert (run_dir / "config.yaml").read_bytes() == first
    assert export_run(run_dir, None, tmp_path / "hf") == 2  # the finished run still exports

    shutil.rmtree(run_dir / "checkpoints")
    run_rl(load_rl_config(rl_config(inputs, run_dir, "grpo", trainer={"total_steps": 1})))
    kept = list(run_dir.glob("config.*.yaml"))
    assert len(kept) == 1 and kept[0].read_bytes() == first
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["total_steps"] == 1


def test_max_to_keep_applies_to_every_role(inputs, tmp_path):
    run_dir = tmp_path / "run"
    trainer = {"total_steps": 3, "save_freq": 1, "max_to_keep": 1}
    run_rl(load_rl_config(rl_config(inputs, run_dir, "ppo", trainer=trainer)))
    for role in ("actor", "critic", "trainer"):
        steps = sorted(p.name for p in (run_dir / "checkpoints" / role).iterdir() if p.name.isdigit())
        assert steps == ["3"], role


@pytest.mark.parametrize("role", ["actor", pytest.param("critic", marks=pytest.mark.slow)])
def test_a_damaged_step_of_one_role_resumes_every_role_from_the_step_before(inputs, tmp_path, role, caplog):
    two = {"total_steps": 2, "save_freq": 1}
    run_dir = tmp_path / "run"
    full = run_rl(load_rl_config(rl_config(inputs, run_dir, "ppo", trainer=two)))
    uninterrupted = read_metrics(run_dir)  # the run as it finished, before its step 2 is damaged
    damaged = flip_bytes(run_dir / "checkpoints" / role / "2")  # restored without an error but for its checksums
    again = run_rl(load_rl_config(rl_config(inputs, run_dir, "ppo", trainer={**two, "total_steps": 2})))
    assert f"step 2 cannot be restored: {role}:" in caplog.text and "falling back to the previous step" in caplog.text
    assert f"{damaged} does not match its saved sha256" in caplog.text
    assert len(again) == 1  # step 2 redone from step 1, by every role
    _assert_same_steps(read_metrics(run_dir), uninterrupted)
    assert deterministic(again[0]) == pytest.approx(deterministic(full[1]), rel=1e-6, abs=1e-7)
    assert (run_dir / "checkpoints" / role / "2.unreadable").is_dir()  # kept for inspection


ASYNCIO_LEFTOVERS = ("exception was never retrieved", "Event loop is closed", "Task was destroyed but it is pending")


def test_a_damaged_step_is_set_aside_in_one_warning_without_asyncio_tracebacks(tmp_path, capfd, caplog, monkeypatch):
    """Orbax reads a step's arrays concurrently; truncated data files fail one read while the others are in flight.
    The step is set aside with the checkpoint's one warning, and no read is left to end on a closed event loop (no
    "Future/Task exception was never retrieved", no "Event loop is closed" traceback, as a damaged actor step printed
    from its worker)."""
    unraisable: list[str] = []  # where tensorstore's callbacks into a closed loop end up (printed outside pytest)
    monkeypatch.setattr(sys, "unraisablehook", lambda report: unraisable.append(repr(report.exc_value)))
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = {f"w{i}": jnp.full((32, 32), float(i)) for i in range(64)}
    targets = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in params.items()}}
    for trial in range(3):  # each read's timing varies: several damaged steps, so a leftover read shows
        directory = tmp_path / str(trial)
        with CheckpointManager(directory) as manager:
            manager.save(1, {"params": params})
            manager.save(2, {"params": jax.tree.map(lambda x: x + 1, params)})
        (directory / "2" / MANIFEST).unlink()  # a step without checksums: orbax's reads meet the damage
        for file in (directory / "2" / "params").rglob("*"):
            if file.is_file() and file.parent.name == "d":
                with open(file, "r+b") as handle:
                    handle.truncate(file.stat().st_size // 2)
        with CheckpointManager(directory) as manager:
            step, items, _ = manager.restore(None, targets)
        assert step == 1 and float(items["params"]["w3"][0, 0]) == 3.0
        assert (directory / "2.unreadable").is_dir()
    time.sleep(0.2)  # a read left in flight would end (and print) within milliseconds
    gc.collect()  # a task or future whose error nobody retrieved is reported when it is collected
    printed = "\n".join([capfd.readouterr().err, caplog.text, *unraisable])
    assert not [line for line in printed.splitlines() if any(s in line for s in ASYNCIO_LEFTOVERS)], printed
    warnings = [r.getMessage() for r in caplog.records if r.name == "hfjax.records.checkpoint"]
    assert len(warnings) == 3 and all("is unreadable" in w and "falling back" in w for w in warnings)


@pytest.mark.parametrize(
    "signal_name", ["SIGKILL during a save", pytest.param("SIGINT mid-step", marks=pytest.mark.slow)]
)
def test_a_driver_killed_or_interrupted_leaves_the_last_complete_step(inputs, tmp_path, signal_name):
    run_dir = tmp_path / "run"
    config = rl_config(inputs, run_dir, "grpo", trainer={"total_steps": 50, "save_freq": 1, "progress": False})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    actor, trainer = run_dir / "checkpoints" / "actor", run_dir / "checkpoints" / "trainer"
    kill = signal_name.startswith("SIGKILL")

    def due() -> bool:  # a step complete, and the actor saving a later step (SIGKILL) or a later step under way
        # (SIGINT). Any complete step, not step 1: with warm compiles a step takes under a second, and step 1 is gone
        # (trainer.max_to_keep) by the time a busy machine polls
        if not trainer.is_dir() or not any(p.name.isdigit() for p in trainer.iterdir()):
            return False
        return any("tmp" in p.name for p in actor.glob("*")) if kill else len(read_metrics(run_dir)) >= 1

    returncode, stderr, _ = _signal_train(tmp_path / "run.yaml", due, signal.SIGKILL if kill else signal.SIGINT)
    if not kill:
        assert returncode == 130, stderr[-3000:]
        assert stderr.strip().splitlines()[-1].startswith("hfjax train: interrupted; the workers are stopped")
        assert "Traceback" not in stderr
    complete = sorted(int(p.name) for p in trainer.iterdir() if p.name.isdigit())
    assert complete and [m["step"] for m in read_metrics(run_dir)][-1] >= complete[-1]
    resumed = run_rl(load_rl_config({**config, "trainer": {**config["trainer"], "total_steps": complete[-1] + 1}}))
    assert len(resumed) == 1
    steps = [m["step"] for m in read_metrics(run_dir)]
    assert steps == list(range(1, complete[-1] + 2))


def test_an_interrupt_stays_the_error_when_closing_the_run_also_fails(monkeypatch, caplog):
    """Ctrl-C mid-step whose clean-up then fails (a save cut short, say): the run still ends as interrupted (the
    command exits 130), and the clean-up's failure is logged rather than raised in its place."""
    closed = []

    class InterruptedTrainer:
        def __init__(self, cfg, lock) -> None:
            pass

        def fit(self) -> None:
            raise KeyboardInterrupt

        def close(self) -> None:
            closed.append(True)
            raise CheckpointError("writing step 2 failed")

    monkeypatch.setattr(launch, "RLTrainer", InterruptedTrainer)
    with pytest.raises(KeyboardInterrupt):
        launch._train(None, None)
    assert closed == [True]
    assert "closing the stopped run also failed: writing step 2 failed" in caplog.text


# Gives the driver the SIGINT of a terminal's foreground command, then becomes it (same process): a test run started
# in the background of a non-interactive shell (`cmd &` in a CI script) inherits SIGINT ignored, and Python then
# installs no handler, so Ctrl-C would never reach the driver. (Not `preexec_fn`: a fork of this multithreaded process.)
DEFAULT_SIGINT_EXEC = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def _signal_train(config: Path, due: Callable[[], bool], signum: int) -> tuple[int, str, float]:
    """Runs `hfjax train config` in a subprocess, sends it `signum` once `due()` (polled), and returns its exit code,
    its stderr and the seconds from the signal to its exit."""
    driver = subprocess.Popen(
        [sys.executable, "-c", DEFAULT_SIGINT_EXEC, "-m", "hfjax.cli.main", "train", str(config)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not due():
            assert driver.poll() is None and time.monotonic() < deadline, "the run ended before the signal"
            time.sleep(0.005)
        driver.send_signal(signum)
        sent = time.monotonic()
        _, stderr = driver.communicate(timeout=120)
        return driver.returncode, stderr, time.monotonic() - sent
    finally:
        driver.kill()
        driver.wait()


def _spans_of(run_dir: Path, step_index: int) -> list[dict]:
    """The timeline's spans of step `step_index` (0-based) that have ended."""
    path = run_dir / "timeline.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [span for line in lines if line.endswith("}") and (span := json.loads(line))["step"] == step_index]


@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.slow)])
def test_sigterm_mid_step_saves_that_step_and_the_resumed_run_equals_an_uninterrupted_one(inputs, tmp_path, backend):
    run_dir, grace = tmp_path / "run", 20.0
    trainer = {"total_steps": 50, "save_freq": 0, "backend": backend, "preemption_grace_s": grace}
    config = rl_config(inputs, run_dir, "grpo", trainer=trainer)  # save_freq 0: only the preemption can save
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    # due once a span of step 2 (index 1) ended: that step is under way
    returncode, stderr, took = _signal_train(tmp_path / "run.yaml", lambda: bool(_spans_of(run_dir, 1)), signal.SIGTERM)
    assert returncode == 143, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    saved = re.fullmatch(r"hfjax train: preempted \(SIGTERM\): step (\d+) saved; run the same command to resume", last)
    assert saved, stderr[-3000:]
    assert "Traceback" not in stderr
    assert took < grace + HARD_EXIT_MARGIN_S
    step = int(saved.group(1))
    assert step == 2  # the step in flight when the signal came was finished and saved, not lost
    assert sorted(int(p.name) for p in (run_dir / "checkpoints" / "trainer").iterdir() if p.name.isdigit()) == [step]
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, step + 1))
    local = {"backend": "local", "total_steps": step + 1}
    resumed = run_rl(load_rl_config({**config, "trainer": {**config["trainer"], **local}}))
    assert len(resumed) == 1
    run_rl(load_rl_config(rl_config(inputs, tmp_path / "full", "grpo", trainer={**trainer, **local})))
    _assert_same_steps(read_metrics(run_dir), read_metrics(tmp_path / "full"))


# --- a checkpoint that cannot be written ---------------------------------------------------------------------------

NO_SPACE = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
# what orbax re-raises when tensorstore's background write hits a full disk (seen on a full tmpfs)
NO_SPACE_IN_BACKGROUND = ValueError(
    'RESOURCE_EXHAUSTED: Error writing "w/0" in OCDBT database at local file "/ckpt/2.orbax-checkpoint-tmp/": '
    "Failed to write 586055 bytes to file 4: No space left on device [os_error_code='28']"
)


@pytest.mark.parametrize("where", ["save", "background write"])
def test_a_save_that_finds_the_disk_full_names_the_intact_step_and_it_restores(tmp_path, monkeypatch, where):
    directory = tmp_path / "ckpt"
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.ShapeDtypeStruct((3,), jnp.float32, sharding=sharding)
    manager = CheckpointManager(directory)
    manager.save(1, {"w": jnp.arange(3.0)})
    manager.wait()
    if where == "save":
        monkeypatch.setattr(ocp.CheckpointManager, "save", _raises(NO_SPACE))
    else:  # the write starts, then fails in orbax's thread: the error comes back when the save is waited for

        def write_fails_later(*args, **kwargs):
            monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", _raises(NO_SPACE_IN_BACKGROUND))

        monkeypatch.setattr(ocp.CheckpointManager, "save", write_fails_later)
    with pytest.raises(CheckpointSaveError) as failed:
        manager.save(2, {"w": jnp.arange(3.0) + 10})
        manager.wait()
    assert str(failed.value) == (
        f"{directory}: writing step 2 failed (No space left on device, errno 28); the steps before it (1) are intact"
    )
    assert failed.value.step == 2
    monkeypatch.undo()
    with CheckpointManager(directory) as fresh:  # as a resumed run sees it
        step, items, _ = fresh.restore(None, {"w": target})
    assert step == 1 and items["w"].tolist() == [0.0, 1.0, 2.0]


def _raises(error: Exception):
    def fail(*args, **kwargs):
        raise error

    return fail


def test_a_run_whose_checkpoint_finds_the_disk_full_stops_in_one_line_and_resumes_from_the_step_before(
    inputs, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    config = rl_config(inputs, run_dir, "grpo", trainer={"total_steps": 3, "save_freq": 1})
    save = ocp.CheckpointManager.save

    def disk_full_at_step_2(self, step, *args, **kwargs):
        if step == 2:
            raise NO_SPACE
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", disk_full_at_step_2)
    with pytest.raises(CheckpointSaveError) as failed:
        run_rl(load_rl_config(config))
    message = str(failed.value)
    assert "\n" not in message and isinstance(failed.value, user_errors())  # the CLI prints it as one line, rc 2
    assert message == (
        f"checkpoint of step 2 not saved: {run_dir / 'checkpoints' / 'actor'}: writing step 2 failed (No space left "
        "on device, errno 28); the steps before it (1) are intact; step 1 is the last complete checkpoint, and a "
        f"resumed run continues from it: free space (or fix the permissions) under {run_dir / 'checkpoints'}, then "
        "run the same command"
    )
    monkeypatch.undo()
    resumed = run_rl(load_rl_config({**config, "trainer": {**config["trainer"], "total_steps": 2}}))
    assert len(resumed) == 1  # step 2 redone from step 1
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]


# --- runs that cannot learn ----------------------------------------------------------------------------------------


def test_nan_weights_stop_the_run_after_consecutive_skipped_updates(inputs, tmp_path):
    model = tmp_path / "nan_policy"
    shutil.copytree(inputs["policy"], model)
    weights = safetensors.numpy.load_file(model / "model.safetensors")
    name = next(k for k in weights if k.endswith("mlp.down_proj.weight"))
    weights[name] = np.full_like(weights[name], np.nan)
    safetensors.numpy.save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    config = rl_config({**inputs, "policy": str(model)}, tmp_path / "run", "grpo", trainer={"total_steps": 6})
    config["trainer"]["health"] = {"max_skipped_steps": 2}
    with pytest.raises(
        RunStalledError, match=r"step 2: updates were skipped for non-finite gradients in 2 consecutive"
    ):
        run_rl(load_rl_config(config))
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]  # the steps that ran are logged


def test_flat_rewards_stop_the_run_or_warn(inputs, tmp_path, caplog):
    constant = tmp_path / "constant.py"
    constant.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    config = rl_config(inputs, tmp_path / "stop", "grpo", trainer={"total_steps": 4})
    config["reward"] = {"function": f"{constant}:compute_score"}
    config["trainer"]["health"] = {"max_flat_reward_steps": 3}
    with pytest.raises(RunStalledError, match="step 3: every response scored 1 in 3 consecutive steps"):
        run_rl(load_rl_config(config))
    config["trainer"].update(run_dir=str(tmp_path / "warn"), health={"max_flat_reward_steps": 3, "on_stall": "warn"})
    assert len(run_rl(load_rl_config(config))) == 4
    assert "on_stall=warn: the run goes on" in caplog.text


def test_local_ray_listens_on_loopback_only_prefixes_worker_output_and_removes_its_temp_dir(inputs, tmp_path):
    config = rl_config(inputs, tmp_path / "run", "grpo", trainer={"backend": "ray"})
    temp = Path(tempfile.mkdtemp(prefix="hfx"))  # short: Ray's socket paths must fit in 107 bytes
    script = f"""
import json, tempfile, time, psutil, ray
from hfjax.cli.runner import user_errors
from hfjax.config.rl import load_rl_config
from hfjax.controller import RayWorkerGroup, ResourcePool
from hfjax.trainer.launch import ray_session
from test_faults import Napper
tempfile.tempdir = {str(temp)!r}
cfg = load_rl_config(json.loads({json.dumps(config)!r}))
with ray_session(cfg):
    group = RayWorkerGroup(ResourcePool([1, 1]), Napper, name="actor+critic")
    group.shout("hello")
    pids = {{p.pid for p in psutil.Process().children(recursive=True)}} | {{psutil.Process().pid}}
    addresses = [c.laddr.ip for c in psutil.net_connections("inet") if c.status == "LISTEN" and c.pid in pids]
    time.sleep(2)  # the workers' output reaches the driver's console
    group.shutdown()
print(json.dumps(addresses))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    addresses = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(addresses) >= 3  # the GCS, the raylet, the workers
    loopback = ("127.0.0.1", "::ffff:127.0.0.1", "::1")
    assert not [a for a in addresses if a not in loopback]  # nothing on every interface ('::') or a public address
    for rank in (0, 1):  # each worker's console output, prefixed by its group, rank and pid
        assert re.search(rf"\(actor\+critic rank {rank} pid=\d+\).* hello from rank {rank}", out.stdout), out.stdout
    assert not list(temp.iterdir())  # Ray's temp dir was removed after the run
    temp.rmdir()


# --- workers that die, stop or hang (Ray) --------------------------------------------------------------------------


class Napper(Worker):
    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def shout(self, word: str) -> None:
        print(f"{word} from rank {self.rank}", flush=True)

    @register(Dispatch.ONE_TO_ALL)
    def spin(self, seconds: float) -> int:
        """Busy in Python (holding the GIL between switches) for `seconds`."""
        end, count = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            count += 1
        return count


@pytest.mark.ray
@pytest.mark.slow  # 30 s of silence by default
def test_a_stopped_worker_is_reported_within_a_minute(ray_cluster):
    group = RayWorkerGroup(ResourcePool([1, 1]), Napper)  # default liveness
    try:
        pending = group.nap(600.0)
        os.kill(group.pids[1], signal.SIGSTOP)
        started = time.perf_counter()
        with pytest.raises(
            WorkerHungError, match=r"Napper.nap failed on rank 1 of 2:\nthe worker process has answered"
        ):
            pending.get()
        detected = time.perf_counter() - started
        assert LivenessConfig().silent_after_s <= detected < 60
    finally:
        os.kill(group.pids[1], signal.SIGCONT)
        group.shutdown()


@pytest.mark.ray
def test_a_call_past_its_deadline_is_reported_and_a_busy_worker_is_not(ray_cluster):
    # 4 s of silence (8 heartbeats) before a worker counts as hung: 2 s was seen to flag a worker starting up on a
    # loaded 2-core machine
    liveness = LivenessConfig(heartbeat_s=0.5, silent_after_s=4.0, deadline_s={"nap": 3.0})
    group = RayWorkerGroup(ResourcePool([1, 1]), Napper, liveness=liveness)
    try:
        assert min(group.spin(6.0)) > 0  # 6 s busy in Python: heartbeats still answered, nothing reported
        started = time.perf_counter()
        with pytest.raises(WorkerHungError, match=r"Napper.nap failed on rank 0 of 2:\nstill running after 3 s, past"):
            group.nap(600.0).get()
        assert time.perf_counter() - started < 6
    finally:
        group.shutdown()


def _worker_pids() -> list[int]:
    mine = psutil.Process().children(recursive=True)  # this test process's cluster only (not another pytest worker's)
    return [p.pid for p in mine if "ray::WorkerHost" in " ".join(_cmdline(p))]


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:  # ended meanwhile
        return []


def _when(condition, action, timeout_s: float = 300) -> threading.Thread:
    """Runs `action()` on a thread as soon as `condition()` holds."""

    def watch():
        deadline = time.monotonic() + timeout_s
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)
        action()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill mid-step", "kill during a save", "stop mid-step"])
def test_a_worker_killed_or_stopped_stops_the_run_and_it_resumes_from_the_last_checkpoint(
    ray_cluster, inputs, tmp_path, fault
):
    two = {"total_steps": 2, "save_freq": 1}
    run_rl(load_rl_config(rl_config(inputs, tmp_path / "full", "grpo", trainer=two)))
    run_dir = tmp_path / "run"
    ray_trainer = {**two, "backend": "ray", "liveness": {"heartbeat_s": 1.0, "silent_after_s": 5.0}}
    config = rl_config(inputs, run_dir, "grpo", trainer=ray_trainer)
    stopped: list[int] = []
    fault_at: list[float] = []

    def saving() -> bool:  # step 1 is complete and the actor is saving step 2
        actor = run_dir / "checkpoints" / "actor"
        return (run_dir / "checkpoints" / "trainer" / "1").is_dir() and any("tmp" in p.name for p in actor.glob("*"))

    def kill() -> None:
        fault_at.append(time.perf_counter())
        for pid in _worker_pids():
            os.kill(pid, signal.SIGKILL)

    def stop() -> None:
        fault_at.append(time.perf_counter())
        for pid in _worker_pids():
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)

    def step_one_logged() -> bool:
        return len(read_metrics(run_dir)) >= 1

    if fault == "kill mid-step":
        watcher, error = _when(step_one_logged, kill), WorkerDiedError
    elif fault == "kill during a save":
        watcher, error = _when(saving, kill), WorkerDiedError
    else:
        watcher, error = _when(step_one_logged, stop), WorkerHungError
    try:
        with pytest.raises(error, match="rank 0 of 1"):
            run_rl(load_rl_config(config))
        detected = time.perf_counter() - fault_at[0]
    finally:
        watcher.join()
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    # a dead process is reported at once; a stopped one after silent_after_s (5 s here) and one more heartbeat
    assert detected < (10 if error is WorkerDiedError else 5 + 1 + 5), detected
    deadline = time.monotonic() + 30
    while _worker_pids() and time.monotonic() < deadline:  # the run's workers were shut down
        time.sleep(0.1)
    assert not _worker_pids()
    assert sorted(p.name for p in (run_dir / "checkpoints" / "trainer").iterdir() if p.name.isdigit()) == ["1"]
    resumed = run_rl(load_rl_config(config))
    assert len(resumed) == 1
    _assert_same_steps(read_metrics(run_dir), read_metrics(tmp_path / "full"))
