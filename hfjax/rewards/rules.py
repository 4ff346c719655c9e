"""Rule rewards on response text: GSM8K-style answers after `####` (strict and flexible extraction, as verl's gsm8k
scorer), exact match (the synthetic tasks) and the last `\\boxed{}` answer (geometry3k). Pure functions of strings
returning floats; imports only the standard library."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

TAIL_CHARS = 300  # only the response's end is searched (as verl does), which bounds regex time on long responses
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")
_METHODS = ("strict", "flexible")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final answer in a response, or None. `strict`: the number after the last "#### "; `flexible`: the last
    number anywhere. Thousands separators and a trailing period are removed."""
    if method not in _METHODS:
        raise ValueError(f"method: expected one of {_METHODS}, got {method!r}")
    tail = solution_str[-TAIL_CHARS:]
    found = _STRICT.findall(tail) if method == "strict" else _NUMBER.findall(tail)
    for candidate in reversed(found):
        answer = candidate.replace(",", "").rstrip(".")
        if answer not in ("", "-"):
            return answer
    return None


def same_number(answer: str, ground_truth: str) -> bool:
    """Equal as decimal numbers ("42.0" == "42"), else equal as strings after removing thousands separators."""
    truth = str(ground_truth).strip().replace(",", "")
    try:
        return Decimal(answer) == Decimal(truth)
    except InvalidOperation:
        return answer == truth


def gsm8k_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """`score` when the extracted answer equals the ground truth, `format_score` when an answer was found but is
    wrong, 0 when none was found."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if same_number(answer, ground_truth) else float(format_score)


def exact_match_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the ground truth exactly, else 0.0."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


def last_boxed(solution_str: str) -> str | None:
    """The content of the response's last `\\boxed{...}` (nested braces kept whole), or None when it has none or
    the last one is not closed."""
    start = solution_str.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(solution_str)):
        if solution_str[i] == "{":
            depth += 1
        elif solution_str[i] == "}":
            if depth == 0:
                return solution_str[begin:i]
            depth -= 1
    return None


def boxed_answer_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last `\\boxed{...}` answer equals the ground truth (whitespace removed; numbers compared as
    decimals: "3.0" == "3"), else 0.0 (geometry3k's answers)."""
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    compact, truth = "".join(answer.split()), "".join(str(ground_truth).split())
    return 1.0 if same_number(compact, truth) else 0.0
