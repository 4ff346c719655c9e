"""`Step`: one RL iteration's state on the controller — the batch flowing between roles and the operations the
algorithm programs are written in (each one role call or one controller computation, timed as `timing_s/<name>`).

The names in `PUBLIC_API` are the stable API that programs are written in, the built-in ones
(`hfjax.trainer.programs`) and users' own (`algorithm.program`, docs/algorithms.md): their names, arguments and the
batch keys each reads and writes (listed in its docstring) keep working across releases. Every other name is
internal and may change.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from hfjax.algos import compute_advantage, kl_penalty, masked_mean, masked_seq_mean, rollout_correction
from hfjax.config.rl import RLConfig
from hfjax.envs.trajectory import batch_agent_metrics
from hfjax.protocol import ROW_IN_LOSS, DataProto
from hfjax.rewards.token_level import scores_to_token_level
from hfjax.trainer.roles import ControllerState, Roles, group_names
from hfjax.trainer.rollout_stream import PendingRollout, rollout_meta
from hfjax.trainer.timeline import Timeline
from hfjax.workers.sequences import IMAGES, ROUTED_EXPERTS

PROMPT_TENSORS = ["input_ids", "attention_mask", "position_ids"]
PUBLIC_API = (
    # state
    "cfg",
    "step",
    "prompts",
    "batch",
    "metrics",
    # operations, in the order PPO calls them
    "greedy_baseline",
    "generate",
    "score",
    "cost",
    "old_log_prob",
    "ref_log_prob",
    "values",
    "advantages",
    "safe_advantages",
    "update_critic",
    "update_actor",
    "update_lagrange",
)


def _mean_metrics(meta: dict[str, Any]) -> dict[str, float]:
    """Worker metrics (a value, or a list of values from several ranks) as floats."""
    usage = ("worker_seconds", "device_peak_bytes")  # per call, gathered by `Step.absorb`
    return {k: float(np.mean(v)) for k, v in meta.get("metrics", {}).items() if k not in usage}


class Step:
    """One iteration of a program. State: `cfg` (the run's `RLConfig`), `step` (the iteration, from 0), `prompts`
    (this step's prompts, a `DataProto`), `batch` (the prompts, then from `generate` on the rollout batch: one row
    per response, `batch.batch` its arrays, `batch.non_tensor_batch["uid"]` its prompt's id), `metrics` (what is
    logged for the step: a program may add its own)."""

    def __init__(
        self,
        cfg: RLConfig,
        roles: Mapping[str, Any],
        batch: DataProto,
        step: int,
        state: ControllerState,
        rollout: PendingRollout | None = None,
        timeline: Timeline | None = None,
    ):
        """`roles`: the run's role handles (`Roles`, or a mapping of them by role name); `state`: what the
        controller carries between steps (KL controller, Lagrange multiplier, scorer); `rollout`: the step's
        generation already under way on a rollout group, else `generate` runs it; `timeline`: where role calls are
        recorded (lanes named by `group_names`)."""
        self.cfg, self.step, self.state = cfg, step, state
        self.roles = roles if isinstance(roles, Roles) else Roles(roles, cfg.algorithm.source)
        self.prompts = batch
        self.batch = batch
        self.rollout, self.timeline = rollout, timeline
        self.lanes = group_names(cfg)
        self.metrics: dict[str, float] = {}
        self.reward_baselines: np.ndarray | None = None
        self._corrected = False  # rollout correction applied (once per step, before the advantages)

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        key = f"timing_s/{name}"
        self.metrics[key] = self.metrics.get(key, 0.0) + time.perf_counter() - start

    def on_lane(self, lane: str, name: str) -> contextlib.AbstractContextManager[None]:
        """Records the block on the timeline (if any) as `name` on `lane`."""
        return self.timeline.span(lane, name, self.step) if self.timeline is not None else contextlib.nullcontext()

    def _call(
        self, role: str, method: Callable[[DataProto], DataProto], data: DataProto
    ) -> tuple[DataProto, dict[str, float]]:
        """`method`, a group method of `role`'s handle (e.g. `self.roles.actor.update_actor`, typed as the worker's
        own method), called with `data` and recorded on the role's timeline lane: its rows (without `meta_info`, so
        that they union with the batch) and its metrics (`absorb`). Every role call of a step goes through here."""
        with self.on_lane(self.lanes[role], method.__name__):
            out = method(data)
        return self.absorb(data, out)

    def absorb(self, data: DataProto, out: DataProto) -> tuple[DataProto, dict[str, float]]:
        """The rows and metrics of a group call's output `out` for request `data`. The time the worker spent inside
        it goes to `perf/worker_seconds` (the slowest rank's: ranks run in parallel); the array bytes of its rows in
        and out to `perf/dispatch_bytes_sent` / `_received` (the controller sends each process of a group its own
        rows, so a host's share is that over the hosts). The most device memory a device of the group has held so
        far goes to `perf/device_peak_bytes` (the largest over the step's calls; on platforms that count it)."""
        for key, proto in (("perf/dispatch_bytes_sent", data), ("perf/dispatch_bytes_received", out)):
            self.metrics[key] = self.metrics.get(key, 0.0) + float(proto.nbytes())
        usage = out.meta_info.get("metrics", {})
        if usage.get("worker_seconds") is not None:
            seconds = float(np.max(usage["worker_seconds"]))
            self.metrics["perf/worker_seconds"] = self.metrics.get("perf/worker_seconds", 0.0) + seconds
        if usage.get("device_peak_bytes") is not None:
            peak = float(np.max(usage["device_peak_bytes"]))
            self.metrics["perf/device_peak_bytes"] = max(self.metrics.get("perf/device_peak_bytes", 0.0), peak)
        return DataProto(out.batch, out.non_tensor_batch, {}), _mean_metrics(out.meta_info)

    # --------------------------------------------------------------------------------------------- generation
    def _gen_metrics(self, gen_metrics: dict[str, float]) -> None:
        reshard = gen_metrics.get("reshard_seconds", 0.0)  # none on a rollout group of its own
        self.metrics["timing_s/reshard"] = self.metrics.get("timing_s/reshard", 0.0) + reshard
        self.metrics["perf/kv_cache_bytes"] = gen_metrics["gen_kv_cache_bytes"]
        # the engine's compiled programs so far (a count that keeps growing: shapes that were not bucketed)
        self.metrics.update({k: v for k, v in gen_metrics.items() if k.endswith("_programs")})
        if "agent/env_wait_share" in gen_metrics:  # the rest of agent/* comes from the batch (`generate`)
            self.metrics["agent/env_wait_share"] = gen_metrics["agent/env_wait_share"]

    def _generate(self, prompts: DataProto, meta: dict[str, Any]) -> DataProto:
        request = DataProto(prompts.batch, prompts.non_tensor_batch, {**prompts.meta_info, **meta})
        if "rollout" in self.roles:  # generation on devices of its own
            out, gen_metrics = self._call("rollout", self.roles.rollout.generate_sequences, request)
        else:
            out, gen_metrics = self._call("actor", self.roles.actor.generate_sequences, request)
        self._gen_metrics(gen_metrics)
        return out

    def generate(self) -> None:
        """`rollout.n` sampled responses per prompt; the batch becomes the rollout batch (the prompts' rows repeated,
        interleaved) with `responses`, `response_mask`, `input_ids`, `attention_mask`, `position_ids` and
        `rollout_log_probs`. A rollout already under way (asynchronous runs) is waited for instead (`timing_s/gen`
        is then the wait)."""
        n = self.cfg.rollout.n
        with self.timed("gen"):
            if self.rollout is None:
                out = self._generate(self.prompts, rollout_meta(self.cfg, self.step))
            else:
                out, gen_metrics = self.absorb(self.rollout.request, self.rollout.result())
                self._gen_metrics(gen_metrics)
                self.metrics.update(self.rollout.metrics)
        rows = self.prompts.repeat(n, interleave=True)
        rows.pop(batch_keys=PROMPT_TENSORS)
        self.batch = DataProto(out.batch, rows.non_tensor_batch, {})
        if "agent_turns" in self.batch.batch:  # multi-turn: over the whole batch, not a mean of the hosts' metrics
            self.metrics.update(batch_agent_metrics(self.batch.batch))

    def greedy_baseline(self) -> None:
        """ReMax: the reward of one greedy response per prompt, repeated for the prompt's n samples, as the
        `reward_baselines` that `advantages` hands the estimator. Call it before `generate`."""
        with self.timed("gen_max"):
            out = self._generate(self.prompts, {"do_sample": False})
            rows = self.prompts.select(non_tensor_batch_keys=list(self.prompts.non_tensor_batch))
            greedy = DataProto(out.batch, rows.non_tensor_batch, {})
            scores = self.sequence_scores(greedy)
        self.reward_baselines = np.repeat(scores, self.cfg.rollout.n)

    # --------------------------------------------------------------------------------------------- rewards
    def sequence_scores(self, data: DataProto) -> np.ndarray:
        """One score per response of `data`: the controller's (`Scorer`: environment and rule rewards, on the
        timeline's controller lane) plus the reward model's when the run has one (a role call like any other)."""
        with self.on_lane("controller", "reward"):
            scores = self.state.scorer.controller_scores(data)
        if "reward_model" in self.roles:
            out, _ = self._call("reward_model", self.roles.score_model("reward_model").compute_rm_score, data)
            scores = scores + out.batch["rm_scores"]
        return scores

    def score(self) -> None:
        """The reward of each response (rule and/or reward model, plus a multi-turn trajectory's environment
        rewards): `scores` (rows,) and `token_level_scores` (the score on the last response token; environment
        rewards on the tokens they were given at, e.g. each turn's last token)."""
        with self.timed("reward"):
            scores = self.sequence_scores(self.batch)
        mask = self.batch.batch["response_mask"]
        env = self.batch.batch.get("env_rewards")
        self.batch.batch["scores"] = scores
        if env is None:
            self.batch.batch["token_level_scores"] = scores_to_token_level(scores, mask)
        else:
            self.batch.batch["token_level_scores"] = scores_to_token_level(scores - env.sum(-1), mask) + env

    def cost(self) -> None:
        """Safe-RLHF: the cost model's score as `costs` (rows,) and `token_level_costs` (role `cost_model`)."""
        with self.timed("cost"):
            cost_model = self.roles.score_model("cost_model")
            costs = self._call("cost_model", cost_model.compute_rm_score, self.batch)[0].batch["cost_scores"]
        self.batch.batch["costs"] = costs
        self.batch.batch["token_level_costs"] = scores_to_token_level(costs, self.batch.batch["response_mask"])

    # --------------------------------------------------------------------------------------------- model passes
    def old_log_prob(self) -> None:
        """`old_log_probs` of the responses under the current policy (skipped when the actor update computes them
        itself: `RLConfig.reuses_update_log_probs`); logs `actor/entropy_rollout`."""
        if self.cfg.reuses_update_log_probs:
            return
        with self.timed("old_log_prob"):
            out, _ = self._call("actor", self.roles.actor.compute_log_prob, self.batch)
        mask = self.batch.batch["response_mask"]
        self.metrics["actor/entropy_rollout"] = float(masked_mean(out.batch.pop("entropys"), mask))
        self.batch = self.batch.union(out)

    def ref_log_prob(self) -> None:
        """`ref_log_prob` under the reference policy, when the run uses it (a KL loss or a KL in the reward)."""
        if not self.cfg.uses_ref:
            return
        with self.timed("ref"):
            self.batch = self.batch.union(self._call("actor", self.roles.actor.compute_ref_log_prob, self.batch)[0])

    def values(self, role: str, key: str) -> None:
        """The value model `role` (`critic`, `cost_critic`) of every response token, stored as `key`."""
        with self.timed(f"values_{role}" if role != "critic" else "values"):
            values = self._call(role, self.roles.value_model(role).compute_values, self.batch)[0].batch["values"]
        self.batch.batch[key] = values

    # --------------------------------------------------------------------------------------------- advantages
    def _rewards(self, scores_key: str) -> np.ndarray:
        """Token-level rewards: the scores, minus the KL penalty to the reference when it is in the reward. The KL
        logged (`actor/reward_kl_penalty`) and given to the KL controller is verl's: the mean over sequences of
        each sequence's token-mean KL."""
        scores = self.batch.batch[scores_key]
        if not self.cfg.algorithm.use_kl_in_reward:
            return scores
        algo, mask = self.cfg.algorithm, self.batch.batch["response_mask"]
        kl = (
            np.asarray(kl_penalty(self.batch.batch["old_log_probs"], self.batch.batch["ref_log_prob"], algo.kl_penalty))
            * mask
        )
        beta = self.state.kl_ctrl.value
        current = float(masked_seq_mean(kl, mask))
        self.state.kl_ctrl.update(current, len(mask))
        self.metrics.update({"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": beta})
        return scores - beta * kl

    def _correct_off_policy(self) -> None:
        """verl's rollout correction (decoupled mode), once per step before the advantages: with the batch's
        `old_log_probs` (pi_old) and `rollout_log_probs` (mu) and `actor.rollout_correction`, the importance weights
        go to the batch as `rollout_is_weights` and the rejected tokens leave `response_mask` (so the advantages,
        both updates and their token and sequence counts see only the kept ones); the `rollout_corr/*` metrics are
        the whole batch's. Without old log probs (the update computes them: `RLConfig.reuses_update_log_probs`) the
        actor logs the mismatch metrics instead."""
        data, correction = self.batch.batch, self.cfg.actor.rollout_correction
        if self._corrected or "rollout_log_probs" not in data:
            return
        if "old_log_probs" not in data:
            if correction.enabled:
                raise ValueError(
                    "actor.rollout_correction needs the old log probs before the advantages: call "
                    "step.old_log_prob() first"
                )
            return
        weights, kept, metrics = rollout_correction(
            data["old_log_probs"],
            data["rollout_log_probs"],
            data["response_mask"],
            rollout_is=correction.rollout_is,
            rollout_is_threshold=correction.rollout_is_threshold,
            rollout_is_batch_normalize=correction.rollout_is_batch_normalize,
            rollout_rs=correction.rollout_rs,
            rollout_rs_threshold=correction.rollout_rs_threshold,
        )
        if weights is not None:
            data["rollout_is_weights"] = np.asarray(weights, np.float32)
        data["response_mask"] = np.asarray(kept).astype(data["response_mask"].dtype)
        self.metrics.update({key: float(value) for key, value in metrics.items()})
        self._corrected = True

    def _gae_or_rule(self, estimator: str, rewards: np.ndarray, values: np.ndarray | None) -> tuple[Any, Any]:
        algo, data = self.cfg.algorithm, self.batch
        advantages, returns = compute_advantage(
            estimator,
            token_level_rewards=rewards,
            response_mask=data.batch["response_mask"],
            values=values,
            index=data.non_tensor_batch["uid"],
            reward_baselines=self.reward_baselines,
            gamma=algo.gamma,
            lam=algo.lam,
            norm_adv_by_std=algo.norm_adv_by_std,
        )
        return np.asarray(advantages, np.float32), np.asarray(returns, np.float32)

    def advantages(self, estimator: str | None = None) -> None:
        """`token_level_rewards` (the scores minus the KL penalty when `algorithm.use_kl_in_reward`), then
        `advantages` and `returns` by `estimator` (a registered name or `path/to/file.py:function`; None: the
        run's `algorithm.adv_estimator`, else the one of `algorithm.name`). The estimator gets `values` when the
        batch has them and `reward_baselines` after `greedy_baseline`. Before it, the off-policy correction
        (`actor.rollout_correction`, verl's) adds `rollout_is_weights` and drops rejected tokens from
        `response_mask`."""
        with self.timed("adv"), self.on_lane("controller", "advantages"):
            rewards = self._rewards("token_level_scores")
            self.batch.batch["token_level_rewards"] = rewards.astype(np.float32)
            self._correct_off_policy()
            values = self.batch.batch.get("values")
            adv, ret = self._gae_or_rule(estimator or self.cfg.algorithm.estimator, rewards, values)
        self.batch.batch["advantages"], self.batch.batch["returns"] = adv, ret

    def safe_advantages(self) -> None:
        """Safe-RLHF: reward and cost advantages (the run's estimator, GAE by default, over `values` and
        `cost_values`); the actor follows `advantages` = (A_r - lambda * A_c) / (1 + lambda); also `returns` and
        `cost_returns`. The off-policy correction runs first, as in `advantages`."""
        estimator = self.cfg.algorithm.estimator
        with self.timed("adv"), self.on_lane("controller", "advantages"):
            rewards = self._rewards("token_level_scores")
            self.batch.batch["token_level_rewards"] = rewards.astype(np.float32)
            self._correct_off_policy()
            adv_r, ret_r = self._gae_or_rule(estimator, rewards, self.batch.batch["values"])
            costs = self.batch.batch["token_level_costs"]
            adv_c, ret_c = self._gae_or_rule(estimator, costs, self.batch.batch["cost_values"])
            lam = self.state.lagrange
        self.batch.batch["advantages"] = ((adv_r - lam * adv_c) / (1.0 + lam)).astype(np.float32)
        self.batch.batch["returns"], self.batch.batch["cost_returns"] = ret_r, ret_c

    def update_lagrange(self) -> None:
        """Safe-RLHF: projected gradient ascent on the Lagrange multiplier lambda, which grows while the mean cost
        exceeds `algorithm.cost_limit`; logs `safe/lambda`, `safe/cost/mean`."""
        algo = self.cfg.algorithm
        mean_cost = float(np.mean(self.batch.batch["costs"]))
        self.state.lagrange = max(0.0, self.state.lagrange + algo.lambda_lr * (mean_cost - algo.cost_limit))
        self.metrics.update({"safe/lambda": self.state.lagrange, "safe/cost/mean": mean_cost})

    # --------------------------------------------------------------------------------------------- updates
    def update_critic(self, role: str, values_key: str, returns_key: str) -> None:
        """PPO epochs of the value model `role` towards `returns_key` (its old values: `values_key`); logs its
        metrics under `critic/` (or `<role>/`)."""
        data = self.batch.select(batch_keys=[*PROMPT_TENSORS, "responses", "response_mask"])
        data.batch["values"], data.batch["returns"] = self.batch.batch[values_key], self.batch.batch[returns_key]
        with self.timed("update_critic" if role == "critic" else f"update_{role}"):
            _, metrics = self._call(role, self.roles.value_model(role).update_critic, data)
        prefix = "critic/" if role == "critic" else f"{role}/"
        self.metrics.update({prefix + k.split("/", 1)[-1]: v for k, v in metrics.items()})

    def update_actor(self, rows: np.ndarray | None = None) -> None:
        """PPO epochs of the policy on `advantages` with `actor.policy_loss` (after `trainer.critic_warmup` steps);
        logs the `actor/` metrics; `rollout_is_weights` (from the correction) weigh the token losses. `rows` (a
        boolean mask over the batch) keeps the others out of the loss and its token and sequence counts, while they
        stay in the batch and its metrics."""
        if self.step < self.cfg.trainer.critic_warmup:
            return
        keys = [*PROMPT_TENSORS, "responses", "response_mask", "advantages"]
        keys += [] if self.cfg.reuses_update_log_probs else ["old_log_probs"]
        keys += ["ref_log_prob"] if self.cfg.actor.use_kl_loss else []
        keys += ["rollout_is_weights"] if "rollout_is_weights" in self.batch.batch else []  # off-policy correction
        if self.cfg.reuses_update_log_probs and "rollout_log_probs" in self.batch.batch:
            keys.append("rollout_log_probs")  # the update measures the mismatch to its own log probs
        keys += [ROUTED_EXPERTS] if self.cfg.actor.router_replay else []  # routing replay
        keys += [IMAGES] if IMAGES in self.batch.batch else []  # a vision-language policy's prompt images
        data = self.batch.select(batch_keys=keys)
        if rows is not None:
            data.batch["response_mask"] = data.batch["response_mask"] * np.asarray(rows, bool)[:, None]
            data.batch[ROW_IN_LOSS] = np.asarray(rows, bool)
        with self.timed("update_actor"):
            _, metrics = self._call("actor", self.roles.actor.update_actor, data)
        self.metrics.update(metrics)
