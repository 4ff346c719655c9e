"""The environment and tool API (`hfjax.envs`): tool schemas from function signatures, the tool registry's error
results and timeouts, the Hermes and Llama 3 tool-call parsers, `ToolEnvironment` end to end with the example
calculator environment, loading environments from files, checking step results, and the token ids of observations
against the chat template's own rendering of the whole conversation (a plain template and a ChatML one)."""

from __future__ import annotations

import math
import re
import threading
import time

import pytest

from hfjax.envs import (
    EnvError,
    Environment,
    ParsedAction,
    StepResult,
    Tool,
    ToolCall,
    ToolRegistry,
    ToolResult,
    check_step_result,
    get_parser,
    load_environment,
    observation_tokens,
    parser_for_model_type,
    prompt_tokens,
    tool,
    tools,
)
from hfjax.envs.examples.calculator import CalculatorEnv, calculator
from hfjax.envs.parsers import HermesParser, Llama3JsonParser
from hfjax.envs.tool_env import with_model_parser
from hfjax.models.local_tokenizer import build_bpe_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL_6_TIMES_7 = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
ROW = {
    "prompt": [{"role": "user", "content": "What is 6 * 7? Use the calculator."}],
    "reward_model": {"ground_truth": "42"},
}


def search(query: str, limit: int = 3, exact: bool = False) -> str:
    """Searches the notes.

    Longer explanation that is not part of the description."""
    return f"{query}:{limit}:{exact}"


def test_tool_schema_from_signature():
    expected = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Searches the notes.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"}},
                "required": ["query"],
            },
        },
    }
    assert tool(search).schema() == expected
    named = tool(name="find", description="Finds.")(search)
    assert (named.name, named.description, named.fn) == ("find", "Finds.", search)

    def mixed(weights: list[float], options: dict, scale: float) -> str:
        """Mixes."""
        return ""

    assert tool(mixed).parameters["properties"] == {
        "weights": {"type": "array", "items": {"type": "number"}},
        "options": {"type": "object"},
        "scale": {"type": "number"},
    }


def test_tool_rejects_bad_annotations():
    def untyped(x) -> str:
        """Doc."""
        return x

    def tupled(x: tuple) -> str:
        """Doc."""
        return ""

    def undocumented(x: str) -> str:
        return x

    with pytest.raises(EnvError, match=r"untyped, parameter 'x': no type annotation"):
        tool(untyped)
    with pytest.raises(EnvError, match=r"tupled, parameter 'x': type .*tuple.* is not supported"):
        tool(tupled)
    with pytest.raises(EnvError, match="undocumented: no description"):
        tool(undocumented)
    with pytest.raises(EnvError, match="tool name 'two words': expected an identifier"):
        Tool("two words", "Doc.", {"type": "object", "properties": {}}, search)
    with pytest.raises(EnvError, match="tool t: parameters must be a JSON schema with type 'object'"):
        Tool("t", "Doc.", {"type": "string"}, search)


def slow(seconds: float) -> str:
    """Sleeps."""
    time.sleep(seconds)
    return "woke"


def broken(x: int) -> str:
    """Raises."""
    raise RuntimeError(f"no luck with {x}")


def counts(x: int) -> str:
    """Returns a number instead of text."""
    return x  # type: ignore[return-value]


@pytest.fixture(scope="module")
def registry():
    return ToolRegistry([search, tool(slow), broken, counts])


def test_registry_success(registry):
    assert registry.names == ["search", "slow", "broken", "counts"]
    assert [s["function"]["name"] for s in registry.schemas()] == registry.names
    assert registry.call("search", {"query": "cats", "limit": 2}, timeout_s=5) == ToolResult("search", "cats:2:False")


