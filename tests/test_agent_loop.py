"""Multi-turn rollouts (`AgentGenerator`): appending observations to running slots gives the tokens of re-prefilling
the history; continuous batching with environments equals one trajectory at a time; model tokens' logprobs equal a
teacher-forced forward of the whole trajectory while environment tokens are masked with logprob 0; tool errors and
timeouts become observations and the trajectory goes on; turn and token limits, environment errors and environment
steps past `env_step_timeout_s` end trajectories with their reason; a tool environment gets the parser of the
policy's model family."""

from __future__ import annotations

import threading
import time
from typing import ClassVar

import jax
import numpy as np
import pytest
from flax import nnx
from support.checkpoints import save_hf_model
from support.tiny_models import full_forward_routes

from hfjax.data.synthetic import build_addition_tokenizer
from hfjax.envs import Environment, StepResult, ToolEnvironment
from hfjax.envs.agent_loop import AgentGenerator, turn_request
from hfjax.envs.trajectory import agent_columns, agent_metrics
from hfjax.models import load_hf
from hfjax.rollout import JaxEngine, OfflineGenerator, SamplingParams
from hfjax.rollout.sampling import SamplingError

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=5)


class CountingEnv(Environment):
    """Ends after `row["turns"]` turns; turn k's observation is k + 2 copies of token 10 + k; reward 0.5 per
    observation and the number of turns at the end."""

    def reset(self, row):
        self.row, self.turn = row, 0

    def step(self, action):
        self.turn += 1
        if self.turn >= self.row["turns"]:
            return StepResult(None, reward=float(self.turn), done=True)
        return StepResult([10 + self.turn] * (self.turn + 2), reward=0.5)


def _slow(seconds: float) -> str:
    """Sleeps."""
    time.sleep(seconds)
    return "slept"


def _broken(x: int) -> str:
    """Raises."""
    raise ZeroDivisionError("tool failed")


def _number(x: int) -> str:
    """Returns an int, not text."""
    return x  # type: ignore[return-value]


class FlakyToolEnv(ToolEnvironment):
    """Whatever the model writes, turn k calls tool k: one that raises, one that hangs past its timeout, one that
    returns non-text, then the final answer (its calls in the Hermes format, whatever the model)."""

    parser = "hermes"
    tools = (_broken, _slow, _number)
    tool_timeout_s = 0.3
    calls = (
        '"_broken", "arguments": {"x": 1}',
        '"_slow", "arguments": {"seconds": 5}',
        '"_number", "arguments": {"x": 2}',
    )

    def reset(self, row):
        self.turn = 0
        return super().reset(row)

    def step(self, action):
        self.turn += 1
        call = f'<tool_call>{{"name": {self.calls[self.turn - 1]}}}</tool_call>' if self.turn <= 3 else "42"
        result = super().step(call)
        self.observed = result.observation
        return result


class RaisingEnv(CountingEnv):
    def step(self, action):
        if self.row["turns"] == 2:
            raise RuntimeError("environment bug")
        return super().step(action)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokenizer = build_addition_tokenizer()
    _, path = save_hf_model(
        tmp_path_factory.mktemp("agent"), "llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id
    )
    model = load_hf(path, dtype="float32")
    _, params, _ = nnx.split(model, nnx.Param, ...)
    return model, params, tokenizer


def _agent(setup, env=CountingEnv, slots=4, max_new=64, max_prefill=96, **kwargs):
    model, params, tokenizer = setup
    engine = JaxEngine(model, max_concurrent_decodes=slots, max_prefill_length=max_prefill, max_new_tokens=max_new)
    options = {"max_turns": 4, "max_tokens": 60, "max_tokens_per_turn": 6, **kwargs}
    return AgentGenerator(OfflineGenerator(engine, params, progress=False), env, tokenizer, **options)


def _prompts(n: int) -> tuple[list[list[int]], list[dict]]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 20, int(rng.integers(3, 12))).tolist() for _ in range(n)]
    return prompts, [{"turns": 1 + i % 4} for i in range(n)]


def _as_lists(trajectories) -> list[tuple]:
    return [(t.tokens.tolist(), t.response_mask.tolist(), t.finish_reason, t.turns) for t in trajectories]


def test_appending_observations_equals_re_prefilling_the_history(setup):
    prompts, rows = _prompts(6)
    extended = _agent(setup, slots=4).generate(prompts, rows, GREEDY)
    reprefilled = _agent(setup, slots=4, append="reprefill").generate(prompts, rows, GREEDY)
    assert _as_lists(extended) == _as_lists(reprefilled)
    assert [t.turns for t in extended] == [r["turns"] for r in rows]  # 1 to 4 turns in one batch


