"""hfjax.optim on 8 fake CPU devices: the learning-rate schedule against its formula, TrainState (one AdamW step
against a numpy reference, micro-batch accumulation equal to the whole batch, non-finite steps skipped, one compile
per shape), orbax checkpoints (bitwise round trip, restore into another layout, fallback past a damaged latest step,
a leftover partial save, checksums that name a changed file) and the metrics log."""

import json
import logging
import math
import re
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.checkpoints import flip_bytes
from support.tiny_models import TINY, random_model

from hfjax.algos import agg_loss, logprobs_from_logits
from hfjax.optim import OptimConfig, TrainState, compile_counts, learning_rate_schedule, make_optimizer
from hfjax.parallel import Layout
from hfjax.records import CheckpointError, CheckpointManager, MetricsLogger, read_metrics
from hfjax.records.checkpoint import UnreadableStepError
from hfjax.records.checksums import MANIFEST

TRAIN_LAYOUT = {"mesh": {"fsdp": 4, "tensor": 2}, "rules": "fsdp_tp"}
OTHER_LAYOUT = {"mesh": {"fsdp": 8}, "rules": "fsdp"}
# One optimizer for the TrainState tests (equal settings share compiled programs). eps well above the gradients'
# rounding error keeps Adam's first step g / (|g| + eps) well conditioned, so results compare close to rounding.
ADAMW = OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=0.05, warmup_steps=3, eps=1e-4)


def _state(optim: OptimConfig, layout=TRAIN_LAYOUT, total_steps=None, seed=0) -> TrainState:
    return TrainState(
        random_model(TINY, seed), Layout.from_config(layout), make_optimizer(optim, total_steps), optim.grad_clip
    )


def token_mean_nll(model, batch):
    """Next-token NLL over masked positions, normalised by the whole step's token count (`global_tokens`)."""
    logits = model(batch["input_ids"], batch["attention_mask"])
    logp = logprobs_from_logits(logits[:, :-1], batch["input_ids"][:, 1:])
    mask = batch["loss_mask"][:, 1:]
    loss = agg_loss(-logp, mask, "token-mean", global_tokens=batch["global_tokens"][0]) * batch["scale"][0]
    return loss, {"mean_logp": (logp * mask).sum() / mask.sum()}


def _batch(rng, rows=8, length=12):
    ids = rng.integers(3, TINY.vocab_size, (rows, length)).astype(np.int32)
    lengths = rng.integers(length // 2, length + 1, rows)
    attention = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int32)
    loss_mask = attention * (rng.random((rows, length)) < 0.7)
    tokens = float(loss_mask[:, 1:].sum())
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "loss_mask": loss_mask.astype(np.int32),
        "global_tokens": np.full(rows, tokens, np.float32),
        "scale": np.ones(rows, np.float32),
    }


def _split(batch, size):
    rows = len(batch["input_ids"])
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, rows, size)]


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _reference_lr(cfg: OptimConfig, total: int, step: int) -> float:
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps)
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, max(0.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.mark.parametrize(
    "cfg, total",
    [
        (OptimConfig(lr=3e-4, warmup_steps=5, schedule="cosine", min_lr_ratio=0.1), 40),
        (OptimConfig(lr=2e-5, warmup_steps=0, schedule="cosine"), 17),
        (OptimConfig(lr=1e-3, warmup_steps=7, schedule="constant"), None),
    ],
)
def test_schedule_matches_formula(cfg, total):
    schedule = learning_rate_schedule(cfg, total)
    steps = range(0, (total or 20) + 5)
    got = [float(schedule(s)) for s in steps]
    want = [_reference_lr(cfg, total or 0, s) for s in steps]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[0] > 0  # the first update already moves
    if cfg.schedule == "cosine":
        assert got[-1] == pytest.approx(cfg.lr * cfg.min_lr_ratio, rel=1e-6, abs=1e-12)


def test_optim_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"optim\.b2: expected in \[0, 1\)"):
        OptimConfig(b2=1.0)
    with pytest.raises(ValueError, match=r"optim\.min_lr_ratio"):
        OptimConfig(min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="total_steps"):
        make_optimizer(OptimConfig(schedule="cosine"), None)


