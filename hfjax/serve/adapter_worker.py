"""`AdapterWorker`: the service's models in one worker process. One frozen base model, loaded from a Hugging Face
checkpoint onto the config's layout; each training client's LoRA adapter on it (float32, sharded as its base
weights), with its accumulated gradient and Adam moments; frozen sampler versions of adapters; one generation engine
per adapter shape (rank and targets), shared by every adapter of that shape. The base's arrays exist once: every
adapter's model is the same base arrays merged with that adapter's matrices.

Calls run one at a time, in the order the service sends them (`hfjax.serve.app` queues them per client and runs
them on one thread): an adapter is never read by one call while another writes it."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hfjax.controller.dispatch import Dispatch
from hfjax.controller.worker import Worker, register
from hfjax.models.hf import load_hf
from hfjax.models.lora import ATTENTION_TARGETS, LoraConfig, LoraParam, add_lora, lora_modules
from hfjax.models.peft_io import save_peft
from hfjax.optim.train_state import place_batch
from hfjax.parallel.layout import Layout
from hfjax.records.checkpoint import CheckpointError, CheckpointManager
from hfjax.rollout import JaxEngine, OfflineGenerator
from hfjax.serve.adapter_programs import AdapterPrograms, adam_hyper, loss_config, pad_data
from hfjax.serve.backend import (
    LOSSES,
    AdamStep,
    Refusal,
    SampledSequence,
    SampleRequest,
    SampleResult,
    ServeError,
    TrainDatum,
    refusals_returned,
)
from hfjax.serve.config import ServeConfig
from hfjax.serve.sample_batches import engine_calls, sampling_params

log = logging.getLogger(__name__)
DEFAULT_LAYOUT = {"mesh": {"data": 1}, "rules": "dp_tp_gen", "devices": [0]}
META = "adapter.json"  # beside a saved state: what it was saved with (base model, rank, targets, seed, optimizer)
SAMPLER_VERSIONS_KEPT = 8  # per training client: older sampler versions are dropped (their clients get a 404)


@dataclasses.dataclass
class _Shape:
    """What every adapter of one rank and target set shares: the merged model's structure, the base's arrays in it,
    and (built at its first sample) its generation engine."""

    graphdef: Any
    rest: Any  # the base's parameters and other state: the same arrays for every shape
    initial: Any  # the matrices of a fresh adapter of this shape (none for the base alone)
    generator: OfflineGenerator | None = None


@dataclasses.dataclass
class _Adapter:
    base_model: str
    lora: LoraConfig
    seed: int
    params: Any  # the adapter's matrices (nnx.State of LoraParam)
    m: Any
    v: Any
    count: jax.Array
    grads: Any = None  # accumulated since the last optim_step
    versions: list[str] = dataclasses.field(default_factory=list)  # its sampler versions, oldest first

    @property
    def shape_key(self) -> tuple[int, tuple[str, ...]]:
        return self.lora.rank, tuple(self.lora.targets)


class AdapterWorker(Worker):
    """The models behind `hfjax serve` (implements `hfjax.serve.backend.ServeBackend` as group methods)."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.layout = Layout.from_config(config.layout or DEFAULT_LAYOUT, "layout")
        model = load_hf(config.model_path, dtype=config.dtype, layout=self.layout)
        if model.head_kind != "causal_lm":
            raise ServeError(f"model_path: {config.model_path} is a {model.head_kind} checkpoint; expected a causal LM")
        self.base = model
        self.model_config = model.config
        self.programs = AdapterPrograms(self.layout)
        self.shapes: dict[tuple[int, tuple[str, ...]] | None, _Shape] = {}
        self.adapters: dict[str, _Adapter] = {}
        self.versions: dict[str, tuple[tuple[int, tuple[str, ...]], Any]] = {}  # sampler key -> (shape, matrices)
        self._draws = 0  # samples without a seed draw with seed = this count

    # -- adapters --------------------------------------------------------------------------------------------
    def _adapter(self, model_id: str) -> _Adapter:
        adapter = self.adapters.get(model_id)
        if adapter is None:
            raise ServeError(f"model_id: no training client {model_id!r} on this server", status=404)
        return adapter

    def _check_base(self, base_model: str) -> None:
        if base_model != self.config.base_model:
            raise ServeError(f"base_model: {base_model!r} is not served here; expected {self.config.base_model!r}", 404)

    def _lora_model(self, lora: LoraConfig, seed: int) -> nnx.Module:
        return add_lora(nnx.merge(*nnx.split(self.base)), lora, seed)  # a new module over the base's arrays

    def _shape(self, lora: LoraConfig | None) -> _Shape:
        """The shared structure of adapters like `lora` (None: the base alone)."""
        key = None if lora is None else (lora.rank, tuple(lora.targets))
        if key not in self.shapes:
            model = self.base if lora is None else self._lora_model(lora, 0)
            graphdef, initial, rest = nnx.split(model, LoraParam, ...)
            self.shapes[key] = _Shape(graphdef, rest, initial)
        return self.shapes[key]

    @register(Dispatch.RANK_ZERO)
    @refusals_returned
    def base_models(self) -> list[str]:
        return [self.config.base_model]

    @register(Dispatch.RANK_ZERO)
    @refusals_returned
    def create_adapter(self, model_id: str, base_model: str, rank: int, seed: int, train_mlp: bool, train_attn: bool
                       ) -> None:  # fmt: skip
        self._check_base(base_model)
        if not 1 <= rank <= self.config.max_lora_rank:
            raise ServeError(f"lora_config.rank: expected 1..{self.config.max_lora_rank} on this server, got {rank}")
        if model_id not in self.adapters and len(self.adapters) >= self.config.max_adapters:
            raise ServeError(f"the server holds its max_adapters ({self.config.max_adapters}) training clients; "
                             "unload one first")  # fmt: skip
        modules = lora_modules(self.model_config)
        targets = [
            t for t in modules if (t in ATTENTION_TARGETS and train_attn) or (t not in ATTENTION_TARGETS and train_mlp)
        ]
        if not targets:
            raise ServeError(f"lora_config: train_attn and train_mlp select none of the model's modules {modules}")
        lora = LoraConfig(rank=rank, alpha=self.config.lora_alpha, targets=targets)
        self._shape(lora)
        params = nnx.state(self._lora_model(lora, seed), LoraParam)
        params = jax.device_put(params, self.layout.shardings(params))
        zeros = jax.tree.map(jnp.zeros_like, params)
        self.adapters[model_id] = _Adapter(base_model, lora, seed, params, zeros, zeros, jnp.zeros((), jnp.int32))

    @register(Dispatch.RANK_ZERO)
    @refusals_returned
    def unload(self, model_id: str) -> None:
        adapter = self.adapters.pop(model_id, None)
        for key in adapter.versions if adapter else ():
            self.versions.pop(key, None)

    # -- training --------------------------------------------------------------------------------------------
    @register(Dispatch.RANK_ZERO)
    @refusals_returned
    def forward_backward(self, model_id: str, data: list[TrainDatum], loss_fn: str, loss_fn_config: dict | None,
                         backward: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:  # fmt: skip
        adapter = self._adapter(model_id)
        if loss_fn not in LOSSES:
            raise ServeError(f"loss_fn: {loss_fn!r} is not supported here; expected one of {list(LOSSES)}")
        clip = jnp.asarray(loss_config(loss_fn, loss_fn_config), jnp.float32)
        batch = pad_data(data, loss_fn, self.model_config.vocab_size, self.config.max_train_tokens,
                         self.layout.batch_parts)  # fmt: skip
        shape = self._shape(adapter.lora)
        placed = place_batch(self.layout, batch.arrays)
        loss, logp, grads = self.programs.loss(shape.graphdef, adapter.params, shape.rest, placed, loss_fn, clip,
                                               backward)  # fmt: skip
        if grads is not None:
            adapter.grads = grads if adapter.grads is None else self.programs.add(adapter.grads, grads)
        logp = np.asarray(logp)
        outputs = [{"logprobs": logp[i, :n].copy()} for i, n in enumerate(batch.lengths)]
        return outputs, {"loss:sum": float(loss)}

    @register(Dispatch.RANK_ZERO)
    @refusals_returned
    def optim_step(self, model_id: str, step: AdamStep) -> dict[str, float]:
        adapter = self._adapter(model_id)
        hyper = adam_hyper(step)
        if adapter.grads is None:
            raise ServeError("optim_step: no gradient since the last optim_step; call forward_backward first")
        adapter.params, adapter.m, adapter.v, adapter.count, norm = self.programs.adam(
            adapter.params, adapter.grads, adapter.m, adapter.v, adapter.count, hyper
        )
        adapter.grads = None
        return {"grad_norm:mean": float(norm)}

    # -- checkpoints -----------------------------------------------------------------------------------------
    @register(Dispatch.RANK_ZERO)
    @refusals_returned
    def save_state(self, model_id: str, name: str, optimizer: bool) -> str:
        adapter = self._adapter(model_id)
        directory = Path(self.config.run_dir) / "checkpoints" / model_id / name
        items = {"adapter": adapter.params}
        if optimizer:
            items["optimizer"] = {"m": adapter.m, "v": adapter.v, "count": adapter.count}
        extra = {"base_model": adapter.base_model, "rank": adapter.lora.rank, "targets": adapter.lora.targets,
                 "alpha": adapter.lora.alpha, "seed": adapter.seed, "optimizer": optimizer}  # fmt: skip
        with CheckpointManager(directory / "state", max_to_keep=1, async_save=False) as manager:
            manager.save(0, items, extra)
        (directory / META).write_text(json.dumps(extra, indent=1) + "\n")
        shape = self._shape(adapter.lora)
        save_peft(nnx.merge(shape.graphdef, adapter.params, shape.rest), adapter.lora, directory / "peft",
                  self.config.model_path)  # fmt: skip
        return str(directory)

    @register(Dispatch.RANK_ZERO)
    @refusals_returned
    def load_state(self, model_id: str, path: str, optimizer: bool) -> None:
        adapter = self._adapter(model_id)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                {"m": adapter.m, "v": adapter.v, "count": adapter.count})  # fmt: skip
        targets = {"adapter": abstract["m"]}
        extra = self._checkpoint_info(path)
        try:
            with CheckpointManager(Path(path) / "state", max_to_keep=1, async_save=False) as manager:
                if (extra["rank"], extra["targets"]) != (adapter.lora.rank, adapter.lora.targets):
                    raise ServeError(f"path: {path} holds a rank-{extra['rank']} adapter of {extra['targets']}; the "
                                     f"client's is rank {adapter.lora.rank} of {adapter.lora.targets}")  # fmt: skip
                if optimizer:
                    if not extra["optimizer"]:
                        raise ServeError(f"path: {path} was saved without its optimizer state")
                    targets["optimizer"] = abstract
                items = manager.restore(0, targets)[1]
        except CheckpointError as exc:
            raise ServeError(f"path: {exc}", status=404) from None
        adapter.params, adapter.grads = items["adapter"], None
        if optimizer:
            adapter.m, adapter.v, adapter.count = (items["optimizer"][k] for k in ("m", "v", "count"))

    @register(Dispatch.RANK_ZERO)
    @refusals_returned
    def checkpoint_info(self, path: str) -> dict[str, Any]:
        """The base model, rank, targets and seed a `save_state` checkpoint at `path` was saved with."""
        return self._checkpoint_info(path)

    def _checkpoint_info(self, path: str) -> dict[str, Any]:
        meta = Path(path) / META
        if not meta.is_file():
            raise ServeError(f"path: no checkpoint of this server at {path}", status=404)
        return json.loads(meta.read_text())

    # -- sampling --------------------------------------------------------------------------------------------
    @register(Dispatch.RANK_ZERO)
    @refusals_returned
    def save_for_sampler(self, model_id: str, name: str) -> str:
        adapter = self._adapter(model_id)
        key = f"{model_id}/{name}"
        self.versions[key] = (adapter.shape_key, adapter.params)  # arrays are immutable: a snapshot
        if key in adapter.versions:
            adapter.versions.remove(key)
        adapter.versions.append(key)
        while len(adapter.versions) > SAMPLER_VERSIONS_KEPT:
            self.versions.pop(adapter.versions.pop(0), None)
        return key

    def _generator(self, shape: _Shape) -> OfflineGenerator:
        if shape.generator is None:
            cfg = self.config
            model = nnx.merge(shape.graphdef, shape.initial, shape.rest)
            engine = JaxEngine(model, self.layout, max_concurrent_decodes=cfg.slots,
                               max_prefill_length=cfg.max_prompt_tokens, max_new_tokens=cfg.max_new_tokens)  # fmt: skip
            shape.generator = OfflineGenerator(engine, None, eos_token_ids=(), progress=False)
        return shape.generator

    def _sampler(self, sampler: str | None, base_model: str) -> tuple[_Shape, Any]:
        self._check_base(base_model)
        if sampler is None:
            return self._shape(None), self._shape(None).initial
        if sampler not in self.versions:
            raise ServeError(f"model_path: no sampler weights {sampler!r} on this server (never saved, or dropped "
                             f"after {SAMPLER_VERSIONS_KEPT} newer versions of its client)", status=404)  # fmt: skip
        shape_key, params = self.versions[sampler]
        return self.shapes[shape_key], params

    @register(Dispatch.RANK_ZERO)
    @refusals_returned
    def sample(self, sampler: str | None, base_model: str, requests: list[SampleRequest]
               ) -> list[SampleResult | Refusal]:  # fmt: skip
        shape, params = self._sampler(sampler, base_model)
        self._draws += 1
        results: list[SampleResult | Refusal | None] = [None] * len(requests)
        settings = {}
        for i, request in enumerate(requests):
            try:
                settings[i] = sampling_params(request, self.config, self.model_config.vocab_size, self._draws)
            except ServeError as exc:
                results[i] = Refusal(str(exc), exc.status)
        generator = self._generator(shape)
        generator.update_params(nnx.split(nnx.merge(shape.graphdef, params, shape.rest), nnx.Param, ...)[1])
        for call in engine_calls(requests, settings):
            started = time.perf_counter()
            prompts = [np.asarray(requests[i].prompt, np.int32).reshape(-1) for i in call.members]
            outputs = generator.generate(prompts, call.sampling, first_request=call.requests)
            n = call.sampling.n
            log.info("sampled %d prompts x %d samples in %.2f s", len(prompts), n, time.perf_counter() - started)
            for k, i in enumerate(call.members):
                sequences = [SampledSequence(o.tokens.tolist(), o.logprobs.astype(float).tolist(), o.finish_reason)
                             for o in outputs[k * n : (k + 1) * n]]  # fmt: skip
                wanted = requests[i].prompt_logprobs
                results[i] = SampleResult(
                    sequences, self._prompt_logprobs(shape, params, prompts[k]) if wanted else None
                )
        return results

    def _prompt_logprobs(self, shape: _Shape, params: Any, prompt: np.ndarray) -> list[float | None]:
        if len(prompt) == 1:
            return [None]
        datum = TrainDatum(prompt[:-1], {"target_tokens": prompt[1:]})
        batch = pad_data([datum], "cross_entropy", self.model_config.vocab_size, self.config.max_prompt_tokens,
                         self.layout.batch_parts)  # fmt: skip
        logp = self.programs.target_logprobs(shape.graphdef, params, shape.rest, place_batch(self.layout, batch.arrays))
        return [None, *np.asarray(logp)[0, : len(prompt) - 1].astype(float).tolist()]
