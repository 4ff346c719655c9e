"""Generation engine: greedy parity with transformers `generate`, logprobs against a teacher-forced forward,
sampling filters against numpy, determinism, stop tokens, continuous batching, weight swaps, bad input."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from checkpoints import save_hf_model
from flax import nnx

from hfjax.models import load_hf
from hfjax.parallel import Layout
from hfjax.rollout import JaxEngine, OfflineGenerator, SamplingError, SamplingParams, prefill_buckets
from hfjax.rollout.sampling import SamplerKind, _first_max_index, filter_logits, sample_key, sample_tokens

VOCAB = 96  # divisible by the tensor axis of the sharded layout
EOS = 7


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(8, VOCAB, n).tolist() for n in lengths]


def _generator(path, layout=None, slots=4, max_prefill=32, max_new=16):
    model = load_hf(path, dtype="float32", layout=layout)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    engine = JaxEngine(
        model, layout, max_concurrent_decodes=slots, max_prefill_length=max_prefill, max_new_tokens=max_new
    )
    return model, OfflineGenerator(engine, params, progress=False)


def _teacher_forced(model, width: int = 32):
    """A jitted forward returning logits [len(seq), vocab] for one sequence, right-padded to `width` (causal, so
    the padding after the sequence does not change its logits)."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids))

    def logits(seq: np.ndarray) -> np.ndarray:
        ids = np.zeros((1, width), np.int32)
        ids[0, : len(seq)] = seq
        return np.asarray(forward(state, ids))[0, : len(seq)]

    return logits


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_hf_model(tmp_path_factory.mktemp("gen"), "llama", vocab_size=VOCAB, eos_token_id=EOS)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("sharded", [False, True])
def test_greedy_equals_transformers(tmp_path, family, sharded):
    extra = {"sliding_window": 6} if family == "mistral" else {}
    hf, path = save_hf_model(tmp_path, family, vocab_size=VOCAB, eos_token_id=EOS, seed=3, **extra)
    layout = Layout.from_config({"mesh": {"data": 4, "tensor": 2}, "rules": "dp_tp_gen"}) if sharded else None
    _, generator = _generator(path, layout, slots=8 if sharded else 4)
    prompts = _prompts(1, (5, 11, 3, 17, 9, 24))
    outs = generator.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.0))
    assert [o.request for o in outs] == list(range(len(prompts)))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        expected = ref[0, len(prompt) :].tolist()
        assert out.tokens.tolist() == expected
        assert out.finish_reason == ("stop" if expected[-1] == EOS else "length")
    assert generator.engine.blocks == 2  # capacity 48 in 32-position blocks: short contexts skip the second block
    assert generator.engine.compiles["generate"] == 2  # one step per count of blocks in use


def test_logprobs_equal_teacher_forced_forward(llama):
    _, path = llama
    model, generator = _generator(path)
    prompts = _prompts(2, (6, 13, 4))
    temperature = 0.7
    forward = _teacher_forced(model)
    outs = generator.generate(prompts, SamplingParams(max_new_tokens=10, temperature=temperature, n=2, seed=5))
    for out in outs:
        logits = forward(np.concatenate([prompts[out.request], out.tokens])) / temperature
        logp = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
        start = len(prompts[out.request]) - 1
        expected = np.asarray(logp[np.arange(start, start + len(out.tokens)), out.tokens])
        np.testing.assert_allclose(out.logprobs, expected, rtol=0, atol=1e-5)