def test_one_step_matches_numpy_adamw_with_clipping():
    cfg = ADAMW
    state = _state(cfg)
    batch = _batch(np.random.default_rng(1))
    before = nnx.to_flat_state(state.params)
    before = {path: np.asarray(v[...], np.float64) for path, v in before}
    # Independent gradient: the unsharded model, one whole-batch jax.grad.
    graphdef, params = nnx.split(random_model(TINY, 0), nnx.Param)
    grads = jax.jit(jax.grad(lambda p: token_mean_nll(nnx.merge(graphdef, p), batch)[0]))(params)
    grads = {path: np.asarray(v[...], np.float64) for path, v in nnx.to_flat_state(grads)}
    norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
    assert norm > cfg.grad_clip  # clipping is active

    metrics = state.update(token_mean_nll, _split(batch, 4))

    lr = cfg.lr / cfg.warmup_steps
    scale = cfg.grad_clip / max(norm, cfg.grad_clip)
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert metrics["lr"] == pytest.approx(lr, rel=1e-6)
    assert metrics["skipped"] == 0 and state.step == 1
    after = {path: np.asarray(v[...], np.float64) for path, v in nnx.to_flat_state(state.params)}
    for path, p in before.items():
        g = grads[path] * scale  # Adam's first step: m_hat = g, v_hat = g^2
        want = p - lr * (g / (np.abs(g) + cfg.eps) + cfg.weight_decay * p)
        np.testing.assert_allclose(after[path], want, rtol=1e-6, atol=1e-7, err_msg=str(path))


def test_micro_batches_equal_the_whole_batch():
    whole, split = _state(ADAMW), _state(ADAMW)
    rng = np.random.default_rng(2)
    for _ in range(2):
        batch = _batch(rng, rows=4)
        a = whole.update(token_mean_nll, [batch])
        b = split.update(token_mean_nll, _split(batch, 1))  # 1 row does not divide over fsdp=4: replicated
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for x, y in zip(_host(whole.items()), _host(split.items()), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-8)
    compiled = compile_counts()
    split.update(token_mean_nll, _split(_batch(rng, rows=4), 1))
    assert compile_counts() == compiled  # steady state compiles nothing


def test_non_finite_gradient_skips_the_step():
    state = _state(ADAMW)
    rng = np.random.default_rng(3)
    before = _host(state.items())
    poisoned = _batch(rng)
    poisoned["scale"][:] = np.inf
    metrics = state.update(token_mean_nll, _split(poisoned, 4))
    assert metrics["skipped"] == 1 and not math.isfinite(metrics["grad_norm"])
    assert (state.step, state.skipped_steps) == (1, 1)
    for x, y in zip(before, _host(state.items()), strict=True):
        np.testing.assert_array_equal(x, y)
    metrics = state.update(token_mean_nll, _split(_batch(rng), 4))
    assert metrics["skipped"] == 0 and (state.step, state.skipped_steps) == (2, 1)
    assert metrics["lr"] == pytest.approx(ADAMW.lr / ADAMW.warmup_steps)  # the skip did not advance the schedule
    assert any(not np.array_equal(x, y) for x, y in zip(before, _host(state.items()), strict=True))


def _logits(model, batch):
    return model(batch["input_ids"], batch["attention_mask"])


def test_eval_runs_forward_on_current_params():
    state = _state(ADAMW)
    batch = _batch(np.random.default_rng(4))
    logits = state.eval(_logits, batch)
    graphdef, params = nnx.split(random_model(TINY, 0))
    reference = jax.jit(lambda p: _logits(nnx.merge(graphdef, p), batch))(params)
    assert isinstance(logits, np.ndarray)
    np.testing.assert_allclose(logits, np.asarray(reference), rtol=1e-5, atol=1e-5)


@pytest.fixture()
def trained_state():
    state = _state(ADAMW)
    state.update(token_mean_nll, _split(_batch(np.random.default_rng(5)), 4))
    return state


