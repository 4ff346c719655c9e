"""The engine's JetStream interface and multi-turn appends: `prefill` with an `existing_prefix` and `extend` of a
running slot give the logits and tokens of re-prefilling the whole history (greedy, fp32, Llama and Qwen); the fused
`prefill_insert` gives the tokens of `prefill` then `insert`; `prefill`'s first token is `insert`'s sample 0. Extends
of observations of 5 to 300 tokens compile a bounded number of programs (bucketed shapes, a cap past which a call
pads up to a compiled shape) and give the tokens and log probs of a teacher-forced forward."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from support.checkpoints import relative_error, save_hf_model
from support.tiny_models import TINY, random_model

from hfjax.models import load_hf
from hfjax.rollout import JaxEngine, SamplingParams
from hfjax.rollout.cached_forward import extend_forward, prefill_forward
from hfjax.rollout.extend_shapes import ExtendShape, ExtendShapes
from hfjax.rollout.sampling import SamplerKind, SamplingError

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


def _tokens(seed: int, n: int, vocab: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(seed).integers(8, vocab, n).astype(np.int32)


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


# --------------------------------------------------------------------------------------------- bounded extend compiles
GREEDY_KIND = SamplerKind.of(GREEDY)
ALL_KIND = SamplerKind(top_k=True, top_p=True)
PROMPT_LENGTHS = (9, 20, 37, 60)  # one prompt per slot of a 4-slot engine: extends start at different positions


def _tiny_engine(model, **kwargs) -> JaxEngine:
    """4 slots with 384 positions of their own each (6 blocks of 64, past the prompts in the shared pool): room for a
    60-token prompt and a 300-token observation written by extends from position 0 of an empty slot."""
    return JaxEngine(model, max_concurrent_decodes=4, max_prefill_length=64, max_new_tokens=384, **kwargs)


def _agent_like_calls(seed: int, calls: int = 64) -> list[list[tuple[int, np.ndarray]]]:
    """`calls` extends, each of 1-4 distinct slots with an observation of 5-300 tokens."""
    rng = np.random.default_rng(seed)
    slot_sets = [rng.permutation(4)[: rng.integers(1, 5)] for _ in range(calls)]
    return [[(int(s), _tokens(int(rng.integers(1 << 30)), int(rng.integers(5, 301)), TINY.vocab_size)) for s in slots]
            for slots in slot_sets]  # fmt: skip


def _call_dims(eng: JaxEngine, rows: list[tuple[int, np.ndarray]]) -> tuple[int, int, int]:
    """(rows, longest observation, cache blocks reached) of an extend of `rows` after the slots' prompts."""
    end = max(PROMPT_LENGTHS[slot] + len(obs) for slot, obs in rows)
    return len(rows), max(len(obs) for _, obs in rows), -(-end // eng.block)


def test_extend_shapes_bucket_and_pad_up_past_the_cap():
    shapes = ExtendShapes(slots=4, capacity=384, blocks=8, max_programs=2)
    assert shapes.widths == (16, 24, 32, 48, 64, 96, 128, 192, 256, 384)
    assert (shapes.row_sizes, shapes.live_sizes) == ((1, 2, 4), (1, 2, 4, 8))
    assert shapes.program_bound == 2 + 3 + 10 + 4 - 2
    big, small = ExtendShape(2, 48, 4, GREEDY_KIND), ExtendShape(1, 16, 1, GREEDY_KIND)
    assert shapes.choose(2, 40, 3, GREEDY_KIND) == big
    assert shapes.choose(1, 6, 1, GREEDY_KIND) == small
    assert shapes.choose(1, 20, 2, GREEDY_KIND) == big  # a third shape, past the cap: padded up, nothing compiled
    assert shapes.choose(1, 6, 1, ALL_KIND) == ExtendShape(1, 16, 1, ALL_KIND)  # no compiled shape of its kind
    assert shapes.choose(4, 100, 1, GREEDY_KIND) == ExtendShape(4, 128, 4, GREEDY_KIND)  # none holds it: the maximum
    assert shapes.choose(2, 60, 2, GREEDY_KIND) == ExtendShape(4, 128, 4, GREEDY_KIND)
    assert shapes.compiled == [big, small, ExtendShape(1, 16, 1, ALL_KIND), ExtendShape(4, 128, 4, GREEDY_KIND)]
    with pytest.raises(SamplingError, match="5 rows"):
        shapes.choose(5, 6, 1, GREEDY_KIND)


def test_agent_like_extends_choose_a_bounded_number_of_shapes():
    """64 extends of 1-4 slots with observations of 5-300 tokens, through an engine with the default cap (16): at
    most 16 + 3 + 10 + 4 - 2 = 31 shapes (3 row, 10 width and 4 block buckets), fewer than the shapes of the widths
    rounded to a multiple of 8 tokens (what the agent loop padded to before). Shapes only: no program runs."""
    eng = _tiny_engine(random_model(TINY))
    calls = [_call_dims(eng, rows) for rows in _agent_like_calls(1)]
    for dims in calls:
        eng.extend_shapes.choose(*dims, GREEDY_KIND)
    unbucketed = {(1 << (rows - 1).bit_length(), -(-width // 8), 1 << (live - 1).bit_length())
                  for rows, width, live in calls}  # fmt: skip
    assert len(eng.extend_shapes.compiled) <= 31 < len(unbucketed)


@pytest.fixture(scope="module")
def tiny_lm():
    """A one-layer random model, its parameters and a jitted teacher-forced forward: logits at each row's last real
    token of right-padded rows."""
    model = random_model(TINY)
    _, params, _ = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def last_logits(model, tokens, lengths):
        mask = (np.arange(tokens.shape[1])[None, :] < lengths[:, None]).astype(np.int32)
        logits = model(tokens, mask)
        return jax.numpy.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]

    return model, params, last_logits


def _teacher_forced(model, last_logits, histories: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Greedy tokens and their log probs after each history, from the model's plain forward."""
    logits = np.asarray(last_logits(model, *_padded(histories, 384)), np.float64)
    tokens = logits.argmax(-1)
    shifted = logits - logits.max(-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return tokens, logprobs[np.arange(len(tokens)), tokens]


def test_padded_extends_past_the_cap_equal_a_teacher_forced_forward(tiny_lm):
    """The prompts, then the agent-like extends, through an engine capped at 2 programs: every call runs padded (rows,
    tokens and cache blocks) to one of at most 2 + 3 + 10 + 4 - 2 = 17 compiled shapes, the engine traces exactly
    those, and each row's greedy token and log prob are those of the model's plain forward over its prompt and
    observation (each extend writes after its slot's prompt, over what earlier, longer extends left in the cache)."""
    model, params, last_logits = tiny_lm
    eng = _tiny_engine(model, max_extend_programs=2)
    prompts = [_tokens(30 + i, n, TINY.vocab_size) for i, n in enumerate(PROMPT_LENGTHS)]
    state = eng.init_decode_state()  # greedy, empty slots: the first extend writes the prompts at position 0
    calls = [[(slot, prompt) for slot, prompt in enumerate(prompts)], *_agent_like_calls(1)]
    histories, tokens, logprobs = [], [], []
    for call, rows in enumerate(calls):
        slots = [slot for slot, _ in rows]
        padded, lengths = _padded([obs for _, obs in rows], max(len(obs) for _, obs in rows))
        starts = [PROMPT_LENGTHS[s] if call else 0 for s in slots]
        state, out = eng.extend(
            params, state, slots=slots, padded_tokens=padded, true_length=lengths, starts=starts, kind=GREEDY_KIND
        )
        out = jax.device_get(out)
        histories += [np.concatenate([prompts[slot], obs]) if call else obs for slot, obs in rows]
        tokens += out.tokens[: len(rows)].tolist()
        logprobs += out.logprobs[: len(rows)].tolist()
    requested = {eng.extend_shapes.bucket(*_call_dims(eng, rows), GREEDY_KIND) for rows in calls[1:]}
    assert eng.compiles["extend"] == len(eng.extend_shapes.compiled) <= 17 < len(requested)
    reference_tokens, reference_logprobs = _teacher_forced(model, last_logits, histories)
    assert tokens == reference_tokens.tolist()
    np.testing.assert_allclose(logprobs, reference_logprobs, rtol=1e-5, atol=1e-6)
