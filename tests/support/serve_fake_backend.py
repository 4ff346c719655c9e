"""`FakeBackend`: a deterministic numpy `ServeBackend` for the HTTP layer's tests (`tests/test_serve_protocol.py`).

Each adapter has a `version` that `optim_step` bumps; every value the fake computes is a simple function of token
ids and that version (`logprob`, `sampled`), in multiples of 1/8 so they survive float32 exactly. The tests compute
the same functions and check that values round-trip exactly, that calls run in order on one thread and never
interleave, and that a sampler samples the version it saved. Checkpoints and sampler versions are small JSON files
under `root`, so a fresh `FakeBackend` on the same root (a restarted server) loads them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import numpy as np

from hfjax.serve.backend import (
    AdamStep,
    Refusal,
    SampledSequence,
    SampleRequest,
    SampleResult,
    ServeError,
    TrainDatum,
)

VOCAB = 64
MAX_RANK = 64
BASE_MODEL = "fake/tiny-base"


def logprob(target: int, previous: int, version: int) -> float:
    """The fake model's log prob of `target` after `previous` at adapter `version` (a multiple of 1/8)."""
    return -float((target * 7 + previous * 3 + version * 5) % 16 + 1) / 8


def sampled(
    prompt: list[int],
    version: int,
    max_tokens: int,
    stop: tuple[int, ...] = (),
    index: int = 0,
    seed: int | None = None,
) -> tuple[list[int], list[float], str]:
    """Sample `index` of a request: tokens, their log probs and the stop reason."""
    tokens, logprobs, previous = [], [], prompt[-1]
    for step in range(max_tokens):
        token = (previous * 5 + version * 7 + index * 3 + step + (seed or 0)) % VOCAB
        tokens.append(token)
        logprobs.append(logprob(token, previous, version))
        previous = token
        if token in stop:
            return tokens, logprobs, "stop"
    return tokens, logprobs, "length"


def loss(name: str, logprobs: np.ndarray, inputs: dict[str, np.ndarray], config: dict | None) -> float:
    """The fake's loss of one datum (summed over positions)."""
    lp = logprobs.astype(np.float64)
    if name == "cross_entropy":
        return float(-(lp * inputs["weights"]).sum())
    ratio = np.exp(lp - inputs["logprobs"])
    advantages = inputs["advantages"].astype(np.float64)
    if name == "importance_sampling":
        return float(-(ratio * advantages).sum())
    low = (config or {}).get("clip_low_threshold", 0.2)
    high = (config or {}).get("clip_high_threshold", 0.2)
    return float(-np.minimum(ratio * advantages, np.clip(ratio, 1 - low, 1 + high) * advantages).sum())


