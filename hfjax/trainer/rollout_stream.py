"""Rollouts generated ahead of training on a rollout group of their own devices (the disaggregated placement), with
bounded staleness: asynchronous RL.

A policy *version* counts the actor updates behind a set of weights (the checkpoint is version 0, or the restored
step). After every update the trainer's weights go to the rollout group (`sync`): the actor's blocks, cast to the
rollout's dtype, pass from the trainer's processes to the rollout's through Ray's object store, never through the
controller. `take(step)` returns the rollout of `step`, first starting generation for every step up to
`step + max_staleness` whose prompts are not yet out. Calls on a group run in the order the controller made them,
so a generation started after `sync(v)` runs with version `v`: the rollout of step `k`, started at step
`k - max_staleness`, is exactly `max_staleness` versions old when step `k` updates on it (0: the synchronous loop).
At most `max_staleness + 1` rollouts are in flight (the bounded buffer); when the trainer is slower the rollout group
waits (back-pressure), when the rollout is slower the trainer waits in `take` (`timing_s/gen`).
With `async.partial_rollout` the weights are not queued on the rollout group but published in a `WeightMailbox`
(a Ray actor holding the newest version's block refs); the rollout takes the newest at the start of each generation
and part way through it (`hfjax.workers.partial_rollout`), so a rollout is at most `max_staleness` versions old where
it starts and newer after; the batch records each token's version (`rollout_versions`).
Imports `hfjax.config`, `hfjax.protocol` and this package's step and timeline.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from hfjax.config import RLConfig
from hfjax.protocol import DataProto
from hfjax.trainer.step import group_names, rollout_meta
from hfjax.trainer.timeline import Timeline


class WeightMailbox:
    """The newest published policy version and the object refs of its blocks (run as a Ray actor: the controller
    publishes, the rollout processes poll `newest` and `take`). Holding the refs keeps the blocks alive until a newer
    version replaces them."""

    def __init__(self) -> None:
        self.version, self.parts = -1, []

    def publish(self, version: int, parts: list[Any]) -> None:
        self.version, self.parts = version, parts

    def newest(self) -> int:
        return self.version

    def take(self) -> tuple[int, list[Any]]:
        return self.version, self.parts


def token_staleness(step: int, versions: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """Staleness metrics of a partial rollout from each token's policy version: the oldest and mean (versions behind
    the policy that updates at `step`), and the share of samples whose tokens come from more than one version."""
    real = mask.astype(bool)
    behind = (step - versions)[real]
    spans = [len(np.unique(row[keep])) for row, keep in zip(versions, real, strict=True) if keep.any()]
    return {
        "async/staleness": float(behind.max(initial=0)),
        "async/token_staleness_mean": float(behind.mean()) if behind.size else 0.0,
        "async/partial_frac": float(np.mean([n > 1 for n in spans])) if spans else 0.0,
    }


def _values(meta: dict[str, Any], key: str) -> list[float]:
    value = meta.get("metrics", {}).get(key)
    return [float(v) for v in np.atleast_1d(value)] if value is not None else []


@dataclasses.dataclass
class PendingRollout:
    """One step's generation under way: its prompts and request, the group call's future, the policy version its
    weights are, and the weight syncs queued on the rollout group before it (checked when it is taken)."""

    step: int
    prompts: DataProto
    request: DataProto
    future: Any
    version: int
    syncs: list[Any]
    staleness: int
    lane: str
    timeline: Timeline | None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    def result(self) -> DataProto:
        """Waits for the rollout; raises if a weight sync before it failed or it ran with other weights than
        planned. Fills `metrics` with the syncs' bytes and seconds and the staleness."""
        for sync in self.syncs:
            ranks = sync.get()  # raises the rollout's WeightSyncError, naming the version it kept
            self.metrics["sync/bytes"] = self.metrics.get("sync/bytes", 0.0) + ranks[0]["bytes"]
            seconds = max(r["ended_at"] for r in ranks) - min(r["started_at"] for r in ranks)
            self.metrics["timing_s/weight_sync"] = self.metrics.get("timing_s/weight_sync", 0.0) + seconds
            self.metrics["sync/export_s"] = max(r["export_seconds"] for r in ranks)
            if self.timeline is not None:
                for r in ranks:
                    self.timeline.record(self.lane, "load_weights", self.step, r["started_at"], r["ended_at"])
        out = self.future.get()
        versions = set(_values(out.meta_info, "weights_version"))
        partial = "rollout_versions" in out.batch
        if (min(versions) < self.version) if partial else (versions != {float(self.version)}):
            raise RuntimeError(
                f"the rollout of step {self.step} ran with weights version(s) {sorted(versions)}, expected "
                f"{self.version}{' or newer' if partial else ''}: a weight sync was lost"
            )
        starts, ends = _values(out.meta_info, "gen_started_at"), _values(out.meta_info, "gen_ended_at")
        if self.timeline is not None and starts:
            self.timeline.record(self.lane, "generate_sequences", self.step, min(starts), max(ends))
        self.metrics["async/staleness"] = float(self.staleness)
        self.metrics["async/weights_version"] = float(min(versions))
        if partial:
            batch = out.batch
            self.metrics.update(token_staleness(self.step, batch["rollout_versions"], batch["response_mask"]))
            self.metrics["sync/loads"] = sum(_values(out.meta_info, "weight_loads"))
            self.metrics["timing_s/weight_sync"] = max(_values(out.meta_info, "weight_load_seconds"))
        return out


