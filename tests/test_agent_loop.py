"""Multi-turn rollouts (`AgentGenerator`): appending observations to running slots gives the tokens of re-prefilling
the history; continuous batching with environments equals one trajectory at a time; model tokens' logprobs equal a
teacher-forced forward of the whole trajectory while environment tokens are masked with logprob 0; tool errors and
timeouts become observations and the trajectory goes on; turn and token limits end trajectories with their reason."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest
from checkpoints import save_hf_model
from flax import nnx

from hfjax.data.synthetic import build_addition_tokenizer
from hfjax.envs import Environment, StepResult, ToolEnvironment
from hfjax.envs.agent_loop import AgentGenerator, agent_columns, agent_metrics
from hfjax.models import load_hf
from hfjax.rollout import JaxEngine, OfflineGenerator, SamplingParams

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
    returns non-text, then the final answer."""

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
