"""Micro-batches without their all-padding columns (`actor.trim_padding`, `critic.trim_padding`) and packed
micro-batches (`packed_row_tokens`): the columns cut are exactly the shared padding, and log probs, values and an
update equal those of the full-width batch."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from support.rl_setup import build_run_inputs, rl_config

import hfjax.workers.model_role as model_role
from hfjax.config.rl import load_rl_config
from hfjax.controller import LocalWorkerGroup
from hfjax.protocol import DataProto
from hfjax.rollout.generator import SampleOutput
from hfjax.workers.actor import ActorRolloutRefWorker
from hfjax.workers.critic import CriticWorker
from hfjax.workers.sequences import assemble, length_order, trim_padding

PROMPT_WIDTH, RESPONSE_LENGTH = 40, 48
PROMPT_LENGTHS = [3, 17, 5, 2, 9, 30, 4, 6]
RESPONSE_LENGTHS = [1, 4, 20, 0, 48, 7, 2, 11]


def _batch(vocab: int, pad_id: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A rollout batch with the prompt and response lengths above (random tokens, never the pad id)."""
    rng = np.random.default_rng(seed)
    ids = np.full((len(PROMPT_LENGTHS), PROMPT_WIDTH), pad_id, np.int32)
    mask = np.zeros_like(ids)
    for row, n in enumerate(PROMPT_LENGTHS):
        ids[row, PROMPT_WIDTH - n :] = rng.integers(3, vocab, n)
        mask[row, PROMPT_WIDTH - n :] = 1
    outputs = [
        SampleOutput(i, 0, rng.integers(3, vocab, n).astype(np.int32), np.zeros(n, np.float32), "stop")
        for i, n in enumerate(RESPONSE_LENGTHS)
    ]
    batch = assemble(ids, mask, outputs, 1, RESPONSE_LENGTH, pad_id)
    batch["advantages"] = rng.standard_normal(batch["responses"].shape).astype(np.float32)
    batch["returns"] = rng.standard_normal(batch["responses"].shape).astype(np.float32)
    batch["values"] = rng.standard_normal(batch["responses"].shape).astype(np.float32)
    return batch


def test_trim_keeps_every_real_token_and_cuts_to_padded_lengths():
    batch = _batch(50, 0)
    batch["per_row"] = np.arange(len(PROMPT_LENGTHS), dtype=np.float32)
    rows = slice(0, 4)  # longest prompt 17 -> 24 columns, longest response 20 -> 24 columns
    part = trim_padding({k: v[rows] for k, v in batch.items()}, RESPONSE_LENGTH)
    assert part["input_ids"].shape == (4, 24 + 24) and part["responses"].shape == (4, 24)
    np.testing.assert_array_equal(part["input_ids"], batch["input_ids"][rows, PROMPT_WIDTH - 24 : PROMPT_WIDTH + 24])
    np.testing.assert_array_equal(part["advantages"], batch["advantages"][rows, :24])
    np.testing.assert_array_equal(part["per_row"], batch["per_row"][rows])
    assert part["attention_mask"].sum() == batch["attention_mask"][rows].sum()  # only padding was cut
    np.testing.assert_array_equal(part["prompts"], batch["prompts"][rows, PROMPT_WIDTH - 24 :])
    whole = trim_padding(batch, RESPONSE_LENGTH)  # a 30-token prompt keeps 32 columns, a 48-token response all 48
    assert whole["input_ids"].shape == (8, 32 + RESPONSE_LENGTH)
    with pytest.raises(ValueError, match="odd has 3 columns, expected 48"):
        trim_padding({**batch, "odd": np.zeros((8, 3))}, RESPONSE_LENGTH)


def test_length_order_groups_rows_by_response_then_prompt_length():
    order = length_order(_batch(50, 0), RESPONSE_LENGTH)
    # padded response lengths: 16 for rows 0, 1, 3, 5, 6, 7 (prompts 3, 17, 2, 30, 4, 6), 24 for row 2, 48 for row 4
    assert order.tolist() == [3, 0, 6, 7, 1, 5, 2, 4]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_run_inputs(tmp_path_factory.mktemp("trim"))


