"""The engine's JetStream interface and multi-turn appends: `prefill` with an `existing_prefix` and `extend` of a
running slot give the logits and tokens of re-prefilling the whole history (greedy, fp32, Llama and Qwen); the fused
`prefill_insert` gives the tokens of `prefill` then `insert`; `prefill`'s first token is `insert`'s sample 0."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from checkpoints import relative_error, save_hf_model
from flax import nnx

from hfjax.models import load_hf
from hfjax.rollout import JaxEngine, SamplingParams
from hfjax.rollout.cached_forward import extend_forward, prefill_forward
from hfjax.rollout.sampling import SamplerKind

VOCAB = 96
EOS = 7
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, top_k=20, seed=11)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def engine(request, tmp_path_factory):
    _, path = save_hf_model(tmp_path_factory.mktemp(request.param), request.param, vocab_size=VOCAB, eos_token_id=EOS)
    model = load_hf(path, dtype="float32")
    _, params, _ = nnx.split(model, nnx.Param, ...)
    return model, params, JaxEngine(model, max_concurrent_decodes=4, max_prefill_length=64, max_new_tokens=32)


def _tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(8, VOCAB, n).astype(np.int32)


def _padded(rows: list[np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray]:
    out = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out, np.array([len(r) for r in rows], np.int32)


def test_extend_forward_equals_prefill_of_the_whole_history(engine):
    model, _, _ = engine
    history, observation = [_tokens(1, 13), _tokens(2, 5)], [_tokens(3, 7), _tokens(4, 11)]
    joined = [np.concatenate(p) for p in zip(history, observation, strict=True)]
    whole = jax.jit(prefill_forward)(model, *_padded(joined, 32))
    cached = jax.jit(prefill_forward)(model, *_padded(history, 32))  # a 32-position cache: the appends fit in it
    tokens, counts = _padded(observation, 16)
    appended = jax.jit(extend_forward)(model, tokens, cached.lengths, counts, cached.keys, cached.values)
    assert np.array_equal(appended.lengths, whole.lengths)
    assert relative_error(np.asarray(appended.last_logits), np.asarray(whole.last_logits)) < 1e-5
    for row, n in enumerate(np.asarray(whole.lengths)):
        for ours, reference in zip(appended.keys, whole.keys, strict=True):
            assert relative_error(np.asarray(ours[row, :n]), np.asarray(reference[row, :n])) < 1e-5


def test_prefill_onto_an_existing_prefix_equals_prefill_of_the_joined_prompts(engine):
    _, params, eng = engine
    head, tail = _tokens(5, 10), _tokens(6, 9)
    existing, _ = eng.prefill(params=params, padded_tokens=_padded([head], 16)[0], true_length=[10])
    joined, first = eng.prefill(
        params=params, existing_prefix=existing, padded_tokens=_padded([tail], 16)[0], true_length=[9], sampler=SAMPLED
    )
    whole, reference = eng.prefill(
        params=params, padded_tokens=_padded([np.concatenate([head, tail])], 24)[0], true_length=[19], sampler=SAMPLED
    )
    assert int(joined.cache.lengths[0]) == 19
    assert relative_error(np.asarray(joined.cache.last_logits), np.asarray(whole.cache.last_logits)) < 1e-5
    assert int(first.tokens[0]) == int(reference.tokens[0])


def _greedy_continue(eng, params, state, slot: int, token: int, length: int, steps: int) -> list[int]:
    out = [token]
    for _ in range(steps):
        state, result = eng.generate(params, state, SamplerKind.of(GREEDY), length + len(out))
        out.append(int(result.tokens[slot]))
    return out


def test_extend_of_a_running_slot_equals_re_prefilling_the_history(engine):
    """Turn 1 decodes in slot 2 next to another sequence; its observation is appended with `extend`; the next turn's
    tokens and logprobs equal those of a fresh prefill of prompt + turn 1 + observation."""
    _, params, eng = engine
    prompt, other, observation = _tokens(7, 12), _tokens(8, 20), _tokens(9, 9)
    state = eng.init_decode_state()
    prefix, _ = eng.prefill(params=params, padded_tokens=_padded([prompt, other], 24)[0], true_length=[12, 20])
    state = eng.insert(prefix, state, [2, 0])
    turn = [int(jax.device_get(state.tokens)[2])]
    for _ in range(5):  # five decode steps of both slots
        state, result = eng.generate(params, state)
        turn.append(int(result.tokens[2]))
    # the cache holds prompt + turn[:-1]; the last sampled token goes in with the observation
    cached = len(prompt) + len(turn) - 1
    state, result = eng.extend(
        params,
        state,
        slots=[2, 4],  # a padding row (slot out of range) is ignored
        padded_tokens=_padded([np.concatenate([[turn[-1]], observation]), observation[:1]], 16)[0],
        true_length=[1 + len(observation), 1],
        starts=[cached, 0],
    )
    history = np.concatenate([prompt, turn, observation])
    fresh_state = eng.init_decode_state()
    fresh, fresh_first = eng.prefill(params=params, padded_tokens=_padded([history], 32)[0], true_length=[len(history)])
    fresh_state = eng.insert(fresh, fresh_state, 1)
    assert int(result.tokens[0]) == int(fresh_first.tokens[0])
    np.testing.assert_allclose(float(result.logprobs[0]), float(fresh_first.logprobs[0]), rtol=1e-5, atol=1e-6)
    assert int(jax.device_get(state.lengths)[2]) == len(history)
    ours = _greedy_continue(eng, params, state, 2, int(result.tokens[0]), len(history), 6)
    reference = _greedy_continue(eng, params, fresh_state, 1, int(fresh_first.tokens[0]), len(history), 6)
    assert ours == reference


def test_fused_prefill_insert_equals_prefill_then_insert(engine):
    _, params, eng = engine
    prompts = [_tokens(10, 6), _tokens(11, 14)]
    tokens, lengths = _padded(prompts, 16)
    requests = np.array([3, 8], np.int32)
    prefix, first = eng.prefill(
        params=params, padded_tokens=tokens, true_length=lengths, sampler=SAMPLED, request_id=requests
    )
    slots, rows, samples = np.array([1, 3, 0]), np.array([0, 1, 1]), np.array([0, 0, 1])
    unfused = eng.insert_samples(prefix, eng.init_decode_state(), slots, rows, samples)
    fused = eng.prefill_insert(
        params, eng.init_decode_state(), tokens, lengths, SAMPLED, requests, slots, rows, samples
    )
    assert np.array_equal(unfused[1].tokens, fused[1].tokens)
    # prefill's token is the one insert gives sample 0 (one key, folded once)
    assert np.array_equal(np.asarray(first.tokens), np.asarray(unfused[1].tokens)[:2])
    states = [unfused[0], fused[0]]
    for _ in range(4):
        steps = [eng.generate(params, s, SamplerKind.of(SAMPLED)) for s in states]
        states = [s for s, _ in steps]
        assert np.array_equal(steps[0][1].tokens, steps[1][1].tokens)
