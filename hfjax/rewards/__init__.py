"""Rewards computed on the controller: rule rewards from response text (GSM8K answers, exact match, boxed answers,
user functions from `file.py:name`, verl-style dispatch by data source), the rule-reward step over a batch
(`rule_reward.RuleReward`) and sequence scores placed on the last response token (`token_level`)."""

from hfjax.rewards.dispatch import SCORERS, compute_score, make_reward_function, register_scorer
from hfjax.rewards.errors import RewardError
from hfjax.rewards.rules import boxed_answer_score, exact_match_score, extract_answer, gsm8k_score
from hfjax.rewards.user_function import load_reward_function

__all__ = [
    "SCORERS",
    "RewardError",
    "boxed_answer_score",
    "compute_score",
    "exact_match_score",
    "extract_answer",
    "gsm8k_score",
    "load_reward_function",
    "make_reward_function",
    "register_scorer",
]
