"""The JSON request bodies of the Tinker API, as the SDK sends them (pydantic models; FastAPI validates each route's
body against its model, and `hfjax.serve.app` answers a mismatch 400 naming the field)."""

from __future__ import annotations

from typing import Any

import pydantic

from hfjax.serve.backend import AdamStep


class WireModel(pydantic.BaseModel):
    """A JSON request body: fields the server does not know are ignored (newer SDKs send more)."""

    model_config = pydantic.ConfigDict(extra="ignore", protected_namespaces=())


class LoraConfigBody(WireModel):
    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfigBody(WireModel):
    type: str = "adamw"


class CreateModelBody(WireModel):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigBody | None = None
    optimizer_config: OptimizerConfigBody = OptimizerConfigBody()


_ADAM = AdamStep()  # the defaults of Tinker's AdamParams


class AdamParamsBody(WireModel):
    learning_rate: float = _ADAM.learning_rate
    beta1: float = _ADAM.beta1
    beta2: float = _ADAM.beta2
    eps: float = _ADAM.eps
    weight_decay: float = _ADAM.weight_decay
    grad_clip_norm: float = _ADAM.grad_clip_norm


class OptimStepBody(WireModel):
    model_id: str
    seq_id: int | None = None
    adam_params: AdamParamsBody | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsBody(WireModel):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class SaveForSamplerBody(WireModel):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


class LoadWeightsBody(WireModel):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool
    optimizer_config: OptimizerConfigBody | None = None
    weights_access_token: str | None = None


class CreateSessionBody(WireModel):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None


class SessionIdBody(WireModel):
    session_id: str


class CreateSamplingSessionBody(WireModel):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class SamplingSessionIdBody(WireModel):
    sampling_session_id: str


class GetInfoBody(WireModel):
    model_id: str


class RequestIdBody(WireModel):
    request_id: str
    allow_metadata_only: bool = False


class ModelInputBody(WireModel):
    chunks: list[dict[str, Any]]


class SamplingParamsBody(WireModel):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[int] | list[str] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class SampleBody(WireModel):
    num_samples: int = 1
    prompt: ModelInputBody
    sampling_params: SamplingParamsBody
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None
