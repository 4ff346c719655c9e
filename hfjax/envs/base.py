"""The environment interface of multi-turn rollouts: `Environment` (what a researcher subclasses), `StepResult` (what
its `step` returns), the `Observation` forms, loading an environment class from `path/to/file.py:ClassName`, and
checking what user environments return. Every error is an `EnvError` naming the environment and what was expected."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hfjax.user_code import UserCodeError, load_callable

# What an environment shows the model next: chat messages (rendered with the tokenizer's chat template), token ids
# (appended as they are), plain text (encoded and appended as it is), or None (nothing).
Observation = list[dict[str, Any]] | list[int] | str | None


class EnvError(ValueError):
    """An environment spec that cannot be loaded, or an environment that returned something of the wrong form."""


@dataclass
class StepResult:
    """What `Environment.step` returns: the observation to append, the reward of this turn, whether the trajectory
    ended, and free-form information for logging."""

    observation: Observation = None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment:
    """One trajectory's environment. The rollout loop builds `cls(**env_kwargs)` for each trajectory, calls `reset`
    with the dataset row, then `step` with the text of each model turn until a step returns `done`, and `close` at
    the end. Subclasses define `step` and may override `reset` and `close`."""

    def reset(self, row: dict[str, Any]) -> Observation:
        """Starts the trajectory for a dataset row. None (the default) keeps the row's prompt as the dataset gives
        it; a returned observation replaces the prompt (messages are rendered with the chat template and a
        generation prompt)."""
        return None

    def step(self, action: str) -> StepResult:
        """Responds to one model turn: `action` is its decoded text, without the stop token."""
        raise NotImplementedError(
            f"{type(self).__name__} does not define step: an Environment subclass must define "
            "step(self, action: str) -> StepResult"
        )

    def close(self) -> None:
        """Releases what the trajectory held; called once when it ends. Does nothing by default."""


def load_environment(spec: str) -> type[Environment]:
    """The Environment subclass named by `spec` ("path/to/file.py:ClassName"), loaded through `hfjax.user_code`."""
    try:
        cls = load_callable(spec, "environment")
    except UserCodeError as exc:
        raise EnvError(str(exc)) from exc.__cause__
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        kind = f"class {cls.__name__}" if isinstance(cls, type) else type(cls).__name__
        raise EnvError(f"environment {spec!r}: names a {kind}; expected a subclass of hfjax.envs.Environment")
    if cls.step is Environment.step:
        raise EnvError(f"environment {spec!r}: {cls.__name__} does not define step(self, action: str) -> StepResult")
    return cls


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_message(message: Any, index: int, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise EnvError(f"{where}: message {index} is a {type(message).__name__}; expected a dict")
    for key in ("role", "content"):
        if not isinstance(message.get(key), str):
            raise EnvError(f"{where}: message {index} needs a str {key!r}, got {_describe(message.get(key))}")
    return message


def check_observation(observation: Any, where: str) -> Observation:
    """`observation` if it has one of the `Observation` forms (token ids become Python ints); `where` names its
    source in errors (e.g. "environment MyEnv: step")."""
    if observation is None or isinstance(observation, str):
        return observation
    if not isinstance(observation, list):
        raise EnvError(
            f"{where}: observation is a {type(observation).__name__}; expected a list of messages, a list of "
            "token ids, a str or None"
        )
    if all(isinstance(item, dict) for item in observation):
        return [_check_message(message, i, where) for i, message in enumerate(observation)]
    if all(isinstance(item, numbers.Integral) and not isinstance(item, bool) for item in observation):
        if any(item < 0 for item in observation):
            raise EnvError(f"{where}: observation has negative token ids: {_describe(observation)}")
        return [int(item) for item in observation]
    raise EnvError(
        f"{where}: observation {_describe(observation)} mixes types; expected all message dicts or all token ids"
    )


def check_step_result(result: Any, env_name: str) -> StepResult:
    """What environment `env_name`'s `step` returned as a checked StepResult: a StepResult, or a 4-tuple
    `(observation, reward, done, info)`; the reward a finite real number, `done` a bool, `info` a dict."""
    where = f"environment {env_name}: step"
    if isinstance(result, tuple) and len(result) == 4:
        result = StepResult(*result)
    if not isinstance(result, StepResult):
        raise EnvError(
            f"{where} returned {_describe(result)}; expected a StepResult or a tuple (observation, reward, done, info)"
        )
    reward = result.reward
    if not (isinstance(reward, numbers.Real) and math.isfinite(float(reward))):
        raise EnvError(f"{where} returned reward {_describe(reward)}; expected a finite real number")
    if not isinstance(result.done, bool | np.bool_):
        raise EnvError(f"{where} returned done {_describe(result.done)}; expected True or False")
    if not isinstance(result.info, dict):
        raise EnvError(f"{where} returned info {_describe(result.info)}; expected a dict")
    return StepResult(check_observation(result.observation, where), float(reward), bool(result.done), result.info)