def test_turn_request_ids_are_negative_and_one_to_one():
    ids = {turn_request(r, t, 4) for r in range(5) for t in (2, 3, 4)}
    assert len(ids) == 15 and max(ids) < 0
    assert turn_request(2**29 - 1, 4, 4) == -1 - (2**31 - 2)  # within int32
    with pytest.raises(SamplingError, match="turn 1 of request 0 with max_turns=4: expected a turn from 2"):
        turn_request(0, 1, 4)
    with pytest.raises(SamplingError, match=r"request x max_turns below 2\*\*31"):
        turn_request(2**29, 2, 4)


def test_every_re_prefilled_turn_samples_with_a_key_of_its_own(setup):
    """The keys (seed, request id, sample) of every prefill of a sampled re-prefill rollout, first turns and later
    turns alike, are distinct: no turn replays another turn's random numbers."""
    prompts, rows = _prompts(4)  # 1 + 2 + 3 + 4 turns, 2 samples each
    agent = _agent(setup, append="reprefill")
    keys, fill = [], agent.generator.fill

    def recording_fill(state, histories, batch, targets, sampling, request_index):
        keys.extend((sampling.seed, int(request_index[r]), i) for r, i in batch)
        return fill(state, histories, batch, targets, sampling, request_index)

    agent.generator.fill = recording_fill
    trajectories = agent.generate(prompts, rows, SAMPLED)
    assert len(keys) == sum(t.turns for t in trajectories) == 2 * (1 + 2 + 3 + 4)
    assert len(set(keys)) == len(keys)


def test_continuous_batching_with_environments_equals_one_at_a_time(setup):
    prompts, rows = _prompts(5)
    batched = _agent(setup, slots=3).generate(prompts, rows, SAMPLED)
    alone = _agent(setup, slots=2)
    singles = [t for r in range(5) for t in alone.generate([prompts[r]], [rows[r]], SAMPLED, first_request=r)]
    assert _as_lists(batched) == _as_lists(singles)
    for ours, alone_ in zip(batched, singles, strict=True):
        np.testing.assert_allclose(ours.logprobs, alone_.logprobs, atol=1e-5)


def test_model_tokens_have_teacher_forced_logprobs_and_environment_tokens_are_masked(setup):
    model, _, _ = setup
    prompts, rows = _prompts(4)
    trajectories = _agent(setup).generate(prompts, rows, SAMPLED)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, ids: jax.nn.log_softmax(nnx.merge(graphdef, s)(ids), axis=-1))
    for t in trajectories:
        whole = np.concatenate([t.prompt, t.tokens])
        padded = np.zeros((1, 128), np.int32)
        padded[0, : len(whole)] = whole
        logp = np.asarray(forward(state, padded))[0, len(t.prompt) - 1 : len(whole) - 1]
        expected = logp[np.arange(len(t.tokens)), t.tokens]
        model_tokens = t.response_mask.astype(bool)
        np.testing.assert_allclose(t.logprobs[model_tokens], expected[model_tokens], rtol=1e-4, atol=1e-4)
        assert not t.logprobs[~model_tokens].any()
        # the environment's tokens, turn by turn, where the mask says
        observed = t.tokens[~model_tokens].tolist()
        assert observed == [10 + k for k in range(1, t.turns) for _ in range(k + 2)]
        # rewards: 0.5 after each observation-producing turn, the turn count at the end, on the turns' last tokens
        assert t.reward == pytest.approx(0.5 * (t.turns - 1) + t.turns)
        ends = np.flatnonzero(t.rewards)
        assert all(t.response_mask[i] == 1 and (i + 1 == len(t.tokens) or t.response_mask[i + 1] == 0) for i in ends)
    env_tokens = sum(int((t.response_mask == 0).sum()) for t in trajectories)
    metrics = agent_metrics(agent_columns(trajectories), env_tokens, sum(len(t.tokens) for t in trajectories))
    assert metrics["agent/finish/done"] == 1.0
    assert metrics["agent/turns_mean"] == pytest.approx(np.mean([t.turns for t in trajectories]))


def test_tool_errors_and_timeouts_become_observations_and_the_trajectory_continues(setup):
    agent = _agent(setup, env=FlakyToolEnv, max_turns=6, max_tokens=480, max_new=480)  # error texts are long
    (trajectory,) = agent.generate([[5, 6, 7]], [{"turns": 0}], GREEDY)
    assert agent.last_stats["env_wait_seconds"] < 2.5  # the 5 s tool was abandoned at its 0.3 s timeout
    assert trajectory.finish_reason == "done" and trajectory.turns == 4
    assert trajectory.tool_calls == 3 and trajectory.tool_errors == 3
    _, _, tokenizer = setup
    text = tokenizer.decode(trajectory.tokens[trajectory.response_mask == 0].tolist())
    assert "ZeroDivisionError" in text and "timed out" in text and "int" in text


