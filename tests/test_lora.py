"""LoRA adapters (`hfjax.models.lora`) on a tiny float32 model, 8 fake CPU devices: fresh adapters leave the logits
bit for bit; the adapters' gradients equal the chain rule through the merged weight W + scale B A (hand-written from
the plain model's weight gradient); a TrainState with `trainable=LoraParam` changes the adapters only, keeps
optimizer state and checkpoint items for them only; the merged model computes what the adapted one does; adapters
shard like their base weights; the config refuses bad values by name. In a run: the reference is the base (no copy),
exports merged or as PEFT adapters that peft loads onto the transformers base to hfjax's logits; the compile check
counts LoRA's memory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
import transformers as tf
from flax import nnx
from safetensors.numpy import load_file
from support.checkpoints import left_padded_batch, save_hf_model
from support.rl_setup import build_run_inputs, rl_config
from support.tiny_models import TINY, compiled_forward, random_model

from hfjax.automap.compiled.programs import AbstractModel, actor_programs, actor_resident, bytes_per_device, measure
from hfjax.config.rl import RLConfig, load_rl_config
from hfjax.config.roles import ActorConfig
from hfjax.models import load_hf, save_hf
from hfjax.models.hf import abstract_model
from hfjax.models.lora import (
    LORA_SITES,
    LoraAdapter,
    LoraConfig,
    LoraParam,
    adapter_dropout,
    adapters_off,
    add_lora,
    lora_parameter_count,
    merge_lora,
    with_adapter,
)
from hfjax.models.peft_io import save_peft
from hfjax.models.presets import named_config
from hfjax.optim import TrainState
from hfjax.parallel import Layout
from hfjax.predict.dataflow import model_shape
from hfjax.protocol import DataProto
from hfjax.trainer.launch import export_run, run_rl
from hfjax.trainer.preflight import predict_memory
from hfjax.workers.actor import ActorRolloutRefWorker
from hfjax.workers.critic import CriticWorker
from hfjax.workers.rollout import RolloutWorker
from hfjax.workers.weight_sync import param_paths

RANK, ALPHA = 4, 8.0
ROWS, LENGTH = 4, 10


def _inputs(seed: int = 0) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, TINY.vocab_size, (ROWS, LENGTH)).astype(np.int32)
    mask = np.ones((ROWS, LENGTH), np.int32)
    mask[0, :3] = 0  # a left-padded row
    return jnp.asarray(ids), jnp.asarray(mask)


def _adapted(seed: int = 0, targets: list[str] | None = None) -> nnx.Module:
    """The tiny model with adapters, their B drawn at random (a fresh B is zero: nothing to differentiate through)."""
    cfg = LoraConfig(rank=RANK, alpha=ALPHA, targets=targets or list(LORA_SITES))
    model = add_lora(random_model(TINY, seed), cfg, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for path, b in nnx.to_flat_state(nnx.state(model, LoraParam)):
        if path[-1] == "b":
            b[...] = jnp.asarray(rng.normal(0, 0.05, b.shape), jnp.float32)
    return model


def _loss(model: nnx.Module, ids: jax.Array, mask: jax.Array, weights: jax.Array) -> jax.Array:
    return jnp.sum(model(ids, mask) * weights)


def test_fresh_adapters_leave_the_logits_bit_for_bit():
    ids, mask = _inputs()
    base = np.asarray(compiled_forward(random_model(TINY, 3), ids, mask))
    adapted = add_lora(random_model(TINY, 3), LoraConfig(rank=RANK, alpha=ALPHA))
    adapters = nnx.to_flat_state(nnx.state(adapted, LoraParam))
    assert len(adapters) == 2 * len(LORA_SITES) * TINY.num_layers
    np.testing.assert_array_equal(np.asarray(compiled_forward(adapted, ids, mask)), base)


def test_adapters_off_computes_the_base_and_merging_computes_the_adapted_model():
    ids, mask = _inputs(1)
    adapted = _adapted(5)
    base = np.asarray(compiled_forward(random_model(TINY, 5), ids, mask))
    with_adapters = np.asarray(compiled_forward(adapted, ids, mask))
    assert np.abs(with_adapters - base).max() > 1e-3  # the random B matter

    @jax.jit
    def base_logits(state: nnx.State, ids: jax.Array, mask: jax.Array) -> jax.Array:
        with adapters_off():
            return nnx.merge(graphdef, state)(ids, mask)

    graphdef, state = nnx.split(adapted)
    np.testing.assert_array_equal(np.asarray(base_logits(state, ids, mask)), base)
    merged = merge_lora(adapted)
    assert not nnx.to_flat_state(nnx.state(merged, LoraParam))
    assert nnx.to_flat_state(nnx.state(adapted, LoraParam))  # the adapted model is left as it was
    np.testing.assert_allclose(np.asarray(compiled_forward(merged, ids, mask)), with_adapters, rtol=1e-5, atol=1e-5)


def test_adapter_gradients_follow_the_chain_rule_through_the_merged_weight():
    """W' = W + s B A, so dL/dB = s G A^T and dL/dA = s B^T G with G = dL/dW' of the plain (merged) model."""
    ids, mask = _inputs(2)
    weights = jax.random.normal(jax.random.key(0), (ROWS, LENGTH, TINY.vocab_size))
    adapted = _adapted(7)
    graphdef, adapters, rest = nnx.split(adapted, LoraParam, ...)
    grads = jax.jit(jax.grad(lambda a: _loss(nnx.merge(graphdef, a, rest), ids, mask, weights)))(adapters)
    merged = merge_lora(adapted)
    m_graphdef, m_params = nnx.split(merged, nnx.Param)
    m_grads = jax.jit(jax.grad(lambda p: _loss(nnx.merge(m_graphdef, p), ids, mask, weights)))(m_params)
    scale = ALPHA / RANK
    for index in range(TINY.num_layers):
        for target, (kernel_attr, adapter_attr, _) in LORA_SITES.items():
            module = "self_attn" if target[0] in "qkvo" else "mlp"
            path = ("model", "layers", index, module)
            g_kernel = np.asarray(_at(m_grads, (*path, kernel_attr)))
            out = g_kernel.reshape(-1, int(np.prod(_at(grads, (*path, adapter_attr, "a")).shape[1:])))
            a = np.asarray(_at(adapters, (*path, adapter_attr, "a"))).reshape(RANK, -1)
            b = np.asarray(_at(adapters, (*path, adapter_attr, "b"))).reshape(-1, RANK)
            want_a, want_b = scale * b.T @ out, scale * out @ a.T
            got_a = np.asarray(_at(grads, (*path, adapter_attr, "a"))).reshape(RANK, -1)
            got_b = np.asarray(_at(grads, (*path, adapter_attr, "b"))).reshape(-1, RANK)
            where = f"layer {index} {target}"
            np.testing.assert_allclose(got_a, want_a, rtol=1e-4, atol=1e-6 * np.abs(want_a).max(), err_msg=where)
            np.testing.assert_allclose(got_b, want_b, rtol=1e-4, atol=1e-6 * np.abs(want_b).max(), err_msg=where)


def test_adapter_dropout_is_unbiased_per_row_and_leaves_the_base_term_alone():
    """Under `adapter_dropout`, an adapter's term sees its input with a share `dropout` of elements zeroed and the
    rest scaled by 1 / (1 - dropout): over many rows of one input the mean term is the whole input's (within five
    standard errors), about that share of elements is dropped, a row's term depends on its seed alone (not on the
    rows beside it), the base term passes through, and outside the block the adapter sees the whole input."""
    rows, width, out, rate = 4096, 12, 6, 0.25
    kernel = nnx.Param(jnp.zeros((out, width)), logical_axes=("mlp", "embed"))
    adapter = LoraAdapter(kernel, 1, RANK, ALPHA, jax.random.key(0), rate, site=3)
    adapter.b[...] = jax.random.normal(jax.random.key(1), adapter.b.shape)
    x = jnp.broadcast_to(jax.random.normal(jax.random.key(2), (width,)), (rows, width))
    base = jnp.full((rows, out), 0.5)
    whole = np.asarray(with_adapter(base, x, adapter, jnp.float32))
    seeds = jnp.arange(rows, dtype=jnp.int32) * 7 + 1

    @jax.jit
    def dropped(seeds, x):
        with adapter_dropout(seeds):
            return with_adapter(base[: len(seeds)], x, adapter, jnp.float32)

    got = np.asarray(dropped(seeds, x))
    terms = got - 0.5
    want = whole[0] - 0.5
    stderr = terms.std(axis=0) / np.sqrt(rows)
    assert (np.abs(terms.mean(axis=0) - want) <= 5 * stderr).all()
    assert np.abs(terms - want).max() > 1e-2  # the masks change each row's term
    # the mask itself, read off an adapter with A = I, B = I and scale 1 on a ones input
    identity = LoraAdapter(nnx.Param(jnp.zeros((width, width)), logical_axes=("mlp", "embed")), 1, width, width,
                           jax.random.key(0), rate, site=3)  # fmt: skip
    identity.a[...], identity.b[...] = jnp.eye(width), jnp.eye(width)
    with adapter_dropout(seeds):
        mask = np.asarray(with_adapter(jnp.zeros((rows, width)), jnp.ones((rows, width)), identity, jnp.float32))
    np.testing.assert_allclose(np.unique(mask), [0.0, 1 / (1 - rate)], rtol=1e-6)
    share = (mask == 0).mean()
    assert abs(share - rate) <= 5 * np.sqrt(rate * (1 - rate) / mask.size)
    with adapter_dropout(seeds[5:6]):  # row 5 in a micro-batch of its own: the same mask
        alone = np.asarray(with_adapter(jnp.zeros((1, width)), jnp.ones((1, width)), identity, jnp.float32))
    np.testing.assert_array_equal(alone[0], mask[5])
    np.testing.assert_array_equal(np.asarray(with_adapter(base, x, adapter, jnp.float32)), whole)


def _at(state: nnx.State, path: tuple) -> jax.Array:
    node = state
    for key in path:
        node = node[key]
    return node[...]


def _nll(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    logits = model(batch["input_ids"], batch["attention_mask"])
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    picked = jnp.take_along_axis(logp, batch["input_ids"][:, 1:, None], axis=-1)[..., 0]
    return -jnp.mean(picked), {}


def test_an_update_trains_the_adapters_only_and_checkpoints_hold_them_only():
    layout = Layout.from_config({"mesh": {"fsdp": 4, "tensor": 2}, "rules": "fsdp_tp"})
    model = add_lora(random_model(TINY, 9), LoraConfig(rank=RANK, alpha=ALPHA, targets=["q_proj", "down_proj"]))
    state = TrainState(model, layout, optax.adam(1e-2), grad_clip=1.0, trainable=LoraParam)
    before = {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(state.params)}
    adapter_paths = {path for path, _ in nnx.to_flat_state(nnx.state(model, LoraParam))}
    assert len(adapter_paths) == 2 * 2 * TINY.num_layers
    ids, mask = _inputs(3)
    batch = {"input_ids": np.asarray(ids), "attention_mask": np.asarray(mask)}
    changed = []
    for _ in range(2):
        metrics = state.update(_nll, [batch])
        assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        after = {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(state.params)}
        assert after.keys() == before.keys()
        changed.append({path for path in before if not np.array_equal(before[path], after[path])})
    # step 1: B moves, A does not (dL/dA = s B^T G, and B starts at zero); step 2: both; the base never
    assert changed == [{p for p in adapter_paths if p[-1] == "b"}, adapter_paths]
    adapter_elements = sum(before[p].size for p in adapter_paths)
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * adapter_elements  # adam's two moments, of the adapters only
    saved = state.items()["params"]
    assert {path for path, _ in nnx.to_flat_state(saved)} == adapter_paths
    for path, value in nnx.to_flat_state(state.params):
        if path in adapter_paths:
            want = _expected_sharding(layout, path, value.shape)
            assert value.sharding.is_equivalent_to(want, value.ndim), (path, value.sharding.spec, want.spec)


def _expected_sharding(layout: Layout, path: tuple, shape: tuple[int, ...]):
    """A = [rank, *in] and B = [*out, rank] sharded as the base kernel's in and out dimensions, rank whole."""
    kernel_attr = next(k for k, a, _ in LORA_SITES.values() if a == path[-2])
    base_axes = {"q_kernel": ("heads", "head_dim", "embed"), "down_kernel": ("embed", "mlp")}[kernel_attr]
    out_dims = next(o for k, _, o in LORA_SITES.values() if k == kernel_attr)
    axes = ("lora_rank", *base_axes[out_dims:]) if path[-1] == "a" else (*base_axes[:out_dims], "lora_rank")
    return layout.sharding(axes, shape)


