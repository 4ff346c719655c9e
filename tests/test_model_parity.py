"""Logits of hfjax models against transformers (PyTorch, float32) on tiny random checkpoints, left-padded batches."""

import numpy as np
import pytest
import torch
from support.checkpoints import build_hf_model, left_padded_batch, relative_error, save_hf_model, torch_logits
from support.tiny_models import compiled_forward

from hfjax.models import load_hf

LENGTHS = [12, 7, 3, 10]
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8,
)

CAUSAL_CASES = {
    "llama-gqa1": ("llama", dict(num_key_value_heads=4)),
    "llama-gqa2": ("llama", dict(num_key_value_heads=2)),
    "llama-gqa4": ("llama", dict(num_attention_heads=8, num_key_value_heads=2)),
    "llama-mqa-tied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "llama3-rope-scaling": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "llama-linear-rope-bias": (
        "llama",
        dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0), attention_bias=True, mlp_bias=True),
    ),
    "qwen2-bias": ("qwen2", dict(num_key_value_heads=2)),
    "qwen2-tied-mqa": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3-qknorm": ("qwen3", dict(num_key_value_heads=2)),
    "qwen3-wide-head": ("qwen3", dict(num_key_value_heads=1, head_dim=32)),
    "mistral-full": ("mistral", dict(num_key_value_heads=2, sliding_window=None)),
    "mistral-sliding-4": ("mistral", dict(num_key_value_heads=2, sliding_window=4)),
    # Gemma (support/checkpoints.py: query scale 24 != head_dim 16, a sliding then a global layer, small soft caps)
    "gemma2-sliding-4": ("gemma2", dict(sliding_window=4)),
    "gemma2-mqa-bias-untied": ("gemma2", dict(num_key_value_heads=1, attention_bias=True, tie_word_embeddings=False)),
    "gemma3-sliding-4": ("gemma3", dict(sliding_window=4)),
    "gemma3-gqa4-untied": ("gemma3", dict(num_attention_heads=8, sliding_window=6, tie_word_embeddings=False)),
}


def _valid(mask):
    return mask.astype(bool)


@pytest.mark.parametrize("case", sorted(CAUSAL_CASES))
def test_causal_lm_logits_match_transformers(tmp_path, case):
    family, overrides = CAUSAL_CASES[case]
    reference, path = save_hf_model(tmp_path, family, **overrides)
    ids, mask, positions = left_padded_batch(reference.config.vocab_size, LENGTHS, seed=1)
    expected = torch_logits(reference, ids, mask, positions)
    model = load_hf(path)
    got = np.asarray(compiled_forward(model, ids, mask))  # positions derived from the mask
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert relative_error(got[_valid(mask)], expected[_valid(mask)]) <= 1e-5


def test_left_padding_does_not_change_a_row(tmp_path):
    reference, path = save_hf_model(tmp_path, "qwen2")
    model = load_hf(path)
    ids, mask, _ = left_padded_batch(reference.config.vocab_size, [9, 4], seed=2)
    padded = np.asarray(compiled_forward(model, ids, mask))
    alone = np.asarray(compiled_forward(model, ids[1:, -4:], mask[1:, -4:]))
    assert relative_error(padded[1, -4:], alone[0]) <= 1e-5


def test_sliding_window_changes_the_result(tmp_path):
    """The window case above is only meaningful if the window matters for this sequence length."""
    windowed = build_hf_model("mistral", sliding_window=4)
    full = build_hf_model("mistral", sliding_window=None)
    ids, mask, positions = left_padded_batch(97, LENGTHS, seed=1)
    a, b = torch_logits(windowed, ids, mask, positions), torch_logits(full, ids, mask, positions)
    assert relative_error(a[_valid(mask)], b[_valid(mask)]) > 1e-2


