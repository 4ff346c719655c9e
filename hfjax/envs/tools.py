"""Tools a model can call: `Tool` (a function with its JSON schema in the function-calling shape chat templates
accept), the `tool` decorator that derives the schema from a plain function's signature, and `ToolRegistry`, which
checks a call's arguments against the schema and runs it with a timeout. A registry never raises on a bad call: an
unknown tool, wrong arguments, a tool that raises, hangs or returns something other than text all become a
`ToolResult` whose `content` is the error text shown to the model. Calls run on at most `MAX_TOOL_THREADS` threads
per process, timed-out calls still running included (`abandoned_tool_calls`)."""

from __future__ import annotations

import inspect
import threading
import time
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hfjax.envs.base import EnvError

MAX_TOOL_THREADS = 64  # tool calls running at once in a process, abandoned (timed-out) ones included

_JSON_TYPES: dict[type, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}
_PYTHON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


@dataclass(frozen=True)
class Tool:
    """A function the model may call by `name`, described to it by `description` and the JSON schema `parameters`
    (an object schema of the keyword arguments `fn` takes). `fn` returns the text shown to the model."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise EnvError(f"tool name {self.name!r}: expected an identifier (letters, digits, underscores)")
        if self.parameters.get("type") != "object" or not isinstance(self.parameters.get("properties", {}), dict):
            raise EnvError(
                f"tool {self.name}: parameters must be a JSON schema with type 'object' and a dict of 'properties', "
                f"got {self.parameters!r}"
            )

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Hugging Face function-calling form (what `apply_chat_template(..., tools=[...])` accepts)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def _json_type(hint: Any, where: str) -> dict[str, Any]:
    origin = typing.get_origin(hint) or hint
    if origin not in _JSON_TYPES:
        raise EnvError(f"{where}: type {hint!r} is not supported; expected one of str, int, float, bool, list, dict")
    schema = {"type": _JSON_TYPES[origin]}
    args = typing.get_args(hint)
    if origin is list and len(args) == 1:
        schema["items"] = _json_type(args[0], where)
    return schema


def _schema_of(fn: Callable[..., Any], fn_name: str) -> dict[str, Any]:
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        where = f"tool function {fn_name}, parameter {param.name!r}"
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise EnvError(f"{where}: *args, **kwargs and positional-only parameters cannot be called by name")
        if param.name not in hints:
            raise EnvError(f"{where}: no type annotation; expected one of str, int, float, bool, list, dict")
        properties[param.name] = _json_type(hints[param.name], where)
        if param.default is param.empty:
            required.append(param.name)
    return {"type": "object", "properties": properties, "required": required}


def _make_tool(function: Callable[..., Any], name: str | None, description: str | None) -> Tool:
    fn_name = getattr(function, "__name__", repr(function))
    doc = inspect.getdoc(function) or ""
    text = description or doc.split("\n\n")[0].replace("\n", " ").strip()
    if not text:
        raise EnvError(f"tool function {fn_name}: no description; give it a docstring or pass description=")
    return Tool(name or fn_name, text, _schema_of(function, fn_name), function)


def tool(
    fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """A Tool built from a plain function: its name, the first paragraph of its docstring as the description and a
    JSON schema from its type hints (parameters without defaults are required). Use as `@tool`, `@tool(name=...)`
    or `tool(fn)`."""
    if fn is None:
        return lambda function: _make_tool(function, name, description)
    return _make_tool(fn, name, description)


@dataclass
class ToolResult:
    """The outcome of one tool call: `content` is the text shown to the model (the tool's output, or the error text
    "Error: ..."); `error` is None on success, else what went wrong."""

    name: str
    content: str
    error: str | None = None

    @classmethod
    def failure(cls, name: str, error: str) -> ToolResult:
        """A failed call, shown to the model as "Error: <error>"."""
        return cls(name, f"Error: {error}", error)


def _argument_error(tool_: Tool, arguments: Any) -> str | None:
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    properties = tool_.parameters.get("properties", {})
    missing = [key for key in tool_.parameters.get("required", []) if key not in arguments]
    if missing:
        return f"missing required arguments {missing}"
    unexpected = [key for key in arguments if key not in properties]
    if unexpected and not tool_.parameters.get("additionalProperties", False):
        return f"unexpected arguments {unexpected}; expected only {list(properties)}"
    for key, value in arguments.items():
        json_type = properties.get(key, {}).get("type")
        allowed = _PYTHON_TYPES.get(json_type)
        if allowed is None:  # no type, or a form this check does not read (e.g. a list of types)
            continue
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            return f"argument {key!r} must be a JSON {json_type}, got {type(value).__name__} {value!r}"
    return None


class _ToolThreads:
    """The process's tool-call threads: at most `limit` at once; `abandoned` counts those still running after their
    call timed out."""

    def __init__(self, limit: int):
        self.limit, self.abandoned = limit, 0
        self._free, self._lock = threading.BoundedSemaphore(limit), threading.Lock()

    def run(self, fn: Callable[[], None], name: str, timeout_s: float) -> bool | None:
        """Runs `fn` on a daemon thread within `timeout_s` seconds (waiting for a free thread included): True if it
        returned in time, False if it was abandoned (it runs on, holding its thread), None if no thread came free."""
        deadline = time.monotonic() + timeout_s
        if not self._free.acquire(timeout=timeout_s):
            return None
        call = {"finished": False, "abandoned": False}

        def body() -> None:
            try:
                fn()
            finally:
                with self._lock:
                    call["finished"] = True
                    self.abandoned -= call["abandoned"]
                self._free.release()

        thread = threading.Thread(target=body, name=name, daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            if not call["finished"]:
                call["abandoned"] = True
                self.abandoned += 1
            return call["finished"]


_THREADS = _ToolThreads(MAX_TOOL_THREADS)


def abandoned_tool_calls() -> int:
    """Tool calls of this process that outlived their timeout and are still running (each holds a thread)."""
    return _THREADS.abandoned


class ToolRegistry:
    """Tools by name, called with checked arguments and a timeout. Each call runs in a daemon thread of its own, one
    of at most `MAX_TOOL_THREADS` in the process; a call that outlives its timeout is abandoned (Python cannot stop a
    thread): it keeps running in the background, holding its thread, until it returns; its result is dropped, and it
    does not delay the process's exit. While every thread is held, a call fails once its timeout passes."""

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]]) -> None:
        self._tools: dict[str, Tool] = {}
        for item in tools:
            built = item if isinstance(item, Tool) else _make_tool(item, None, None)
            if built.name in self._tools:
                raise EnvError(f"tool {built.name!r} is registered twice; tool names must be unique")
            self._tools[built.name] = built

    @property
    def names(self) -> list[str]:
        """The tool names, in registration order."""
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """Every tool's function-calling schema, for `apply_chat_template(..., tools=...)`."""
        return [t.schema() for t in self._tools.values()]

    def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> ToolResult:
        """Runs tool `name` with keyword `arguments`, waiting at most `timeout_s` seconds. Never raises."""
        if name not in self._tools:
            return ToolResult.failure(name, f"unknown tool {name!r}; available tools: {self.names}")
        tool_ = self._tools[name]
        problem = _argument_error(tool_, arguments)
        if problem is not None:
            return ToolResult.failure(name, f"tool {name}: {problem}")
        outcome: list[Any] = []

        def run() -> None:
            try:
                outcome.append(("ok", tool_.fn(**arguments)))
            except Exception as exc:  # the tool may raise anything; the model sees it as an error
                outcome.append(("raised", f"{type(exc).__name__}: {exc}"))

        ran = _THREADS.run(run, f"hfjax-tool-{name}", timeout_s)
        if ran is None:
            return ToolResult.failure(
                name,
                f"tool {name} did not start within {timeout_s:g} s: all {_THREADS.limit} tool threads are busy "
                f"({_THREADS.abandoned} of them with calls that timed out)",
            )
        if not ran:
            return ToolResult.failure(name, f"tool {name} timed out after {timeout_s:g} s")
        status, value = outcome[0]
        if status == "raised":
            return ToolResult.failure(name, f"tool {name} raised {value}")
        if not isinstance(value, str):
            return ToolResult.failure(name, f"tool {name} returned {type(value).__name__}, expected str")
        return ToolResult(name, value)