def test_trainstate_refuses_a_model_without_adapters_when_training_adapters():
    layout = Layout.from_config({"mesh": {"fsdp": 8}, "rules": "fsdp"})
    with pytest.raises(ValueError, match=r"no parameter of the model is trainable \(trainable=LoraParam\)"):
        TrainState(random_model(TINY, 0), layout, optax.sgd(0.1), grad_clip=1.0, trainable=LoraParam)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rank": -1}, r"lora.rank: expected an integer >= 0 \(0: no adapters\), got -1"),
        ({"rank": 2.5}, r"lora.rank: expected an integer >= 0"),
        ({"rank": 4, "alpha": 0}, r"lora.alpha: expected > 0, got 0"),
        ({"rank": 4, "targets": ["qkv"]}, r"lora.targets: expected distinct names out of \['q_proj'"),
        ({"rank": 4, "targets": []}, r"lora.targets: expected distinct names"),
        ({"rank": 4, "dropout": 1.0}, r"lora.dropout: expected a number in \[0, 1\), got 1.0"),
        ({"rank": 4, "dropout": -0.1}, r"lora.dropout: expected a number in \[0, 1\), got -0.1"),
    ],
)
def test_lora_config_names_the_bad_field(fields, message):
    with pytest.raises(ValueError, match=message):
        LoraConfig(**fields)


