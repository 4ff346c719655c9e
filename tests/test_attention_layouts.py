"""Attention under layouts and in whole models: under a multi-device layout (the 8 fake CPU devices) the Pallas
kernels run per shard in a shard_map, checked against the reference for the kernels (and their TPU lowering), for
greedy generation over a generation layout, and for a training step and a model role's forward over a training
layout, each with the kernels seen inside the shard_map at their per-shard shapes; a tiny model's logits and greedy
generation under each implementation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend.core import ClosedJaxpr, Jaxpr
from jax.sharding import PartitionSpec as P
from support.attention_cases import (
    BF16,
    F32,
    assert_close,
    cache_blocks,
    left_padded,
    output_and_grads,
    qkv_inputs,
)
from support.tiny_models import TINY, random_model

from hfjax.algos import logprobs_from_logits
from hfjax.models import attention_pallas, save_hf
from hfjax.models.attention import attention_mask, causal_attention, dot_product_attention, resolve_implementation
from hfjax.models.decode_attention import attend_blocks, decode_attention, decode_mask
from hfjax.models.program import program_layout
from hfjax.optim import OptimConfig, TrainState, make_optimizer
from hfjax.parallel import Layout
from hfjax.parallel.layout import RULE_PRESETS
from hfjax.rollout import JaxEngine, OfflineGenerator, SamplingParams
from hfjax.workers.model_role import LoadedModel

# ----------------------------------------------------------------------------------------------- under a layout
DATA2_TENSOR2 = Layout.from_config({"mesh": {"data": 2, "tensor": 2}, "rules": "dp_tp_gen", "devices": [0, 1, 2, 3]})
FSDP4 = Layout.from_config({"mesh": {"fsdp": 4}, "rules": "fsdp", "devices": [0, 1, 2, 3]})
DATA4_TENSOR2 = Layout.from_config({"mesh": {"data": 4, "tensor": 2}, "rules": "dp_tp_gen"})
FSDP4_TENSOR2 = Layout.from_config({"mesh": {"fsdp": 4, "tensor": 2}, "rules": "fsdp_tp"})
# built directly: `Layout.from_config` refuses a mesh axis that no rule uses
TENSOR2_FSDP_UNUSED = Layout(
    axes=(("data", 1), ("fsdp", 2), ("expert", 1), ("sequence", 1), ("tensor", 2)),
    rules=RULE_PRESETS["tp"],
    device_ids=(0, 1, 2, 3),
)


def _in_layout(layout: Layout | None, fn):
    """`fn` with its attention traced under `layout`, as the engine and the training programs trace theirs."""

    def traced(*args):
        with program_layout(layout):
            return fn(*args)

    return traced


def _kernel_sites(jaxpr: Jaxpr, specs=None) -> list:
    """For every pallas_call in `jaxpr` and the jaxprs nested in it: the in_specs of the shard_map around it (None
    when it is outside any)."""
    sites = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            sites.append(specs)
        inner = eqn.params["in_specs"] if eqn.primitive.name == "shard_map" else specs
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (Jaxpr, ClosedJaxpr)):
                    sites += _kernel_sites(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub, inner)
    return sites


def _assert_per_shard(jaxpr: ClosedJaxpr, query_spec: P, kernels: int) -> None:
    """At least `kernels` Pallas kernels, each inside a shard_map that splits the queries by `query_spec`."""
    sites = _kernel_sites(jaxpr.jaxpr)
    assert len(sites) >= kernels
    assert all(site is not None and query_spec in site for site in sites)


@pytest.mark.parametrize(
    ("layout", "query_spec"),
    [
        (DATA2_TENSOR2, P("data", None, "tensor", None)),
        (FSDP4, P("fsdp", None, None, None)),
        (TENSOR2_FSDP_UNUSED, P(None, None, "tensor", None)),  # every operand replicated over fsdp
    ],
    ids=["data2-tensor2", "fsdp4", "tensor2-fsdp2-unused"],
)
@pytest.mark.parametrize("window", [None, 5])
def test_causal_kernel_per_shard_matches_reference(layout, query_spec, window):
    """Rows over the batch axes and heads over the tensor axis: each shard's splash kernels (forward and backward)
    give the reference's outputs and gradients (also where a mesh axis splits nothing: the shards' equal gradients
    must not add up)."""
    t = 12
    q, k, v = qkv_inputs(10, 4, t, 4, 2, 8, jnp.float32)
    valid = left_padded(t, [t, 9, 1, 0])
    mask = attention_mask(valid, jnp.arange(t), jnp.arange(t), window)

    def attend(q, k, v):
        return causal_attention(q, k, v, mask=mask, window=window, implementation="pallas_interpret")

    fn = _in_layout(layout, attend)
    out, grads = output_and_grads(fn, q, k, v, valid)
    want, want_grads = output_and_grads(lambda q, k, v: dot_product_attention(q, k, v, mask), q, k, v, valid)
    real = np.asarray(valid)
    assert_close(out, want, real, jnp.float32)
    for got, expected in zip(grads, want_grads, strict=True):
        assert_close(got, expected, np.ones(real.shape, bool), jnp.float32)
    total = jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))
    _assert_per_shard(jax.make_jaxpr(total)(q, k, v), query_spec, kernels=3)  # forward; backward dq and dkv


@pytest.mark.parametrize(("heads", "dtype", "window"), [(4, jnp.float32, None), (4, BF16, 6), (16, jnp.float32, 6)])
def test_decode_kernel_per_shard_matches_attend_blocks(heads, dtype, window):
    """Slots over data (4) and kv heads with their query heads over tensor (2), in both query layouts."""
    block, blocks, d, slots = 16, 3, 16, 8
    keys, values = cache_blocks(11, slots, 2, d, block, blocks, dtype)
    q = jnp.asarray(np.random.default_rng(12).standard_normal((slots, 1, heads, d)), dtype)
    lengths = jnp.asarray([0, 5, 16, 33, 47, 20, 9, 31], jnp.int32)

    def attend(q):
        return decode_attention(q, keys, values, lengths, window, implementation="pallas_interpret")

    fn = _in_layout(DATA4_TENSOR2, attend)
    got = jax.jit(fn)(q)
    want = attend_blocks(q, keys, values, decode_mask(lengths, block * blocks, window))
    assert_close(got, want, np.ones(got.shape[:3], bool), dtype)  # every slot sees a position
    _assert_per_shard(jax.make_jaxpr(fn)(q), P("data", None, "tensor", None), kernels=1)


HEADS_ALONE = Layout.from_config(
    {"mesh": {"fsdp": 2, "tensor": 2}, "rules": [["batch", "fsdp"], ["heads", "tensor"]], "devices": [0, 1, 2, 3]}
)


@pytest.mark.parametrize(
    "layout",
    [FSDP4_TENSOR2, HEADS_ALONE],  # 6 rows do not divide by fsdp 4; query heads split, kv heads not
    ids=["indivisible", "heads-split-without-kv-heads"],
)
def test_kernels_run_xla_where_the_layout_cannot_split_them(layout):
    t, block = 8, 16
    q, k, v = qkv_inputs(13, 6, t, 4, 2, 8, jnp.float32)
    mask = attention_mask(left_padded(t, [8, 5, 1, 8, 2, 7]), jnp.arange(t), jnp.arange(t), None)
    keys, values = cache_blocks(14, 6, 2, 8, block, 2, jnp.float32)
    lengths = jnp.asarray([3, 0, 17, 31, 8, 16], jnp.int32)
    step = q[:, :1]

    def causal(q):
        return causal_attention(q, k, v, mask=mask, implementation="pallas_interpret")

    def decode(q):
        return decode_attention(q, keys, values, lengths, implementation="pallas_interpret")

    cases = [
        (causal, q, dot_product_attention(q, k, v, mask)),
        (decode, step, attend_blocks(step, keys, values, decode_mask(lengths, 2 * block, None))),
    ]
    for attend, x, want in cases:
        fn = _in_layout(layout, attend)
        assert not _kernel_sites(jax.make_jaxpr(fn)(x).jaxpr)  # no kernel: the xla implementation
        np.testing.assert_allclose(np.asarray(jax.jit(fn)(x)), np.asarray(want), **F32)


def test_auto_runs_pallas_per_shard_on_a_tpu_only_inside_a_layout(monkeypatch):
    """On CPU a layout changes nothing (the same xla program); on (mocked) TPU devices, 8 of them, auto runs the
    kernel in a shard_map inside a layout and xla outside one. Inside a layout the layout's devices decide (a program
    compiled for a target chooses for the target), outside one the default backend."""
    monkeypatch.delenv("HFJAX_ATTENTION", raising=False)
    q, k, v = qkv_inputs(15, 4, 12, 4, 2, 8, jnp.float32)
    valid = left_padded(12, [12, 9, 1, 0])

    def attend(q, k, v):
        return causal_attention(q, k, v, valid=valid)

    plain = str(jax.make_jaxpr(attend)(q, k, v))
    assert str(jax.make_jaxpr(_in_layout(DATA4_TENSOR2, attend))(q, k, v)) == plain
    assert "shard_map" not in plain and "pallas_call" not in plain
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert jax.device_count() == 8 and resolve_implementation() == "xla"  # no known layout: XLA must partition it
    with program_layout(DATA4_TENSOR2):
        assert resolve_implementation() == "xla"  # the layout's devices are CPUs, whatever the default backend says
    monkeypatch.setattr(Layout, "platform", property(lambda self: "tpu"))
    with program_layout(DATA4_TENSOR2):
        assert resolve_implementation() == "pallas_tpu"
        with program_layout(None):
            assert resolve_implementation() == "xla"
    tpu = jax.make_jaxpr(_in_layout(DATA4_TENSOR2, attend))(q, k, v)  # traced, not run: no TPU here
    _assert_per_shard(tpu, P("data", None, "tensor", None), kernels=1)


def test_pallas_kernels_lower_for_tpu_per_shard():
    """The kernels in their shard_map over an 8-device mesh (data 4 x tensor 2) lower for an 8-chip TPU program, each
    shard's Mosaic kernel inside a manual computation with rows over data and heads over tensor."""
    layout = DATA4_TENSOR2

    def loss(q, k, v, valid):
        with program_layout(layout):
            out = causal_attention(q, k, v, valid=valid, window=100, implementation="pallas_tpu")
        return out.astype(jnp.float32).sum()

    def decode(q, keys, values, lengths):
        with program_layout(layout):
            return decode_attention(q, keys, values, lengths, 64, implementation="pallas_tpu")

    q, kv = jax.ShapeDtypeStruct((8, 200, 8, 128), BF16), jax.ShapeDtypeStruct((8, 200, 2, 128), BF16)
    blocks = [jax.ShapeDtypeStruct((8, 2, 128, 128), BF16)] * 2
    for fn, args in (
        (jax.grad(loss, argnums=(0, 1, 2)), (q, kv, kv, jax.ShapeDtypeStruct((8, 200), jnp.bool_))),
        (decode, (jax.ShapeDtypeStruct((8, 1, 8, 128), BF16), blocks, blocks, jax.ShapeDtypeStruct((8,), jnp.int32))),
    ):
        exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
        text = exported.mlir_module()
        assert exported.nr_devices == 8
        assert "sdy.manual_computation" in text and "tpu_custom_call" in text
        assert '[{"data"}, {}, {"tensor"}, {}]' in text  # the queries' split, in the manual computation's shardings