@pytest.mark.parametrize(
    "name, arguments, error",
    [
        ("nope", {}, "unknown tool 'nope'; available tools: ['search', 'slow', 'broken', 'counts']"),
        ("search", {}, "tool search: missing required arguments ['query']"),
        ("search", {"query": "a", "lang": "en"}, "tool search: unexpected arguments ['lang']; expected only"),
        ("search", {"query": 3}, "tool search: argument 'query' must be a JSON string, got int 3"),
        (
            "search",
            {"query": "a", "limit": True},
            "tool search: argument 'limit' must be a JSON integer, got bool True",
        ),
        ("search", ["a"], "tool search: arguments must be a JSON object, got list"),
        ("broken", {"x": 7}, "tool broken raised RuntimeError: no luck with 7"),
        ("counts", {"x": 7}, "tool counts returned int, expected str"),
    ],
)
def test_registry_errors_are_results(registry, name, arguments, error):
    result = registry.call(name, arguments, timeout_s=5)
    assert result.name == name
    assert result.error is not None and result.error.startswith(error)
    assert result.content == f"Error: {result.error}"


def test_registry_timeout_abandons_the_call(registry):
    start = time.monotonic()
    result = registry.call("slow", {"seconds": 5.0}, timeout_s=0.2)
    assert time.monotonic() - start < 1.5
    assert result.error == "tool slow timed out after 0.2 s"
    assert registry.call("slow", {"seconds": 0.0}, timeout_s=5) == ToolResult("slow", "woke")  # still usable


def test_tool_threads_are_bounded_and_abandoned_calls_counted(monkeypatch):
    monkeypatch.setattr(tools, "_THREADS", tools._ToolThreads(2))
    release = threading.Event()

    def stuck() -> str:
        """Waits for the test."""
        release.wait(10)
        return "released"

    registry = ToolRegistry([stuck, search])
    for _ in range(2):
        assert registry.call("stuck", {}, timeout_s=0.05).error == "tool stuck timed out after 0.05 s"
    assert tools.abandoned_tool_calls() == 2
    start = time.monotonic()
    full = registry.call("search", {"query": "a"}, timeout_s=0.1)  # both threads held: no third one
    assert 0.1 <= time.monotonic() - start < 1.0
    assert full.error == (
        "tool search did not start within 0.1 s: all 2 tool threads are busy (2 of them with calls that timed out)"
    )
    release.set()  # the abandoned calls return and give their threads back
    deadline = time.monotonic() + 5
    while tools.abandoned_tool_calls() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tools.abandoned_tool_calls() == 0
    assert registry.call("search", {"query": "a"}, timeout_s=1) == ToolResult("search", "a:3:False")


def test_tool_environment_parser_follows_the_model_family():
    llama = with_model_parser(CalculatorEnv, {"tool_timeout_s": 2.0}, "llama")
    assert llama == {"tool_timeout_s": 2.0, "parser": "llama3_json"}
    assert isinstance(CalculatorEnv(**llama)._parser, Llama3JsonParser)
    assert with_model_parser(CalculatorEnv, {}, "qwen2") == {"parser": "hermes"}
    assert with_model_parser(CalculatorEnv, {"parser": "hermes"}, "llama") == {"parser": "hermes"}  # named: kept

    class NamedParser(CalculatorEnv):
        parser = "hermes"

    assert with_model_parser(NamedParser, {}, "llama") == {}
    assert with_model_parser(Environment, {"k": 1}, "llama") == {"k": 1}  # not a tool environment: as given
    assert isinstance(CalculatorEnv()._parser, HermesParser)  # built without a model family
    # a Llama 3 JSON call runs the tool under the parser chosen for a Llama policy
    env = CalculatorEnv(**llama)
    env.reset(ROW)
    result = env.step('{"name": "calculator", "parameters": {"expression": "6 * 7"}}')
    assert result.observation == [{"role": "ipython", "content": "42"}] and result.info["tool_errors"] == 0