def test_adapter_dropout_is_refused_with_packed_rows():
    with pytest.raises(ValueError, match=r"lora.dropout: not supported with packed_row_tokens yet"):
        ActorConfig(lora=LoraConfig(rank=4, dropout=0.1), packed_row_tokens=64)


def test_ppo_with_lora_uses_the_base_as_reference_and_exports_merged_weights(tmp_path):
    """Three PPO steps in-process, the actor with adapters on q and v, the critic with adapters on every projection:
    the KL to the reference is exactly 0 at step 1 (fresh adapters: the policy is its base) and grows after updates,
    the value loss is finite (the actor's adapters with dropout, which a fresh adapter's zero B makes no difference
    to at step 1), and `hfjax export` writes merged weights that transformers loads: q and v changed,
    every other tensor bit for bit the base's; `hfjax export --adapters` writes adapters that peft puts on the base to
    the merged model's logits."""
    inputs = build_run_inputs(tmp_path)
    lora = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"], "dropout": 0.1}
    actor = {"lora": lora, "optim": {"lr": 1e-2}, "ppo_mini_batch_size": 8}  # one update per step: at step 1 the
    # KL is measured before any update
    config = rl_config(inputs, tmp_path / "run", "ppo", actor=actor, critic={"lora": {"rank": 4}})
    history = run_rl(load_rl_config(config))
    kl = [m["actor/kl_loss"] for m in history]
    assert kl[0] == 0 and kl[-1] > 0, kl
    assert all(np.isfinite(m["critic/vf_loss"]) for m in history)
    assert export_run(tmp_path / "run", None, tmp_path / "hf") == 3
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    base = load_file(str(next(Path(inputs["policy"]).glob("*.safetensors"))))
    assert exported.keys() == base.keys()
    adapted = {name for name in base if name.endswith(("q_proj.weight", "v_proj.weight"))}
    assert adapted and all(not np.array_equal(exported[n], base[n]) for n in adapted)
    for name in base.keys() - adapted:
        np.testing.assert_array_equal(exported[name], base[name], err_msg=name)
    merged = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert export_run(tmp_path / "run", None, tmp_path / "adapters", adapters=True) == 3
    assert json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())["lora_dropout"] == 0.1
    base_model = tf.AutoModelForCausalLM.from_pretrained(inputs["policy"], dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base_model, tmp_path / "adapters").eval()
    ids = torch.as_tensor(np.random.default_rng(0).integers(3, 12, (2, 9)))
    with torch.no_grad():
        want, got = merged(input_ids=ids).logits.numpy(), adapted(input_ids=ids).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _sequences(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """4 sequences of 12 tokens, the last 6 the response (every token real and in the loss)."""
    ids = rng.integers(3, 12, (4, 12)).astype(np.int32)
    return {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "position_ids": np.tile(np.arange(12, dtype=np.int32), (4, 1)),
        "responses": ids[:, 6:],
        "response_mask": np.ones((4, 6), np.float32),
    }


@pytest.mark.parametrize("base_layout", ["train", "gen"])
def test_a_lora_actor_with_a_reference_role_loads_no_reference_copy(tmp_path, base_layout):
    """The actor_rollout_ref worker with LoRA: no reference parameters, and its reference log probs are the base
    model's (those of a worker without adapters), before and after the adapters are trained (bit for bit after).
    With the base in the training layout the plain worker's programs are the same ones: bit for bit. Kept in the
    generation layout (replicated here, against fsdp over 8 devices) the matmuls sum in another order: float32
    rounding."""
    inputs = build_run_inputs(tmp_path)
    rollout = {"lora_base_layout": base_layout}
    config = rl_config(inputs, tmp_path / "run", "grpo", actor={"lora": {"rank": 4}}, rollout=rollout)
    cfg = load_rl_config(config)
    worker = ActorRolloutRefWorker(cfg.actor, cfg.rollout, "actor_rollout_ref", total_steps=3, max_prompt_length=16)
    worker.init_model()
    assert worker.ref_params is None
    plain = ActorRolloutRefWorker(dataclasses.replace(cfg.actor, lora=LoraConfig()), cfg.rollout, "ref")
    plain.init_model()
    assert plain.ref_params is not None
    same = np.testing.assert_array_equal if base_layout == "train" else _float32_rounding
    rng = np.random.default_rng(0)
    data = DataProto.from_dict(_sequences(rng))
    want = plain.compute_ref_log_prob(data).batch["ref_log_prob"]
    before = worker.compute_ref_log_prob(data).batch["ref_log_prob"]
    same(before, want)
    policy = plain.compute_log_prob(data).batch["old_log_probs"]  # (the program with entropies: other roundings)
    same(worker.compute_log_prob(data).batch["old_log_probs"], policy)  # fresh: B = 0
    data.batch["advantages"] = rng.normal(size=(4, 6)).astype(np.float32)
    data.batch["ref_log_prob"] = want
    worker.update_actor(data)
    np.testing.assert_array_equal(worker.compute_ref_log_prob(data).batch["ref_log_prob"], before)
    assert np.abs(worker.compute_log_prob(data).batch["old_log_probs"] - policy).max() > 1e-4


def _float32_rounding(actual: np.ndarray, desired: np.ndarray) -> None:
    """Equal but for float32 rounding: a few units in the last place of log probs near -5."""
    np.testing.assert_allclose(actual, desired, rtol=4 * np.finfo(np.float32).eps, atol=0)


def test_the_compile_check_counts_lora_memory():
    """The compile check's programs of a LoRA actor (bfloat16, with a reference): no reference copy, optimizer state
    for the adapters only, and the optimizer step reads adapters, their moments and gradients, not the whole model:
    against full fine-tuning of the same config, compiled for this machine's 8 devices."""
    layout = Layout.from_config({"mesh": {"fsdp": 4, "tensor": 2}, "rules": "fsdp_tp"})
    gen = Layout.from_config({"mesh": {"data": 4, "tensor": 2}, "rules": "dp_tp_gen"})
    widths = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}
    shape = dataclasses.replace(TINY, **widths, num_layers=2, sliding_windows=(None, None))

    def config(lora: dict, base_layout: str = "train") -> RLConfig:
        actor = {"model_path": "unused", "dtype": "bfloat16", "micro_batch_size": 8, "ppo_mini_batch_size": 8}
        return load_rl_config(
            {
                "actor": {**actor, "use_kl_loss": True, "lora": lora},
                "data": {"max_prompt_length": 16},
                "rollout": {"response_length": 16, "slots": 8, "n": 2, "lora_base_layout": base_layout},
            }
        )

    full, lora, lora_in_gen = config({}), config({"rank": 4}), config({"rank": 4}, "gen")
    trained = ("loss+grad", "optimizer step", "log probs", "ref log probs")  # (generation: the same programs)
    programs = {
        name: {t.program: measure(t) for t in actor_programs(cfg, shape, layout, gen) if t.program in trained}
        for name, cfg in (("full", full), ("lora", lora))
    }
    assert programs["full"].keys() == programs["lora"].keys() == set(trained)
    policy = AbstractModel.build(shape, "causal_lm", layout, "bfloat16", None, lora=lora.actor.lora)
    adapters = bytes_per_device(policy.trained_and_rest()[0])
    base = bytes_per_device(policy.params) - adapters
    # between programs: the bfloat16 base, the float32 adapters and their two Adam moments (+ a step count)
    assert actor_resident(lora, shape, layout, gen) == pytest.approx(base + 3 * adapters, abs=64)
    # the base kept in the generation layout: its generation shard, 4 times the training one (tensor 2 of 8 devices)
    assert actor_resident(lora_in_gen, shape, layout, gen) == pytest.approx(4 * base + 3 * adapters, abs=64)
    in_gen = {t.program: t for t in actor_programs(lora_in_gen, shape, layout, gen) if t.program in trained}
    base_args = jax.tree.leaves(in_gen["loss+grad"].traced.args_info[1])  # the frozen base: the program's `rest`
    assert {a.sharding.spec for a in base_args} <= {a.sharding.spec for a in jax.tree.leaves(policy.cast(None, gen))}
    # full fine-tuning: a float32 master (twice the bfloat16 base), its two float32 moments and a bfloat16 reference
    assert actor_resident(full, shape, layout, gen) == pytest.approx(2 * base + 2 * 2 * base + base, abs=64)
    step = programs["lora"]["optimizer step"]
    assert step.arguments == pytest.approx(4 * adapters, abs=64)  # adapters, gradients and two moments
    assert programs["lora"]["ref log probs"].resident == pytest.approx(2 * adapters, abs=64)  # the moments only
    for name in trained:
        assert programs["lora"][name].peak < programs["full"][name].peak, name


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_a_peft_export_gives_transformers_the_adapted_logits(tmp_path, family):
    """hfjax's adapted model (random B on all seven projections) against peft loading the exported adapter directory
    onto the transformers base (float32, a left-padded batch): the same logits; and the merged export, loaded by
    transformers alone, the same again."""
    hf_model, path = save_hf_model(tmp_path, family)
    model = add_lora(load_hf(path), LoraConfig(rank=RANK, alpha=ALPHA), seed=1)
    rng = np.random.default_rng(2)
    for _, b in nnx.to_flat_state(nnx.state(model, LoraParam)):
        if b.shape[-1] == RANK:  # the B matrices
            b[...] = jnp.asarray(rng.normal(0, 0.05, b.shape), jnp.float32)
    ids, mask, positions = left_padded_batch(hf_model.config.vocab_size, [7, 4, 6])
    vocab = hf_model.config.vocab_size
    ours = np.asarray(compiled_forward(model, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(positions)))[..., :vocab]
    save_peft(model, LoraConfig(rank=RANK, alpha=ALPHA), tmp_path / "adapters", str(path))
    peft_model = peft.PeftModel.from_pretrained(hf_model, tmp_path / "adapters").eval()
    torch_inputs = {"input_ids": torch.as_tensor(ids), "attention_mask": torch.as_tensor(mask)}
    torch_inputs["position_ids"] = torch.as_tensor(positions)
    with torch.no_grad():
        theirs = peft_model(**torch_inputs).logits.numpy()
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], theirs[real], rtol=1e-5, atol=1e-5 * np.abs(theirs).max())
    save_hf(merge_lora(model), tmp_path / "merged")
    merged = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        merged_logits = merged(**torch_inputs).logits.numpy()
    np.testing.assert_allclose(merged_logits[real], theirs[real], rtol=1e-5, atol=1e-5 * np.abs(theirs).max())


