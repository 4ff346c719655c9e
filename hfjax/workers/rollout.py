"""`RolloutWorker`: generation on devices of its own (the disaggregated placement): the policy in the generation
layout and compute dtype only (no master copy, no optimizer state, no HybridEngine), fed new weights by the trainer
(`load_weights`) and answering `generate_sequences` exactly like the policy worker.

Each process runs one continuous-batching loop over its own replicas of the generation layout (as the policy worker
does). Weights arrive as the trainer processes' blocks (`hfjax.workers.weight_sync`); the new copy is placed beside
the old one and swapped in only when complete, so a failed sync leaves the previous version serving.
Imports `hfjax.controller`, `hfjax.parallel`, `hfjax.rollout`, `hfjax.protocol` and this package.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from hfjax.controller import Dispatch, Worker, register
from hfjax.parallel import layout_or_default
from hfjax.parallel.host_local import host_local_layout, process_layout
from hfjax.protocol import DataProto
from hfjax.rollout import JaxEngine, OfflineGenerator
from hfjax.workers.config import ActorConfig, RolloutConfig
from hfjax.workers.generation import agent_generator, generate_batch, sampling_params
from hfjax.workers.model_role import LoadedModel, reports_seconds
from hfjax.workers.partial_rollout import generate_across_versions
from hfjax.workers.weight_sync import WeightShards, WeightSyncError, assemble, param_paths


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
    ):
        """`partial`: samples may move to newer weights part way (`follow` a mailbox; prompts then reach the
        engine with the tokens so far, so it takes prompts of `max_prompt_length + response_length` tokens);
        `check_every`: decode steps between looks for newer weights."""
        self.actor_cfg, self.rollout_cfg, self.max_prompt_length = actor, rollout, max_prompt_length
        self.partial, self.check_every = partial, check_every
        self.version, self.mailbox = 0, None
        self.loads: list[float] = []  # seconds of each load from the mailbox during the current generation

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Loads the checkpoint straight into this process's generation replicas; builds the engine."""
        rollout = self.rollout_cfg
        gen = layout_or_default(rollout.gen_layout, generation=True, where="rollout.gen_layout")
        self.local_layout = process_layout(host_local_layout(gen))  # its own order, when host-local
        dtype = self.actor_cfg.dtype
        self.policy = LoadedModel(
            self.actor_cfg.model_path, self.local_layout, dtype=dtype, param_dtype=dtype, head="causal_lm"
        )
        self.pad_id = self.policy.config.pad_token_id or 0
        self.engine = JaxEngine(
            self.policy.model,
            self.local_layout,
            max_concurrent_decodes=rollout.slots,
            max_prefill_length=self.max_prompt_length + (rollout.response_length if self.partial else 0),
            max_new_tokens=rollout.response_length,
        )
        self.generator = OfflineGenerator(self.engine, None, progress=False)
        self.agent = agent_generator(self.generator, rollout)
        self.expected = {path: (tuple(leaf.shape), leaf.dtype.name) for path, leaf in param_paths(self.policy.params)}
        return {
            "gen_layout": gen.describe(),
            "params": self.policy.config.num_params,
            "gen_memory": {"kv_cache_bytes_per_device": self.engine.kv_cache_bytes_per_device()},
        }

    @register(Dispatch.DP_COMPUTE_PROTO)
    @reports_seconds
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """As `ActorRolloutRefWorker.generate_sequences`, with the weights of the last `load_weights` (or, following a
        mailbox, the newest published, also part way: the batch then has `rollout_versions`, each token's policy
        version); the metrics add `weights_version` (the version at the start), `weight_loads` and
        `weight_load_seconds` (loads from the mailbox during this call)."""
        sampling = sampling_params(self.rollout_cfg, prompts.meta_info)
        run, self.loads = None, []
        if self.mailbox is not None:
            if self._newer():
                self._load_newest()
            start = self.version

            def run(prompt_lists: list, request: Any, first: int) -> list:
                return generate_across_versions(
                    self.generator,
                    prompt_lists,
                    request,
                    first,
                    version=start,
                    newer=self._newer,
                    load_newest=self._load_newest,
                    check_every=self.check_every,
                )

        version = self.version
        self.generator.update_params(self.policy.params)
        try:
            batch, timing = generate_batch(self.generator, prompts, sampling, self.pad_id, run, self.agent)
        finally:
            self.generator.update_params(None)
        timing["weights_version"] = version
        timing["weight_loads"], timing["weight_load_seconds"] = float(len(self.loads)), sum(self.loads)
        return DataProto.from_dict(batch, meta_info={"metrics": timing})

    @register(Dispatch.ONE_TO_ALL)
    def follow(self, mailbox: Any) -> None:
        """Partial rollouts: from now on generation takes the newest weights published in `mailbox` (a Ray actor
        with `newest() -> version` and `take() -> (version, blocks refs)`), at its start and part way."""
        if not self.partial:
            raise RuntimeError("RolloutWorker.follow: this worker was built without partial=True")
        self.mailbox = mailbox

    def _newer(self) -> bool:
        import ray

        return ray.get(self.mailbox.newest.remote()) > self.version

    def _load_newest(self) -> int:
        import ray

        started = time.perf_counter()
        version, refs = ray.get(self.mailbox.take.remote())
        self._install(version, ray.get(refs))
        self.generator.update_params(self.policy.params)
        self.loads.append(time.perf_counter() - started)
        return version

    @register(Dispatch.ONE_TO_ALL)
    def load_weights(self, version: int, *parts: WeightShards) -> dict[str, float]:
        """Replaces the weights by the trainer's blocks (`parts`: one `WeightShards` per trainer process) as policy
        `version`. Checks every block before placing anything; the old weights serve until the new ones are all on
        the devices. Returns the bytes received and the seconds spent here and in the trainer's export."""
        started, started_at = time.perf_counter(), time.time()
        self._install(version, parts)
        return {
            "version": version,
            "bytes": float(sum(p.nbytes for p in parts)),
            "receive_seconds": time.perf_counter() - started,
            "export_seconds": max((p.seconds for p in parts), default=0.0),
            "started_at": started_at,
            "ended_at": time.time(),
        }

    def _install(self, version: int, parts: list[WeightShards] | tuple[WeightShards, ...]) -> None:
        """The blocks as the weights of `version`, swapped in once all are placed (see `load_weights`)."""
        try:
            arrays = assemble(list(parts), self.expected)
            leaves, treedef = jax.tree.flatten(self.policy.params)
            placed = [
                jax.device_put(arrays[path], leaf.sharding)
                for (path, _), leaf in zip(param_paths(self.policy.params), leaves, strict=True)
            ]
            jax.block_until_ready(placed)
        except Exception as exc:
            raise WeightSyncError(
                f"weight sync to version {version} failed; the rollout keeps serving version {self.version}: {exc}"
            ) from exc
        old, self.policy.params = leaves, jax.tree.unflatten(treedef, placed)
        for leaf in old:
            leaf.delete()
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
