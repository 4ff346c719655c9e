"""`TinkerService`: what each Tinker API call does, between the HTTP routes (`hfjax.serve.app`) and the backend.

A call that needs the backend is checked here first (bad input raises `ServeError`, answered with its status), then
queued on the one backend thread; the client gets a future (`{"request_id": ...}`) and polls for the result. Calls
that only read the service's records are answered directly.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hfjax.serve import request_bodies as bodies
from hfjax.serve import wire
from hfjax.serve.backend import Refusal, SampleRequest, ServeBackend, ServeError
from hfjax.serve.futures import CallQueue, FutureStore, Payload, failure
from hfjax.serve.registry import Registry, RunRecord, SamplerRecord, check_name

log = logging.getLogger(__name__)


class TinkerService:
    """The state behind one server: the backend, the registry of sessions, runs and samplers, the backend thread and
    the futures. Its methods are called from the HTTP event loop (one at a time)."""

    def __init__(self, backend: ServeBackend, *, run_dir: str, tokenizer_id: str) -> None:
        self.backend = backend
        self.tokenizer_id = tokenizer_id
        self.base_models = list(backend.base_models())
        self.registry = Registry(run_dir)
        self.queue = CallQueue()
        self.futures = FutureStore()
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._eos_ids: tuple[int, ...] | None = None
        self._warned_unembed = False

    def close(self) -> None:
        self.queue.close()

    def _submit(self, method: str, model_id: str | None, call: Callable[[], Payload], dedup_key: Any = None) -> dict:
        """Queues a backend call; a resubmission (same `dedup_key`) gets the first one's future."""
        request_id = self.futures.existing(dedup_key) if dedup_key is not None else None
        if request_id is None:
            request_id = self.futures.add(self.queue.submit(method, model_id, call), dedup_key)
        return {"request_id": request_id, "model_id": model_id}

    def _check_base_model(self, base_model: str) -> None:
        if base_model not in self.base_models:
            raise ServeError(f"unknown base_model {base_model!r}; this server serves {self.base_models}", 404)

    @staticmethod
    def _check_optimizer(config: bodies.OptimizerConfigBody | None) -> None:
        if config is not None and config.type != "adamw":
            raise ServeError(f"optimizer {config.type!r} is not supported; this server runs Adam (adamw) only")

    # sessions and read-only calls

    def capabilities(self) -> dict:
        models = [{"model_name": name, "trainable": True, "sampleable": True} for name in self.base_models]
        return {"supported_models": models}

    def end_session(self, session_id: str, owner: str) -> None:
        """Ends a session and frees its adapters (queued behind their pending calls)."""
        for model_id in self.registry.end_session(session_id, owner):
            self.queue.submit("unload", model_id, lambda model_id=model_id: self.backend.unload(model_id) or {})

    def get_info(self, model_id: str, owner: str) -> dict:
        run = self.registry.live_run(model_id, owner)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {"model_name": run.base_model, "tokenizer_id": self.tokenizer_id},
            "is_lora": True,
            "lora_rank": run.rank,
            "model_name": run.base_model,
        }

    def sampler_info(self, sampling_session_id: str, owner: str) -> dict:
        record = self.registry.sampler(sampling_session_id, owner)
        return {"sampler_id": sampling_session_id, "base_model": record.base_model, "model_path": record.model_path}

    def list_checkpoints(self, model_id: str) -> dict:
        checkpoints = [
            {
                "checkpoint_id": checkpoint_id,
                "checkpoint_type": "training" if checkpoint_id.startswith("weights/") else "sampler",
                "time": entry["time"],
                "tinker_path": self.registry.checkpoint_path(model_id, *checkpoint_id.split("/", 1)),
                "user_metadata": entry.get("user_metadata"),
            }
            for checkpoint_id, entry in self.registry.checkpoints(model_id).items()
        ]
        return {"checkpoints": checkpoints}

    # training

    def create_model(self, body: bodies.CreateModelBody, owner: str) -> dict:
        self.registry.check_session(body.session_id, owner)
        self._check_base_model(body.base_model)
        self._check_optimizer(body.optimizer_config)
        lora = body.lora_config
        if lora is None:
            raise ServeError("lora_config is required: this server trains LoRA adapters only")
        if lora.rank < 1:
            raise ServeError(f"lora rank must be >= 1 (got {lora.rank})")
        if not (lora.train_mlp or lora.train_attn):
            raise ServeError("set train_mlp or train_attn: this server has no unembedding-only adapters")
        if lora.train_unembed and not self._warned_unembed:
            self._warned_unembed = True
            log.warning("train_unembed is not supported: adapters train attention and/or MLP layers only")
        model_id = self.registry.model_id(body.session_id, body.model_seq_id)
        record = RunRecord(
            model_id=model_id,
            base_model=body.base_model,
            rank=lora.rank,
            seed=secrets.randbits(31) if lora.seed is None else lora.seed,
            train_mlp=lora.train_mlp,
            train_attn=lora.train_attn,
            train_unembed=False,
            owner=owner,
            user_metadata=body.user_metadata,
        )

        def call() -> Payload:
            self._create_adapter(record)
            self.registry.add_run(record, body.session_id)
            return {"model_id": model_id, "type": "create_model"}

        return self._submit("create_model", model_id, call, ("create", model_id))

    def _create_adapter(self, record: RunRecord) -> None:
        if self.registry.is_live(record.model_id):
            raise ServeError(f"model id {record.model_id!r} already exists")
        self.backend.create_adapter(
            record.model_id, record.base_model, record.rank, record.seed, record.train_mlp, record.train_attn
        )

    def forward_backward(self, request: wire.ForwardBackwardCall, owner: str) -> dict:
        model_id = request.model_id
        self.registry.live_run(model_id, owner)

        def call() -> Payload:
            outputs, metrics = self.backend.forward_backward(
                model_id, request.data, request.loss_fn, request.loss_fn_config, not request.forward_only
            )
            if len(outputs) != len(request.data):
                raise RuntimeError(f"the backend answered {len(outputs)} outputs for {len(request.data)} datums")
            return wire.encode_forward_backward_output(outputs, metrics)

        method = "forward" if request.forward_only else "forward_backward"
        return self._submit(method, model_id, call, (model_id, request.seq_id))

    def optim_step(self, body: bodies.OptimStepBody, owner: str) -> dict:
        step = wire.adam_step(body)
        self.registry.live_run(body.model_id, owner)

        def call() -> Payload:
            metrics = self.backend.optim_step(body.model_id, step)
            return {"metrics": {name: float(value) for name, value in metrics.items()}}

        return self._submit("optim_step", body.model_id, call, self._seq_key(body.model_id, body.seq_id))

    @staticmethod
    def _seq_key(model_id: str, seq_id: int | None) -> Any:
        return None if seq_id is None else (model_id, seq_id)

    def save_state(self, body: bodies.SaveWeightsBody, owner: str) -> dict:
        name = check_name(body.path, "checkpoint")
        model_id = body.model_id
        self.registry.live_run(model_id, owner)

        def call() -> Payload:
            if self.registry.has_checkpoint(model_id, "weights", name) and not body.overwrite:
                raise ServeError(
                    f"checkpoint {name!r} of {model_id!r} already exists; pass overwrite=True to replace it"
                )
            directory = self.backend.save_state(model_id, name, True)
            entry = {"dir": directory, "optimizer": True, "user_metadata": body.user_metadata}
            return {"path": self.registry.add_checkpoint(model_id, "weights", name, entry), "type": "save_weights"}

        return self._submit("save_state", model_id, call, self._seq_key(model_id, body.seq_id))

    def save_for_sampler(self, body: bodies.SaveForSamplerBody, owner: str) -> dict:
        model_id = body.model_id
        run = self.registry.live_run(model_id, owner)
        if body.kind != "snapshot":
            raise ServeError(f"kind={body.kind!r} sampling clients are not supported; use kind='snapshot'")
        if body.path is None and body.sampling_session_seq_id is None:
            raise ServeError("save_weights_for_sampler needs a name (path) or a sampling_session_seq_id")
        name = check_name(body.path, "sampler checkpoint") if body.path is not None else None
        session_id = self.registry.live_session(model_id)

        def call() -> Payload:
            if name is not None and self.registry.has_checkpoint(model_id, "sampler_weights", name):
                raise ServeError(
                    f"sampler checkpoint {name!r} of {model_id!r} already exists (sampler paths are final)"
                )
            sampler = self.backend.save_for_sampler(model_id, name or f"_sampler-{body.sampling_session_seq_id}")
            if name is not None:
                path = self.registry.add_checkpoint(
                    model_id, "sampler_weights", name, {"sampler": sampler, "user_metadata": body.user_metadata}
                )
                return {"path": path, "type": "save_weights_for_sampler"}
            sampling_session_id = self.registry.sampling_session_id(session_id, body.sampling_session_seq_id)
            self.registry.add_sampler(SamplerRecord(sampling_session_id, run.base_model, sampler, None, owner))
            return {"sampling_session_id": sampling_session_id, "type": "save_weights_for_sampler"}

        return self._submit("save_for_sampler", model_id, call, self._seq_key(model_id, body.seq_id))

    def load_weights(self, body: bodies.LoadWeightsBody, owner: str) -> dict:
        checkpoint = self.registry.resolve(body.path, kind="weights")
        source = checkpoint.run
        if body.optimizer and not checkpoint.entry.get("optimizer"):
            raise ServeError(f"checkpoint {body.path!r} has no optimizer state")
        directory = checkpoint.entry["dir"]
        if body.model_id is not None:  # onto a live model (TrainingClient.load_state*)
            model_id = body.model_id
            run = self.registry.live_run(model_id, owner)
            if (run.base_model, run.rank) != (source.base_model, source.rank):
                raise ServeError(
                    f"checkpoint {body.path!r} is a rank-{source.rank} adapter of {source.base_model!r}; model "
                    f"{model_id!r} is a rank-{run.rank} adapter of {run.base_model!r}"
                )

            def load() -> Payload:
                self.backend.load_state(model_id, directory, body.optimizer)
                return {"path": body.path, "model_id": model_id, "type": "load_weights"}

            return self._submit("load_state", model_id, load, self._seq_key(model_id, body.seq_id))
        if body.session_id is None or body.model_seq_id is None:
            raise ServeError("load_weights needs model_id, or session_id and model_seq_id")
        self.registry.check_session(body.session_id, owner)
        if body.base_model is not None and body.base_model != source.base_model:
            raise ServeError(f"base_model {body.base_model!r} differs from the checkpoint's {source.base_model!r}")
        self._check_base_model(source.base_model)
        self._check_optimizer(body.optimizer_config)
        model_id = self.registry.model_id(body.session_id, body.model_seq_id)
        record = source.started_again(model_id, owner, body.user_metadata)

        def create_and_load() -> Payload:
            self._create_adapter(record)
            try:
                self.backend.load_state(model_id, directory, body.optimizer)
            except BaseException:
                self.backend.unload(model_id)
                raise
            self.registry.add_run(record, body.session_id)
            return {"path": body.path, "model_id": model_id, "type": "load_weights"}

        return self._submit("create_from_state", model_id, create_and_load, ("create", model_id))

    # sampling

    def _sampler_for(
        self, model_path: str | None, base_model: str | None, sampling_session_id: str, owner: str
    ) -> SamplerRecord:
        """The sampler a sampling client of `model_path` (a sampler checkpoint) or `base_model` samples."""
        if model_path is not None:
            checkpoint = self.registry.resolve(model_path, kind="sampler_weights")
            if base_model is not None and base_model != checkpoint.run.base_model:
                raise ServeError(
                    f"base_model {base_model!r} differs from {model_path!r}'s {checkpoint.run.base_model!r}"
                )
            self._check_base_model(checkpoint.run.base_model)
            sampler = checkpoint.entry["sampler"]
            return SamplerRecord(sampling_session_id, checkpoint.run.base_model, sampler, model_path, owner)
        if base_model is None:
            raise ServeError("a sampling client needs a model_path or a base_model")
        self._check_base_model(base_model)
        return SamplerRecord(sampling_session_id, base_model, None, None, owner)

    def create_sampling_session(self, body: bodies.CreateSamplingSessionBody, owner: str) -> dict:
        self.registry.check_session(body.session_id, owner)
        sampling_session_id = self.registry.sampling_session_id(body.session_id, body.sampling_session_seq_id)
        self.registry.add_sampler(self._sampler_for(body.model_path, body.base_model, sampling_session_id, owner))
        return {"sampling_session_id": sampling_session_id, "type": "create_sampling_session"}

    def asample(self, body: bodies.SampleBody, owner: str) -> dict:
        if body.sampling_session_id is not None:
            sampler = self.registry.sampler(body.sampling_session_id, owner)
        else:
            sampler = self._sampler_for(body.model_path, body.base_model, "", owner)
        request = wire.sample_request(body, self.stop_token_ids)
        key = None if body.seq_id is None or not body.sampling_session_id else (body.sampling_session_id, body.seq_id)
        request_id = self.futures.existing(key) if key is not None else None
        if request_id is None:
            item = (request, body.prompt_logprobs_last_n)
            group = (sampler.sampler, sampler.base_model)
            call = functools.partial(self._sample_group, *group)
            subject = sampler.model_path or sampler.sampling_session_id or sampler.base_model
            request_id = self.futures.add(self.queue.submit_grouped("sample", subject, group, item, call), key)
        sequence_ids = [f"{request_id}-{i}" for i in range(request.num_samples)]
        return {"request_id": request_id, "model_id": None, "sample_sequence_ids": sequence_ids}

    def _sample_group(
        self, sampler: str | None, base_model: str, items: list[tuple[SampleRequest, int | None]]
    ) -> list[Payload]:
        """Samples the queued requests of one sampler version in one backend call."""
        results = self.backend.sample(sampler, base_model, [request for request, _ in items])
        payloads: list[Payload] = []
        for (request, last_n), result in zip(items, results, strict=True):
            if isinstance(result, Refusal):
                payloads.append(failure(result.message))
            elif len(result.sequences) != request.num_samples:
                payloads.append(
                    failure(f"the backend sampled {len(result.sequences)} of {request.num_samples}", "server")
                )
            elif request.prompt_logprobs and result.prompt_logprobs is None:
                payloads.append(failure("the backend returned no prompt logprobs", "server"))
            else:
                payloads.append(wire.encode_sample_response(result, last_n))
        return payloads

    def stop_token_ids(self, stop: str | list[int] | list[str] | None) -> tuple[int, ...]:
        """`SamplingParams.stop` as token ids: None is the tokenizer's end-of-sequence token, [] none; a stop string
        must be one token of the server's tokenizer."""
        if stop is None:
            return self._end_of_sequence_ids()
        ids: list[int] = []
        for item in [stop] if isinstance(stop, str) else stop:
            if isinstance(item, int):
                if item < 0:
                    raise ServeError(f"stop token ids must be >= 0 (got {item})")
                ids.append(item)
                continue
            tokenizer = self._load_tokenizer()
            if tokenizer is None:
                raise ServeError("stop strings are not supported (the server has no tokenizer): pass stop token ids")
            encoded = tokenizer.encode(item, add_special_tokens=False)
            if len(encoded) != 1:
                raise ServeError(
                    f"stop string {item!r} is {len(encoded)} tokens; this server stops on single tokens only: pass "
                    "stop token ids, or stop strings that are one token each"
                )
            ids.append(int(encoded[0]))
        return tuple(dict.fromkeys(ids))

    def _end_of_sequence_ids(self) -> tuple[int, ...]:
        """The tokenizer's end-of-sequence token and those of `generation_config.json` beside it (chat models end
        turns with their own token)."""
        if self._eos_ids is None:
            tokenizer = self._load_tokenizer()
            ids = [getattr(tokenizer, "eos_token_id", None)]
            with contextlib.suppress(OSError, ValueError):
                ids += [
                    json.loads((Path(self.tokenizer_id) / "generation_config.json").read_text()).get("eos_token_id")
                ]
            flat = [i for item in ids for i in (item if isinstance(item, list) else [item]) if isinstance(i, int)]
            self._eos_ids = tuple(dict.fromkeys(flat))
            if not self._eos_ids:
                log.warning("no end-of-sequence token known: samples with stop=None run to max_tokens")
        return self._eos_ids

    def _load_tokenizer(self) -> Any:
        """The tokenizer of `tokenizer_id` (loaded once), or None if it does not load."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                try:
                    from transformers import AutoTokenizer

                    self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_id)
                except Exception as error:
                    log.warning("could not load the tokenizer %r: %s", self.tokenizer_id, error)
                    self._tokenizer = False
            return self._tokenizer or None