def test_the_adapter_count_of_a_config_is_the_built_models():
    """`lora_parameter_count` (what the cost model reads) against the adapters `add_lora` builds, abstractly, for
    Llama-3.1-8B at rank 16 on every projection (41,943,040) and for Gemma 3 1B on q and v only."""
    for name, lora in (
        ("llama-3.1-8b", LoraConfig(rank=16)),
        ("gemma-3-1b", LoraConfig(8, targets=["q_proj", "v_proj"])),
    ):
        shape = named_config(name)
        model = add_lora(abstract_model(shape, "causal_lm", "bfloat16"), lora)
        built = sum(x.size for x in jax.tree.leaves(nnx.state(model, LoraParam)))
        assert lora_parameter_count(shape, lora) == built, name
    assert lora_parameter_count(named_config("llama-3.1-8b"), LoraConfig(rank=16)) == 41_943_040


def test_the_cost_model_counts_lora_memory():
    """The shipped Llama-3.1-8B LoRA config on a v5e-8 against the same config fully fine-tuned (float32 master):
    the actor keeps its base in bfloat16 plus float32 adapters, optimizer state and gradients scale with the adapters'
    share of the parameters, and the reference keeps nothing of its own. Kept in the generation layout (the
    default), the base's generation shard is resident and generation adds nothing; in the training layout
    (`rollout.lora_base_layout=train`) generation adds the difference."""
    path = "configs/gsm8k/llama-3.1-8b-grpo-lora-tpu-v5e-8.yaml"
    lora_cfg = load_rl_config(path, ["rollout.lora_base_layout=train"])
    full_cfg = load_rl_config(path, ["actor.lora.rank=0"])
    lora, full, in_gen = (predict_memory(cfg, 1e15).roles for cfg in (lora_cfg, full_cfg, load_rl_config(path)))
    share = 41_943_040 / named_config("llama-3.1-8b").num_params
    base = full["actor"].memory["params"] / 2  # float32 master -> bfloat16 base
    assert lora["actor"].memory["params"] == pytest.approx(base + base * 2 * share)
    assert lora["actor"].memory["optimizer"] == pytest.approx(full["actor"].memory["optimizer"] * share)
    assert lora["actor"].memory["grads"] == pytest.approx(full["actor"].memory["grads"] * share)
    assert lora["ref"].memory["params"] == 0 and full["ref"].memory["params"] == pytest.approx(base)
    moved = lora["actor"].memory["gen_extra_params"]
    # fsdp 8 -> tensor 4: the generation shard is about twice the training one (small weights shard differently)
    assert moved == pytest.approx(base, rel=1e-3)
    assert in_gen["actor"].memory["params"] == pytest.approx(lora["actor"].memory["params"] + moved)
    assert in_gen["actor"].memory["gen_extra_params"] == 0


