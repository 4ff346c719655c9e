"""Rule rewards: GSM8K answer extraction (strict and flexible) and scores, exact match, dispatch by data source, and
user functions from `file.py:name` with their error messages."""

from __future__ import annotations

import re

import numpy as np
import pytest

from hfjax.data.gsm8k import DATA_SOURCE as GSM8K_SOURCE
from hfjax.data.synthetic import DATA_SOURCE as ADDITION_SOURCE
from hfjax.rewards import (
    SCORERS,
    RewardError,
    boxed_answer_score,
    compute_score,
    exact_match_score,
    extract_answer,
    gsm8k_score,
    load_reward_function,
    make_reward_function,
    register_scorer,
)


@pytest.mark.parametrize(
    "text, strict, flexible",
    [
        ("She has 3 apples, then 4.\n#### 7", "7", "7"),
        ("#### 1,234 is it", "1234", "1234"),
        ("first #### 5 then #### -12.", "-12", "-12"),
        ("so 18 + 2 = 20. The answer is 20.", None, "20"),
        ("####20 (no space)", None, "20"),
        ("no number here", None, None),
        ("ends with a dot: 9 .", None, "9"),
    ],
)
def test_extract_answer(text, strict, flexible):
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "flexible") == flexible


def test_gsm8k_score_on_random_answers():
    rng = np.random.default_rng()
    for n in rng.integers(-(10**7), 10**7, size=20).tolist():
        response = f"Reasoning with {rng.integers(100)} steps.\n#### {n:,}"
        assert gsm8k_score(response, str(n)) == 1.0
        assert gsm8k_score(response, str(n + 1), format_score=0.25) == 0.25
        assert gsm8k_score(f"{response}.0", str(n)) == 1.0  # equal as numbers
        assert gsm8k_score(response.replace("#### ", ""), str(n)) == 0.0  # strict needs the marker
        assert gsm8k_score(response.replace("#### ", ""), str(n), method="flexible") == 1.0
    # Only the response's last 300 characters are searched.
    assert gsm8k_score("#### 5" + " pad" * 100, "5") == 0.0 and gsm8k_score("#### 5" + " pad" * 70, "5") == 1.0
    with pytest.raises(ValueError, match="method: expected one of"):
        extract_answer("#### 1", "loose")


def test_exact_match():
    rng = np.random.default_rng()
    for n in rng.integers(0, 10**6, size=10).tolist():
        assert exact_match_score(f" {n}\n", str(n)) == 1.0
        assert exact_match_score(f"{n}0", str(n)) == 0.0 and exact_match_score(f"{n} ", f"{n + 1}") == 0.0


def test_dispatch_by_data_source():
    assert {GSM8K_SOURCE, ADDITION_SOURCE} <= set(SCORERS)  # the data package's sources all have a rule reward
    assert compute_score(GSM8K_SOURCE, "so #### 12", "12") == 1.0
    assert compute_score(GSM8K_SOURCE, "so 12", "12") == 0.0
    assert (
        compute_score(ADDITION_SOURCE, "357", "357") == 1.0 and compute_score(ADDITION_SOURCE, "#### 357", "357") == 0
    )
    with pytest.raises(RewardError, match=r"no rule reward for data_source 'mine' \(known: \["):
        compute_score("mine", "x", "y")
    register_scorer("test/len", lambda solution, truth, extra: len(solution) * extra["w"])
    try:
        assert compute_score("test/len", "abcd", None, {"w": 0.5}) == 2.0
        assert make_reward_function(None) is compute_score
    finally:
        del SCORERS["test/len"]


def test_user_function_loads_and_scores(tmp_path):
    (tmp_path / "my_reward.py").write_text(
        "import math\n"
        "LIMIT = 3\n"
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': len(solution_str) / ground_truth, 'extra': data_source}\n"
        "def bad(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return solution_str\n"
    )
    spec = f"{tmp_path / 'my_reward.py'}:score"
    fn = make_reward_function(spec)
    rng = np.random.default_rng()
    text, truth = "x" * int(rng.integers(1, 50)), int(rng.integers(1, 9))
    assert fn("src", text, truth) == len(text) / truth
    cloudpickle = pytest.importorskip("ray.cloudpickle")
    assert cloudpickle.loads(cloudpickle.dumps(fn))("src", text, truth) == len(text) / truth  # ships to workers
    with pytest.raises(RewardError, match=r"returned 'oops'; expected a finite number or a dict"):
        load_reward_function(f"{tmp_path / 'my_reward.py'}:bad")("src", "oops", 1)
    with pytest.raises(RewardError, match=r"has no 'scor' \(its functions: \['bad', 'score'\]\)"):
        load_reward_function(f"{tmp_path / 'my_reward.py'}:scor")
    with pytest.raises(RewardError, match="'LIMIT' is a int, not a function"):
        load_reward_function(f"{tmp_path / 'my_reward.py'}:LIMIT")


def test_user_function_errors(tmp_path):
    with pytest.raises(RewardError, match=re.escape(f"no such file {tmp_path / 'absent.py'}")):
        load_reward_function(f"{tmp_path / 'absent.py'}:score")
    with pytest.raises(RewardError, match=re.escape("expected 'path/to/file.py:function_name', got 'reward.py'")):
        load_reward_function("reward.py")
    (tmp_path / "broken.py").write_text("def score(:\n")
    with pytest.raises(RewardError, match=re.escape(f"importing {tmp_path / 'broken.py'} failed: SyntaxError")):
        load_reward_function(f"{tmp_path / 'broken.py'}:score")


@pytest.mark.parametrize(
    "text, truth, score",
    [
        ("so the angle is \\boxed{60}", "60", 1.0),
        ("\\boxed{12} first, then \\boxed{ 7.0 }", "7", 1.0),  # the last box, compared as numbers
        ("\\boxed{\\frac{2}{3}}", "\\frac{2}{3}", 1.0),  # nested braces kept whole
        ("\\boxed{\\frac{2}{3}}", "\\frac{3}{2}", 0.0),
        ("\\boxed{5", "5", 0.0),  # never closed
        ("the answer is 5", "5", 0.0),  # no box
    ],
)
def test_boxed_answer_score(text, truth, score):
    assert boxed_answer_score(text, truth) == score
    assert compute_score("hiyouga/geometry3k", text, truth) == score
