"""Environments and tools for multi-turn, tool-using rollouts: the `Environment` interface a researcher subclasses,
tools with JSON schemas and a registry that runs them with timeouts, tool-call parsers per model family, the
ready-made `ToolEnvironment`, and the token ids of prompts and observations from the chat template. This layer sits
above `hfjax.rollout` (which generates tokens) and below `hfjax.workers` (which runs trajectories); it imports the
standard library, numpy and `hfjax.user_code`, never JAX."""

from hfjax.envs.base import (
    EnvError,
    Environment,
    Observation,
    StepResult,
    check_observation,
    check_step_result,
    load_environment,
)
from hfjax.envs.chat import observation_tokens, prompt_tokens
from hfjax.envs.parsers import PARSERS, ParsedAction, ToolCall, get_parser, parser_for_model_type
from hfjax.envs.tool_env import ToolEnvironment
from hfjax.envs.tools import Tool, ToolRegistry, ToolResult, tool

__all__ = [
    "PARSERS",
    "EnvError",
    "Environment",
    "Observation",
    "ParsedAction",
    "StepResult",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "ToolRegistry",
    "ToolResult",
    "check_observation",
    "check_step_result",
    "get_parser",
    "load_environment",
    "observation_tokens",
    "parser_for_model_type",
    "prompt_tokens",
    "tool",
]