def test_the_cost_model_counts_a_lora_critics_memory():
    """A PPO config's critic with rank-16 adapters against the same critic fully trained: the base in the compute
    dtype plus float32 adapters, optimizer state and gradients scaled by the adapters' share."""
    path = "configs/gsm8k/llama-3.1-8b-ppo-8gpu.yaml"
    full = predict_memory(load_rl_config(path), 1e15).roles["critic"].memory
    adapted = predict_memory(load_rl_config(path, ["critic.lora.rank=16"]), 1e15).roles["critic"].memory
    shape = dataclasses.replace(named_config("llama-3.1-8b"), num_labels=1)
    share = lora_parameter_count(shape, LoraConfig(rank=16)) / model_shape(shape, "token_cls").params
    base = full["params"] / 2  # float32 master -> bfloat16 base
    assert adapted["params"] == pytest.approx(base + base * 2 * share)
    assert adapted["optimizer"] == pytest.approx(full["optimizer"] * share)
    assert adapted["grads"] == pytest.approx(full["grads"] * share)


def test_a_lora_critic_trains_its_adapters_and_value_head(tmp_path):
    """A bfloat16 critic with LoRA: the base stays in bfloat16 and unchanged, the value head is float32 and trains
    beside the adapters, and checkpoints hold those two."""
    inputs = build_run_inputs(tmp_path)
    critic = {"lora": {"rank": 4}, "dtype": "bfloat16"}
    cfg = load_rl_config(rl_config(inputs, tmp_path / "run", "ppo", critic=critic))
    worker = CriticWorker(cfg.critic, total_steps=3)
    worker.init_model()
    before = {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(worker.state.params)}
    head = {path for path in before if path[0] in ("score", "score_bias")}
    adapters = {path for path in before if str(path[-2:][0]).endswith("_lora")}
    assert head and all(before[p].dtype == np.float32 for p in head | adapters)
    assert all(before[p].dtype == jnp.bfloat16 for p in before.keys() - head - adapters)
    assert {path for path, _ in nnx.to_flat_state(worker.state.items()["params"])} == head | adapters
    rng = np.random.default_rng(0)
    batch = {**_sequences(rng), "values": np.zeros((4, 6), np.float32)}
    returns = rng.normal(size=(4, 6)).astype(np.float32)
    worker.update_critic(DataProto.from_dict({**batch, "returns": returns}))
    after = {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(worker.state.params)}
    changed = {path for path in before if not np.array_equal(before[path], after[path])}
    assert changed == head | {p for p in adapters if p[-1] == "b"}  # (A moves from the second step: B starts at 0)
    # with adapter dropout the same update moves B elsewhere (its gradient sees the dropped inputs)
    critic["lora"] = {"rank": 4, "dropout": 0.5}
    dropping = CriticWorker(load_rl_config(rl_config(inputs, tmp_path / "run2", "ppo", critic=critic)).critic)
    dropping.init_model()
    for path, value in nnx.to_flat_state(dropping.state.params):  # the same start: only the dropout differs
        np.testing.assert_array_equal(np.asarray(value[...]), before[path], err_msg=str(path))
    dropping.update_critic(DataProto.from_dict({**batch, "returns": returns}))
    moved = {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(dropping.state.params)}
    for path in adapters:
        if path[-1] == "b":
            assert np.abs(moved[path] - after[path]).max() > 1e-6, path


