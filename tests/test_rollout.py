"""Generation engine: greedy parity with transformers `generate`, logprobs against a teacher-forced forward,
sampling filters against numpy, determinism, stop tokens, continuous batching, weight swaps, bad input."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from support.checkpoints import save_hf_model
from support.devices import needs_devices

from hfjax.models import load_hf
from hfjax.parallel import Layout
from hfjax.rollout import JaxEngine, OfflineGenerator, SamplingError, SamplingParams, prefill_buckets
from hfjax.rollout.sampling import SamplerKind, _first_max_index, filter_logits, sample_key, sample_tokens

SCHEDULE_FIRST = 2  # about this many minutes of tests in CI: started early on a worker (conftest.py)

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


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma2", "gemma3", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("sharded", [False, pytest.param(True, marks=needs_devices(8))])
def test_greedy_equals_transformers(tmp_path, family, sharded):
    # a window shorter than most sequences (Gemma: its sliding layers only; soft caps and two rotary bases in play)
    extra = {"sliding_window": 6} if family in ("mistral", "gemma2", "gemma3", "mixtral") else {}
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
    # 32-position blocks: every prompt in one shared prompt block, every response in one own block
    assert (generator.engine.prompt_blocks, generator.engine.blocks) == (1, 1)
    assert generator.engine.compiles["generate"] == 1  # one step per pair of block counts in use


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
    out = np.asarray(_filter(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p), kind=BOTH))
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
    out = np.asarray(_filter(jnp.asarray(logits, jnp.float32), jnp.asarray(top_k), jnp.asarray(top_p), kind=BOTH))
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


def _tie_heavy_logits(kind: str, rows: int, vocab: int, seed: int) -> np.ndarray:
    """Random logits: `normal`, `integer` (rounded, so ties, -0 beside +0, and -inf columns) or `three` (values in
    {0, 1, 2}: ties everywhere, including across the candidate boundary)."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return (rng.normal(size=(rows, vocab)) * 3).astype(np.float32)
    if kind == "integer":
        logits = np.round(rng.normal(size=(rows, vocab)) * 3).astype(np.float32)
        logits[:, rng.integers(0, vocab, 9)] = -np.inf
        return logits
    return rng.integers(0, 3, (rows, vocab)).astype(np.float32)


FITTING = [(0, 1.0), (1, 0.5), (50, 0.9), (5, 1.0), (128, 0.95), (0, 0.2), (3, 0.7)]  # top_k <= CANDIDATES
SPILLING = [*FITTING, (200, 0.9), (0, 0.999), (300, 1.0)]  # top_k past the candidates, nucleus past them


_filter = jax.jit(filter_logits, static_argnames=("kind", "method"))  # one program, not one compile per operation
BOTH = SamplerKind(True, True)


@pytest.mark.parametrize("combos", [FITTING, SPILLING], ids=["fitting", "spilling"])
def test_candidate_filters_keep_the_bisection_tokens(combos):
    """30 rows cycle through (top_k, top_p) settings, off (0, 1.0) included, on normal, integer and three-valued
    logits; fitting settings run the `lax.top_k` branch, spilling ones the full-sort fallback. Both keep exactly the
    tokens the bisection keeps, ties included, and those follow the numpy reference."""
    from hfjax.rollout.token_filters import CANDIDATES, _filter_over_candidates

    rows, vocab = 30, 300
    settings = [combos[i % len(combos)] for i in range(rows)]
    top_k = jnp.asarray([k for k, _ in settings], jnp.int32)
    top_p = jnp.asarray([p for _, p in settings], jnp.float32)
    kind = SamplerKind(True, True)
    for seed, logits_kind in enumerate(["normal", "integer", "three"]):
        logits = jnp.asarray(_tie_heavy_logits(logits_kind, rows, vocab, seed))
        bisection = np.isfinite(np.asarray(_filter(logits, top_k, top_p, kind=kind, method="bisection")))
        candidates = np.isfinite(np.asarray(_filter(logits, top_k, top_p, kind=kind, method="candidates")))
        np.testing.assert_array_equal(candidates, bisection, err_msg=logits_kind)
        fits = jax.jit(_filter_over_candidates, static_argnums=(3, 4))(logits, top_k, top_p, kind, CANDIDATES)[1]
        assert bool(np.all(fits)) == (combos is FITTING)
        for row in range(rows):  # the rule in float64: the mass strictly above a kept token is below top_p
            row_logits = np.asarray(logits[row], np.float64)
            expected = _numpy_filter(row_logits, int(top_k[row]), float(top_p[row])) & np.isfinite(row_logits)
            np.testing.assert_array_equal(bisection[row], expected, err_msg=f"{logits_kind} row {row}")


