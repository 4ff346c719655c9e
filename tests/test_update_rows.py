"""Which rows an update counts: padding rows (`split_rows`' padding of a short mini- or micro-batch, the rows DP
dispatch adds) and the rows a program keeps out (`Step.update_actor(rows=...)`) are in no loss and no row count, so
the sequence-mean modes divide by the mini-batch's real rows (verl's `global_batch_size`) on any number of ranks,
no micro-batch is padding alone, and a mini-batch without a counted row takes no optimizer step. Ranks are simulated
processes (threads with a stand-in for `process_reduce`)."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.algos_reference import ragged_mask, ref_agg, ref_ppo_tokens, seeded_rng

import hfjax.workers.model_role as model_role
from hfjax.algos import AGG_MODES, policy_loss
from hfjax.controller.dispatch import Dispatch, dispatch_mode
from hfjax.optim import OptimConfig, TrainState, make_optimizer
from hfjax.parallel import Layout
from hfjax.protocol import PADDING_ROWS, ROW_IN_LOSS, DataProto
from hfjax.workers import packing, sequences
from hfjax.workers.model_role import TrainedRole, padding_masked

ROWS, T, DIM, MINI, MICRO = 10, 7, 5, 12, 4  # 10 rows: a short mini-batch of 12, which 4 ranks split with padding
SEQ_MEAN_LOSSES = [*((mode, "ppo") for mode in AGG_MODES if mode.startswith("seq-mean")), ("token-mean", "geo_mean")]


@pytest.fixture
def rng(request):
    return seeded_rng(request)


class _RecordingState:
    """Stands in for `TrainState`: records the micro-batches of each optimizer step."""

    skipped_steps = 0
    layout = SimpleNamespace(batch_parts=1)  # one packed row per micro-batch

    def __init__(self) -> None:
        self.steps: list[list[dict[str, np.ndarray]]] = []

    def update(self, loss_fn, chunks):
        self.steps.append(chunks)
        return {"loss": 0.0}


def _update_counts(mask: np.ndarray, meta: dict, in_loss: np.ndarray | None = None) -> tuple[float, float]:
    batch = {"response_mask": mask, "responses": np.zeros_like(mask)}
    if in_loss is not None:
        batch[ROW_IN_LOSS] = in_loss
    data = DataProto.from_dict(batch, meta_info=meta)
    arrays = padding_masked({k: np.asarray(v) for k, v in data.batch.items() if k != ROW_IN_LOSS}, data)
    role = SimpleNamespace(state=_RecordingState())
    TrainedRole.ppo_epochs(role, arrays, loss_fn=None, epochs=1, mini=len(mask), micro=2, role="actor")
    chunk = role.state.steps[0][0]
    assert ROW_IN_LOSS not in chunk  # the loss functions see the counts, not the flag
    return float(chunk["global_tokens"][0]), float(chunk["global_seqs"][0])


def test_padding_rows_and_rows_kept_out_are_not_counted():
    mask = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], np.float32)
    # rows 4 and 5 are DP padding (copies of rows 0 and 1); row 2 is a real row without a valid token: it counts
    tokens, seqs = _update_counts(mask, {PADDING_ROWS: 2})
    assert (tokens, seqs) == (mask[:4].sum(), 4.0)
    # a program keeps row 3 out of the update: its tokens leave with it (the step zeroes its mask) and its row too
    kept = np.array([1, 1, 1, 0, 1, 1], bool)
    tokens, seqs = _update_counts(mask * kept[:, None], {PADDING_ROWS: 2}, kept)
    assert (tokens, seqs) == ((mask * kept[:, None])[:4].sum(), 3.0)
    # no padding, nothing kept out: every row counts
    assert _update_counts(mask, {}) == (mask.sum(), 6.0)


# ------------------------------------------------------------- the same rows on 1, 2 and 4 ranks


class _Group:
    """A group of `size` simulated processes, one thread each: `share` and `reduce` stand in for `process_share` and
    `process_reduce` (a collective that every thread must reach)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list[np.ndarray | None] = [None] * size
        self.local = threading.local()

    def share(self, rows: int, name: str) -> int:
        assert rows % self.size == 0, (name, rows)
        return rows // self.size

    def reduce(self, values, op: str) -> np.ndarray:
        self.slots[self.local.rank] = np.asarray(values)
        self.barrier.wait()
        stacked = np.stack(self.slots)
        self.barrier.wait()  # every thread has read the slots before any writes them again
        return stacked.sum(axis=0) if op == "sum" else stacked.max(axis=0)

    def run(self, fn, parts: list) -> list:
        """`fn(parts[r])` on rank r, all ranks at once; their results in rank order."""
        results, errors = [None] * self.size, []

        def rank(r: int) -> None:
            self.local.rank = r
            try:
                results[r] = fn(parts[r])
            except BaseException as exc:  # re-raised below, once the other ranks have stopped
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