def test_hermes_parser():
    parser = get_parser("hermes")
    text = (
        "Let me compute.\n<tool_call>\n"
        + '{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>\n'
        + '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call> done'
    )
    assert parser.parse(text) == ParsedAction(
        "Let me compute.\n\n done",
        [ToolCall("calculator", {"expression": "1 + 2"}), ToolCall("search", {"query": "x"})],
        [],
    )
    assert parser.parse("  The answer is 4.  ") == ParsedAction("The answer is 4.")
    bad = parser.parse('ok <tool_call>{"name": "calculator", "arguments": {</tool_call> <tool_call>{"arguments": {}')
    assert bad.content == "ok" and bad.calls == []
    assert bad.errors[0].startswith("malformed tool call (invalid JSON: ")
    assert bad.errors[0].endswith("""'{"name": "calculator", "arguments": {'""")
    assert bad.errors[1] == """unclosed <tool_call> (no </tool_call>): '{"arguments": {}'"""
    no_name = parser.parse('<tool_call>{"arguments": {}}</tool_call>')
    assert no_name.errors == [
        """tool call without a name, expected {"name": ..., "arguments": {...}}: '{"arguments": {}}'"""
    ]
    assert parser.format_results([ToolResult("calculator", "3")]) == [
        {"role": "tool", "name": "calculator", "content": "3"}
    ]


def test_llama3_json_parser():
    parser = get_parser("llama3_json")
    one = parser.parse('{"name": "calculator", "parameters": {"expression": "2 * 3"}}')
    assert one == ParsedAction("", [ToolCall("calculator", {"expression": "2 * 3"})], [])
    two = parser.parse('Sure.<|python_tag|>{"name": "a", "arguments": {"x": "1;2"}}; {"name": "b", "parameters": {}}')
    assert two == ParsedAction("Sure.", [ToolCall("a", {"x": "1;2"}), ToolCall("b", {})], [])
    assert parser.parse("It is 6.") == ParsedAction("It is 6.")
    bad = parser.parse('{"name": "a", "parameters": {"x": 1}}; {"name": oops}')
    assert bad.calls == [ToolCall("a", {"x": 1})]
    assert len(bad.errors) == 1 and bad.errors[0].endswith("""'{"name": oops}'""")
    trailing = parser.parse('{"name": "a", "parameters": [1]} and more')
    assert trailing.calls == [] and trailing.errors[0].startswith("tool call 'a': arguments are not a JSON object")
    assert trailing.errors[1] == "text after a tool call, expected ';' and another call: 'and more'"
    assert parser.format_results([ToolResult("a", "6")]) == [{"role": "ipython", "content": "6"}]


def test_parser_names():
    with pytest.raises(EnvError, match=r"unknown tool-call parser 'hermse'; did you mean 'hermes'\? known parsers"):
        get_parser("hermse")
    assert [parser_for_model_type(t) for t in ("qwen2", "qwen3", "llama", "gpt2")] == [
        "hermes",
        "hermes",
        "llama3_json",
        "hermes",
    ]


@pytest.mark.parametrize(
    "expression, value",
    [("6 * 7", "42"), ("(3 + 4) * -2", "-14"), ("2 ** 10 - 1", "1023"), ("  10 - 20 - 30 ", "-40")],
)
def test_calculator_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, error",
    [
        ("x + 1", "unsupported name 'x'"),
        ("__import__('os')", "unsupported function call"),
        ("7 / 2", "unsupported operator Div"),
        ("1.5 * 2", "unsupported constant 1.5"),
        ("10 ** 10 ** 10", "10 ** 10000000000 is too large"),
        ("9" * 60 + " * " + "9" * 60, "more than 333 bits"),
        ("2 ** -1", "negative exponent -1"),
        ("1 +", "not an arithmetic expression"),
        ("1+" * 200 + "1", "expression has 401 characters"),
    ],
)
def test_calculator_rejects(expression, error):
    start = time.monotonic()
    with pytest.raises(ValueError, match=re.escape(error)):
        calculator(expression)
    assert time.monotonic() - start < 1.0