def _numpy_filter(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Reference: keep the k largest (ties kept), then the most likely tokens until their renormalised mass
    reaches top_p (the token that crosses it is kept)."""
    keep = np.ones_like(logits, bool)
    if top_k > 0:
        keep &= logits >= np.sort(logits)[::-1][top_k - 1]
    if top_p < 1.0:
        kept = np.where(keep, logits, -np.inf)
        probs = np.exp(kept - kept.max())
        probs /= probs.sum()
        order = np.argsort(-kept, kind="stable")
        mass, chosen = 0.0, []
        for i in order:
            if mass >= top_p:
                break
            chosen.append(i)
            mass += probs[i]
        keep &= kept >= kept[chosen[-1]]
    return keep


def test_filters_match_numpy_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32) * 3
    top_k = np.array([0, 1, 5, 17, 0, 3], np.int32)
    top_p = np.array([0.3, 1.0, 0.9, 0.5, 0.95, 1.0], np.float32)
    out = np.asarray(
        filter_logits(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p), SamplerKind(True, True))
    )
    for row in range(len(logits)):
        expected = _numpy_filter(logits[row].astype(np.float64), int(top_k[row]), float(top_p[row]))
        np.testing.assert_array_equal(np.isfinite(out[row]), expected)
        np.testing.assert_array_equal(out[row][expected], logits[row][expected])
    # many rows with ties (logits on a half-unit grid), negative and -inf logits, random settings
    logits = np.round(rng.normal(size=(64, 300)) * 6) / 2
    logits[:, :5] = -np.inf
    logits[3, 5:] = 0.0  # all finite logits tied
    top_k = rng.integers(0, 40, 64).astype(np.int32)
    top_p = rng.uniform(0.05, 1.0, 64).astype(np.float32)
    top_p[:4] = 1.0
    out = np.asarray(
        filter_logits(jnp.asarray(logits, jnp.float32), jnp.asarray(top_k), jnp.asarray(top_p), SamplerKind(True, True))
    )
    for row in range(len(logits)):
        expected = _numpy_filter(logits[row], int(top_k[row]), float(top_p[row]))
        np.testing.assert_array_equal(np.isfinite(out[row]), expected, err_msg=f"row {row}")


@pytest.mark.parametrize(("temperature", "top_p", "vocab"), [(0.7, 1.0, 300), (1.3, 0.8, 300), (1.0, 1.0, 293)])
def test_sampled_tokens_follow_the_filtered_softmax(temperature, top_p, vocab):
    """40,000 draws from one row of logits (two tokens at -inf, a block of zeros): counts against softmax(logits / T)
    after the numpy reference filter, by a chi-square bound far in the tail. A prime vocabulary has no block size
    that divides it, so its probabilities are padded."""
    rng = np.random.default_rng(1)
    row = (rng.normal(size=vocab) * 2).astype(np.float32)
    row[[7, 250]] = -np.inf
    row[100:140] = -30.0  # probabilities that round to tiny values
    draws = 40_000
    requests = np.arange(draws, dtype=np.int32)
    keys = jax.jit(sample_key)(np.zeros(draws, np.int32), requests, np.zeros(draws, np.int32))
    tokens, _ = jax.jit(sample_tokens, static_argnames="kind")(
        jnp.broadcast_to(row, (draws, vocab)),
        keys,
        jnp.ones(draws, jnp.int32),
        jnp.full(draws, temperature),
        jnp.zeros(draws, jnp.int32),
        jnp.full(draws, top_p),
        kind=SamplerKind(top_k=False, top_p=top_p < 1, sampled=True),
    )
    keep = _numpy_filter(row.astype(np.float64) / temperature, 0, top_p)
    probs = np.where(keep, np.exp(row.astype(np.float64) / temperature - row.max() / temperature), 0.0)
    probs /= probs.sum()
    counts = np.bincount(np.asarray(tokens), minlength=vocab)
    assert counts[probs == 0].sum() == 0
    expected = draws * probs
    cells = expected > 5
    chi2 = float((((counts - expected) ** 2)[cells] / expected[cells]).sum())
    dof = int(cells.sum()) - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof), (chi2, dof)


def test_greedy_token_is_the_first_maximum():
    """The greedy pick equals numpy's argmax (first index of the maximum), with ties and -inf entries."""
    rng = np.random.default_rng(4)
    logits = rng.integers(-3, 4, size=(64, 257)).astype(np.float32)  # many ties
    logits[5] = -np.inf
    logits[6, :] = -np.inf
    logits[6, 200] = 1.0
    tokens = _first_max_index(jnp.asarray(logits))
    np.testing.assert_array_equal(np.asarray(tokens), np.argmax(logits, axis=-1))


def test_prefill_buckets_leave_at_most_a_third_of_a_padded_prompt_as_padding():
    assert prefill_buckets(64) == (16, 24, 32, 48, 64)
    assert prefill_buckets(100) == (16, 24, 32, 48, 64, 96, 100)
    buckets = prefill_buckets(4096)
    assert all(next(b for b in buckets if b >= n) <= max(16, n * 3 / 2) for n in range(1, 4097))


def test_top_k_samples_stay_in_top_k(llama):
    _, path = llama
    model, generator = _generator(path)
    prompts = _prompts(3, (8,))
    outs = generator.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.5, top_k=3, n=4, seed=1))
    forward = _teacher_forced(model)
    for out in outs:
        logits = forward(np.concatenate([prompts[0], out.tokens]))[len(prompts[0]) - 1 : -1]
        top3 = np.argsort(-logits, axis=-1)[:, :3]
        assert all(tok in row for tok, row in zip(out.tokens, top3, strict=True))