def _record_widths(monkeypatch) -> list[int]:
    """Records the width of every micro-batch a worker runs (the list is the caller's to clear)."""
    widths = []
    place = model_role.place_batch

    def recording(layout, batch):
        widths.append(batch["input_ids"].shape[1])
        return place(layout, batch)

    monkeypatch.setattr(model_role, "place_batch", recording)
    return widths


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_trimmed_and_packed_micro_batches_give_the_full_width_results(inputs, monkeypatch, role):
    """Trimmed micro-batches (`trim_padding`) and packed ones (`packed_row_tokens`) against full-width padded ones:
    per-token log probs or values, the update's metrics and the updated parameters."""
    base = rl_config(inputs, "unused", "ppo")
    # Adam with eps 1 steps by about lr * gradient: the new parameters then differ only as much as the gradients do
    # (with eps 1e-8 the first step is lr * sign(gradient), which flips on rounding where a gradient is ~0).
    optim = {"lr": 1e-3, "eps": 1.0}
    actor_settings = dict(use_kl_loss=False, entropy_coeff=0.01, loss_agg_mode="seq-mean-token-mean")
    base["actor"].update(ppo_mini_batch_size=8, micro_batch_size=4, optim=optim, **actor_settings)
    base["critic"].update(ppo_mini_batch_size=8, micro_batch_size=4, optim=optim)
    cfg = load_rl_config(base)
    modes = {"full": dict(trim_padding=False), "trim": dict(trim_padding=True), "packed": dict(packed_row_tokens=96)}
    results = {}
    recorded = _record_widths(monkeypatch)
    for mode, settings in modes.items():
        recorded.clear()
        if role == "actor":
            actor = dataclasses.replace(cfg.actor, **settings)
            group = LocalWorkerGroup(ActorRolloutRefWorker, actor, cfg.rollout, "actor", max_prompt_length=40)
            group.init_model()
            data = DataProto.from_dict(_batch(group.worker.policy.config.vocab_size, group.worker.pad_id))
            per_token = group.compute_log_prob(data).batch["old_log_probs"]
            data.batch["old_log_probs"] = per_token
            metrics = group.update_actor(data).meta_info["metrics"]
        else:
            critic = dataclasses.replace(cfg.critic, **settings)
            group = LocalWorkerGroup(CriticWorker, critic)
            group.init_model()
            data = DataProto.from_dict(_batch(group.worker.critic.config.vocab_size, 0))
            per_token = group.compute_values(data).batch["values"]
            metrics = group.update_critic(data).meta_info["metrics"]
        params = jax.tree.map(np.asarray, group.worker.state.params)
        results[mode] = per_token, metrics, params, list(recorded)
    full, full_metrics, full_params, full_widths = results["full"]
    assert set(full_widths) == {PROMPT_WIDTH + RESPONSE_LENGTH}
    assert min(results["trim"][3]) < PROMPT_WIDTH + RESPONSE_LENGTH  # trimming happened
    # packed: 169 tokens of 8 sequences in rows of <= 96 (94 and 75 tokens): the pass runs one micro-batch, one row
    # per device of the default fsdp=8 layout
    assert results["packed"][3] == [96]
    mask = data.batch["response_mask"].astype(bool)
    for mode in ("trim", "packed"):
        got, got_metrics, got_params, _ = results[mode]
        np.testing.assert_allclose(got[mask], full[mask], rtol=0, atol=2e-6, err_msg=mode)
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
            if key in full_metrics:
                assert got_metrics[key] == pytest.approx(full_metrics[key], rel=1e-5, abs=1e-7), (mode, key)
        for got_leaf, want in zip(jax.tree.leaves(got_params), jax.tree.leaves(full_params), strict=True):
            np.testing.assert_allclose(got_leaf, want, rtol=1e-5, atol=1e-7, err_msg=mode)
