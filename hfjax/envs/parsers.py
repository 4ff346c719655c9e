"""Tool-call formats of model families: parsing a model turn's text into its tool calls (`ParsedAction`) and
turning tool results into the chat messages that the family's own chat template renders. `HermesParser` reads the
Hermes/Qwen `<tool_call>{...}</tool_call>` blocks; `Llama3JsonParser` reads Llama 3.1/3.2 JSON tool calls. Malformed
calls never raise: they are listed in `ParsedAction.errors` with their text."""

from __future__ import annotations

import contextlib
import difflib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from hfjax.envs.base import EnvError
from hfjax.envs.tools import ToolResult

_SHOWN_CHARS = 200  # how much of a malformed call's text an error quotes


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: a tool name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedAction:
    """A model turn split into its text outside the tool calls (stripped), its well-formed calls in order, and one
    error per malformed call (what was wrong and the offending text)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _quote(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...")


def _to_call(obj: Any, text: str, argument_keys: tuple[str, ...]) -> ToolCall | str:
    """The call a decoded JSON object describes, or an error naming what is wrong with it."""
    expected = f'expected {{"name": ..., "{argument_keys[0]}": {{...}}}}'
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return f"tool call without a name, {expected}: {_quote(text)}"
    key = next((k for k in argument_keys if k in obj), None)
    arguments = obj[key] if key else {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return f"tool call {obj['name']!r}: arguments are not a JSON object, {expected}: {_quote(text)}"
    return ToolCall(obj["name"], arguments)


class ToolCallParser:
    """A model family's tool-call format: `parse` reads a turn, `format_results` writes the tool messages."""

    def parse(self, text: str) -> ParsedAction:
        """The tool calls in a model turn's text."""
        raise NotImplementedError(f"{type(self).__name__} does not define parse")

    def format_results(self, results: list[ToolResult]) -> list[dict[str, Any]]:
        """The chat messages that show `results` to the model, in order."""
        raise NotImplementedError(f"{type(self).__name__} does not define format_results")


class HermesParser(ToolCallParser):
    """Hermes / Qwen2, 2.5 and 3: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (any
    whitespace inside the tags); a turn may hold several. Results are `tool` messages with the tool's name."""

    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _OPEN = "<tool_call>"

    def parse(self, text: str) -> ParsedAction:
        calls: list[ToolCall] = []
        errors: list[str] = []
        for match in self._BLOCK.finditer(text):
            body = match.group(1)
            try:
                call = _to_call(json.loads(body), body, ("arguments", "parameters"))
            except json.JSONDecodeError as exc:
                call = f"malformed tool call (invalid JSON: {exc.msg}): {_quote(body)}"
            (calls if isinstance(call, ToolCall) else errors).append(call)
        content = self._BLOCK.sub("", text)
        if self._OPEN in content:
            content, tail = content.split(self._OPEN, 1)
            errors.append(f"unclosed <tool_call> (no </tool_call>): {_quote(tail)}")
        return ParsedAction(content.strip(), calls, errors)

    def format_results(self, results: list[ToolResult]) -> list[dict[str, Any]]:
        return [{"role": "tool", "name": r.name, "content": r.content} for r in results]


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1 / 3.2 JSON tool calling: the whole turn, or the part after `<|python_tag|>`, is a JSON object
    `{"name": ..., "parameters": {...}}` ("arguments" is accepted too), or several separated by ';'. A turn that
    starts with '{' is read as calls. Results are `ipython` messages."""

    _TAG = "<|python_tag|>"
    _DECODER = json.JSONDecoder()

    def parse(self, text: str) -> ParsedAction:
        if self._TAG in text:
            content, payload = text.split(self._TAG, 1)
        elif text.lstrip().startswith("{"):
            content, payload = "", text
        else:
            return ParsedAction(text.strip())
        calls: list[ToolCall] = []
        errors: list[str] = []
        payload = payload.strip()
        pos = 0
        while pos < len(payload):
            try:
                obj, end = self._DECODER.raw_decode(payload, pos)
            except json.JSONDecodeError as exc:
                errors.append(f"malformed tool call (invalid JSON: {exc.msg}): {_quote(payload[pos:])}")
                break
            call = _to_call(obj, payload[pos:end], ("parameters", "arguments"))
            (calls if isinstance(call, ToolCall) else errors).append(call)
            rest = payload[end:].lstrip()
            if rest and not rest.startswith(";"):
                errors.append(f"text after a tool call, expected ';' and another call: {_quote(rest)}")
                break
            pos = len(payload) - len(rest[1:].lstrip())
        return ParsedAction(content.strip(), calls, errors)

    def format_results(self, results: list[ToolResult]) -> list[dict[str, Any]]:
        return [{"role": "ipython", "content": r.content} for r in results]


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
DEFAULT_PARSER = "hermes"  # the format of model families without one of their own
_MODEL_TYPE_PARSERS = {"qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "llama": "llama3_json"}


def get_parser(name: str) -> ToolCallParser:
    """The parser registered as `name` in `PARSERS`."""
    if name not in PARSERS:
        close = difflib.get_close_matches(name, PARSERS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise EnvError(f"unknown tool-call parser {name!r}; {hint}known parsers: {sorted(PARSERS)}")
    return PARSERS[name]()


def parser_for_model_type(model_type: str) -> str:
    """The parser name for a Hugging Face `config.model_type` ("qwen2", "qwen3" -> hermes, "llama" -> llama3_json);
    hermes for other types."""
    return _MODEL_TYPE_PARSERS.get(model_type, DEFAULT_PARSER)
