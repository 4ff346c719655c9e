"""Rollouts generated ahead of training on a rollout group of their own devices (the disaggregated placement), with
bounded staleness: asynchronous RL.

A policy *version* counts the actor updates behind a set of weights (the checkpoint is version 0, or the restored
step). After every update the trainer's weights go to the rollout group (`sync`): the actor's blocks, cast to the
rollout's dtype, pass from the trainer's processes to the rollout's through Ray's object store, never through the
controller, and switch in two phases on every rollout process or on none (`sync_weights`). `take(step)` returns the
rollout of `step`, first starting generation for every step up to `step + max_staleness` whose prompts are not yet
out. Calls on a group run in the order the controller made them, so a generation started after `sync(v)` runs with
version `v`: the rollout of step `k`, started at step `k - max_staleness`, is exactly `max_staleness` versions old
when step `k` updates on it (0: the synchronous loop). At most `max_staleness + 1` rollouts are in flight (the
bounded buffer); when the trainer is slower the rollout group waits (back-pressure), when the rollout is slower the
trainer waits in `take` (`timing_s/gen`).
With `async.partial_rollout` the weights are not queued on the rollout group but published in a `WeightMailbox` (a
Ray actor holding the newest version's block refs); the rollout takes the newest at the start of each generation and
part way through it (`hfjax.workers.partial_rollout`), every process of the group at the same points of its
generation (see `WeightMailbox`), so a rollout is at most `max_staleness` versions old where it starts and newer
after; the batch records each token's version (`rollout_versions`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from hfjax.config.rl import RLConfig
from hfjax.protocol import DataProto
from hfjax.trainer.roles import Roles, group_names
from hfjax.trainer.timeline import Timeline

Point = tuple[int, int, int]  # (generation call, round, check) of a rollout process following a mailbox
PASSED_ALL = 2**62  # the round of a process that ended its generation call: past every point of that call


def sync_weights(rollout: Any, version: int, parts: list[Any]) -> Any:
    """Queues a two-phase weight sync of the trainer's blocks (`parts`: the refs of the actor's
    `weights_for_rollout`) on the `rollout` group as policy `version`; returns the future of phase two at once.
    Every process stages the blocks while its old weights serve (`stage_weights`), then every process, given all
    the stage reports (passed as refs between the group's own calls, never through the controller), switches to
    `version`, or drops it and raises if any process failed (`commit_weights`). Later calls on the group run
    after both."""
    staged = rollout.stage_weights.submit(version, *parts)
    return rollout.commit_weights.submit(version, *staged.parts)


@dataclasses.dataclass
class VersionSwitch:
    """A switch to `version` (its blocks' refs `parts`) decided at `point`, with the stage error (or None) of each
    process that reached it; `failed` once some process could not stage it."""

    point: Point
    version: int
    parts: list[Any]
    reports: dict[int, str | None] = dataclasses.field(default_factory=dict)
    failed: bool = False


class WeightMailbox:
    """The newest published policy version and its blocks' refs, and the versions the `processes` of one rollout
    group switch to and where (run as a Ray actor: the controller publishes, the rollout processes ask).

    Each process asks at every *point* of its generation: `(call, round, check)` counts its generation calls, the rounds
    within the call (round 0 is the call's start, one ask; round 1 begins the generation, and every switch part way
    begins another) and the checks of the round (one every `check_every` decode steps), so the same point is the same
    place of the generation on every process, however far apart in time. The processes run loops of their own (different
    rows, different lengths), so no collective can stand in: one that finishes its rows early would never join it.
    Instead the first process to reach a point beyond every point decided so far decides it (`decide`): a switch to the
    newest published version if it is newer than the version in force there, and at the start of every call (round 0,
    check 0) a switch to the newest published version whatever is in force. A point at or behind that frontier gets the
    decision already taken, so every process reaching a point gets the same answer. A switch is two-phase: each process
    at the point that serves an older version stages the version and reports (`report`; one already serving it reports
    at once); the outcome (`outcome`) is known once every process has reported there or passed the point without
    reaching it (it ended its call before: `finish`), and it is every process's: switch, or drop if any failed. A
    process that passed a switch so, serving the older version to the end of its call, switches at the start of its next
    call: no call starts on an older version than the one in force. Switches every process has passed are forgotten (and
    their blocks released)."""

    def __init__(self, processes: int = 1) -> None:
        self.processes = processes
        self.version, self.parts = -1, []
        self.frontier: Point | None = None  # the furthest point decided
        self.switches: list[VersionSwitch] = []
        self.settled = -1  # the version in force before the first switch still kept
        self.positions: dict[int, Point] = {}  # each process's last point

    def publish(self, version: int, parts: list[Any]) -> None:
        """The trainer's newest weights (`parts`: the refs of its processes' blocks) as policy `version`."""
        self.version, self.parts = version, parts

    def decide(self, rank: int, point: Point, serving: int) -> tuple[Point, int, list[Any]] | None:
        """Process `rank`, serving version `serving`, at `point`: the switch it must make there (the switch's
        point, version and blocks' refs), or None."""
        self.positions[rank] = point
        if self.frontier is None or point > self.frontier:
            self.frontier = point
            call_start = point[1:] == (0, 0) and self.version >= 0  # every process then serves the newest
            if call_start or self.version > self._in_force(point):
                self.switches.append(VersionSwitch(point, self.version, self.parts))
        self._forget_passed()
        switch = self._latest(point)
        if switch is None or switch.version == serving:
            if switch is not None and switch.point == point:
                switch.reports[rank] = None  # already there: nothing to stage
            return None
        return switch.point, switch.version, switch.parts

    def report(self, rank: int, point: Point, error: str | None) -> list[str] | None:
        """Process `rank` staged the switch of `point` (`error`: why not); returns `outcome(point)`."""
        self._at(point).reports[rank] = error
        return self.outcome(point)

    def outcome(self, point: Point) -> list[str] | None:
        """None while a process may still reach `point`; then the stage errors there (empty: every process that
        reached it switches)."""
        switch = self._at(point)
        waiting = [
            r for r in range(self.processes) if r not in switch.reports and self.positions.get(r, point) <= point
        ]
        if waiting:
            return None
        errors = [error for error in switch.reports.values() if error]
        switch.failed = bool(errors)
        return errors

    def finish(self, rank: int, call: int) -> None:
        """Process `rank` ended generation call `call`: it reaches no later point of it."""
        self.positions[rank] = (call, PASSED_ALL, 0)

    def _in_force(self, point: Point) -> int:
        switch = self._latest(point)
        return self.settled if switch is None else switch.version

    def _latest(self, point: Point) -> VersionSwitch | None:
        """The last switch at or before `point` that did not fail."""
        return next((s for s in reversed(self.switches) if s.point <= point and not s.failed), None)

    def _at(self, point: Point) -> VersionSwitch:
        return next(s for s in self.switches if s.point == point)

    def _forget_passed(self) -> None:
        if len(self.positions) < self.processes:
            return
        lowest = min(self.positions.values())
        while self.switches and self.switches[0].point < lowest:
            switch = self.switches.pop(0)
            if not switch.failed:
                self.settled = switch.version


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


def rollout_meta(cfg: RLConfig, step: int) -> dict[str, Any]:
    """The sampling request of a step's rollout: `rollout.n` samples per prompt, seeded by the step (sample s of
    prompt p draws with the key of (seed, p, s); partial rollouts' continuations with the same seed and negative
    request ids, `hfjax.workers.partial_rollout.continuation_request`)."""
    return {"n": cfg.rollout.n, "seed": cfg.rollout.seed + step}


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
        roles: Roles,
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

            self.mailbox = ray.remote(num_cpus=0)(WeightMailbox).remote(roles.rollout.world_size)
            roles.rollout.follow(self.mailbox)

    def sync(self, version: int) -> None:
        """Queues the trainer's current weights to the rollout group as policy `version` (returns at once)."""
        shards = self.roles.actor.weights_for_rollout()  # a future: the blocks stay in the cluster
        if self.mailbox is not None:  # the rollout takes it when it looks, even part way through a generation
            self.mailbox.publish.remote(version, shards.parts)
        else:
            self.unchecked.append(sync_weights(self.roles["rollout"], version, shards.parts))
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