def test_candidates_spill_on_ties_across_a_small_candidate_set():
    """With 4 candidates, the rows whose top-k or nucleus lies inside them give the bisection's tokens (ties at the
    4th value kept, though not among the candidates), and the others say they do not fit."""
    from hfjax.rollout.token_filters import _filter_by_bisection, _filter_over_candidates

    logits = jnp.asarray(_tie_heavy_logits("three", 40, 64, 7))
    top_k = jnp.asarray([0, 2, 4, 5, 9] * 8, jnp.int32)
    top_p = jnp.asarray([0.05, 0.3, 1.0, 0.5, 0.99] * 8, jnp.float32)
    kind = SamplerKind(True, True)
    filtered, fits = jax.jit(_filter_over_candidates, static_argnums=(3, 4))(logits, top_k, top_p, kind, 4)
    expected = np.isfinite(np.asarray(jax.jit(_filter_by_bisection, static_argnums=3)(logits, top_k, top_p, kind)))
    fits = np.asarray(fits)
    assert fits.any() and not fits.all()
    np.testing.assert_array_equal(np.isfinite(np.asarray(filtered))[fits], expected[fits])


def test_candidate_sampler_draws_the_bisection_tokens():
    """Under the same keys, both filter methods draw the same tokens with the same log probs (rows with top-k,
    top-p, both and neither)."""
    filters = SamplerKind(True, True)
    rows = 2 * len(FITTING)
    logits = jnp.asarray(_tie_heavy_logits("integer", rows, 300, 3))
    keys = jax.jit(sample_key)(*(np.arange(rows, dtype=np.int32),) * 3)
    settings = (
        jnp.ones(rows, jnp.int32),
        jnp.full(rows, 1.3),
        jnp.asarray([k for k, _ in FITTING] * 2, jnp.int32),
        jnp.asarray([p for _, p in FITTING] * 2, jnp.float32),
    )
    run = jax.jit(sample_tokens, static_argnames=("kind", "filter_method"))
    bisection = run(logits, keys, *settings, kind=filters, filter_method="bisection")
    candidates = run(logits, keys, *settings, kind=filters, filter_method="candidates")
    np.testing.assert_array_equal(np.asarray(candidates[0]), np.asarray(bisection[0]))
    np.testing.assert_array_equal(np.asarray(candidates[1]), np.asarray(bisection[1]))


def test_greedy_token_is_the_first_maximum():
    """The greedy pick equals numpy's argmax (first index of the maximum), with ties and -inf entries."""
    rng = np.random.default_rng(4)
    logits = rng.integers(-3, 4, size=(64, 257)).astype(np.float32)  # many ties
    logits[5] = -np.inf
    logits[6, :] = -np.inf
    logits[6, 200] = 1.0
    tokens = _first_max_index(jnp.asarray(logits))
    np.testing.assert_array_equal(np.asarray(tokens), np.argmax(logits, axis=-1))


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_decode_programs_stay_bounded_at_any_trajectory_length(platform):
    """A decode step compiles once per (own blocks, prompt blocks) in use (and sampler kind, reader width), so the
    programs stay bounded when the block, not the block count, grows with the cache: from 192 to 131,072 positions
    (the shipped 1k + 15k and 1k + 31k configs among them) `kv_block_size` gives blocks of the platform's multiple
    and a slot's own and prompt blocks number at most MAX_KV_BLOCKS + 1 together (at most 4 x 5 pairs)."""
    from hfjax.rollout.interface import MAX_KV_BLOCKS, kv_block_size

    for prompt, response in [(64, 128), (512, 1024), (1024, 7168), (1024, 15360), (1024, 31744), (4096, 126976)]:
        block = kv_block_size(prompt + response, platform)
        own, prompt_blocks = -(-response // block), -(-prompt // block)
        assert block % (128 if platform == "tpu" else 16) == 0
        assert own + prompt_blocks <= MAX_KV_BLOCKS + 1 and own * prompt_blocks <= 20, (prompt, response, block)


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


@needs_devices(8)
def test_data_parallel_generation_equals_one_device(llama):
    """Prefill rows split over data=4 give the one-device sampled tokens and log-probs (greedy tokens under
    data=4,tensor=2: `test_greedy_equals_transformers`). The 6 samples of 3 prompts (one prefill bucket) refill as
    prefill calls of 4 + 2 rows, the 2 padded to 4 under data=4."""
    _, path = llama
    prompts = _prompts(7, (9, 14, 12))
    data4 = Layout.from_config({"mesh": {"data": 4}, "rules": "dp_tp_gen", "devices": [0, 1, 2, 3]})
    sampling = SamplingParams(max_new_tokens=8, n=2, seed=9)
    expected = _generator(path, slots=8)[1].generate(prompts, sampling)
    got = _generator(path, data4, slots=8)[1].generate(prompts, sampling)
    assert [o.tokens.tolist() for o in got] == [o.tokens.tolist() for o in expected]
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


@needs_devices(8)
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
