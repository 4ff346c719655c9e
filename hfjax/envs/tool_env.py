"""`ToolEnvironment`: the environment of a tool-using model, declared by a few class attributes. Each model turn is
parsed for tool calls in the model family's format; calls are run through a `ToolRegistry` and their results (and
one error message per malformed call) become the next observation, and a turn without calls is the final answer,
scored by `score`. The parser is the one the environment names, else the model family's (`with_model_parser`, which
the rollout applies)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from hfjax.envs.base import EnvError, Environment, Observation, StepResult
from hfjax.envs.parsers import DEFAULT_PARSER, get_parser, parser_for_model_type
from hfjax.envs.tools import Tool, ToolRegistry, ToolResult

INVALID_CALL = "invalid_tool_call"  # the tool name on the error message of a malformed call


class ToolEnvironment(Environment):
    """Tools for a model, ended by an answer without tool calls. A subclass sets `tools` (Tools or plain functions
    with type hints and a docstring), `parser` (a name in `hfjax.envs.parsers.PARSERS`; empty, the default: the
    policy model family's, which the rollout passes in, or `DEFAULT_PARSER` when built without one) and
    `tool_timeout_s`, and overrides `score`. Keyword arguments of the constructor (the config's env kwargs) are kept
    in `self.kwargs`; `parser` and `tool_timeout_s` among them override the class attributes for this instance.

    Step info: `tool_calls` (calls the turn asked for, malformed ones included) and `tool_errors` (those that
    failed); both 0 on the final step."""

    tools: ClassVar[Sequence[Tool | Callable[..., Any]]] = ()
    parser: str = ""
    tool_timeout_s: float = 10.0

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.parser = kwargs.get("parser") or type(self).parser or DEFAULT_PARSER
        timeout = kwargs.get("tool_timeout_s", type(self).tool_timeout_s)
        if isinstance(timeout, bool) or not (isinstance(timeout, numbers.Real) and 0 < timeout < math.inf):
            raise EnvError(f"{type(self).__name__}: tool_timeout_s must be a positive finite number, got {timeout!r}")
        self.tool_timeout_s = float(timeout)
        self.row: dict[str, Any] = {}
        self._parser = get_parser(self.parser)
        self._registry = ToolRegistry(self.tools)

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools' function-calling schemas, for rendering the prompt with `tools=`."""
        return self._registry.schemas()

    def reset(self, row: dict[str, Any]) -> Observation:
        """Keeps `row` (as `self.row`, for `score`) and starts from the dataset's prompt."""
        self.row = row
        return None

    def step(self, action: str) -> StepResult:
        """Runs the turn's tool calls, or scores the turn as the final answer when it has none."""
        parsed = self._parser.parse(action)
        if not parsed.calls and not parsed.errors:
            reward = self.score(parsed.content, self.row)
            return StepResult(None, reward=reward, done=True, info={"tool_calls": 0, "tool_errors": 0})
        results = [self._registry.call(c.name, c.arguments, self.tool_timeout_s) for c in parsed.calls]
        results += [ToolResult.failure(INVALID_CALL, error) for error in parsed.errors]
        info = {"tool_calls": len(results), "tool_errors": sum(r.error is not None for r in results)}
        return StepResult(self._parser.format_results(results), reward=0.0, done=False, info=info)

    def score(self, final_text: str, row: dict[str, Any]) -> float:
        """The reward of the final answer `final_text` (the last turn's text outside tool calls) for dataset row
        `row`. 0.0 by default; subclasses override it."""
        return 0.0


def with_model_parser(env_cls: type, env_kwargs: dict[str, Any], model_type: str) -> dict[str, Any]:
    """`env_kwargs` for `env_cls`, given the tool-call `parser` of the model family `model_type` (a Hugging Face
    `model_type`, `parser_for_model_type`) when `env_cls` is a `ToolEnvironment` that names none, neither as its class
    attribute nor in `env_kwargs`; other environments' kwargs unchanged."""
    if issubclass(env_cls, ToolEnvironment) and not env_cls.parser and not env_kwargs.get("parser"):
        return {**env_kwargs, "parser": parser_for_model_type(model_type)}
    return env_kwargs