def test_calculator_environment_end_to_end():
    env = CalculatorEnv(tool_timeout_s=2.0)
    assert env.tool_schemas() == [tool(calculator).schema()]
    assert env.reset(ROW) is None
    call = env.step(f"I will use the tool.\n{CALL_6_TIMES_7}")
    assert call == StepResult(
        [{"role": "tool", "name": "calculator", "content": "42"}], 0.0, False, {"tool_calls": 1, "tool_errors": 0}
    )
    failed = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "6 / 7"}}</tool_call><tool_call>{')
    assert [m["content"][:7] for m in failed.observation] == ["Error: ", "Error: "]
    assert failed.info == {"tool_calls": 2, "tool_errors": 2} and not failed.done
    assert env.step("6 * 7 = 42, so the answer is 42.") == StepResult(
        None, 1.0, True, {"tool_calls": 0, "tool_errors": 0}
    )
    assert env.step("The answer is 41.").reward == 0.0
    with pytest.raises(EnvError, match="tool_timeout_s must be a positive finite number, got 0"):
        CalculatorEnv(tool_timeout_s=0)


def test_load_environment(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(
        "from hfjax.envs import Environment, StepResult\n\n"
        "class Echo(Environment):\n"
        "    def step(self, action):\n"
        "        return StepResult(action, 1.0, True)\n\n"
        "class Lazy(Environment):\n"
        "    pass\n\n"
        "class NotAnEnv:\n"
        "    pass\n"
    )
    cls = load_environment(f"{path}:Echo")
    assert issubclass(cls, Environment) and cls().step("hi") == StepResult("hi", 1.0, True)
    with pytest.raises(EnvError, match=r"my_env.py:NotAnEnv'.*class NotAnEnv; expected a subclass of .*Environment"):
        load_environment(f"{path}:NotAnEnv")
    with pytest.raises(EnvError, match=r"my_env.py:Lazy'.*Lazy does not define step"):
        load_environment(f"{path}:Lazy")
    with pytest.raises(EnvError, match="has no 'Missing'"):
        load_environment(f"{path}:Missing")


def test_check_step_result():
    messages = [{"role": "user", "content": "more"}]
    assert check_step_result((messages, 1, False, {"k": 1}), "E") == StepResult(messages, 1.0, False, {"k": 1})
    assert check_step_result(StepResult([5, 6]), "E").observation == [5, 6]
    bad = [
        (StepResult(reward=math.nan), "environment E: step returned reward nan; expected a finite real number"),
        (StepResult(reward="1"), "returned reward '1'; expected a finite real number"),
        (StepResult(done=None), "returned done None; expected True or False"),
        (StepResult(observation=[{"role": "user"}]), "message 0 needs a str 'content', got None"),
        (StepResult(observation=[1, "a"]), "mixes types"),
        (StepResult(observation=(1, 2)), "observation is a tuple; expected a list of messages"),
        ((None, 0.0, True), "expected a StepResult or a tuple"),
    ]
    for result, error in bad:
        with pytest.raises(EnvError, match=re.escape(error)):
            check_step_result(result, "E")


def test_environment_defaults():
    env = Environment()
    assert env.reset(ROW) is None
    with pytest.raises(NotImplementedError, match="Environment does not define step"):
        env.step("x")


CORPUS = [
    "user assistant tool system: What is 6 * 7? Use the calculator. I will use the tool.",
    '<tool_call> {"name": "calculator", "arguments": {"expression": "6 * 7"}} </tool_call> 0123456789',
    "The answer is 42. Hi. Hello.",
] * 20


@pytest.fixture(scope="module")
def plain_tokenizer():
    return build_bpe_tokenizer(CORPUS, 512)


def chatml(template: str = CHATML):
    """A local BPE tokenizer with ChatML's special tokens, `<|im_end|>` as its eos, and `template`."""
    tokenizer = build_bpe_tokenizer(CORPUS, 512, chat_template=template)
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer


@pytest.fixture(scope="module")
def chatml_tokenizer():
    return chatml()


def rendering(tokenizer, messages) -> list[int]:
    """The template's own token ids of a whole conversation, with the generation prompt."""
    return tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )["input_ids"]


def trajectory(tokenizer, model_texts: list[str]) -> tuple[list[int], list[int], list[dict]]:
    """A calculator trajectory built by appending: the prompt, then per model turn its text's tokens, the stop token
    and the observation's tokens. Returns the tokens, the stop tokens' positions, and the conversation as messages
    (assistant contents without surrounding whitespace, as the parser reads them)."""
    eos = tokenizer.eos_token_id
    env = CalculatorEnv()
    env.reset(ROW)
    tokens, stops, messages = prompt_tokens(tokenizer, ROW["prompt"]), [], list(ROW["prompt"])
    for text in model_texts:
        step = env.step(text)
        tokens += tokenizer.encode(text, add_special_tokens=False)
        stops.append(len(tokens))
        tokens += [eos, *observation_tokens(tokenizer, step.observation, [eos])]
        messages += [{"role": "assistant", "content": text.strip()}, *(step.observation or [])]
    return tokens, stops, messages


TURNS = [CALL_6_TIMES_7, '<tool_call>{"name": "calculator", "arguments": {"expression": "42 + 1"}}</tool_call>']


def test_observation_tokens_chatml_equal_the_whole_rendering(chatml_tokenizer):
    """ChatML closes the assistant turn with the stop token itself: the appended sequence is the rendering."""
    tokens, _, messages = trajectory(chatml_tokenizer, TURNS)
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["42", "43"]
    assert tokens == rendering(chatml_tokenizer, messages)
    assert chatml_tokenizer.decode(tokens).endswith(
        "</tool_call><|im_end|>\n<|im_start|>tool\n43<|im_end|>\n<|im_start|>assistant\n"
    )


def test_observation_tokens_plain_template_keep_the_stop_token_after_the_content(plain_tokenizer):
    """The plain template ends turns with "\\n" and writes no stop token: the sequence is the rendering with the
    model's stop token inserted where its content ends (the prompt ends with "assistant:", so the model's text starts
    with the space the template writes before the content)."""
    tokens, stops, messages = trajectory(plain_tokenizer, [" " + text for text in TURNS])
    assert [tokens[i] for i in stops] == [plain_tokenizer.eos_token_id] * 2
    assert [t for i, t in enumerate(tokens) if i not in stops] == rendering(plain_tokenizer, messages)
    assert plain_tokenizer.decode(tokens[stops[1] :]) == "</s>\ntool: 43\nassistant:"


def test_observation_tokens_text_ids_and_errors(chatml_tokenizer):
    eos = chatml_tokenizer.eos_token_id
    assert observation_tokens(chatml_tokenizer, [3, 4], [eos]) == [3, 4]
    assert observation_tokens(chatml_tokenizer, None, [eos]) == []
    assert observation_tokens(chatml_tokenizer, "Hello.", [eos]) == chatml_tokenizer.encode(
        "Hello.", add_special_tokens=False
    )
    rerenders = chatml(
        CHATML.replace("{{ m['content'] }}", "{% if loop.last %}<think></think>{% endif %}{{ m['content'] }}")
    )
    with pytest.raises(EnvError, match="renders the assistant turn differently when messages follow it"):
        observation_tokens(rerenders, [{"role": "tool", "content": "1"}], [rerenders.eos_token_id])
    with pytest.raises(EnvError, match="message 0 needs a str 'role'"):
        observation_tokens(chatml_tokenizer, [{"content": "1"}], [eos])


def test_prompt_tokens_with_tools(chatml_tokenizer):
    schemas = CalculatorEnv().tool_schemas()
    plain = prompt_tokens(chatml_tokenizer, ROW["prompt"])
    assert prompt_tokens(chatml_tokenizer, ROW["prompt"], tools=schemas) == plain  # this template ignores tools
    lists_tools = chatml("{% for t in tools %}{{ t['function']['name'] }};{% endfor %}" + CHATML)
    tool_names = lists_tools.encode("calculator;", add_special_tokens=False)
    assert prompt_tokens(lists_tools, ROW["prompt"], tools=schemas) == tool_names + plain