def test_a_weight_sync_of_a_lora_policy_sends_the_adapters_alone(tmp_path):
    """Disaggregated placement: after an update, the trainer's blocks for the rollout are its float32 adapters only
    (their bytes exactly), and the rollout, which loaded the frozen base itself, then holds the trainer's weights."""
    inputs = build_run_inputs(tmp_path)
    cfg = load_rl_config(rl_config(inputs, tmp_path / "run", "grpo", actor={"lora": {"rank": 4}}))
    actor = ActorRolloutRefWorker(cfg.actor, cfg.rollout, "actor", total_steps=3, max_prompt_length=16)
    actor.init_model()
    rng = np.random.default_rng(0)
    batch = {**_sequences(rng), "ref_log_prob": np.zeros((4, 6), np.float32)}
    actor.update_actor(DataProto.from_dict({**batch, "advantages": rng.normal(size=(4, 6)).astype(np.float32)}))
    rollout = RolloutWorker(cfg.actor, cfg.rollout, max_prompt_length=16)
    rollout.init_model()
    part = actor.weights_for_rollout()
    adapters = nnx.split_state(actor.params, LoraParam, ...)[0]
    assert part.nbytes == sum(x.nbytes for x in jax.tree.leaves(adapters))
    assert part.nbytes < sum(x.nbytes for x in jax.tree.leaves(actor.params)) / 4
    rollout.commit_weights(1, rollout.stage_weights(1, part))
    held = rollout.rollout_params()
    trainer = {path: np.asarray(leaf) for path, leaf in param_paths(actor.params)}
    assert held.keys() == trainer.keys()
    for path in trainer:
        np.testing.assert_array_equal(held[path], trainer[path], err_msg=path)


