"""What a step of an RL run works with besides its batch: the run's roles as the controller calls them (`Roles`,
typed by the worker each runs) and what the controller itself carries from step to step (`ControllerState`: the KL
controller, the Lagrange multiplier and the `Scorer` of rule and environment rewards)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, cast

import numpy as np

from hfjax.algos.kl import AdaptiveKLController, FixedKLController, make_kl_controller
from hfjax.config.rl import RLConfig
from hfjax.protocol import DataProto
from hfjax.rewards.rule_reward import RuleReward
from hfjax.workers.actor import ActorRolloutRefWorker
from hfjax.workers.critic import CriticWorker
from hfjax.workers.reward_model import RewardModelWorker
from hfjax.workers.rollout import RolloutWorker

VALUE_ROLES = ("critic", "cost_critic")
SCORE_ROLES = ("reward_model", "cost_model")


def group_names(cfg: RLConfig) -> dict[str, str]:
    """Each role's timeline lane: the roles of its worker group joined by '+' (e.g. `actor+critic`)."""
    return {role: "+".join(group) for group in cfg.worker_groups() for role in group}


class Roles(Mapping[str, Any]):
    """The handle of every role the run started, by role name, and typed by the worker the role runs:
    `roles.critic.update_critic(data)` runs `CriticWorker.update_critic` on the critic's worker group, dispatched
    and collected as its `@register` mode says. A handle (`hfjax.controller.worker_group.RoleGroup`) has the
    worker's registered methods under the same names and arguments, so each property is typed as its worker class
    and an editor goes from a call here to the worker's code. Asking for a role the run did not start raises a
    `ValueError` that names it and `source` (where the run's roles were chosen)."""

    def __init__(self, handles: Mapping[str, Any], source: str = "the run's config") -> None:
        self._handles, self.source = dict(handles), source

    def __getitem__(self, name: str) -> Any:
        if name not in self._handles:
            raise ValueError(
                f"the program calls the {name} role, which this run does not start ({self.source}); a program of "
                "your own lists the roles it calls besides the actor in its file's ROLES"
            )
        return self._handles[name]

    def __contains__(self, name: object) -> bool:
        return name in self._handles

    def get(self, name: str, default: Any = None) -> Any:
        """The handle of `name`, or `default` where the run did not start it (no error, as `Mapping.get`)."""
        return self._handles.get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._handles)

    def __len__(self) -> int:
        return len(self._handles)

    @property
    def actor(self) -> ActorRolloutRefWorker:
        """The actor (its generation too, unless a rollout group generates) and the reference policy."""
        return cast(ActorRolloutRefWorker, self["actor"])

    @property
    def rollout(self) -> RolloutWorker:
        """The rollout group of a disaggregated run (generation on devices of its own)."""
        return cast(RolloutWorker, self["rollout"])

    def value_model(self, name: str) -> CriticWorker:
        """A value model: `critic` or (Safe-RLHF) `cost_critic`."""
        if name not in VALUE_ROLES:
            raise ValueError(f"value model {name!r}: expected one of {VALUE_ROLES}")
        return cast(CriticWorker, self[name])

    def score_model(self, name: str) -> RewardModelWorker:
        """A score model: `reward_model` or (Safe-RLHF) `cost_model`."""
        if name not in SCORE_ROLES:
            raise ValueError(f"score model {name!r}: expected one of {SCORE_ROLES}")
        return cast(RewardModelWorker, self[name])


class Scorer:
    """The rewards the controller computes itself: a multi-turn trajectory's environment rewards and the rule
    reward (`reward.function` by data source); `errors` counts the samples whose reward function failed since
    the last `reset` (`reward.on_error: skip`). The reward model's score is a role call (`Step.sequence_scores`)."""

    def __init__(self, rule_reward: RuleReward | None) -> None:
        self.rule_reward, self.errors = rule_reward, 0

    def reset(self) -> None:
        self.errors = 0

    def controller_scores(self, data: DataProto) -> np.ndarray:
        """One score per response: environment rewards summed over the trajectory, plus the rule reward."""
        scores = np.zeros(len(data), np.float32)
        if "env_rewards" in data.batch:
            scores += data.batch["env_rewards"].sum(-1)
        if self.rule_reward is not None:
            out = self.rule_reward(data)
            scores += out.batch["scores"]
            self.errors += int(out.meta_info.get("metrics", {}).get("reward/errors", 0))
        return scores


@dataclasses.dataclass
class ControllerState:
    """What the controller carries from step to step: the in-reward KL coefficient's controller (`kl_ctrl`),
    Safe-RLHF's Lagrange multiplier (`lagrange`) and the `scorer`. The trainer saves `state_dict()` with every
    checkpoint and restores it on resume."""

    kl_ctrl: FixedKLController | AdaptiveKLController
    lagrange: float
    scorer: Scorer

    @classmethod
    def from_config(cls, cfg: RLConfig, tokenizer: Any) -> ControllerState:
        """The state at step 0 for `cfg` (`tokenizer`: the one the rule reward decodes responses with)."""
        algo, reward = cfg.algorithm, cfg.reward
        kl_ctrl = make_kl_controller(algo.kl_ctrl, kl_coef=algo.kl_coef, target_kl=algo.target_kl, horizon=algo.horizon)
        rule = RuleReward(tokenizer, reward.function, reward.on_error) if reward.use_rule else None
        return cls(kl_ctrl, algo.lambda_init, Scorer(rule))

    def state_dict(self) -> dict[str, Any]:
        return {"kl_ctrl": self.kl_ctrl.state_dict(), "lagrange": self.lagrange}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.lagrange = float(state["lagrange"])
