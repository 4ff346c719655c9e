"""Mixed precision and generation memory: float32 master weights keep a 1e-6 AdamW step that bfloat16 storage
loses, the optimizer state is float32 either way, the HybridEngine moves a bfloat16 copy (half the bytes) and
keeps the master, and no KV-cache buffer outlives `generate_sequences`."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.checkpoints import save_hf_model
from support.rl_setup import build_run_inputs, rl_config

from hfjax.config.rl import load_rl_config
from hfjax.controller import LocalWorkerGroup
from hfjax.data import BatchLoader, PromptDataset
from hfjax.models import load_hf, load_tokenizer
from hfjax.optim import TrainState
from hfjax.optim.optimizer import OptimConfig, make_optimizer
from hfjax.parallel import HybridEngine, Layout
from hfjax.protocol import DataProto
from hfjax.workers.actor import ActorRolloutRefWorker

WIDE = dict(vocab_size=128, num_attention_heads=8, num_key_value_heads=8, hidden_size=64, intermediate_size=96)
FSDP8 = {"mesh": {"fsdp": 8}, "rules": "fsdp"}
GEN = {"mesh": {"data": 4, "tensor": 2}, "rules": "dp_tp_gen"}
LR = 1e-6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_hf_model(tmp_path_factory.mktemp("precision"), "llama", **WIDE)[1]


def _next_token_loss(model, batch):
    logits = model(batch["ids"][:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    loss = -jnp.mean(jnp.take_along_axis(logp, batch["ids"][:, 1:, None], axis=-1))
    return loss, {}


def _host(tree):
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("param_dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])
def test_small_update_moves_float32_master_weights_and_not_bfloat16_ones(checkpoint, param_dtype):
    """One AdamW step at lr 1e-6 of a bfloat16-compute model. Adam's first step is -lr * g / (|g| + eps) by hand
    (bias-corrected moments are g and g^2): with float32 master weights every weight whose gradient is well above
    eps moves by that step; stored in bfloat16 (a unit in the last place of a weight of 0.05 is 2.4e-4) almost none
    move. The optimizer state is float32 in both."""
    layout = Layout.from_config(FSDP8)
    model = load_hf(checkpoint, dtype="bfloat16", param_dtype=param_dtype, layout=layout)
    ids = np.random.default_rng(0).integers(0, WIDE["vocab_size"], (8, 12)).astype(np.int32)
    # compiled as one program (an eager gradient compiles each operation over the 8 devices on its own)
    grads = nnx.jit(nnx.grad(lambda m, ids: _next_token_loss(m, {"ids": ids})[0]))(model, jnp.asarray(ids))
    optimizer = make_optimizer(OptimConfig(lr=LR, grad_clip=0.0), None)
    state = TrainState(model, layout, optimizer, grad_clip=0.0, donate=False)
    before = _host(state.params)
    moments = [x for x in jax.tree.leaves(state.opt_state) if hasattr(x, "ndim") and x.ndim > 0]
    assert moments and {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}
    state.update(_next_token_loss, [{"ids": ids}])
    after, g = _host(state.params), _host(nnx.state(grads, nnx.Param))
    moved = np.concatenate([(a != b).ravel() for a, b in zip(after, before, strict=True)])
    if param_dtype == "float32":
        # A step is exact up to rounding the new weight to float32 (half a unit in its last place). The gradients
        # are bfloat16 arithmetic, computed here and in the update in different orders: a few small ones differ
        # (in sign, or zero in one), so 99.5% of the steps must match, not all.
        flat = lambda trees: np.concatenate([x.ravel() for x in trees])  # noqa: E731
        strong = np.abs(flat(g)) > 1e-5
        step = flat(after)[strong] - flat(before)[strong]
        expected = -LR * np.sign(flat(g)[strong])
        rounding = np.spacing(np.abs(flat(before)[strong])) / 2
        assert strong.mean() > 0.9 and moved.mean() > 0.9
        assert np.mean(np.abs(step - expected) <= 0.001 * LR + rounding) > 0.995
    else:
        assert moved.mean() < 0.02


def test_hybrid_engine_casts_the_generation_copy_and_keeps_the_master(checkpoint):
    """float32 master weights under FSDP8, bfloat16 generation copy under data 4 x tensor 2: the generation
    weights are the master rounded to bfloat16 (bitwise), half the bytes move, the master is neither changed nor
    freed, and `to_train` frees the generation copy and returns the master itself."""
    model = load_hf(checkpoint, dtype="bfloat16", param_dtype="float32", layout=FSDP8)
    params = nnx.state(model, nnx.Param)
    master = _host(params)
    engine = HybridEngine(FSDP8, GEN, params, gen_dtype="bfloat16")
    gen = engine.to_gen(params)
    for leaf, want, sharding in zip(jax.tree.leaves(gen), master, engine.gen_shardings, strict=True):
        assert leaf.dtype == jnp.bfloat16 and leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
        np.testing.assert_array_equal(np.asarray(leaf).view(np.uint16), want.astype(jnp.bfloat16).view(np.uint16))
    stats = engine.stats()
    assert stats["param_dtype"] == "float32" and stats["gen_dtype"] == "bfloat16"
    assert stats["received_bytes_per_device"] * 2 == stats["uncast_received_bytes_per_device"] > 0
    assert stats["master_bytes_per_device"] == stats["train_bytes_per_device"]
    assert stats["peak_param_bytes_per_device"] == stats["gen_bytes_per_device"] + stats["train_bytes_per_device"]
    back = engine.to_train(gen)
    assert all(a is b for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True))
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(gen))
    for got, want in zip(_host(back), master, strict=True):
        np.testing.assert_array_equal(got, want)


def test_no_kv_cache_outlives_generation(tmp_path):
    """`generate_sequences` allocates its KV cache when it starts and frees it before it returns: afterwards no live
    array has a cache block's shape, while the engine's decode state (the positive control) is made of them."""
    inputs = build_run_inputs(tmp_path)
    cfg = load_rl_config(rl_config(inputs, tmp_path / "run", "grpo", actor={"dtype": "bfloat16"}))
    group = LocalWorkerGroup(ActorRolloutRefWorker, cfg.actor, cfg.rollout, "actor_rollout", max_prompt_length=16)
    (info,) = group.init_model()
    worker = group.worker
    engine = worker.engine
    cache = engine.cache  # each slot's own blocks and the shared prompt pool
    cache_shapes = {cache.key_shape, cache.value_shape, cache.pool_key_shape, cache.pool_value_shape}
    probe = engine.init_decode_state()
    blocks = [x for x in jax.tree.leaves(probe) if x.shape in cache_shapes]
    assert len(blocks) == 2 * (engine.blocks + 1) * engine.config.num_layers
    assert sum(x.nbytes for x in blocks) // 8 == engine.kv_cache_bytes_per_device()  # slots, pool over 8 devices
    del probe, blocks
    data = PromptDataset(cfg.data.train_files, load_tokenizer(inputs["policy"]), max_prompt_length=16)
    batch = next(iter(BatchLoader(data, 4, shuffle=False)))
    out = group.generate_sequences(DataProto.from_dict(batch.tensors, meta_info={"n": 2, "seed": 1}))
    assert out.meta_info["metrics"]["gen_kv_cache_bytes"] == engine.kv_cache_bytes_per_device() > 0
    assert info["gen_memory"]["kv_cache_bytes_per_device"] == engine.kv_cache_bytes_per_device()
    gc.collect()
    assert not [x.shape for x in jax.live_arrays() if x.shape in cache_shapes]
    # bfloat16 compute: the generation copy is bfloat16, the master float32
    assert {x.dtype for x in jax.tree.leaves(worker.params)} == {jnp.dtype(jnp.float32)}
    assert worker.hybrid.stats()["gen_dtype"] == "bfloat16"
    assert isinstance(worker.state.optimizer, optax.GradientTransformation)


def test_offload_keeps_the_master_in_host_memory_while_generating(checkpoint, monkeypatch):
    """With `offload_optimizer` and a cast generation copy, the master goes to pinned host memory chunk by chunk
    during `to_gen` and comes back bitwise at `to_train`. XLA:CPU has that memory space although it is the same RAM,
    so the engine is made to use it here."""
    import hfjax.parallel.hybrid_engine as hybrid_engine

    monkeypatch.setattr(hybrid_engine, "has_separate_host_memory", lambda layout: True)
    model = load_hf(checkpoint, dtype="bfloat16", param_dtype="float32", layout=FSDP8)
    params = nnx.state(model, nnx.Param)
    master = _host(params)
    engine = HybridEngine(FSDP8, GEN, params, gen_dtype="bfloat16", offload_optimizer=True, chunk_bytes=2**14)
    assert len(engine._chunks(list(range(len(master))))) > 1  # the master moves out in several chunks
    gen = engine.to_gen(params)
    hosted = jax.tree.leaves(engine._kept_train)
    assert {x.sharding.memory_kind for x in hosted} == {"pinned_host"}
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(params))  # no device copy of the master is left
    for leaf, want in zip(jax.tree.leaves(gen), master, strict=True):
        np.testing.assert_array_equal(np.asarray(leaf).view(np.uint16), want.astype(jnp.bfloat16).view(np.uint16))
    stats = engine.stats()
    assert stats["master_offloaded"] and stats["peak_param_bytes_per_device"] == stats["gen_bytes_per_device"]
    back = engine.to_train(gen)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(back)} == {"device"}
    for got, want in zip(_host(back), master, strict=True):
        np.testing.assert_array_equal(got, want)