@pytest.mark.parametrize(
    "family,change",
    [
        ("gemma2", dict(attn_logit_softcapping=None)),
        ("gemma2", dict(final_logit_softcapping=None)),
        ("gemma3", dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
        ("gemma3", dict(query_pre_attn_scalar=16)),
    ],
)
def test_each_gemma_option_changes_the_result(family, change):
    """The Gemma cases above are only meaningful if what they set (soft caps, the local rotary base, the query
    scale) changes the logits of these tiny models."""
    ids, mask, positions = left_padded_batch(97, LENGTHS, seed=1)
    a = torch_logits(build_hf_model(family, sliding_window=4), ids, mask, positions)
    b = torch_logits(build_hf_model(family, sliding_window=4, **change), ids, mask, positions)
    assert relative_error(a[_valid(mask)], b[_valid(mask)]) > 1e-3


def test_llama3_rope_scaling_changes_the_result(tmp_path):
    scaled = build_hf_model("llama", rope_parameters=LLAMA3_ROPE)
    plain = build_hf_model("llama", rope_parameters=dict(rope_type="default", rope_theta=500000.0))
    ids, mask, positions = left_padded_batch(97, LENGTHS, seed=1)
    a, b = torch_logits(scaled, ids, mask, positions), torch_logits(plain, ids, mask, positions)
    assert relative_error(a[_valid(mask)], b[_valid(mask)]) > 1e-3


@pytest.mark.parametrize(
    "family,num_labels", [("llama", 1), ("qwen2", 3), ("qwen3", 1), ("mistral", 2), ("gemma2", 2), ("gemma3", 1)]
)
def test_sequence_classification_scores_match_transformers(tmp_path, family, num_labels):
    reference, path = save_hf_model(tmp_path, family, head="SequenceClassification", num_labels=num_labels)
    ids, mask, positions = left_padded_batch(reference.config.vocab_size, LENGTHS, seed=3)
    expected = torch_logits(reference, ids, mask, positions)
    model = load_hf(path)
    got = np.asarray(compiled_forward(model, ids, mask))
    assert got.shape == (len(LENGTHS), num_labels)
    assert relative_error(got, expected) <= 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_critic_values_match_token_classification(tmp_path, family):
    reference, path = save_hf_model(tmp_path, family, head="TokenClassification", num_labels=1)
    ids, mask, positions = left_padded_batch(reference.config.vocab_size, LENGTHS, seed=4)
    expected = torch_logits(reference, ids, mask, positions)[..., 0]
    values = np.asarray(compiled_forward(load_hf(path), ids, mask))
    assert values.shape == ids.shape
    assert relative_error(values[_valid(mask)], expected[_valid(mask)]) <= 1e-5


def test_critic_from_causal_checkpoint_keeps_the_backbone(tmp_path):
    reference, path = save_hf_model(tmp_path, "llama")
    critic = load_hf(path, head="token_cls", seed=7)
    lm = load_hf(path)
    ids, mask, _ = left_padded_batch(reference.config.vocab_size, LENGTHS, seed=5)
    hidden = np.asarray(compiled_forward(lm.model, ids, mask))
    head = np.asarray(critic.score[...])
    expected = hidden @ head[0] + np.asarray(critic.score_bias[...])[0]
    assert relative_error(np.asarray(compiled_forward(critic, ids, mask))[_valid(mask)], expected[_valid(mask)]) <= 1e-5
    assert np.asarray(critic.score_bias[...]).tolist() == [0.0]
    assert 0.005 < float(head.std()) < 0.05  # initialised like HF (normal, initializer_range 0.02), not zeros


@pytest.mark.parametrize("param_dtype", ["bfloat16", "float32"])
def test_bfloat16_compute_stays_close_to_float32(tmp_path, param_dtype):
    reference, path = save_hf_model(tmp_path, "qwen2")
    ids, mask, positions = left_padded_batch(reference.config.vocab_size, LENGTHS, seed=6)
    expected = torch_logits(reference, ids, mask, positions)
    model = load_hf(path, dtype="bfloat16", param_dtype=param_dtype)
    assert model.model.layers[0].self_attn.q_kernel[...].dtype == np.dtype(param_dtype)
    got = np.asarray(compiled_forward(model, ids, mask))
    assert got.dtype == np.float32
    err = relative_error(got[_valid(mask)], expected[_valid(mask)])
    assert 1e-6 < err <= 3e-2  # bf16 rounding is visible, and bounded


def test_bfloat16_matches_transformers_bfloat16(tmp_path):
    reference, path = save_hf_model(tmp_path, "llama")
    ids, mask, positions = left_padded_batch(reference.config.vocab_size, LENGTHS, seed=6)
    expected32 = torch_logits(reference, ids, mask, positions)
    expected16 = torch_logits(reference.to(torch.bfloat16), ids, mask, positions)
    got = np.asarray(compiled_forward(load_hf(path, dtype="bfloat16"), ids, mask))
    v = _valid(mask)
    # hfjax bf16 is no further from the fp32 truth than transformers' own bf16 run (with a 50% margin).
    assert relative_error(got[v], expected32[v]) <= 1.5 * relative_error(expected16[v], expected32[v])


def test_long_left_padded_batch_uses_causal_blocks_exactly(tmp_path):
    """128 tokens: attention runs in 4 causal query blocks (each skipping later keys); logits still match."""
    reference, path = save_hf_model(tmp_path, "mistral", num_key_value_heads=2, sliding_window=50)
    ids, mask, positions = left_padded_batch(reference.config.vocab_size, [128, 100, 37], seed=8)
    expected = torch_logits(reference, ids, mask, positions)
    got = np.asarray(compiled_forward(load_hf(path), ids, mask))
    assert relative_error(got[_valid(mask)], expected[_valid(mask)]) <= 1e-5


def _log_likelihood_torch(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray):
    logits = model(
        input_ids=torch.as_tensor(ids, dtype=torch.long),
        attention_mask=torch.as_tensor(mask),
        position_ids=torch.as_tensor(positions, dtype=torch.long),
    ).logits[:, :-1]
    target = torch.as_tensor(ids[:, 1:], dtype=torch.long)
    picked = torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0]
    weight = torch.as_tensor(mask[:, 1:] * mask[:, :-1], dtype=torch.float32)
    return (picked * weight).sum() / weight.sum()


