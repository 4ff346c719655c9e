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

from hfjax.controller import Dispatch, Worker, register
from hfjax.parallel import layout_or_default
from hfjax.parallel.host_local import process_layout
from hfjax.protocol import DataProto
from hfjax.rollout import JaxEngine, OfflineGenerator
from hfjax.workers.config import ActorConfig, RolloutConfig
from hfjax.workers.generation import generate_batch, sampling_params
from hfjax.workers.model_role import LoadedModel, reports_seconds
from hfjax.workers.weight_sync import WeightShards, WeightSyncError, assemble, param_paths


class RolloutWorker(Worker):
    """The policy checkpoint of `actor.model_path` in `actor.dtype`, generating under `rollout.gen_layout`."""

    def __init__(self, actor: ActorConfig, rollout: RolloutConfig, *, max_prompt_length: int = 512):
        self.actor_cfg, self.rollout_cfg, self.max_prompt_length = actor, rollout, max_prompt_length
        self.version = 0

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Loads the checkpoint straight into this process's generation replicas; builds the engine."""
        rollout = self.rollout_cfg
        gen = layout_or_default(rollout.gen_layout, generation=True, where="rollout.gen_layout")
        self.local_layout = process_layout(gen)
        dtype = self.actor_cfg.dtype
        self.policy = LoadedModel(
            self.actor_cfg.model_path, self.local_layout, dtype=dtype, param_dtype=dtype, head="causal_lm"
        )
        self.pad_id = self.policy.config.pad_token_id or 0
        self.engine = JaxEngine(
            self.policy.model,
            self.local_layout,
            max_concurrent_decodes=rollout.slots,
            max_prefill_length=self.max_prompt_length,
            max_new_tokens=rollout.response_length,
        )
        self.generator = OfflineGenerator(self.engine, None, progress=False)
        self.expected = {path: (tuple(leaf.shape), leaf.dtype.name) for path, leaf in param_paths(self.policy.params)}
        return {
            "gen_layout": gen.describe(),
            "params": self.policy.config.num_params,
            "gen_memory": {"kv_cache_bytes_per_device": self.engine.kv_cache_bytes_per_device()},
        }

    @register(Dispatch.DP_COMPUTE_PROTO)
    @reports_seconds
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """As `ActorRolloutRefWorker.generate_sequences`, with the weights of the last `load_weights`; the metrics
        add `weights_version` (the policy version the samples come from)."""
        sampling = sampling_params(self.rollout_cfg, prompts.meta_info)
        self.generator.update_params(self.policy.params)
        try:
            batch, timing = generate_batch(self.generator, prompts, sampling, self.pad_id)
        finally:
            self.generator.update_params(None)
        timing["weights_version"] = self.version
        return DataProto.from_dict(batch, meta_info={"metrics": timing})

    @register(Dispatch.ONE_TO_ALL)
    def load_weights(self, version: int, *parts: WeightShards) -> dict[str, float]:
        """Replaces the weights by the trainer's blocks (`parts`: one `WeightShards` per trainer process) as policy
        `version`. Checks every block before placing anything; the old weights serve until the new ones are all on
        the devices. Returns the bytes received and the seconds spent here and in the trainer's export."""
        started, started_at = time.perf_counter(), time.time()
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
        return {
            "version": version,
            "bytes": float(sum(p.nbytes for p in parts)),
            "receive_seconds": time.perf_counter() - started,
            "export_seconds": max((p.seconds for p in parts), default=0.0),
            "started_at": started_at,
            "ended_at": time.time(),
        }

    @register(Dispatch.ONE_TO_ALL)
    def weights_version(self) -> int:
        """The policy version generation runs with."""
        return self.version

    @register(Dispatch.ONE_TO_ALL)
    def rollout_params(self) -> dict[str, Any]:
        """This process's weights as host arrays by parameter path (tests compare them with the trainer's)."""
        return {path: jax.device_get(leaf) for path, leaf in param_paths(self.policy.params)}
