"""What a multi-turn rollout returns: `Trajectory` (one sample's model and environment tokens, rewards and why it
ended), its finish reasons, and the turn metrics of a batch of them (`agent_columns`, `agent_metrics`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from hfjax.rollout.generator import FINISH_REJECTED, SampleOutput

FINISH_DONE, FINISH_MAX_TURNS, FINISH_LENGTH, FINISH_ENV_ERROR = "done", "max_turns", "length", "env_error"
FINISH_REASONS = (FINISH_DONE, FINISH_MAX_TURNS, FINISH_LENGTH, FINISH_ENV_ERROR, FINISH_REJECTED)


@dataclasses.dataclass
class Trajectory(SampleOutput):
    """A multi-turn sample: `tokens` are everything after `prompt` (model turns and observations), `response_mask` 1
    on the model's tokens, `rewards` each token's reward (a step's reward on the last token of the turn it answered);
    `finish_reason` is `done` (the environment ended it), `max_turns`, `length` (token budget), `env_error` (the
    environment raised, or a step ran past its timeout: `error` says what) or `rejected`."""

    prompt: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    response_mask: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    rewards: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float32))
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0

    @property
    def reward(self) -> float:
        return float(self.rewards.sum())


AGENT_COLUMNS = ("agent_turns", "agent_tool_calls", "agent_tool_errors", "agent_finish")


def agent_columns(trajectories: Sequence[Trajectory]) -> dict[str, np.ndarray]:
    """Per trajectory: turns, tool calls, tool errors and the index of its finish reason in `FINISH_REASONS` (int32
    columns of the rollout batch, so the controller computes the turn metrics over the whole batch)."""
    values = [(t.turns, t.tool_calls, t.tool_errors, FINISH_REASONS.index(t.finish_reason)) for t in trajectories]
    table = np.asarray(values, np.int32).reshape(-1, len(AGENT_COLUMNS))
    return {name: table[:, i] for i, name in enumerate(AGENT_COLUMNS)}


def agent_metrics(columns: dict[str, np.ndarray], env_tokens: int, tokens: int) -> dict[str, float]:
    """The turn metrics of a batch from its `agent_columns`: turns, tool calls and tool errors per trajectory, the
    share of trajectory tokens (`tokens`) that came from environments (`env_tokens`), and the share of each finish
    reason (`agent/finish/<reason>`)."""
    turns = columns["agent_turns"]
    count = max(len(turns), 1)
    out = {
        "agent/turns_mean": float(turns.sum()) / count,
        "agent/turns_max": float(turns.max(initial=0)),
        "agent/tool_calls_mean": float(columns["agent_tool_calls"].sum()) / count,
        "agent/tool_errors_mean": float(columns["agent_tool_errors"].sum()) / count,
        "agent/env_token_share": env_tokens / max(tokens, 1),
    }
    for code, reason in enumerate(FINISH_REASONS):
        out[f"agent/finish/{reason}"] = float((columns["agent_finish"] == code).sum()) / count
    return out


def batch_agent_metrics(batch: dict[str, np.ndarray]) -> dict[str, float]:
    """The turn metrics (`hfjax.envs.trajectory.agent_metrics`) of a whole rollout batch of trajectories; environment
    tokens are the attended response tokens outside `response_mask`."""
    width = batch["responses"].shape[1]
    attended = int(np.asarray(batch["attention_mask"])[:, -width:].sum())
    env_tokens = attended - int(np.asarray(batch["response_mask"]).sum())
    return agent_metrics({k: np.asarray(batch[k]) for k in AGENT_COLUMNS}, env_tokens, attended)