@pytest.mark.parametrize("case", ["llama-linear-rope-bias", "qwen2-tied-mqa", "qwen3-qknorm", "gemma2-sliding-4"])
def test_parameter_gradients_match_torch_autograd(tmp_path, case):
    """The gradient of a masked next-token log likelihood with respect to every parameter (the model's
    hand-written `dense` backward included) against PyTorch autograd on the same checkpoint."""
    import jax
    from flax import nnx

    from hfjax.models.hf import param_plan

    family, overrides = CAUSAL_CASES[case]
    reference, path = save_hf_model(tmp_path, family, **overrides)
    ids, mask, positions = left_padded_batch(reference.config.vocab_size, LENGTHS, seed=3)
    reference.zero_grad()
    _log_likelihood_torch(reference, ids, mask, positions).backward()
    expected = {name: p.grad.numpy() for name, p in reference.named_parameters()}

    model = load_hf(path)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def log_likelihood(params):
        logits = nnx.merge(graphdef, params, rest)(ids, mask)[:, :-1]
        picked = jax.numpy.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1)[..., 0]
        weight = mask[:, 1:] * mask[:, :-1]
        return (picked * weight).sum() / weight.sum()

    grads = dict(nnx.to_flat_state(jax.jit(jax.grad(log_likelihood))(params)))
    plan = param_plan(model.config, "causal_lm")
    assert {m.hf_name for m in plan} == set(expected)
    for mapping in plan:
        got = mapping.to_hf(np.asarray(grads[mapping.path][...]))
        assert got.shape == expected[mapping.hf_name].shape
        assert relative_error(got, expected[mapping.hf_name]) <= 1e-4, mapping.hf_name