# ------------------------------------------------------------------------------------------------- whole model
TWO_LAYERS = dataclasses.replace(TINY, num_layers=2, sliding_windows=(None, 3))


def _record_kernel_calls(monkeypatch) -> dict[str, list[tuple[int, ...]]]:
    """The query shape of every trace of each Pallas kernel (inside a shard_map: the shard's shape)."""
    calls = {"splash_causal_attention": [], "decode_attention": []}
    for name in calls:
        original = getattr(attention_pallas, name)

        def recorded(q, *args, _name=name, _original=original, **kwargs):
            calls[_name].append(q.shape)
            return _original(q, *args, **kwargs)

        monkeypatch.setattr(attention_pallas, name, recorded)
    return calls


def test_model_logits_under_each_implementation(monkeypatch):
    model = random_model(TWO_LAYERS, seed=1)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(6)
    mask = np.asarray(left_padded(10, [10, 7, 2]), np.int32)
    ids = np.where(mask, rng.integers(1, TINY.vocab_size, mask.shape), 0).astype(np.int32)
    calls = _record_kernel_calls(monkeypatch)
    logits = {}
    for name in ("xla", "pallas_interpret", "cudnn"):
        monkeypatch.setenv("HFJAX_ATTENTION", name)
        forward = jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state)(ids, mask))  # traced under `name`
        logits[name] = np.asarray(forward(state, ids, mask))
        assert np.isfinite(logits[name]).all()
    assert len(calls["splash_causal_attention"]) == TWO_LAYERS.num_layers  # the pallas forward ran it per layer
    real = mask.astype(bool)
    np.testing.assert_allclose(logits["pallas_interpret"][real], logits["xla"][real], **F32)
    assert np.array_equal(logits["cudnn"], logits["xla"])  # a float32 model is not for cuDNN: xla, bit for bit