class FakeBackend:
    """`ServeBackend` of the fake model; `calls` lists (method, model id or sampler) in the order they ran, `events`
    the start and end of each call with its thread, `sample_batches` the number of requests of each sample call and
    `last_requests` the requests of the last one."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root) / "fake_backend"
        self.adapters: dict[str, dict] = {}
        self.calls: list[tuple[str, str | None]] = []
        self.events: list[tuple[str, str, int]] = []
        self.sample_batches: list[int] = []
        self.last_requests: list[SampleRequest] = []
        self.delay_s = 0.0  # each call's duration (for the interleaving test)

    @contextlib.contextmanager
    def _call(self, method: str, subject: str | None) -> Iterator[None]:
        self.events.append(("start", method, threading.get_ident()))
        self.calls.append((method, subject))
        try:
            if self.delay_s:
                threading.Event().wait(self.delay_s)
            yield
        finally:
            self.events.append(("end", method, threading.get_ident()))

    def _adapter(self, model_id: str) -> dict:
        if model_id not in self.adapters:
            raise ServeError(f"unknown model id {model_id!r}", 404)
        return self.adapters[model_id]

    def base_models(self) -> list[str]:
        return [BASE_MODEL]

    def create_adapter(
        self, model_id: str, base_model: str, rank: int, seed: int, train_mlp: bool, train_attn: bool
    ) -> None:
        with self._call("create_adapter", model_id):
            if rank > MAX_RANK:
                raise ServeError(f"lora rank {rank} is above this server's max_lora_rank {MAX_RANK}", 422)
            self.adapters[model_id] = {"base": base_model, "rank": rank, "seed": seed, "version": 0, "steps": 0}

    def forward_backward(
        self, model_id: str, data: list[TrainDatum], loss_fn: str, loss_fn_config: dict | None, backward: bool
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        with self._call("forward_backward" if backward else "forward", model_id):
            adapter = self._adapter(model_id)
            outputs, total = [], 0.0
            for i, datum in enumerate(data):
                if int(datum.tokens.max()) >= VOCAB:
                    raise ServeError(f"datum {i}: token ids must be < {VOCAB}")
                targets = datum.inputs["target_tokens"]
                lp = np.array(
                    [logprob(int(t), int(p), adapter["version"]) for t, p in zip(targets, datum.tokens, strict=True)],
                    np.float32,
                )
                outputs.append({"logprobs": lp})
                total += loss(loss_fn, lp, datum.inputs, loss_fn_config)
            return outputs, {"loss:sum": total}

    def optim_step(self, model_id: str, step: AdamStep) -> dict[str, float]:
        with self._call("optim_step", model_id):
            adapter = self._adapter(model_id)
            adapter["version"] += 1
            adapter["steps"] += 1
            return {"version": float(adapter["version"]), "learning_rate": step.learning_rate}

    def _dir(self, kind: str, model_id: str, name: str) -> Path:
        return self.root / kind / quote(model_id, safe="") / name

    def save_state(self, model_id: str, name: str, optimizer: bool) -> str:
        with self._call("save_state", model_id):
            adapter = self._adapter(model_id)
            directory = self._dir("state", model_id, name)
            directory.mkdir(parents=True, exist_ok=True)
            state = {"version": adapter["version"], "rank": adapter["rank"]}
            if optimizer:
                state["steps"] = adapter["steps"]
            (directory / "state.json").write_text(json.dumps(state))
            return str(directory)

    def load_state(self, model_id: str, path: str, optimizer: bool) -> None:
        with self._call("load_state", model_id):
            adapter = self._adapter(model_id)
            state = json.loads((Path(path) / "state.json").read_text())
            adapter["version"] = state["version"]
            adapter["steps"] = state["steps"] if optimizer else 0

    def save_for_sampler(self, model_id: str, name: str) -> str:
        with self._call("save_for_sampler", model_id):
            adapter = self._adapter(model_id)
            directory = self._dir("sampler", model_id, name)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "sampler.json").write_text(json.dumps({"version": adapter["version"]}))
            return str(directory)

    def sample(
        self, sampler: str | None, base_model: str, requests: list[SampleRequest]
    ) -> list[SampleResult | Refusal]:
        with self._call("sample", sampler):
            version = 0 if sampler is None else json.loads((Path(sampler) / "sampler.json").read_text())["version"]
            self.sample_batches.append(len(requests))
            self.last_requests = list(requests)
            return [self._sample_one(version, request) for request in requests]

    @staticmethod
    def _sample_one(version: int, request: SampleRequest) -> SampleResult | Refusal:
        prompt = [int(t) for t in request.prompt]
        if max(prompt) >= VOCAB:
            return Refusal(f"prompt: token ids must be < {VOCAB}", 400)
        sequences = []
        for index in range(request.num_samples):
            stop = tuple(request.stop_token_ids)
            tokens, logprobs, reason = sampled(prompt, version, request.max_tokens, stop, index, request.seed)
            sequences.append(SampledSequence(tokens, logprobs, reason))
        prompt_logprobs = None
        if request.prompt_logprobs:
            prompt_logprobs = [None] + [logprob(t, p, version) for p, t in itertools.pairwise(prompt)]
        return SampleResult(sequences, prompt_logprobs)

    def unload(self, model_id: str) -> None:
        with self._call("unload", model_id):
            self.adapters.pop(model_id, None)
