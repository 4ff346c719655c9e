"""What the service asks of the models behind it (`ServeBackend`), in plain numpy and Python values: the HTTP layer
(`hfjax.serve.app`) turns the Tinker wire types into these, and `hfjax.serve.adapter_worker` answers them on hfjax's
worker groups. Every method runs for one client's model at a time, in that client's request order."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

LOSSES = ("cross_entropy", "importance_sampling", "ppo")


class ServeError(ValueError):
    """A request the service refuses (the client's fault): `status` is the HTTP status it is answered with (400 bad
    input, 404 an unknown model or checkpoint, 422 a value out of range); the message names the bad field."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A `ServeError` as a value, returned by a worker method instead of raised."""

    message: str
    status: int


def refusals_returned(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` returning a `Refusal` where it raises `ServeError`."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except ServeError as exc:
            return Refusal(str(exc), exc.status)

    return run


@dataclasses.dataclass
class TrainDatum:
    """One sequence of a `forward` / `forward_backward` call: the model's input tokens [n] and the loss inputs, each
    [n] per position: `target_tokens` (int), and by loss `weights` (cross_entropy), `logprobs` (the sampler's, for
    importance_sampling / ppo) and `advantages`."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray]


@dataclasses.dataclass
class AdamStep:
    """One optimizer step's hyperparameters (Tinker's `AdamParams`; decoupled weight decay; clip 0: none)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclasses.dataclass
class SampleRequest:
    """`num_samples` continuations of `prompt` [n] int; `stop_token_ids` end a sample (kept as its last token);
    `prompt_logprobs`: also the log prob of each prompt token given those before it (the first is None)."""

    prompt: np.ndarray
    num_samples: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    prompt_logprobs: bool = False


@dataclasses.dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" (a stop token) or "length" (max_tokens)


@dataclasses.dataclass
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None


class ServeBackend(Protocol):
    """The models behind the service: one frozen base, LoRA adapters on it keyed by model id."""

    def base_models(self) -> list[str]:
        """The base model names a client may create an adapter on."""
        ...

    def create_adapter(self, model_id: str, base_model: str, rank: int, seed: int, train_mlp: bool, train_attn: bool
                       ) -> None:  # fmt: skip
        """A fresh adapter (B = 0: the base's outputs) and optimizer state for `model_id`."""
        ...

    def forward_backward(self, model_id: str, data: list[TrainDatum], loss_fn: str, loss_fn_config: dict | None,
                         backward: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:  # fmt: skip
        """Per datum its outputs (`logprobs` [n] of the target tokens), and metrics (`loss:sum`); with `backward` the
        loss's gradient is added to the adapter's accumulated gradient."""
        ...

    def optim_step(self, model_id: str, step: AdamStep) -> dict[str, float]:
        """One Adam step on the accumulated gradient, which is then cleared."""
        ...

    def save_state(self, model_id: str, name: str, optimizer: bool) -> str:
        """Writes the adapter (and its optimizer state) as a checkpoint; returns its directory."""
        ...

    def load_state(self, model_id: str, path: str, optimizer: bool) -> None:
        """Replaces the adapter (and optimizer state) with the checkpoint at `path` (from `save_state`)."""
        ...

    def save_for_sampler(self, model_id: str, name: str) -> str:
        """Freezes the adapter's current weights as a sampler version; returns its key for `sample`."""
        ...

    def sample(self, sampler: str | None, base_model: str, requests: list[SampleRequest]
               ) -> list[SampleResult | Refusal]:  # fmt: skip
        """Samples each request with the sampler version `sampler` (from `save_for_sampler`), or the base alone when
        None; a request that fails its checks gets its `Refusal` in its place, the others run."""
        ...

    def unload(self, model_id: str) -> None:
        """Frees the adapter and optimizer state of `model_id`."""
        ...