def test_greedy_generation_under_pallas_equals_xla(monkeypatch):
    model = random_model(TWO_LAYERS, seed=2)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, TINY.vocab_size, n).tolist() for n in (5, 11, 3, 16, 9)]
    sampling = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=())
    calls = _record_kernel_calls(monkeypatch)
    tokens = {}
    for name in ("xla", "pallas_interpret"):
        monkeypatch.setenv("HFJAX_ATTENTION", name)
        engine = JaxEngine(model, max_concurrent_decodes=4, max_prefill_length=16, max_new_tokens=10)
        outs = OfflineGenerator(engine, params, progress=False).generate(prompts, sampling)
        tokens[name] = [o.tokens.tolist() for o in outs]
        assert all(np.isfinite(o.logprobs).all() for o in outs)
    assert calls["splash_causal_attention"] and calls["decode_attention"]
    assert all(len(t) == 10 for t in tokens["xla"])
    assert tokens["pallas_interpret"] == tokens["xla"]


def test_greedy_generation_per_shard_equals_xla(monkeypatch):
    """An engine over 8 devices (slots over data 4, heads over tensor 2): the prefill and decode kernels run per shard
    and generate the xla tokens."""
    layout = DATA4_TENSOR2
    model = random_model(TWO_LAYERS, seed=3)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    params = jax.device_put(params, layout.shardings(params))
    rng = np.random.default_rng(8)
    prompts = [rng.integers(1, TINY.vocab_size, n).tolist() for n in (5, 11, 3, 16, 9, 14, 7, 12)]  # 8 rows of 16
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=())
    calls = _record_kernel_calls(monkeypatch)
    tokens = {}
    for name in ("xla", "pallas_interpret"):
        monkeypatch.setenv("HFJAX_ATTENTION", name)
        engine = JaxEngine(model, layout, max_concurrent_decodes=8, max_prefill_length=16, max_new_tokens=8)
        outs = OfflineGenerator(engine, params, progress=False).generate(prompts, sampling)
        tokens[name] = [o.tokens.tolist() for o in outs]
        assert all(np.isfinite(o.logprobs).all() for o in outs)
    heads, d = TINY.num_heads // 2, TINY.head_dim  # per shard: a quarter of the rows, half the heads
    assert calls["splash_causal_attention"] and set(calls["splash_causal_attention"]) == {(2, 16, heads, d)}
    assert calls["decode_attention"] and set(calls["decode_attention"]) == {(2, 1, heads, d)}
    assert all(len(t) == 8 for t in tokens["xla"])
    assert tokens["pallas_interpret"] == tokens["xla"]