def test_checkpoint_round_trip_is_bitwise_and_restores_into_another_layout(tmp_path, trained_state):
    saved = _host(trained_state.items())
    extra = {"data": {"epoch": 1, "batch": 3}, "rng": [1, 2], "step": 1}
    with CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(1, trained_state.items(), extra)
        for leaf in jax.tree.leaves(trained_state.items()):
            leaf.delete()  # the save copied the arrays off the devices before returning
        manager.wait()
        assert manager.all_steps() == [1] and manager.latest_step() == 1
    other = _state(ADAMW, OTHER_LAYOUT, seed=7)
    targets = other.abstract_items()
    with CheckpointManager(tmp_path / "ckpt") as manager:
        step, items, got_extra = manager.restore(None, targets)
    assert step == 1 and got_extra == extra
    for x, y in zip(saved, _host(items), strict=True):
        np.testing.assert_array_equal(x, y)
    for leaf, target in zip(jax.tree.leaves(items), jax.tree.leaves(targets), strict=True):
        assert leaf.sharding == target.sharding
    other.load_items(items)
    chex.assert_trees_all_equal(other.items(), items)
    # items of another tree, shape or dtype are refused before anything is replaced
    params = other.params
    wrong_dtype = {**items, "params": jax.tree.map(lambda x: x.astype(jnp.bfloat16), items["params"])}
    with pytest.raises(AssertionError, match="dtype"):
        other.load_items(wrong_dtype)
    wrong_tree = {**items, "params": jax.tree.leaves(items["params"])}
    with pytest.raises(AssertionError):
        other.load_items(wrong_tree)
    assert other.params is params


