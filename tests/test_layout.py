"""Layouts from config, their validation, and sharded loading on 8 fake devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from support.checkpoints import left_padded_batch, relative_error, save_hf_model

from hfjax.models import load_hf
from hfjax.parallel import Layout, LayoutError

# 8 heads and kv heads, MLP 96, vocab 128: every sharded dimension divides by 8.
WIDE = dict(vocab_size=128, num_attention_heads=8, num_key_value_heads=8, hidden_size=64, intermediate_size=96)
LAYOUTS = {
    "fsdp8": {"mesh": {"fsdp": 8}, "rules": "fsdp"},
    "fsdp4-tp2": {"mesh": {"fsdp": 4, "tensor": 2}, "rules": "fsdp_tp"},
    "tp8": {"mesh": {"tensor": 8}, "rules": "tp"},
    "dp2-tp4-explicit": {
        "mesh": {"data": 2, "tensor": 4},
        "rules": [
            ["batch", "data"],
            ["heads", "tensor"],
            ["kv_heads", "tensor"],
            ["mlp", "tensor"],
            ["vocab", ["tensor"]],
            ["embed", None],
        ],
    },
}


def test_eight_fake_devices():
    assert jax.device_count() == 8


def test_presets_map_logical_axes():
    layout = Layout.from_config(LAYOUTS["fsdp4-tp2"])
    assert dict(layout.axes) == {"data": 1, "fsdp": 4, "expert": 1, "sequence": 1, "tensor": 2}
    assert layout.spec(("embed", "heads", "head_dim")) == P("fsdp", "tensor", None)
    assert layout.spec(("batch", "length")) == P("fsdp", None)  # data has size 1: dropped
    assert layout.spec(("vocab", "embed")) == P("tensor", "fsdp")
    assert layout.mesh.shape == {"data": 1, "fsdp": 4, "expert": 1, "sequence": 1, "tensor": 2}
    assert Layout.from_config(LAYOUTS["tp8"]).spec(("embed", "mlp")) == P(None, "tensor")
    # the sequence axis splits positions, and under the fsdp presets the weights too
    context = Layout.from_config({"mesh": {"fsdp": 4, "sequence": 2}, "rules": "fsdp"})
    assert context.spec(("embed", "mlp")) == P(("fsdp", "sequence"), None)
    assert context.activation_spec(("batch", "length", "embed"), (8, 64, 32)) == P("fsdp", "sequence", None)
    assert context.activation_spec(("tokens", None), (16, 32)) == P(("fsdp", "sequence"), None)


def test_device_order_is_respected():
    order = [7, 6, 5, 4, 3, 2, 1, 0]
    layout = Layout.from_config({"mesh": {"fsdp": 2, "tensor": 4}, "rules": "fsdp_tp", "devices": order})
    assert [d.id for d in layout.mesh.devices.reshape(-1)] == order


@pytest.mark.parametrize(
    "config,needle",
    [
        ({"mesh": {"fsdp": 3}, "rules": "fsdp"}, "multiply to 3, but there are 8 devices"),
        ({"mesh": {"fsdp": 4, "model": 2}}, "unknown axis 'model'"),
        ({"mesh": {"fsdp": 8}, "rules": [["heads", "tensr"]]}, "mesh axis 'tensr'"),
        ({"mesh": {"fsdp": 8}, "rules": "zero3"}, "unknown preset 'zero3'"),
        ({"mesh": {"fsdp": 8}, "rules": [["hidden", "fsdp"]]}, "unknown logical axis 'hidden'"),
        ({"mesh": {"fsdp": 8}, "rule": "fsdp"}, "unknown keys \\['rule'\\]"),
        ({"mesh": {"fsdp": 0}}, "positive integer"),
        ({"mesh": {"fsdp": 8}, "devices": [0, 1, 2]}, "expected 8 distinct device ids"),
        ({"mesh": {"fsdp": 4, "tensor": 2}, "rules": "fsdp"}, "axis 'tensor' has size 2, but no rule of 'fsdp'"),
        ({"mesh": {"data": 2, "fsdp": 4}, "rules": "tp"}, "axis 'fsdp' has size 4, but no rule of 'tp'"),
    ],
)
def test_bad_layouts_are_named(config, needle):
    with pytest.raises(LayoutError, match=needle):
        _ = Layout.from_config(config).mesh


def test_indivisible_dimension_names_the_parameter(tmp_path):
    _, path = save_hf_model(tmp_path, "llama", num_key_value_heads=2)  # 2 kv heads cannot split 8 ways
    with pytest.raises(LayoutError) as info:
        load_hf(path, layout=LAYOUTS["tp8"])
    message = str(info.value)
    assert (
        "model/layers/0/self_attn/k_kernel: dimension 0 ('kv_heads') of shape (2, 16, 64) is not divisible by "
        "mesh axes ('tensor',) (size 8)"
    ) in message
    assert "q_kernel: dimension 0 ('heads') of shape (4, 16, 64)" in message  # every offender, not only the first
    assert "vocab" not in message  # vocabulary 97 is stored padded to 128 rows


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_sharded_load_gives_single_device_logits(tmp_path, name):
    reference, path = save_hf_model(tmp_path, "llama", **WIDE)
    ids, mask, _ = left_padded_batch(reference.config.vocab_size, [16, 9, 4, 12, 16, 1, 7, 11], seed=0)
    expected = np.asarray(load_hf(path)(ids, mask))
    layout = Layout.from_config(LAYOUTS[name])
    model = load_hf(path, layout=layout)
    for path_, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var[...]
        want = layout.spec(var.get_metadata()["logical_axes"])
        assert value.sharding.spec == want and value.sharding.mesh == layout.mesh, path_
        used = [a for entry in want if entry for a in ((entry,) if isinstance(entry, str) else entry)]
        parts = int(np.prod([layout.axis_size(a) for a in used]))
        assert {s.data.nbytes for s in value.addressable_shards} == {value.nbytes // parts}, path_
    batch = layout.sharding(("batch", "length"), ids.shape)
    forward = nnx.jit(lambda m, i, k: m(i, k))
    got = np.asarray(forward(model, jax.device_put(ids, batch), jax.device_put(mask, batch)))
    v = mask.astype(bool)
    assert relative_error(got[v], expected[v]) <= 1e-5


def test_device_count_mismatch_is_one_error_for_a_whole_model(tmp_path):
    _, path = save_hf_model(tmp_path, "llama")
    devices = jax.device_count()
    with pytest.raises(LayoutError) as info:
        load_hf(path, layout={"mesh": {"data": 2 * devices}})
    assert str(info.value).count(f"but there are {devices} devices") == 1


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_sharded_logits_and_gradients_equal_one_device(tmp_path, family):
    """Gemma's extra parameters (the norms around the MLP, q/k norms) carry logical axes like the others: under FSDP x
    tensor parallelism the logits and every parameter's gradient of a log likelihood equal one device's."""
    reference, path = save_hf_model(tmp_path, family, sliding_window=4, **WIDE)
    ids, mask, _ = left_padded_batch(reference.config.vocab_size, [16, 9, 4, 12, 16, 1, 7, 11], seed=0)

    def logits_and_grads(model, ids, mask):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def log_likelihood(params):
            logits = nnx.merge(graphdef, params, rest)(ids, mask)
            picked = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), ids[:, 1:, None], -1)[..., 0]
            return jnp.sum(picked * mask[:, 1:] * mask[:, :-1]), logits

        (_, logits), grads = jax.jit(jax.value_and_grad(log_likelihood, has_aux=True))(params)
        return np.asarray(logits), {p: np.asarray(g[...]) for p, g in nnx.to_flat_state(grads)}

    expected_logits, expected_grads = logits_and_grads(load_hf(path), ids, mask)
    layout = Layout.from_config(LAYOUTS["fsdp4-tp2"])
    batch = layout.sharding(("batch", "length"), ids.shape)
    got_logits, got_grads = logits_and_grads(
        load_hf(path, layout=layout), jax.device_put(ids, batch), jax.device_put(mask, batch)
    )
    v = mask.astype(bool)
    assert relative_error(got_logits[v], expected_logits[v]) <= 1e-5
    assert got_grads.keys() == expected_grads.keys()
    assert any("pre_feedforward_layernorm" in "/".join(map(str, p)) for p in got_grads)
    for p, grad in expected_grads.items():
        assert relative_error(got_grads[p], grad) <= 1e-5, p
