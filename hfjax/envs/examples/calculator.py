"""A calculator tool and `CalculatorEnv`, a tool environment for arithmetic word problems scored against the row's
`reward_model.ground_truth`. Use it as `hfjax/envs/examples/calculator.py:CalculatorEnv`. The tool evaluates integer
arithmetic by walking the `ast` of the expression (nothing is `eval`ed), with sizes capped so that no expression can
hang it."""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from typing import Any

from hfjax.envs import EnvError, ToolEnvironment

MAX_CHARS = 200  # longest expression accepted
MAX_BITS = 333  # largest magnitude of any operand or result, about 100 decimal digits
_OPERATORS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Pow: operator.pow,
}
_INTEGER = re.compile(r"-?\d+")


def _bounded(value: int) -> int:
    if abs(value).bit_length() > MAX_BITS:
        raise ValueError(f"a value has more than {MAX_BITS} bits (about 100 digits); the calculator's limit")
    return value


def _power(base: int, exponent: int) -> int:
    if exponent < 0:
        raise ValueError(f"negative exponent {exponent}: the calculator does integer arithmetic only")
    if abs(base) > 1 and (abs(base).bit_length() - 1) * exponent > MAX_BITS:
        raise ValueError(f"{base} ** {exponent} is too large (more than {MAX_BITS} bits)")
    return base**exponent


def _unsupported(node: ast.AST) -> ValueError:
    if isinstance(node, ast.Name):
        what = f"name {node.id!r}"
    elif isinstance(node, ast.Call):
        what = "function call"
    elif isinstance(node, ast.Constant):
        what = f"constant {node.value!r}"
    elif isinstance(node, ast.BinOp | ast.UnaryOp):
        what = f"operator {type(node.op).__name__}"
    else:
        what = type(node).__name__
    return ValueError(f"unsupported {what}; expected integers, + - * ** and parentheses")


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _bounded(_power(left, right))
        return _bounded(_OPERATORS[type(node.op)](left, right))
    raise _unsupported(node)


def calculator(expression: str) -> str:
    """Evaluates an integer arithmetic expression with + - * ** and parentheses, e.g. "(3 + 4) * 12".

    Returns the value as text; raises ValueError for anything else (names, calls, division, huge numbers)."""
    if len(expression) > MAX_CHARS:
        raise ValueError(f"expression has {len(expression)} characters; the limit is {MAX_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r} ({exc.msg})") from None
    return str(_evaluate(tree.body))


class CalculatorEnv(ToolEnvironment):
    """Arithmetic with a calculator tool (Hermes/Qwen tool-call format by default). The final answer scores 1.0
    when its last integer equals the row's `reward_model.ground_truth`, else 0.0."""

    tools = (calculator,)

    def score(self, final_text: str, row: dict[str, Any]) -> float:
        """1.0 if the last integer in `final_text` equals the row's ground truth, else 0.0."""
        try:
            truth = int(row["reward_model"]["ground_truth"])
        except (KeyError, TypeError, ValueError) as exc:
            got = row.get("reward_model") if isinstance(row, dict) else row
            raise EnvError(
                f"CalculatorEnv: row field 'reward_model.ground_truth' must hold an integer, got {got!r}"
            ) from exc
        found = _INTEGER.findall(final_text)
        return 1.0 if found and int(found[-1]) == truth else 0.0