def _roles_on_ranks(
    monkeypatch,
    batch: dict,
    ranks: int,
    mini: int = MINI,
    state: Callable[[], Any] = _RecordingState,
    loss_fn: Callable[..., Any] | None = None,
    epochs: int = 1,
    **options,
) -> list[tuple[Any, dict[str, float]]]:
    """Each rank's (state, update metrics): `batch` DP-dispatched over `ranks` ranks as `update_actor` gets it, then
    `padding_masked` and `epochs` epochs of `ppo_epochs` (mini-batch `mini`, micro-batch `MICRO`) on every rank, each
    with a `state()` of its own."""
    group = _Group(ranks)
    for module in (model_role, sequences, packing):
        monkeypatch.setattr(module, "process_reduce", group.reduce)
    monkeypatch.setattr(model_role, "process_share", group.share)
    data = DataProto.from_dict(batch)
    parts = [args[0] for args in dispatch_mode(Dispatch.DP_COMPUTE_PROTO).dispatch(ranks, (data,), {}).args]

    def update(part: DataProto) -> tuple[Any, dict[str, float]]:
        arrays = padding_masked({k: np.asarray(v) for k, v in part.batch.items() if k != ROW_IN_LOSS}, part)
        role = SimpleNamespace(state=state())
        kwargs = {"epochs": epochs, "mini": mini, "micro": MICRO, "role": "actor", **options}
        return role.state, TrainedRole.ppo_epochs(role, arrays, loss_fn, **kwargs).meta_info["metrics"]

    return group.run(update, parts)


def _update_on_ranks(monkeypatch, batch: dict, ranks: int, mini: int = MINI, **options) -> list:
    """Each rank's optimizer steps, as the lists of micro-batches it ran (`_roles_on_ranks`, one epoch)."""
    return [state.steps for state, _ in _roles_on_ranks(monkeypatch, batch, ranks, mini, **options)]


def _ref_log_probs(params: dict, x: np.ndarray) -> np.ndarray:
    """The tiny linear policy's log probs, log sigmoid(x . w + b), in float64."""
    return -np.log1p(np.exp(-(x @ np.asarray(params["w"], np.float64) + np.float64(params["b"]))))


def _policy_batch(rng: np.random.Generator, rows: int = ROWS) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(an update's `rows` rows for the tiny linear policy, its parameters), float32: ragged masks (row 0 has no
    valid token, and counts), old log probs near the policy's so that some tokens are clipped and most are not."""
    x = rng.normal(size=(rows, T, DIM)) * 0.5
    params = {"w": rng.normal(size=DIM).astype(np.float32), "b": np.float32(0.1)}
    batch = {
        "x": x,
        "old_log_probs": _ref_log_probs(params, x) + rng.normal(size=(rows, T)) * 0.15,
        "advantages": rng.normal(size=(rows, T)),
        "response_mask": ragged_mask(rng, bs=rows, length=T),
        "responses": np.zeros((rows, T), np.int32),
    }
    return {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in batch.items()}, params


