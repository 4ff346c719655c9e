"""Partial rollouts: a generation interrupted part way returns each sample's tokens so far, and generation across a
weight change gives, per sample, the first policy's tokens up to the change and then the second policy's
continuation of that prefix, with each token's log prob under the policy that sampled it (checked against the
uninterrupted generations and a teacher-forced forward of each policy) and its version; the random streams of the
samples and continuations of consecutive steps never repeat (checked on the keys a stand-in generator is asked
for)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from support.checkpoints import save_hf_model
from support.tiny_models import compiled_forward, full_forward_routes

from hfjax.models import load_hf
from hfjax.rollout import JaxEngine, OfflineGenerator, SamplingParams
from hfjax.rollout.generator import SampleOutput
from hfjax.rollout.sampling import sample_key
from hfjax.workers import partial_rollout
from hfjax.workers.partial_rollout import generate_across_versions
from hfjax.workers.sequences import assemble

VOCAB, NEW = 96, 10


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """Two policies of one architecture (different random weights): the model and parameters of each."""
    root = tmp_path_factory.mktemp("partial")
    out = []
    for seed in (0, 1):
        _, path = save_hf_model(root, "llama", seed=seed, vocab_size=VOCAB, eos_token_id=7)
        model = load_hf(path, dtype="float32")
        out.append((model, nnx.split(model, nnx.Param, ...)[1]))
    return out


def _generator(model, params, slots=4):
    engine = JaxEngine(model, max_concurrent_decodes=slots, max_prefill_length=32, max_new_tokens=NEW)
    return OfflineGenerator(engine, params, progress=False)


def _prompts(lengths=(5, 9, 12)):
    rng = np.random.default_rng(3)
    return [rng.integers(8, VOCAB, n).astype(np.int32) for n in lengths]


def test_interrupt_returns_each_samples_tokens_so_far(policies):
    (model, params), _ = policies
    generator = _generator(model, params, slots=2)  # the third prompt waits for a slot
    greedy = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=())
    full = generator.generate(_prompts(), greedy)
    asked = []
    cut = generator.generate(_prompts(), greedy, interrupt=lambda: asked.append(1) or True, check_every=3)
    assert len(asked) == 1
    assert [o.finish_reason for o in cut] == ["interrupted"] * 3
    assert [len(o.tokens) for o in cut] == [4, 4, 0]  # the first token from prefill, then 3 decode steps
    for got, want in zip(cut, full, strict=True):
        n = len(got.tokens)
        assert got.tokens.tolist() == want.tokens[:n].tolist()
        np.testing.assert_allclose(got.logprobs, want.logprobs[:n], rtol=1e-5, atol=1e-6)
    # an interrupt that never fires changes nothing
    calm = generator.generate(_prompts(), greedy, interrupt=lambda: False, check_every=2)
    assert [o.tokens.tolist() for o in calm] == [o.tokens.tolist() for o in full]


def _log_softmax(logits):
    return np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1))


def _teacher_forced_logprobs(model, prompt, tokens):
    """Log prob of each of `tokens` after `prompt` under `model` (one forward over the whole sequence)."""
    sequence = np.concatenate([prompt, tokens])[None]
    logits = np.asarray(compiled_forward(model, sequence))[0]
    rows = _log_softmax(logits[len(prompt) - 1 : len(sequence[0]) - 1])
    return rows[np.arange(len(tokens)), tokens]


@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.slow), 1.0])
def test_generation_across_a_weight_change_concatenates_both_policies(policies, temperature):
    (model_a, params_a), (model_b, params_b) = policies
    generator = _generator(model_a, params_a)
    sampling = SamplingParams(max_new_tokens=NEW, temperature=temperature, stop_token_ids=(), seed=5)
    if temperature == 0:
        reference_a = generator.generate(_prompts(), sampling)
    published = {"version": 0}

    def newer():
        published["version"] = 1  # the second policy appears after the first look
        return generator.params is params_a

    def load_newest():
        generator.update_params(params_b)
        return published["version"]

    prompts = _prompts()
    out = generate_across_versions(
        generator, prompts, sampling, 0, version=0, newer=newer, load_newest=load_newest, check_every=3
    )
    switched = 0
    for o, prompt in zip(out, prompts, strict=True):
        assert len(o.tokens) == NEW and o.finish_reason == "length"
        assert np.all(np.diff(o.versions) >= 0) and set(o.versions.tolist()) <= {0, 1}
        m = int(np.sum(o.versions == 0))
        switched += 0 < m < NEW
        # each token's log prob is the one of the policy that sampled it, given everything before it
        want = np.concatenate(
            [
                _teacher_forced_logprobs(model_a, prompt, o.tokens[:m]),
                _teacher_forced_logprobs(model_b, np.concatenate([prompt, o.tokens[:m]]), o.tokens[m:]),
            ]
        )
        np.testing.assert_allclose(o.logprobs, want, rtol=1e-4, atol=1e-4)
        if temperature == 0:  # greedy: the first policy's tokens, then the second policy's continuation
            assert o.tokens[:m].tolist() == reference_a[o.request].tokens[:m].tolist()
            resumed = _generator(model_b, params_b).generate(
                [np.concatenate([prompt, o.tokens[:m]])], dataclasses.replace(sampling, max_new_tokens=NEW - m)
            )[0]
            assert o.tokens[m:].tolist() == resumed.tokens.tolist()
    assert switched == len(prompts)  # every sample was under way when the weights changed
    batch = assemble(np.zeros((3, 1), np.int32), np.ones((3, 1), np.int32), out, 1, NEW, 0)
    np.testing.assert_array_equal(batch["rollout_versions"], np.stack([o.versions for o in out]))


def test_routes_across_a_weight_change_are_those_of_the_weights_that_first_ran_each_position(tmp_path):
    """Routing replay across a weight change (two random Qwen3-MoE policies): each sample's recorded experts are the
    first policy's full forward over the prompt and its tokens, up to the last token it fed, and the second policy's
    from there on, position by position."""
    moe = []
    for seed in (0, 1):
        _, path = save_hf_model(tmp_path, "qwen3_moe", seed=seed, vocab_size=VOCAB, eos_token_id=7)
        model = load_hf(path, dtype="float32")
        moe.append((model, nnx.split(model, nnx.Param, ...)[1]))
    (model_a, params_a), (model_b, params_b) = moe
    engine = JaxEngine(
        model_a, max_concurrent_decodes=4, max_prefill_length=32, max_new_tokens=NEW, record_experts=True
    )
    generator = OfflineGenerator(engine, params_a, progress=False)

    def load_newest():
        generator.update_params(params_b)
        return 1

    sampling = SamplingParams(max_new_tokens=NEW, temperature=1.0, stop_token_ids=(), seed=5)
    prompts = _prompts()
    out = generate_across_versions(
        generator, prompts, sampling, 0, version=0, newer=lambda: generator.params is params_a,
        load_newest=load_newest, check_every=3,
    )  # fmt: skip

    for o, prompt in zip(out, prompts, strict=True):
        m = int(np.sum(o.versions == 0))
        assert 0 < m < NEW
        sequence = np.concatenate([prompt, o.tokens[:-1]])
        first = len(prompt) + m - 1  # positions the first policy ran: the prompt and its tokens but the last
        want = np.concatenate(
            [full_forward_routes(model_a, sequence)[:first], full_forward_routes(model_b, sequence)[first:]]
        )
        np.testing.assert_array_equal(o.experts, want)


class _KeyRecorder:
    """A stand-in generator that records the (seed, request id, sample) of every sample it is asked for and returns
    one token per sample, `interrupted` while an interrupt is given and fewer than `rounds` calls ran, else every
    token of the budget."""

    def __init__(self, rounds: int):
        self.rounds, self.calls, self.streams = rounds, 0, []

    def generate(self, prompts, sampling, first_request, interrupt=None, check_every=8):
        ids = np.arange(first_request, first_request + len(prompts)) if np.ndim(first_request) == 0 else first_request
        self.calls += 1
        cut = interrupt is not None and self.calls <= self.rounds
        out = []
        for r, request in enumerate(ids):
            for i in range(sampling.n):
                self.streams.append((sampling.seed, int(request), i))
                count = 1 if cut else sampling.max_new_tokens
                reason = "interrupted" if cut else "length"
                out.append(SampleOutput(r, i, np.zeros(count, np.int32), np.zeros(count, np.float32), reason))
        return out


def _step_streams(seed: int, rounds: int) -> list[tuple[int, int, int]]:
    """The streams of one step's partial rollout: 3 + 2 prompts on two workers (the second's first request 3), 2
    samples each, moving to newer weights `rounds` times."""
    streams = []
    for first, count in ((0, 3), (3, 2)):
        recorder = _KeyRecorder(rounds)
        sampling = SamplingParams(max_new_tokens=6, n=2, seed=seed)
        out = generate_across_versions(
            recorder, _prompts()[:count], sampling, first, version=0, newer=lambda: True, load_newest=lambda: 1
        )
        assert [len(o.tokens) for o in out] == [6] * 2 * count  # every round's tokens, to the budget
        streams += recorder.streams
    return streams


def _keys(streams: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The raw key of each stream, as the engine derives it (int32 seeds and request ids)."""
    seed, request, sample = (np.asarray(column, np.int64).astype(np.int32) for column in zip(*streams, strict=True))
    return [tuple(k) for k in np.asarray(sample_key(seed, request, sample)).tolist()]