def _base_pointers(worker: ActorRolloutRefWorker) -> list[list[int]]:
    base = nnx.split_state(worker.params, LoraParam, ...)[1]
    return [[s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards] for leaf in jax.tree.leaves(base)]


def test_a_lora_base_kept_in_the_generation_layout_never_moves(tmp_path):
    """`rollout.lora_base_layout: gen`, training fsdp over 8 devices and generating data 4 x tensor 2: the base is
    loaded into the generation layout and keeps its buffers through a generation and an update; a transition
    moves the adapters alone (with `train` it gathers the base too); generation and the update compute what they
    compute with the base in the training layout, but for float32 rounding (the matmuls sum in another order)."""
    inputs = build_run_inputs(tmp_path)
    rollout = {"gen_layout": {"mesh": {"data": 4, "tensor": 2}, "rules": "dp_tp_gen"}}
    prompts = _sequences(np.random.default_rng(1))
    prompts = {"input_ids": prompts["input_ids"][:, :6], "attention_mask": prompts["attention_mask"][:, :6]}
    data = DataProto.from_dict(_sequences(np.random.default_rng(0)))
    data.batch["advantages"] = np.random.default_rng(2).normal(size=(4, 6)).astype(np.float32)
    data.batch["ref_log_prob"] = np.full((4, 6), -2.5, np.float32)  # (the config's KL loss)
    out = {}
    for base_layout in ("gen", "train"):
        config = rl_config(
            inputs, tmp_path / base_layout, "grpo", actor={"lora": {"rank": 4}},
            rollout={**rollout, "lora_base_layout": base_layout},
        )  # fmt: skip
        cfg = load_rl_config(config)
        worker = ActorRolloutRefWorker(cfg.actor, cfg.rollout, "actor_rollout", total_steps=3, max_prompt_length=16)
        worker.init_model()
        base = nnx.split_state(worker.params, LoraParam, ...)[1]
        gen_shardings = worker.hybrid.gen_layout.shardings(base)
        in_gen = [x.sharding == s for x, s in zip(jax.tree.leaves(base), jax.tree.leaves(gen_shardings), strict=True)]
        assert all(in_gen) == (base_layout == "gen") and any(in_gen) == (base_layout == "gen")
        pointers = _base_pointers(worker)
        on_device0 = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(base))
        rolled = worker.generate_sequences(DataProto.from_dict(prompts, meta_info={"n": 1, "do_sample": False}))
        stats = worker.hybrid.stats()
        metrics = worker.update_actor(data).meta_info["metrics"]
        assert (_base_pointers(worker) == pointers) == (base_layout == "gen")
        out[base_layout] = rolled, stats, metrics, worker.compute_log_prob(data).batch["old_log_probs"], on_device0
    (rolled, stats, metrics, after, base_gen_bytes), (rolled_t, stats_t, metrics_t, after_t, base_train_bytes) = (
        out["gen"],
        out["train"],
    )
    adapters = jax.tree.leaves(nnx.state(worker.params, LoraParam))
    assert 0 < stats["received_bytes_per_device"] <= sum(a.nbytes for a in adapters)
    assert stats["stationary_bytes_per_device"] == base_gen_bytes and stats_t["stationary_bytes_per_device"] == 0
    assert stats_t["received_bytes_per_device"] >= base_gen_bytes - base_train_bytes > 0
    np.testing.assert_array_equal(rolled.batch["responses"], rolled_t.batch["responses"])
    np.testing.assert_allclose(rolled.batch["rollout_log_probs"], rolled_t.batch["rollout_log_probs"], rtol=1e-6)
    for key in ("actor/pg_loss", "actor/grad_norm"):
        np.testing.assert_allclose(metrics[key], metrics_t[key], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(after, after_t, rtol=1e-5)


def test_a_base_kept_in_the_generation_layout_needs_each_replica_on_one_host_in_training_order(tmp_path):
    """2 hosts x 4 devices, generation `tensor=4, data=2` (data innermost): in the training device order each
    replica spans both hosts. The engine could reorder a moving base, not a kept one, so the config check refuses
    `rollout.lora_base_layout: gen` there (before any device exists) and takes `train`, or `data` first."""
    inputs = build_run_inputs(tmp_path)
    trainer = {"hosts": 2, "devices_per_host": 4, "backend": "ray"}

    def config(gen_mesh: dict, base_layout: str) -> RLConfig:
        rollout = {"gen_layout": {"mesh": gen_mesh, "rules": "dp_tp_gen"}, "lora_base_layout": base_layout}
        lora = {"lora": {"rank": 4}, "ppo_mini_batch_size": 4, "micro_batch_size": 2}
        return load_rl_config(rl_config(inputs, tmp_path / "run", "grpo", actor=lora, rollout=rollout, trainer=trainer))

    with pytest.raises(ValueError, match=r"rollout\.lora_base_layout: generation layout .* spreads a data-parallel"):
        config({"tensor": 4, "data": 2}, "gen")
    assert config({"tensor": 4, "data": 2}, "train").keeps_lora_base_in_gen is False
    assert config({"data": 2, "tensor": 4}, "gen").keeps_lora_base_in_gen is True