@functools.partial(jax.jit, static_argnames=("mode", "name"))
def _micro_loss_and_grad(params: dict, chunk: dict, mode: str, name: str):
    """What `actor_loss` computes for one micro-batch (the policy loss with the mini-batch's counts from the batch),
    and its gradient."""

    def loss(params):
        logp = jax.nn.log_sigmoid(chunk["x"] @ params["w"] + params["b"])
        counts = {"global_tokens": chunk["global_tokens"][0], "global_seqs": chunk["global_seqs"][0], "norm_length": T}
        args = (chunk["old_log_probs"], logp, chunk["advantages"], chunk["response_mask"])
        return policy_loss(name, *args, loss_agg_mode=mode, **counts)[0]

    return jax.value_and_grad(loss)(params)


def _step_loss_and_grad(steps_per_rank: list, params: dict, mode: str, name: str) -> tuple[float, dict]:
    """The one optimizer step's loss and gradient: the sum over the micro-batches of every rank (a global
    micro-batch's loss is the sum of its ranks' parts, each normalised by the group's counts)."""
    assert all(len(steps) == 1 for steps in steps_per_rank)
    keys = ("x", "old_log_probs", "advantages", "response_mask", "global_tokens", "global_seqs")
    total, grad = 0.0, {k: np.zeros(np.shape(v)) for k, v in params.items()}
    for steps in steps_per_rank:
        for chunk in steps[0]:
            value, g = _micro_loss_and_grad(params, {k: chunk[k] for k in keys}, mode, name)
            total += float(value)
            grad = {k: grad[k] + np.asarray(g[k], np.float64) for k in grad}
    return total, grad


def _ref_gmpo(old, new, adv, m, low: float = 0.2, high: float = 0.2) -> float:
    """GMPO's loss from its definition: per sequence, -mean(A) * exp(mean of the log ratios, each clipped to [-low,
    high] on the side that lowers the objective for its advantage's sign), over its valid tokens; mean over rows."""
    losses = []
    for i in range(len(m)):
        valid = [t for t in range(m.shape[1]) if m[i, t]]
        length = len(valid) + 1e-8
        log_ratio = 0.0
        for t in valid:
            r = new[i, t] - old[i, t]
            clipped = min(max(r, -low), high)
            log_ratio += min(r, clipped) if adv[i, t] > 0 else max(r, clipped)
        losses.append(-sum(adv[i, t] for t in valid) / length * math.exp(log_ratio / length))
    return sum(losses) / len(m)


def _ref_loss(params: dict, batch: dict, rows: np.ndarray, mode: str, name: str) -> float:
    """The loss of `rows` alone, a mini-batch of exactly those rows as verl defines it (float64)."""
    keys = ("x", "old_log_probs", "advantages", "response_mask")
    x, old, adv, m = (np.asarray(batch[k], np.float64)[rows] for k in keys)
    new = _ref_log_probs(params, x)
    if name == "geo_mean":
        return _ref_gmpo(old, new, adv, m)
    return ref_agg(ref_ppo_tokens(old, new, adv, 0.2, 0.2, 3.0)[0], m, mode, norm_length=T)


def _ref_grad(params: dict, batch: dict, rows: np.ndarray, mode: str, name: str) -> dict[str, np.ndarray]:
    """Central differences of `_ref_loss` (float64)."""
    base = {k: np.array(v, np.float64) for k, v in params.items()}
    grad = {}
    for key, value in base.items():
        g = np.zeros(value.shape)
        for index in np.ndindex(value.shape):
            ends = []
            for step in (1e-6, -1e-6):
                moved = {k: v.copy() for k, v in base.items()}
                moved[key][index] += step
                ends.append(_ref_loss(moved, batch, rows, mode, name))
            g[index] = (ends[0] - ends[1]) / 2e-6
        grad[key] = g
    return grad


def _check_rank_independent(monkeypatch, batch: dict, params: dict, rows: np.ndarray, mode: str, name: str) -> None:
    expected, expected_grad = _ref_loss(params, batch, rows, mode, name), _ref_grad(params, batch, rows, mode, name)
    assert abs(expected) > 1e-3 and all(np.abs(g).max() > 1e-3 for g in expected_grad.values())
    for ranks in (1, 2, 4):
        loss, grad = _step_loss_and_grad(_update_on_ranks(monkeypatch, batch, ranks), params, mode, name)
        np.testing.assert_allclose(loss, expected, rtol=2e-5, atol=1e-6, err_msg=f"loss on {ranks} ranks")
        for key in grad:
            np.testing.assert_allclose(
                grad[key], expected_grad[key], rtol=1e-3, atol=1e-5, err_msg=f"d loss / d {key} on {ranks} ranks"
            )