def test_limits_and_environment_errors_end_trajectories_with_their_reason(setup):
    prompts, rows = _prompts(4)  # 1, 2, 3, 4 turns wanted
    limited = _agent(setup, max_turns=2).generate(prompts, rows, GREEDY)
    assert [t.finish_reason for t in limited] == ["done", "done", "max_turns", "max_turns"]
    assert all(t.turns <= 2 for t in limited)
    budget = _agent(setup, max_tokens=14).generate(prompts, rows, GREEDY)
    assert [t.finish_reason for t in budget][2:] == ["length", "length"]
    assert all(len(t.tokens) <= 14 for t in budget)
    failing = _agent(setup, env=RaisingEnv).generate(prompts, rows, GREEDY)
    assert [t.finish_reason for t in failing] == ["done", "env_error", "done", "done"]
    assert "environment bug" in failing[1].error


class LongObservationEnv(CountingEnv):
    def step(self, action):
        result = super().step(action)
        return StepResult([9] * 40, result.reward, result.done) if not result.done else result


def test_observations_may_be_longer_than_the_prompt_limit(setup):
    prompts, rows = _prompts(3)
    trajectories = _agent(setup, env=LongObservationEnv, max_prefill=16, max_tokens=120, max_new=120).generate(
        prompts, rows, GREEDY
    )
    assert [t.finish_reason for t in trajectories] == ["done"] * 3
    assert [int((t.response_mask == 0).sum()) for t in trajectories] == [40 * (r["turns"] - 1) for r in rows]


class HangingEnv(CountingEnv):
    """Row `hang` hangs in its second step until the test releases it; closing is recorded."""

    release = threading.Event()
    closed: ClassVar[list[int]] = []

    def step(self, action):
        if self.row.get("hang") and self.turn == 1:
            self.release.wait(30)
        return super().step(action)

    def close(self):
        self.closed.append(self.row["turns"])


def test_a_hanging_environment_step_ends_its_trajectory_at_the_step_timeout(setup):
    prompts, rows = _prompts(3)
    rows = [{"turns": 3}, {"turns": 3, "hang": True}, {"turns": 2}]
    HangingEnv.release.clear()
    HangingEnv.closed.clear()
    agent = _agent(setup, env=HangingEnv, env_step_timeout_s=0.5)
    start = time.monotonic()
    out = agent.generate(prompts, rows, GREEDY)
    assert time.monotonic() - start < 20
    assert [t.finish_reason for t in out] == ["done", "env_error", "done"]
    assert out[1].error == "HangingEnv.step: no result within 0.5 s" and out[1].turns == 2
    assert agent.last_stats["env_timeouts"] == 1
    assert sorted(HangingEnv.closed) == [2, 3]  # the hanging environment is not closed under its running step
    HangingEnv.release.set()
    deadline = time.monotonic() + 5
    while len(HangingEnv.closed) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(HangingEnv.closed) == [2, 3, 3]  # closed once the step returned


class LlamaToolEnv(ToolEnvironment):
    """A tool environment that names no parser."""


def test_tool_environment_gets_the_parser_of_the_model_family(setup):
    assert _agent(setup, env=LlamaToolEnv).env_kwargs == {"parser": "llama3_json"}  # the test model is a Llama
    assert _agent(setup, env=LlamaToolEnv, env_kwargs={"parser": "hermes"}).env_kwargs == {"parser": "hermes"}
    assert _agent(setup, env=FlakyToolEnv).env_kwargs == {}  # names its own


@pytest.mark.parametrize("append", ["extend", "reprefill"])
def test_a_mixture_of_experts_agent_records_the_routes_of_every_token(tmp_path, append):
    """With an engine that records routes (routing replay), each trajectory's experts (its prompt's, its model
    tokens' and its observations', appended by `extend` or re-prefilled with the history) are those a full forward
    over the prompt and the trajectory chooses, position by position (float32)."""
    tokenizer = build_addition_tokenizer()
    _, path = save_hf_model(tmp_path, "qwen3_moe", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    model = load_hf(path, dtype="float32")
    engine = JaxEngine(model, max_concurrent_decodes=4, max_prefill_length=96, max_new_tokens=64, record_experts=True)
    generator = OfflineGenerator(engine, nnx.state(model, nnx.Param), progress=False)
    options = {"max_turns": 4, "max_tokens": 60, "max_tokens_per_turn": 6, "append": append}
    prompts, rows = _prompts(4)
    trajectories = AgentGenerator(generator, CountingEnv, tokenizer, **options).generate(prompts, rows, SAMPLED)
    assert max(t.turns for t in trajectories) >= 3 and not all(t.response_mask.all() for t in trajectories)
    for t in trajectories:
        sequence = np.concatenate([t.prompt, t.tokens[:-1]])
        assert t.experts.shape == (len(sequence), 1, 2)
        np.testing.assert_array_equal(t.experts, full_forward_routes(model, sequence))