def test_partial_rollout_streams_never_repeat_within_or_across_steps():
    this_step, next_step = _keys(_step_streams(5, rounds=3)), _keys(_step_streams(6, rounds=3))
    assert len(this_step) == 5 * 2 * 4  # each sample: its first call and 3 continuations
    assert len(set(this_step)) == len(this_step) and len(set(next_step)) == len(next_step)
    assert not set(this_step) & set(next_step)


def test_continuation_request_ids_and_their_limit(monkeypatch):
    ids = {partial_rollout.continuation_request(r, s, 2, k) for r in range(4) for s in range(2) for k in (1, 2, 128)}
    assert len(ids) == 4 * 2 * 3 and max(ids) < 0 and min(ids) >= -(2**31)
    assert partial_rollout.continuation_request(2**23 - 1, 1, 2, 128) == -(2**31)  # the last id int32 holds
    with pytest.raises(ValueError, match=r"sample 16777216 .* expected a sample below 16777216"):
        partial_rollout.continuation_request(2**23, 0, 2, 1)
    # the last round allowed runs without an interrupt: every sample ends however often the weights change
    monkeypatch.setattr(partial_rollout, "CONTINUATION_ROUNDS", 2)
    recorder = _KeyRecorder(rounds=10)
    sampling = SamplingParams(max_new_tokens=6, n=1)
    out = generate_across_versions(
        recorder, _prompts(), sampling, 0, version=0, newer=lambda: True, load_newest=lambda: 1
    )
    assert recorder.calls == 3 and [o.finish_reason for o in out] == ["length"] * 3