def _token_nll(model, batch, *, attention: str):
    """Mean NLL of each real token after a real token (a padding position's output is unspecified, so it predicts
    nothing); `attention` names the implementation the program is traced under (it keys the shared compiled program,
    and the trace checks it)."""
    assert resolve_implementation() == attention
    logits = model(batch["input_ids"], batch["attention_mask"])
    logp = logprobs_from_logits(logits[:, :-1], batch["input_ids"][:, 1:])
    mask = batch["attention_mask"][:, :-1] * batch["attention_mask"][:, 1:]
    return -(logp * mask).sum() / mask.sum(), {}


def _padded_batch(seed: int, width: int, lengths: list[int]) -> dict[str, np.ndarray]:
    """Random token ids with a left-padded attention mask of `width` columns and the given real lengths."""
    mask = np.asarray(left_padded(width, lengths), np.int32)
    ids = np.random.default_rng(seed).integers(1, TINY.vocab_size, mask.shape).astype(np.int32)
    return {"input_ids": ids, "attention_mask": mask}


def test_training_step_per_shard_equals_xla(monkeypatch):
    """A TrainState update over 8 devices (rows over fsdp 4, heads over tensor 2): the splash kernels (forward and
    backward) run per shard and give the xla loss and gradient norm."""
    batch = _padded_batch(16, 12, [12, 7, 3, 12, 10, 1, 5, 9])
    calls = _record_kernel_calls(monkeypatch)
    metrics = {}
    for name in ("xla", "pallas_interpret"):
        monkeypatch.setenv("HFJAX_ATTENTION", name)
        optimizer = make_optimizer(OptimConfig(lr=1e-3), None)
        state = TrainState(random_model(TINY, seed=4), FSDP4_TENSOR2, optimizer, grad_clip=1.0)
        metrics[name] = state.update(_token_nll, [batch], attention=name)
    assert calls["splash_causal_attention"] == [(2, 12, TINY.num_heads // 2, TINY.head_dim)]  # one trace, per shard
    # Float32 throughout: the attention outputs and gradients agree to 1e-5 (above) and pass through one float32
    # layer, so the loss (about log 64) and the norm agree to a few float32 roundings.
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(metrics["pallas_interpret"][key], metrics["xla"][key], **F32)


def test_model_role_rows_per_shard_equal_xla(tmp_path, monkeypatch):
    """A model role's row function over 8 devices (rows over fsdp 4, heads over tensor 2): the splash kernel runs
    per shard and gives the xla logits on real tokens."""
    model = random_model(TWO_LAYERS, seed=5)
    nnx.update(model, jax.device_put(nnx.state(model)))  # numpy weights to jax arrays, as save_hf reads them
    loaded = LoadedModel(str(save_hf(model, tmp_path / "model")), FSDP4_TENSOR2, dtype="float32", head=None)
    batch = _padded_batch(17, 10, [10, 7, 3, 10, 2, 1, 5, 9])
    mask = batch["attention_mask"]
    calls = _record_kernel_calls(monkeypatch)
    logits = {}
    for name in ("xla", "pallas_interpret"):
        monkeypatch.setenv("HFJAX_ATTENTION", name)
        rows = loaded.rows_fn(lambda model, batch: model(batch["input_ids"], batch["attention_mask"]))
        logits[name] = loaded.map_rows(rows, loaded.params, batch, micro_batch_size=8)
    assert calls["splash_causal_attention"] == [(2, 10, TINY.num_heads // 2, TINY.head_dim)] * TWO_LAYERS.num_layers
    real = mask.astype(bool)
    np.testing.assert_allclose(logits["pallas_interpret"][real], logits["xla"][real], **F32)