@pytest.mark.parametrize(("mode", "name"), SEQ_MEAN_LOSSES, ids=[m if n == "ppo" else n for m, n in SEQ_MEAN_LOSSES])
def test_seq_mean_loss_and_gradient_are_those_of_the_real_rows_on_any_number_of_ranks(monkeypatch, rng, mode, name):
    """10 rows, ppo_mini_batch_size 12: one short mini-batch, padded by `split_rows` on 1 and 2 ranks and by DP
    dispatch (and `split_rows`) on 4. Its seq-mean loss and gradient are those of the 10 rows (divided by 10) on
    every count of ranks; row 0, a real row without a valid token, counts."""
    batch, params = _policy_batch(rng)
    _check_rank_independent(monkeypatch, batch, params, np.arange(ROWS), mode, name)


@pytest.mark.parametrize("kept_out", [0, 3, 9])
def test_a_row_kept_out_leaves_the_seq_mean_count_on_any_number_of_ranks(monkeypatch, rng, kept_out):
    """A program keeps one row out of the update (`Step.update_actor(rows=...)`, which zeroes its mask): the loss and
    gradient are those of the other 9 rows, whichever row it is (a padding copy of a row does not bring it back)
    and on 1, 2 or 4 ranks."""
    batch, params = _policy_batch(rng)
    rows = np.arange(ROWS) != kept_out
    batch = {**batch, "response_mask": batch["response_mask"] * rows[:, None], ROW_IN_LOSS: rows}
    _check_rank_independent(monkeypatch, batch, params, np.flatnonzero(rows), "seq-mean-token-mean", "ppo")


def _sequence_batch(rows: int, prompt: int = 4) -> dict[str, np.ndarray]:
    """RL rows with full prompts of `prompt` tokens and full responses of `T` tokens."""
    ids = (np.arange(rows * (prompt + T), dtype=np.int32).reshape(rows, prompt + T) % 50) + 3
    return {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "position_ids": np.broadcast_to(np.arange(prompt + T, dtype=np.int32), ids.shape).copy(),
        "responses": ids[:, prompt:],
        "response_mask": np.ones((rows, T), np.float32),
        "advantages": np.ones((rows, T), np.float32),
    }


@pytest.mark.parametrize(
    ("ranks", "options", "micro_batches"),
    [(1, {}, 3), (4, {}, 3), (1, {"trim": True}, 3), (4, {"trim": True}, 3), (1, {"row_tokens": 2 * (4 + T)}, 5)],
    ids=["split-1", "split-4", "trim-1", "trim-4", "packed-1"],
)
def test_micro_batches_of_padding_alone_are_skipped(monkeypatch, ranks, options, micro_batches):
    """10 rows in a mini-batch of 16, micro-batches of 4 rows (or packed rows of 2 sequences): the step runs the
    micro-batches that the 10 rows need (3, or 5 packed), each with a real row in some rank, and every row once."""
    chunks = [steps[0] for steps in _update_on_ranks(monkeypatch, _sequence_batch(ROWS), ranks, mini=16, **options)]
    assert [len(rank) for rank in chunks] == [micro_batches] * ranks
    for j in range(micro_batches):
        assert sum(rank[j]["response_mask"].sum() for rank in chunks) > 0, f"micro-batch {j} is padding in every rank"
    assert sum(chunk["response_mask"].sum() for rank in chunks for chunk in rank) == ROWS * T


# ------------------------------------------------------------- a mini-batch without a counted row


class _LinearPolicy(nnx.Module):
    """The tiny linear policy of `_ref_log_probs` as a model: log sigmoid(x . w + b)."""

    def __init__(self, params: dict) -> None:
        self.w = nnx.Param(jnp.asarray(params["w"]))
        self.b = nnx.Param(jnp.asarray(params["b"]))

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.log_sigmoid(x @ self.w[...] + self.b[...])


