"""`RolloutWorker`: generation on devices of its own (the disaggregated placement): the policy in the generation layout
and compute dtype only (no master copy, no optimizer state, no HybridEngine), fed new weights by the trainer
(`stage_weights`, `commit_weights`, or a mailbox to `follow`; a LoRA policy's adapters only, its base loaded here)
and answering `generate_sequences` exactly like the policy worker.

Each process runs one continuous-batching loop over its own replicas of the generation layout (as the policy worker
does). Weights arrive as the trainer processes' blocks (`hfjax.workers.weight_sync`) and switch in two phases on
every process of the group together (`hfjax.workers.weight_swap`): each process stages them while the old weights
keep serving, then all switch, or all keep the old version if any process failed. On the blocking path the
controller queues `stage_weights` then `commit_weights` (`hfjax.trainer.rollout_stream.sync_weights`); following a
mailbox (partial rollouts) the processes ask it at every check of their generation loops, identified by the same
point on every process, and switch at the points it decides (`WeightMailbox`).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from hfjax.config.roles import ActorConfig, RolloutConfig
from hfjax.controller import Dispatch, Worker, register
from hfjax.models.lora import LoraParam
from hfjax.parallel import layout_or_default
from hfjax.parallel.host_local import host_local_layout, process_layout
from hfjax.protocol import DataProto
from hfjax.rollout import JaxEngine, OfflineGenerator
from hfjax.workers.generation import agent_generator, generate_batch, sampling_params
from hfjax.workers.model_role import LoadedModel, reports_usage
from hfjax.workers.partial_rollout import generate_across_versions
from hfjax.workers.weight_swap import WeightSwap
from hfjax.workers.weight_sync import WeightShards, WeightSyncError, param_paths

SWITCH_POLL_S = 0.005  # seconds between asks while other processes make their way to a switch point


class RolloutWorker(Worker):
    """The policy checkpoint of `actor.model_path` in `actor.dtype`, generating under `rollout.gen_layout`."""

    def __init__(
        self,
        actor: ActorConfig,
        rollout: RolloutConfig,
        *,
        max_prompt_length: int = 512,
        partial: bool = False,
        check_every: int = 8,
        weight_swap: str = "atomic",
    ):
        """`partial`: samples may move to newer weights part way (`follow` a mailbox; prompts then reach the
        engine with the tokens so far, so it takes prompts of `max_prompt_length + response_length` tokens);
        `check_every`: decode steps between looks for newer weights; `weight_swap`: how a sync stages
        (`hfjax.workers.weight_swap`)."""
        self.actor_cfg, self.rollout_cfg, self.max_prompt_length = actor, rollout, max_prompt_length
        self.lora = actor.lora.enabled  # then the base is loaded here once, and syncs bring the adapters
        self.partial, self.check_every = partial, check_every
        self.version, self.mailbox, self.swap = 0, None, WeightSwap(weight_swap)
        self.loads: list[float] = []  # seconds of each load from the mailbox during the current generation
        self.point = (0, 0, 0)  # following a mailbox: (generation call, round, check) of the next ask
        self.due: tuple | None = None  # the switch the mailbox decided at the last ask

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Loads the checkpoint straight into this process's generation replicas; builds the engine."""
        rollout = self.rollout_cfg
        gen = layout_or_default(rollout.gen_layout, generation=True, where="rollout.gen_layout")
        self.local_layout = process_layout(host_local_layout(gen))  # its own order, when host-local
        dtype = self.actor_cfg.dtype
        self.policy = LoadedModel(
            self.actor_cfg.model_path,
            self.local_layout,
            dtype=dtype,
            param_dtype=dtype,
            head="causal_lm",
            lora=self.actor_cfg.lora if self.lora else None,
            images_per_step=self.actor_cfg.images_per_step,
        )
        self.pad_id = self.policy.config.pad_token_id or 0
        self.engine = JaxEngine(
            self.policy.model,
            self.local_layout,
            max_concurrent_decodes=rollout.slots,
            max_prefill_length=self.max_prompt_length + (rollout.response_length if self.partial else 0),
            max_new_tokens=rollout.response_length,
            prompt_cache_tokens=rollout.prompt_cache_tokens,
            record_experts=self.actor_cfg.router_replay,
        )
        self.generator = OfflineGenerator(self.engine, None, progress=False)
        self.agent = agent_generator(self.generator, rollout)
        return {
            "gen_layout": gen.describe(),
            "params": self.policy.config.num_params,
            "gen_memory": {"kv_cache_bytes_per_device": self.engine.kv_cache_bytes_per_device()},
        }

    @register(Dispatch.DP_COMPUTE_PROTO)
    @reports_usage
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """As `ActorRolloutRefWorker.generate_sequences`, with the weights of the last sync (or, following a
        mailbox, the version it decides, also part way: the batch then has `rollout_versions`, each token's policy
        version); the metrics add `weights_version` (the version at the start), `weight_loads` and
        `weight_load_seconds` (switches while following the mailbox during this call)."""
        if self.swap.incomplete:
            raise WeightSyncError(self.swap.incomplete)
        sampling = sampling_params(self.rollout_cfg, prompts.meta_info)
        self.loads = []
        run = self._generate_across_versions if self.mailbox is not None else None
        try:
            if run is not None:
                self._start_call()
            version = self.version
            self.generator.update_params(self.policy.params)
            try:
                batch, timing = generate_batch(self.generator, prompts, sampling, self.pad_id, run, self.agent)
            finally:
                self.generator.update_params(None)
        finally:
            if self.mailbox is not None:  # no switch at a later point of this call waits for this process
                self.mailbox.finish.remote(self.rank, self.point[0])
        timing["weights_version"] = version
        timing["weight_loads"], timing["weight_load_seconds"] = float(len(self.loads)), sum(self.loads)
        return DataProto.from_dict(batch, meta_info={"metrics": timing})

    def _generate_across_versions(self, prompt_lists: list, request: Any, first: int) -> list:
        return generate_across_versions(
            self.generator,
            prompt_lists,
            request,
            first,
            version=self.version,
            newer=self._switch_due,
            load_newest=self._switch,
            check_every=self.check_every,
        )

    @register(Dispatch.ONE_TO_ALL)
    def follow(self, mailbox: Any) -> None:
        """Partial rollouts: from now on generation takes the versions `mailbox` (a Ray actor running
        `hfjax.trainer.rollout_stream.WeightMailbox`) decides, at its start and part way."""
        if not self.partial:
            raise RuntimeError("RolloutWorker.follow: this worker was built without partial=True")
        self.mailbox = mailbox

    def _start_call(self) -> None:
        """The start of the next generation call following the mailbox: takes the version it decides there (the newest
        published: a process that ended its rows before a switch of its last call switches now, whether the others
        do or not); generation then goes on in round 1 on every process, switched here or not, so that the points
        of the call stay the same on all."""
        self.point = (self.point[0] + 1, 0, 0)
        if self._switch_due():
            self._switch()
        self.point = (self.point[0], 1, 0)

    def _switch_due(self) -> bool:
        """Asks the mailbox whether to switch at this point of the generation: the start of each call, then every
        `check_every` decode steps of each round (the same points on every process of the group)."""
        import ray

        call, round_, check = self.point
        self.due = ray.get(self.mailbox.decide.remote(self.rank, self.point, self.version))
        self.point = (call, round_, check + 1)
        return self.due is not None

    def _switch(self) -> int:
        """Switches to the version the mailbox decided at the last ask, in two phases with the other processes at
        that point (see `WeightMailbox`); returns it. Generation goes on in a new round."""
        import ray

        started = time.perf_counter()
        point, version, refs = self.due
        try:
            parts = ray.get(list(refs))
        except Exception as exc:  # reported as a failed stage: the other processes must not wait for this one
            error = f"rank {self.rank}: the blocks of version {version} could not be fetched: {exc}"
        else:
            error = self._stage(version, parts)
        errors = ray.get(self.mailbox.report.remote(self.rank, point, error))
        while errors is None:  # other processes still on their way to `point`
            time.sleep(SWITCH_POLL_S)
            errors = ray.get(self.mailbox.outcome.remote(point))
        self._settle(version, errors)
        self.generator.update_params(self.policy.params)
        self.point = (self.point[0], self.point[1] + 1, 0)
        self.loads.append(time.perf_counter() - started)
        return version

    @register(Dispatch.ONE_TO_ALL)
    def stage_weights(self, version: int, *parts: WeightShards) -> dict[str, Any]:
        """Phase one of a sync (`hfjax.trainer.rollout_stream.sync_weights`): checks the trainer's blocks (`parts`:
        one `WeightShards` per trainer process) and stages them as policy `version`, the old weights serving on.
        Never raises: what failed is in `error`, for every process's `commit_weights` to see. Also returns the bytes
        received and the seconds spent here and in the trainer's export."""
        started, started_at = time.perf_counter(), time.time()
        error = self._stage(version, parts)
        return {
            "version": version,
            "error": error,
            "bytes": float(sum(p.nbytes for p in parts)),
            "stage_seconds": time.perf_counter() - started,
            "export_seconds": max((p.seconds for p in parts), default=0.0),
            "started_at": started_at,
        }

    @register(Dispatch.ONE_TO_ALL)
    def commit_weights(self, version: int, *staged: dict[str, Any]) -> dict[str, Any]:
        """Phase two, given every process's `stage_weights` report (in rank order): switches to `version` where all
        staged it; else drops it and raises `WeightSyncError` (every process keeps serving its version). Returns
        this process's report with `receive_seconds` (both phases here) and `ended_at`."""
        started = time.perf_counter()
        self._settle(version, [report["error"] for report in staged if report["error"]])
        own = staged[self.rank]
        seconds = own["stage_seconds"] + time.perf_counter() - started
        return {**own, "receive_seconds": seconds, "ended_at": time.time()}

    def _synced(self) -> Any:
        """The parameters a sync replaces: all, or a LoRA policy's adapters (its base is `model_path`'s, frozen)."""
        return nnx.split_state(self.policy.params, LoraParam, ...)[0] if self.lora else self.policy.params

    def _stage(self, version: int, parts: Any) -> str | None:
        """Stages `parts` as `version` (`WeightSwap.stage`); what failed, naming this process, or None."""
        try:
            self.swap.stage(version, list(parts), self._synced())
        except Exception as exc:  # every failure must reach phase two on every process, which drops the version
            return f"rank {self.rank}: {exc}"
        return None

    def _settle(self, version: int, errors: list[str]) -> None:
        """Phase two here (`WeightSwap.settle`): `version` serves from now on, or the error is raised."""
        new = self.swap.settle(version, self.version, self._synced(), errors)
        self.policy.params = nnx.merge_state(self.policy.params, new) if self.lora else new
        self.version = version

    @register(Dispatch.ONE_TO_ALL)
    def weights_version(self) -> int:
        """The policy version generation runs with."""
        return self.version

    @register(Dispatch.ONE_TO_ALL)
    def rollout_params(self) -> dict[str, Any]:
        """This process's weights as host arrays by parameter path (tests compare them with the trainer's), after
        checking that every device's shard holds exactly its part of them (raises naming the first that does not)."""
        out = {}
        for path, leaf in param_paths(self.policy.params):
            whole = np.asarray(jax.device_get(leaf))
            for shard in leaf.addressable_shards:
                if not np.array_equal(np.asarray(shard.data), whole[shard.index]):
                    raise RuntimeError(f"rollout_params: {path} on device {shard.device} differs from its other copies")
            out[path] = whole
        return out