class RolloutStream:
    """Generation ahead of training on the `rollout` role's group (see the module docstring)."""

    def __init__(
        self,
        cfg: RLConfig,
        roles: dict[str, Any],
        next_prompts: Callable[[int], DataProto],
        timeline: Timeline | None = None,
    ):
        self.cfg, self.roles, self.next_prompts, self.timeline = cfg, roles, next_prompts, timeline
        self.max_staleness = cfg.async_.max_staleness
        self.lane = group_names(cfg)["rollout"]
        self.pending: collections.deque[PendingRollout] = collections.deque()
        self.next_step: int | None = None
        self.version: int | None = None
        self.unchecked: list[Any] = []
        self.mailbox = None
        if cfg.async_.partial_rollout:
            import ray

            self.mailbox = ray.remote(num_cpus=0)(WeightMailbox).remote()
            roles["rollout"].follow(self.mailbox)

    def sync(self, version: int) -> None:
        """Queues the trainer's current weights to the rollout group as policy `version` (returns at once)."""
        shards = self.roles["actor"].weights_for_rollout()  # a future: the blocks stay in the cluster
        if self.mailbox is not None:  # the rollout takes it when it looks, even part way through a generation
            self.mailbox.publish.remote(version, shards.parts)
        else:
            self.unchecked.append(self.roles["rollout"].load_weights.submit(version, *shards.parts))
        self.version = version

    def take(self, step: int) -> PendingRollout:
        """The rollout of `step`, after starting generation up to `step + max_staleness` (not past the last step)."""
        if self.version is None:
            raise RuntimeError("RolloutStream.take: sync the weights once before the first rollout")
        if self.next_step is None:
            self.next_step = step
        last = min(step + self.max_staleness, self.cfg.trainer.total_steps - 1)
        while self.next_step <= last:
            self._start(self.next_step)
            self.next_step += 1
        item = self.pending.popleft()
        if item.step != step:
            raise RuntimeError(f"RolloutStream.take({step}): the next rollout under way is step {item.step}")
        return item

    def _start(self, step: int) -> None:
        staleness = step - self.version
        if staleness > self.max_staleness:
            raise RuntimeError(
                f"step {step} would train on weights {staleness} versions old (max {self.max_staleness})"
            )
        prompts = self.next_prompts(step)
        request = DataProto(
            prompts.batch, prompts.non_tensor_batch, {**prompts.meta_info, **rollout_meta(self.cfg, step)}
        )
        future = self.roles["rollout"].generate_sequences.submit(request)
        self.pending.append(
            PendingRollout(
                step, prompts, request, future, self.version, self.unchecked, staleness, self.lane, self.timeline
            )
        )
        self.unchecked = []

    def drain(self) -> None:
        """Waits for the syncs no rollout has checked yet (the last one), raising if one failed."""
        for sync in self.unchecked:
            sync.get()
        self.unchecked = []
