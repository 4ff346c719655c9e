"""The error type of the rule-reward package."""


class RewardError(ValueError):
    """A reward function that cannot be found, loaded or called, or that returned something other than a score."""