def _damage(step_dir: Path) -> None:
    """Truncates every data file of the step's parameters to half its size."""
    files = [f for f in (step_dir / "params").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert files
    for f in files:
        with open(f, "r+b") as handle:
            handle.truncate(f.stat().st_size // 2)


def test_damaged_latest_falls_back_and_partial_save_is_ignored(tmp_path, trained_state, caplog):
    directory = tmp_path / "ckpt"
    manager = CheckpointManager(directory, max_to_keep=2)
    manager.save(1, {"params": trained_state.params}, {"n": 1})
    first = _host(trained_state.params)
    trained_state.update(token_mean_nll, _split(_batch(np.random.default_rng(7)), 4))
    manager.save(2, {"params": trained_state.params}, {"n": 2})
    manager.close()
    _damage(directory / "2")
    partial = directory / "3.orbax-checkpoint-tmp-1234567"  # a save killed midway
    (partial / "params").mkdir(parents=True)
    (partial / "params" / "manifest.ocdbt").write_bytes(b"\0" * 10)

    manager = CheckpointManager(directory, max_to_keep=2)
    assert manager.all_steps() == [1, 2]
    targets = {"params": trained_state.abstract_items()["params"]}
    with pytest.raises(CheckpointError, match="unreadable"):
        manager.restore(2, targets)
    with caplog.at_level(logging.WARNING, logger="hfjax.records.checkpoint"):
        step, items, extra = manager.restore(None, targets)
    assert step == 1 and extra == {"n": 1}
    assert "step 2" in caplog.text and "falling back" in caplog.text
    for x, y in zip(first, _host(items["params"]), strict=True):
        np.testing.assert_array_equal(x, y)
    assert manager.all_steps() == [1] and (directory / "2.unreadable").is_dir()
    manager.save(2, items, {"n": 22})  # the step number is free again
    manager.save(1, items, {"n": 11})  # a step saved again (after resuming from an earlier one) is replaced
    manager.wait()
    assert manager.restore(None, targets)[2] == {"n": 22}
    assert manager.restore(1, targets)[2] == {"n": 11} and manager.all_steps() == [1, 2]
    with pytest.raises(CheckpointError, match="opt_state"):
        manager.restore(None, {"opt_state": trained_state.abstract_items()["opt_state"]})
    manager.close()


def test_flipped_bytes_in_the_latest_step_name_the_file_and_the_step_before_restores_bitwise(
    tmp_path, trained_state, caplog
):
    """64 bytes flipped inside the latest step's data (orbax alone restores it without an error): the step's
    checksums name the step and the file, the previous step restores bitwise, the damaged one is kept aside."""
    directory = tmp_path / "ckpt"
    with CheckpointManager(directory) as manager:
        manager.save(1, trained_state.items(), {"n": 1})
        first = _host(trained_state.items())
        trained_state.update(token_mean_nll, _split(_batch(np.random.default_rng(7)), 4))
        manager.save(2, trained_state.items(), {"n": 2})
    damaged = flip_bytes(directory / "2")
    targets = trained_state.abstract_items()
    with CheckpointManager(directory) as manager:
        named = rf"2: unreadable .*{re.escape(damaged)} does not match its saved sha256"
        with pytest.raises(UnreadableStepError, match=named):
            manager.restore(2, targets)
        assert manager.all_steps() == [1, 2]  # an explicit step is reported, not set aside
        with caplog.at_level(logging.INFO, logger="hfjax.records.checkpoint"):
            step, items, extra = manager.restore(None, targets)
    assert step == 1 and extra == {"n": 1}
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "step 2" in warning and damaged in warning and "falling back" in warning
    assert "no checksums" not in caplog.text
    for x, y in zip(first, _host(items), strict=True):
        np.testing.assert_array_equal(x, y)
    assert (directory / "2.unreadable" / damaged).is_file()  # kept for inspection, not deleted


@pytest.mark.parametrize("manifest", ["kept", "removed"])
def test_an_intact_step_verifies_and_one_without_checksums_restores_with_a_note(
    tmp_path, trained_state, caplog, manifest
):
    """Every saved step records its files' checksums, and an untouched step verifies and restores bitwise; a step
    without them (saved before hfjax recorded checksums) restores unverified with a note."""
    directory = tmp_path / "ckpt"
    saved = _host(trained_state.items())
    with CheckpointManager(directory) as manager:
        manager.save(1, trained_state.items(), {"n": 1})
        manager.wait()
        assert (directory / "1" / MANIFEST).is_file()
    if manifest == "removed":
        (directory / "1" / MANIFEST).unlink()
    with (
        caplog.at_level(logging.INFO, logger="hfjax.records.checkpoint"),
        CheckpointManager(directory) as manager,
    ):
        step, items, extra = manager.restore(None, trained_state.abstract_items())
    assert step == 1 and extra == {"n": 1}
    for x, y in zip(saved, _host(items), strict=True):
        np.testing.assert_array_equal(x, y)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert ("step 1" in caplog.text and "no checksums" in caplog.text) == (manifest == "removed")


def test_restore_into_other_shapes_names_them_and_sets_nothing_aside(tmp_path):
    """A checkpoint whose embedding has the HF vocabulary's 97 rows, restored into a model that stores them padded
    to 128, is a caller error: the message names the leaf, both shapes and vocabulary padding; the step stays."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    saved = {"params": {"embed_tokens": jnp.ones((97, 4)), "norm": jnp.ones(4)}}
    target = {
        "params": {
            "embed_tokens": jax.ShapeDtypeStruct((128, 4), jnp.float32, sharding=sharding),
            "norm": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sharding),
        }
    }
    with CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(3, saved)
        manager.wait()
        with pytest.raises(CheckpointError, match=r"embed_tokens: saved \(97, 4\), target \(128, 4\).*vocabulary pad"):
            manager.restore(None, target)
        assert manager.all_steps() == [3] and not list((tmp_path / "ckpt").glob("*.unreadable*"))


def test_metrics_jsonl_tensorboard_and_resume(tmp_path):
    rng = np.random.default_rng(8)
    records = [{"train/loss": float(rng.random()), "train/lr": float(rng.random())} for _ in range(4)]
    with MetricsLogger(tmp_path, console=True) as logger:
        for step, record in enumerate(records, start=1):
            logger.log(step, {**record, "skipped": np.int32(0)})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": s, **r, "skipped": 0.0} for s, r in enumerate(records, start=1)
    ]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "train/lo')  # a crash mid-line
    assert len(read_metrics(tmp_path)) == 4
    with MetricsLogger(tmp_path, console=False, tensorboard=False, start_step=2) as logger:
        logger.log(3, {"train/loss": 0.5})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    with MetricsLogger(tmp_path, console=False, tensorboard=False) as logger, pytest.raises(ValueError, match="'bad'"):
        logger.log(4, {"bad": "x"})