def test_seeds_and_stop_tokens(llama):
    _, path = llama
    _, generator = _generator(path)
    prompts = _prompts(4, (5, 9))
    params = dict(max_new_tokens=12, temperature=1.0, n=3, stop_token_ids=())
    first = generator.generate(prompts, SamplingParams(seed=11, **params))
    again = generator.generate(prompts, SamplingParams(seed=11, **params))
    other = generator.generate(prompts, SamplingParams(seed=12, **params))
    assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(first, again, strict=True))
    assert any(not np.array_equal(a.tokens, b.tokens) for a, b in zip(first, other, strict=True))
    assert len({tuple(o.tokens) for o in first[:3]}) > 1  # the n samples of one prompt differ

    reference = first[1].tokens.tolist()
    stop = reference[4]
    cut = reference.index(stop)
    stopped = generator.generate(prompts, SamplingParams(seed=11, **{**params, "stop_token_ids": (stop,)}))
    assert stopped[1].tokens.tolist() == reference[: cut + 1]
    assert stopped[1].finish_reason == "stop"
    assert all(o.tokens.tolist().count(stop) <= 1 for o in stopped)


def test_continuous_batching_equals_one_at_a_time(llama):
    _, path = llama
    prompts = _prompts(5, (4, 19, 7, 12, 30, 2, 9))
    _, few = _generator(path, slots=2)
    _, many = _generator(path, slots=8)
    greedy = SamplingParams(max_new_tokens=9, temperature=0.0)
    singles = [o for p in prompts for o in many.generate([p], greedy)]
    assert [o.tokens.tolist() for o in few.generate(prompts, greedy)] == [o.tokens.tolist() for o in singles]
    # A sample's random stream depends on (seed, request, sample), not on the slot or batch it ran in.
    sampled = SamplingParams(max_new_tokens=9, n=2, seed=3)
    tokens = [[o.tokens.tolist() for o in g.generate(prompts, sampled)] for g in (few, many)]
    assert tokens[0] == tokens[1]


def test_data_parallel_decode_step_has_no_collectives(llama):
    """Slots sharded over the data axis decode independently: the compiled step (cache writes included) moves
    nothing between devices. Indexing every slot in one scatter made the partitioner all-gather the new keys and
    values of all slots in every layer."""
    _, path = llama
    layout = Layout.from_config({"mesh": {"data": 8}, "rules": "dp_tp_gen"})
    _, generator = _generator(path, layout, slots=8)
    engine = generator.engine
    kind = SamplerKind.of(SamplingParams(max_new_tokens=4))
    hlo = (
        engine._generate.lower(generator.params, engine.init_decode_state(), kind=kind, live=engine.blocks)
        .compile()
        .as_text()
    )
    collectives = re.findall(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)\(", hlo)
    assert collectives == []


def test_update_params_does_not_recompile(llama):
    _, path = llama
    model, generator = _generator(path)
    prompts = _prompts(6, (5, 10))
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0)
    before = generator.generate(prompts, sampling)
    compiles = dict(generator.engine.compiles)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    noisy = jax.tree.map(lambda x: x * 1.5, params)
    generator.update_params(noisy)
    after = generator.generate(prompts, sampling)
    assert dict(generator.engine.compiles) == compiles
    assert any(not np.array_equal(a.tokens, b.tokens) for a, b in zip(before, after, strict=True))
    fresh = OfflineGenerator(generator.engine, noisy, progress=False).generate(prompts, sampling)
    assert [o.tokens.tolist() for o in fresh] == [o.tokens.tolist() for o in after]


def test_bad_input(llama):
    _, path = llama
    _, generator = _generator(path, max_prefill=16, max_new=8)
    for kwargs, field in (
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"temperature": -1.0}, "temperature"),
    ):
        with pytest.raises(SamplingError, match=f"sampling.{field}"):
            SamplingParams(**kwargs)
    with pytest.raises(SamplingError, match="max_new_tokens: 9 exceeds the engine's max_new_tokens 8"):
        generator.generate([[9, 10]], SamplingParams(max_new_tokens=9))
    outs = generator.generate([[9, 10, 11], [], list(range(8, 25))], SamplingParams(max_new_tokens=3, n=2))
    assert all(o.finish_reason in ("stop", "length") and 1 <= len(o.tokens) <= 3 for o in outs[:2])
    assert outs[2].finish_reason == outs[3].finish_reason == "rejected"
    assert "empty prompt" in outs[2].error
    assert outs[4].finish_reason == "rejected" and "17 tokens exceeds max_prefill_length 16" in outs[4].error
    with pytest.raises(SamplingError, match="empty prompt"):
        generator.engine.prefill(params=generator.params, padded_tokens=np.zeros(16, np.int32), true_length=0)