def _policy_step_loss(model: _LinearPolicy, batch: dict) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`actor_loss` of the linear policy: the PPO loss (seq-mean-token-mean) with the mini-batch's counts."""
    counts = {"global_tokens": batch["global_tokens"][0], "global_seqs": batch["global_seqs"][0], "norm_length": T}
    args = (batch["old_log_probs"], model(batch["x"]), batch["advantages"], batch["response_mask"])
    loss = policy_loss("ppo", *args, loss_agg_mode="seq-mean-token-mean", **counts)[0]
    return loss, {"actor/pg_loss": loss}


# AdamW with weight decay and a warm-up: a zero-gradient step would move the parameters and the rate
EMPTY_STEP_OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=1.0, warmup_steps=4)
ONE_DEVICE = {"mesh": {"fsdp": 1}, "rules": "fsdp", "devices": [0]}


def _policy_state(params: dict) -> Callable[[], TrainState]:
    """A fresh `TrainState` of the linear policy at `params`, per call (one per rank)."""
    optimizer, clip = make_optimizer(EMPTY_STEP_OPTIM, None), EMPTY_STEP_OPTIM.grad_clip
    return lambda: TrainState(_LinearPolicy(params), Layout.from_config(ONE_DEVICE), optimizer, clip)


def _host(state: TrainState) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state))]


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_mini_batch_without_a_counted_row_takes_no_optimizer_step(monkeypatch, rng, ranks):
    """12 rows in mini-batches of 4 (per rank: its share), every row of the second one kept out: the update takes
    no step for it, so the parameters, the AdamW state (moments, step count, rate) and the step metrics are bitwise
    those of an update over the other two mini-batches alone; the skip is reported."""
    rows, mini = 12, 4
    batch, params = _policy_batch(rng, rows=rows)
    share, part = rows // ranks, mini // ranks  # a rank's rows and its part of each mini-batch
    empty = np.zeros(rows, bool)
    for rank in range(ranks):
        empty[rank * share + part : rank * share + 2 * part] = True  # the second mini-batch of every rank
    kept_out = {**batch, "response_mask": batch["response_mask"] * ~empty[:, None], ROW_IN_LOSS: ~empty}
    others = {k: v[~empty] for k, v in batch.items()}

    run = functools.partial(_roles_on_ranks, monkeypatch, ranks=ranks, mini=mini, loss_fn=_policy_step_loss)
    skipping = run(kept_out, state=_policy_state(params))
    reference = run(others, state=_policy_state(params))
    for (state, metrics), (expected, expected_metrics) in zip(skipping, reference, strict=True):
        assert state.step == expected.step == 2
        for got, want in zip(_host(state), _host(expected), strict=True):
            np.testing.assert_array_equal(got, want)
        assert metrics.pop("actor/skipped_empty_mini_batches") == 1.0
        assert expected_metrics.pop("actor/skipped_empty_mini_batches") == 0.0
        assert metrics == expected_metrics


def test_an_update_without_a_counted_row_takes_no_step(monkeypatch, rng):
    """Every row kept out, over 2 epochs on 2 ranks: no micro-batch runs and no step is taken (the parameters and
    optimizer state are those the update started from), and the metrics say so instead of averaging no steps."""
    batch, params = _policy_batch(rng)
    batch = {**batch, "response_mask": np.zeros_like(batch["response_mask"]), ROW_IN_LOSS: np.zeros(ROWS, bool)}
    fresh = _policy_state(params)
    ranks = _roles_on_ranks(monkeypatch, batch, 2, mini=4, state=fresh, loss_fn=_policy_step_loss, epochs=2)
    for state, metrics in ranks:
        assert state.step == 0
        for got, want in zip(_host(state), _host(fresh()), strict=True):
            np.testing.assert_array_equal(got, want)
        assert metrics == {"actor/skipped_steps": 0.0, "actor/skipped_empty_mini_batches": 6.0}
