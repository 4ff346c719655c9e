"""Vocabulary padding: vocabularies a tensor axis does not divide (97, 301) are stored with `padded_vocab_size` rows,
load and run under tensor parallelism with transformers' logits, never sample or score a padding column, and save
back to the HF checkpoint bitwise."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file
from support.checkpoints import left_padded_batch, relative_error, save_hf_model, torch_logits

from hfjax.algos import entropy_from_logits, logprobs_from_logits
from hfjax.models import CausalLM, ModelConfig, load_hf, save_hf
from hfjax.models.config import MASKED_SCORE, VOCAB_MULTIPLE
from hfjax.models.hf import abstract_model
from hfjax.models.presets import NAMED_CONFIGS
from hfjax.models.transformer import mask_vocab_padding
from hfjax.parallel import Layout
from hfjax.rollout import JaxEngine, OfflineGenerator, SamplingParams
from hfjax.rollout.sampling import SamplerKind, sample_key, sample_tokens

LENGTHS = [12, 7, 3, 10]


def _config(vocab: int) -> ModelConfig:
    return ModelConfig("llama", vocab, 32, 64, 1, 4, 2, 8)


def _tp_layout(tensor: int, rules: str = "fsdp_tp") -> Layout:
    other = "fsdp" if rules == "fsdp_tp" else "data"
    return Layout.from_config({"mesh": {other: jax.device_count() // tensor, "tensor": tensor}, "rules": rules})


def _vocab_params(model: nnx.Module) -> dict[str, np.ndarray]:
    names = {"embed_tokens", "lm_head"}
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {str(path[-1]): np.asarray(var[...]) for path, var in flat if path[-1] in names}


@pytest.mark.parametrize("vocab", [1, 97, 128, 129, 301, 32000, 32001, 50257, 128256, 151665, 151936])
def test_padded_vocab_size_is_the_next_multiple_of_128(vocab):
    padded = _config(vocab).padded_vocab_size
    assert padded % 128 == 0 and vocab <= padded < vocab + 128
    assert all(padded % tensor == 0 for tensor in (2, 4, 8, 16, 32, 64, 128))
    assert VOCAB_MULTIPLE == 128


def test_presets_and_parameter_count_keep_the_hf_vocabulary():
    # the presets keep their checkpoints' vocabularies: multiples of 128 (no padding) but Gemma 3 4B's 262,208
    unpadded = {name for name, cfg in NAMED_CONFIGS.items() if cfg.padded_vocab_size != cfg.vocab_size}
    assert unpadded == {"gemma-3-4b"}
    assert (NAMED_CONFIGS["gemma-3-4b"].vocab_size, NAMED_CONFIGS["gemma-3-4b"].padded_vocab_size) == (262208, 262272)
    small, padded = _config(97), _config(128)
    assert padded.num_params - small.num_params == 2 * 31 * 32  # embedding and LM head, counted as transformers does


@pytest.mark.parametrize("vocab", [97, 300, 32001])
@pytest.mark.parametrize("tensor", [2, 4, 8])
def test_layout_shards_the_padded_vocabulary(vocab, tensor):
    cfg = ModelConfig("llama", vocab, 64, 96, 1, 8, 8, 8)
    params = nnx.state(abstract_model(cfg, "causal_lm"), nnx.Param)
    shardings = dict(nnx.to_flat_state(_tp_layout(tensor).shardings(params)))
    for name in (("model", "embed_tokens"), ("lm_head",)):
        shape = (cfg.padded_vocab_size, 64)
        assert shardings[name].shard_shape(shape) == (cfg.padded_vocab_size // tensor, 64 // (8 // tensor))


@pytest.mark.parametrize(
    "family,tensor,overrides",
    [
        ("llama", 2, dict(vocab_size=97)),
        ("qwen2", 4, dict(vocab_size=301, num_key_value_heads=4, tie_word_embeddings=True)),
        ("qwen3", 8, dict(vocab_size=301, num_attention_heads=8, num_key_value_heads=8)),
    ],
)
def test_tensor_parallel_load_matches_transformers(tmp_path, family, tensor, overrides):
    """Vocab sharded over `tensor` though the tensor size does not divide it: the HF-shaped forward gives
    transformers' logits; `logits` adds masked columns, and its log-softmax equals transformers' log-softmax."""
    reference, path = save_hf_model(tmp_path, family, **overrides)
    vocab = overrides["vocab_size"]
    ids, mask, positions = left_padded_batch(vocab, LENGTHS, seed=1)
    expected = torch_logits(reference, ids, mask, positions)
    layout = _tp_layout(tensor)
    model = load_hf(path, layout=layout)
    params = _vocab_params(model)
    assert set(params) == ({"embed_tokens"} if overrides.get("tie_word_embeddings") else {"embed_tokens", "lm_head"})
    hf_weights = dict(reference.state_dict())
    for name, value in params.items():
        hf_name = "model.embed_tokens.weight" if name == "embed_tokens" else "lm_head.weight"
        assert value.shape == (_config(vocab).padded_vocab_size, 64)
        np.testing.assert_array_equal(value[:vocab], hf_weights[hf_name].numpy())
        assert not value[vocab:].any()
    assert model.model.embed_tokens[...].sharding.spec == layout.spec(("vocab", "embed"))
    assert layout.spec(("vocab", "embed"))[0] == "tensor"

    batch = layout.sharding(("batch", "length"), ids.shape)
    forward = nnx.jit(lambda m, i, k: (m(i, k), m.logits(m.model(i, k))))
    got, padded = (np.asarray(x) for x in forward(model, jax.device_put(ids, batch), jax.device_put(mask, batch)))
    v = mask.astype(bool)
    assert got.shape == expected.shape and got.dtype == np.float32
    assert relative_error(got[v], expected[v]) <= 1e-5
    assert padded.shape[-1] == _config(vocab).padded_vocab_size
    np.testing.assert_array_equal(padded[..., :vocab], got)
    assert (padded[..., vocab:] == np.float32(MASKED_SCORE)).all()
    want = torch.log_softmax(torch.as_tensor(expected, dtype=torch.float64), -1).numpy()
    np.testing.assert_allclose(np.asarray(jax.nn.log_softmax(padded))[..., :vocab][v], want[v], rtol=0, atol=1e-5)


@pytest.mark.parametrize("head,num_labels", [("SequenceClassification", 2), ("TokenClassification", 1)])
def test_score_heads_pad_only_the_embedding(tmp_path, head, num_labels):
    reference, path = save_hf_model(tmp_path, "llama", head=head, num_labels=num_labels, num_key_value_heads=4)
    ids, mask, positions = left_padded_batch(97, LENGTHS, seed=2)
    expected = torch_logits(reference, ids, mask, positions)
    model = load_hf(path, layout=_tp_layout(4))
    assert model.model.embed_tokens[...].shape == (128, 64) and model.score[...].shape == (num_labels, 64)
    got = np.asarray(nnx.jit(lambda m, i, k: m(i, k))(model, ids, mask))
    if head == "TokenClassification":
        v = mask.astype(bool)
        got, expected = got[v], expected[..., 0][v]
    assert relative_error(got, expected) <= 1e-5


@pytest.mark.parametrize("tensor", [2, 4])
def test_save_under_tensor_parallelism_is_bitwise(tmp_path, tensor):
    """A checkpoint of vocabulary 97 loaded with its vocab sharded over `tensor` saves back the same tensors, bit for
    bit, with `vocab_size` 97 in config.json; so does a multi-file save."""
    reference, path = save_hf_model(tmp_path, "llama", vocab_size=97, num_key_value_heads=4)
    model = load_hf(path, layout=_tp_layout(tensor))
    original = load_file(str(path / "model.safetensors"))
    for name, kwargs in (("single", {}), ("sharded", dict(max_shard_bytes=20_000))):
        out = save_hf(model, tmp_path / name, **kwargs)
        assert json.loads((out / "config.json").read_text())["vocab_size"] == 97
        saved = {}
        for file in out.glob("*.safetensors"):
            saved.update(load_file(str(file)))
        assert saved.keys() == original.keys() and saved["lm_head.weight"].shape == (97, 64)
        for key, value in original.items():
            assert saved[key].dtype == value.dtype and saved[key].tobytes() == value.tobytes(), key
        assert {k: tuple(v.shape) for k, v in reference.state_dict().items()} == {k: v.shape for k, v in saved.items()}


def test_initialised_padding_rows_are_zero_and_get_no_gradient():
    cfg = _config(97)
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    for value in _vocab_params(model).values():
        assert value.shape == (128, 32) and not value[97:].any() and value[:97].std() > 0.01
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 9)), jnp.int32)

    def loss(params):
        m = nnx.merge(graphdef, params, rest)
        logits = m.logits(m.model(ids[:, :-1])) / 0.7
        return -logprobs_from_logits(logits, ids[:, 1:]).mean() - entropy_from_logits(logits).mean()

    grads = _vocab_params(nnx.merge(graphdef, jax.jit(jax.grad(loss))(params), rest))
    for name, grad in grads.items():
        assert np.isfinite(grad).all() and np.abs(grad[:97]).max() > 0 and not grad[97:].any(), name


def _log_softmax64(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    shifted = z - z.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _float32_atol(logits: np.ndarray) -> float:
    """Absolute error bound of float32 log-softmax and entropy: a few ulps of the largest |logit|."""
    return 8 * float(np.finfo(np.float32).eps) * float(np.abs(logits).max())


@pytest.mark.parametrize("temperature", [0.01, 0.7, 1.0, 3.0])
def test_log_softmax_and_entropy_ignore_masked_columns(temperature):
    """Log probs and entropy of masked padded logits / temperature (garbage in the padding before masking) against
    float64 numpy over the real columns, as close as those of the unpadded logits: float32 evaluates them to a few
    ulps of the largest |logit|; large logits overflow exp without the max shift, and at temperature 0.01 the masked
    columns reach -1e32."""
    rng = np.random.default_rng(0)
    vocab = 97
    real = (rng.normal(size=(3, 5, vocab)) * 40).astype(np.float32)
    garbage = rng.normal(size=(3, 5, 128 - vocab)).astype(np.float32) * 1e4
    padded = mask_vocab_padding(jnp.asarray(np.concatenate([real, garbage], -1)), vocab) / temperature
    unpadded = jnp.asarray(real) / temperature
    labels = rng.integers(0, vocab, size=(3, 5))
    logp = _log_softmax64(np.asarray(unpadded))
    want_entropy = -(np.exp(logp) * logp).sum(-1)
    want_logp = np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    atol = _float32_atol(np.asarray(unpadded))
    for logits in (padded, unpadded):
        np.testing.assert_allclose(np.asarray(entropy_from_logits(logits)), want_entropy, rtol=0, atol=atol)
        np.testing.assert_allclose(np.asarray(logprobs_from_logits(logits, labels)), want_logp, rtol=0, atol=atol)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(0.0, 0, 1.0), (0.01, 0, 1.0), (1.0, 0, 1.0), (3.0, 0, 1.0), (2.0, 120, 1.0), (2.0, 0, 0.999), (1.0, 128, 0.9)],
)
def test_sampler_never_picks_a_masked_column(temperature, top_k, top_p):
    """Real logits all far below 0 (the unmasked padding columns' value): greedy, a top-k wider than the vocabulary
    and top-p near 1 still pick real tokens only, with log probs of the real columns' log-softmax."""
    rows, vocab = 4096, 97
    rng = np.random.default_rng(1)
    real = rng.normal(size=(rows, vocab)).astype(np.float32) - 50.0
    logits = mask_vocab_padding(jnp.asarray(np.pad(real, ((0, 0), (0, 128 - vocab)))), vocab)
    kind = SamplerKind.of(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    keys = sample_key(np.zeros(rows, np.int32), np.arange(rows, dtype=np.int32), np.zeros(rows, np.int32))
    tokens, logprobs = jax.jit(sample_tokens, static_argnames="kind")(
        logits,
        keys,
        jnp.zeros(rows, jnp.int32),
        jnp.full(rows, temperature, jnp.float32),
        jnp.full(rows, top_k, jnp.int32),
        jnp.full(rows, top_p, jnp.float32),
        kind=kind,
    )
    tokens = np.asarray(tokens)
    assert (tokens < vocab).all() and len(np.unique(tokens)) > (1 if temperature == 0 else 20)
    if temperature == 0:
        np.testing.assert_array_equal(tokens, real.argmax(-1))
    scaled = real / np.float32(temperature or 1.0)
    want = _log_softmax64(scaled)[np.arange(rows), tokens]
    np.testing.assert_allclose(np.asarray(logprobs), want, rtol=0, atol=_float32_atol(scaled))


@pytest.mark.parametrize("tensor", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_generation_under_tensor_parallelism_matches_transformers(tmp_path, tensor):
    """A vocabulary-97 checkpoint generating with its vocab sharded over `tensor`: greedy tokens equal transformers'
    `generate`; sampled tokens (plain, and top-k with top-p) are real tokens whose log probs equal transformers'
    log-softmax(logits / T)."""
    eos = 5
    hf, path = save_hf_model(tmp_path, "llama", vocab_size=97, num_key_value_heads=4, eos_token_id=eos, seed=3)
    layout = _tp_layout(tensor, "dp_tp_gen")
    model = load_hf(path, layout=layout)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    engine = JaxEngine(model, layout, max_concurrent_decodes=8, max_prefill_length=32, max_new_tokens=12)
    generator = OfflineGenerator(engine, params, progress=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(8, 97, n).tolist() for n in (5, 11, 3, 17)]

    greedy = generator.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.0))
    for prompt, out in zip(prompts, greedy, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        assert out.tokens.tolist() == ref[0, len(prompt) :].tolist()

    for settings in (dict(temperature=1.0), dict(temperature=1.5, top_k=40, top_p=0.9)):
        sampling = SamplingParams(max_new_tokens=12, n=4, seed=2, stop_token_ids=(), **settings)
        outs = generator.generate(prompts, sampling)
        tokens = np.concatenate([out.tokens for out in outs])
        assert tokens.max() < 97 and len(np.unique(tokens)) > 20, settings
        for out in outs:
            prompt = prompts[out.request]
            sequence = np.asarray([[*prompt, *out.tokens]])
            logits = torch_logits(hf, sequence, np.ones_like(sequence), np.arange(sequence.shape[1])[None])[0]
            logp = torch.log_softmax(torch.as_tensor(logits, dtype=torch.float64) / settings["temperature"], -1)
            start = len(prompt) - 1
            want = logp[np.arange(start, start + len(out.tokens)), out.tokens].numpy()
            np.testing.assert_allclose(out.logprobs, want, rtol=0, atol=1e-5)
