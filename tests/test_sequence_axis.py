"""The `sequence` mesh axis: the positions of each row split over devices in the training and log-prob passes.

On a tiny model with a sliding-window layer, left padding and packed rows, the logits, the chunked head's log
probs and entropies, and every parameter's gradient of a loss over both equal one device's (float32, relative 1e-5)
under layouts with `sequence: 2` and `4` (with fsdp and tensor beside it), and the compiled loss-and-gradient's
FLOPs per device fall with the axis size (the positions really split, nothing is computed whole)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.rl_setup import build_run_inputs, rl_config, write_varied_reward
from support.tiny_models import TINY, random_model

from hfjax.config.rl import load_rl_config
from hfjax.models.program import program_layout
from hfjax.models.transformer import positions_from_mask
from hfjax.parallel import Layout
from hfjax.trainer.launch import run_rl

CFG = dataclasses.replace(TINY, num_layers=2, sliding_windows=(None, 5))
ROWS, LENGTH = 4, 32
LAYOUTS = {
    "sequence2": {"mesh": {"sequence": 2}, "rules": "fsdp", "devices": [0, 1]},
    "fsdp2_sequence2_tensor2": {"mesh": {"fsdp": 2, "sequence": 2, "tensor": 2}, "rules": "fsdp_tp"},
    "fsdp2_sequence4": {"mesh": {"fsdp": 2, "sequence": 4}, "rules": "fsdp"},
}


def _batch() -> tuple[np.ndarray, ...]:
    """Token ids, segment ids (left padding in row 0, three packed sequences in row 1, right padding in row 3),
    labels and per-token loss weights."""
    rng = np.random.default_rng(1)
    ids = rng.integers(1, CFG.vocab_size, (ROWS, LENGTH)).astype(np.int32)
    segments = np.ones((ROWS, LENGTH), np.int32)
    segments[0, :7] = 0
    segments[1, 10:21], segments[1, 21:] = 2, 3
    segments[3, 25:] = 0
    labels = rng.integers(0, CFG.vocab_size, (ROWS, LENGTH)).astype(np.int32)
    weights = (segments > 0) * rng.uniform(0.5, 1.5, (ROWS, LENGTH))
    return ids, segments, labels, weights.astype(np.float32)


def _outputs(layout: Layout | None):
    """Logits, log probs, entropies and the gradient of a loss over both, computed under `layout` (None: one
    device), as numpy."""
    graphdef, params = nnx.split(random_model(CFG))
    ids, segments, labels, weights = (jnp.asarray(x) for x in _batch())
    if layout is not None:
        params = jax.device_put(params, layout.shardings(params))

    def run(params):
        with program_layout(layout):
            model = nnx.merge(graphdef, params)
            positions = positions_from_mask(segments)
            hidden = model.model(ids, segments, positions)
            logp, entropy = model.token_logprobs(hidden, labels, with_entropy=True, chunk_tokens=8)
            return jnp.sum(weights * logp) + 0.1 * jnp.sum(weights * entropy), (model.logits(hidden), logp, entropy)

    def logits_and_grads(params):
        (_, outs), grads = jax.value_and_grad(run, has_aux=True)(params)
        return outs, grads

    outs, grads = jax.jit(logits_and_grads)(params)
    return jax.tree.map(np.asarray, (outs, grads))


@pytest.fixture(scope="module")
def one_device():
    return _outputs(None)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_sequence_axis_matches_one_device(name, one_device):
    (logits, logp, entropy), grads = _outputs(Layout.from_config(LAYOUTS[name]))
    (want_logits, want_logp, want_entropy), want_grads = one_device
    real = _batch()[1] > 0
    np.testing.assert_allclose(logits[real], want_logits[real], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logp[real], want_logp[real], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(entropy[real], want_entropy[real], rtol=1e-5, atol=1e-6)
    for (path, got), want in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(want_grads), strict=True):
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


def _flops_per_device(layout: Layout | None, length: int) -> float:
    cfg = dataclasses.replace(CFG, hidden_size=64, intermediate_size=256, num_heads=8, num_kv_heads=4)
    graphdef, params = nnx.split(random_model(cfg))
    ids = jnp.ones((2, length), jnp.int32)
    if layout is not None:
        params = jax.device_put(params, layout.shardings(params))

    def loss(params):
        with program_layout(layout):
            model = nnx.merge(graphdef, params)
            hidden = model.model(ids, jnp.ones_like(ids))
            return jnp.sum(model.token_logprobs(hidden, ids)[0])

    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    return float(compiled.cost_analysis()["flops"])


def _sequence_layout(size: int) -> Layout:
    return Layout.from_config({"mesh": {"sequence": size}, "rules": "fsdp", "devices": list(range(size))})


def test_sequence_axis_splits_the_work():
    """The loss-and-gradient of 2 rows x 512 positions: doubling the `sequence` axis halves each device's FLOPs
    (within 10%), and 4 devices do less than half of one device's. Not a quarter: one device skips the keys past
    each query block (`dot_product_attention`'s causal blocks, 5/8 of the products at this shape), the split
    products do not, and attention is most of this tiny model's work at 512 positions."""
    one, two, four = (_flops_per_device(_sequence_layout(n) if n > 1 else None, 512) for n in (1, 2, 4))
    assert four < two / 2 * 1.1, (four, two)
    assert four < one / 2, (four, one)


@pytest.mark.slow  # two in-process runs: the model-level checks above stay in the default suite
def test_rl_steps_with_a_sequence_axis_train_as_without(tmp_path):
    """Two GRPO iterations with the actor (and its reference) over `fsdp: 4, sequence: 2` train as over `fsdp: 8`:
    the same losses, KL, entropy and gradient norms (the rollout layout has no sequence axis)."""
    inputs = build_run_inputs(tmp_path / "inputs")
    runs = {}
    for name, mesh in (("fsdp8", {"fsdp": 8}), ("sequence2", {"fsdp": 4, "sequence": 2})):
        actor = {"train_layout": {"mesh": mesh, "rules": "fsdp"}, "ppo_mini_batch_size": 8, "micro_batch_size": 4}
        config = rl_config(inputs, tmp_path / name, "grpo", actor=actor, rollout={"n": 2, "response_length": 8})
        config["trainer"]["total_steps"] = 2
        config["reward"] = {"function": write_varied_reward(tmp_path)}
        runs[name] = run_rl(load_rl_config(config))
    for got, want in zip(runs["sequence2"], runs["fsdp8"], strict=True):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


def test_a_generation_layout_with_a_sequence_axis_is_refused(tmp_path):
    inputs = build_run_inputs(tmp_path / "inputs")
    config = rl_config(inputs, tmp_path / "run", "grpo", rollout={"gen_layout": {"mesh": {"data": 4, "sequence": 2}}})
    with pytest.raises(ValueError, match=r"rollout.gen_layout: mesh axis 'sequence' \(size 2\)"):
        load_rl_config(config)


@pytest.mark.parametrize("kernel", ["splash", "cudnn_translation"])
@pytest.mark.parametrize("window", [None, 5])
def test_kernels_per_position_shard_match_the_reference(window, kernel):
    """Under `fsdp: 2, sequence: 2, tensor: 2` the splash kernels (interpret mode) run per shard with each device's
    positions against every key (one kernel per query offset), and so do the cuDNN arguments (the device's offset
    in a mask; run by jax's XLA attention, as no GPU is here): outputs and the gradients of q, k and v equal xla
    attention over whole rows on one device, with left padding and packed rows."""
    from support.attention_cases import assert_close, output_and_grads, qkv_inputs

    from hfjax.models.attention import (
        attention_mask,
        causal_attention,
        cudnn_split_positions_attention,
        dot_product_attention,
    )
    from hfjax.models.per_shard import SPLIT_CAUSAL_AXES, per_shard

    layout = Layout.from_config(LAYOUTS["fsdp2_sequence2_tensor2"])
    t = 24
    q, k, v = qkv_inputs(3, 4, t, 4, 2, 8, jnp.float32)
    valid = np.ones((4, t), np.int32)
    valid[0, :9] = 0
    valid[1, 10:17], valid[1, 17:] = 2, 3
    valid = jnp.asarray(valid)
    index = jnp.arange(t)
    mask = attention_mask(valid, index, index, window)

    def attend(q, k, v):
        with program_layout(layout):
            if kernel == "splash":
                return causal_attention(q, k, v, valid=valid, window=window, implementation="pallas_interpret")
            split = functools.partial(
                cudnn_split_positions_attention, window=window, axes=("sequence",), implementation="xla"
            )
            return per_shard(split, (q, k, v, valid, valid), SPLIT_CAUSAL_AXES, layout)

    out, grads = output_and_grads(attend, q, k, v, valid > 0)
    want, want_grads = output_and_grads(lambda q, k, v: dot_product_attention(q, k, v, mask), q, k, v, valid > 0)
    real = np.asarray(valid) > 0
    assert_close(out, want, real, jnp.float32)
    for got, expected in zip(grads, want_grads, strict=True):
        assert_close(got, expected, np.ones(real.shape, bool), jnp.float32)
    jaxpr = str(jax.make_jaxpr(attend)(q, k, v))
    assert ("pallas_call" in jaxpr) == (kernel == "splash") and "shard_map" in jaxpr


def test_the_split_kernel_is_chosen_by_implementation_dtype_and_shape():
    """Under a sequence axis cuDNN runs per position shard where it takes the shard's shapes (bf16/fp16, heads up to
    128 wide, an even number of positions a shard: its mask becomes a bias), splash on the Pallas names, and xla
    (None) otherwise."""
    from hfjax.models.attention import _split_positions_kernel, cudnn_split_positions_attention

    layout = Layout.from_config(LAYOUTS["fsdp2_sequence2_tensor2"])

    def chosen(name: str, t: int, d: int, dtype) -> object:
        q, k = jnp.zeros((4, t, 4, d), dtype), jnp.zeros((4, t, 2, d), dtype)
        with program_layout(layout):
            kernel = _split_positions_kernel(name, q, k, None, 2)
        return kernel and kernel.func

    assert chosen("cudnn", 64, 128, jnp.bfloat16) is cudnn_split_positions_attention
    assert chosen("cudnn", 64, 128, jnp.float32) is None  # cuDNN takes 2-byte dtypes only
    assert chosen("cudnn", 64, 136, jnp.bfloat16) is None  # wider than 128 off a Hopper process
    assert chosen("cudnn", 66, 128, jnp.bfloat16) is None  # 33 positions a shard: odd, no bias backward
    assert chosen("xla", 64, 128, jnp.bfloat16) is None
    assert chosen("pallas_interpret", 64, 128, jnp.bfloat16).__name__ == "splash_split_positions_attention"
