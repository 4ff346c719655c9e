"""The Tinker SDK's wire payloads and the backend's dataclasses (`hfjax.serve.backend`), both ways.

`forward_backward` requests arrive as protobuf (`tinker_public.ForwardBackwardRequest`), and the results of
`forward_backward` and `sample` futures leave as protobuf (`ForwardBackwardOutput`, `SampleResponse`); everything else
is JSON (`hfjax.serve.request_bodies`). Bad input raises `ServeError` (answered 400) naming the bad field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from hfjax.serve import protobuf as pb
from hfjax.serve.backend import LOSSES, AdamStep, SampleRequest, SampleResult, ServeError, TrainDatum
from hfjax.serve.request_bodies import ModelInputBody, OptimStepBody, SampleBody

PROTOBUF = "application/x-protobuf"
SEED_RANGE = 2**63 - 1
"""Sampling seeds are folded into [0, SEED_RANGE) (the SDK sends any 64-bit int)."""

# tinker_public.DType
_DTYPE_FLOAT32, _DTYPE_INT64, _DTYPE_INT32 = 1, 2, 3
_PROTO_DTYPES = {_DTYPE_FLOAT32: np.float32, _DTYPE_INT64: np.int64, _DTYPE_INT32: np.int32}
# tinker_public.StopReason
_STOP_REASONS = {"stop": 0, "length": 1}

LOSS_INPUTS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "cross_entropy": (frozenset({"target_tokens"}), frozenset({"weights"})),
    "importance_sampling": (frozenset({"target_tokens", "logprobs", "advantages"}), frozenset()),
    "ppo": (frozenset({"target_tokens", "logprobs", "advantages"}), frozenset()),
}
"""Per loss: the `loss_fn_inputs` it requires and those it also accepts (cross_entropy's weights default to 1)."""
assert set(LOSS_INPUTS) == set(LOSSES)


@dataclasses.dataclass
class ForwardBackwardCall:
    """A decoded `/api/v1/forward_backward` request."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None
    forward_only: bool
    data: list[TrainDatum]


def _check_tokens(tokens: np.ndarray, where: str) -> None:
    if tokens.size and int(tokens.min()) < 0:
        raise ServeError(f"{where}: token ids must be >= 0 (got {int(tokens.min())})")


def _chunk_tokens(chunk: pb.Fields, where: str) -> np.ndarray:
    if 2 in chunk:
        raise ServeError(f"{where}: image chunks are not supported (this server takes text tokens only)")
    if 3 in chunk:
        raise ServeError(f"{where}: audio (dmel) chunks are not supported (this server takes text tokens only)")
    text = pb.messages(chunk, 1)
    raw = pb.one_bytes(text[-1], 1) if text else b""
    if len(raw) % 4:
        raise ServeError(f"{where}: encoded_text tokens are not int32 bytes")
    return np.frombuffer(raw, dtype="<i4").astype(np.int64)


def _tensor(message: pb.Fields, where: str) -> np.ndarray:
    """A dense `tinker_public.Tensor` as a numpy array of its shape."""
    if 2 in message:
        raise ServeError(f"{where}: sparse tensors are not supported (send it dense)")
    dtype = _PROTO_DTYPES.get(pb.one_int(message, 3))
    if dtype is None:
        raise ServeError(f"{where}: unsupported dtype {pb.one_int(message, 3)} (float32 or int64)")
    raw = pb.one_bytes(message, 1)
    if len(raw) % np.dtype(dtype).itemsize:
        raise ServeError(f"{where}: {len(raw)} bytes are not whole {np.dtype(dtype).name} values")
    values = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)
    shape = pb.repeated_ints(message, 4)
    if shape and math.prod(shape) != values.size:
        raise ServeError(f"{where}: shape {shape} does not hold its {values.size} values")
    return values.reshape(shape) if shape else values


def _datum(message: pb.Fields, index: int, loss_fn: str) -> TrainDatum:
    chunks = [_chunk_tokens(chunk, f"datum {index}: model_input") for chunk in pb.messages(message, 1)]
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
    if tokens.size == 0:
        raise ServeError(f"datum {index}: model_input has no tokens")
    _check_tokens(tokens, f"datum {index}: model_input")
    inputs: dict[str, np.ndarray] = {}
    for entry in pb.map_entries(message, 2):
        name = pb.one_str(entry, 1)
        inputs[name] = _tensor(
            pb.messages(entry, 2)[-1] if 2 in entry else {}, f"datum {index}: loss_fn_inputs[{name!r}]"
        )
    required, optional = LOSS_INPUTS[loss_fn]
    missing, unknown = sorted(required - inputs.keys()), sorted(inputs.keys() - required - optional)
    if missing:
        raise ServeError(f"datum {index}: loss {loss_fn!r} needs loss_fn_inputs {missing}")
    if unknown:
        raise ServeError(
            f"datum {index}: loss_fn_inputs {unknown} are not supported by loss {loss_fn!r} "
            f"(it takes {sorted(required | optional)})"
        )
    for name, values in inputs.items():
        where = f"datum {index}: loss_fn_inputs[{name!r}]"
        if values.shape != tokens.shape:
            got = f"{values.size} values" if values.ndim == 1 else f"shape {list(values.shape)}"
            raise ServeError(
                f"{where} has {got} for {tokens.size} input tokens (each loss input has one value per input token)"
            )
        if name == "target_tokens":
            if values.dtype.kind != "i":
                raise ServeError(f"{where} must hold integer token ids")
            inputs[name] = values.astype(np.int64)
            _check_tokens(inputs[name], where)
        else:
            inputs[name] = values.astype(np.float32)
            if not np.isfinite(inputs[name]).all():
                raise ServeError(f"{where} holds a NaN or infinite value")
    if loss_fn == "cross_entropy" and "weights" not in inputs:
        inputs["weights"] = np.ones(tokens.shape, np.float32)
    return TrainDatum(tokens=tokens, inputs=inputs)


def _loss_fn_config(message: pb.Fields) -> dict[str, float | str] | None:
    config: dict[str, float | str] = {}
    for entry in pb.map_entries(message, 7):  # loss_fn_config_v2: LossConfigValue (number | text)
        value = pb.messages(entry, 2)[-1] if 2 in entry else {}
        config[pb.one_str(entry, 1)] = pb.one_str(value, 2) if 2 in value else pb.one_double(value, 1)
    if not config:  # the legacy float-only map
        config = {pb.one_str(entry, 1): pb.one_double(entry, 2) for entry in pb.map_entries(message, 5)}
    return config or None


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """Decodes a protobuf `ForwardBackwardRequest`, checking every datum against its loss."""
    try:
        message = pb.decode(body)
        loss_fn = pb.one_str(message, 4)
        if loss_fn == "custom":
            raise ServeError(
                "loss_fn 'custom' (a server-side custom loss) is not supported; supported losses: " + ", ".join(LOSSES)
            )
        if loss_fn not in LOSSES:
            raise ServeError(f"loss_fn {loss_fn!r} is not supported; supported losses: " + ", ".join(LOSSES))
        data = [_datum(datum, i, loss_fn) for i, datum in enumerate(pb.messages(message, 3))]
        if not data:
            raise ServeError("forward_backward needs at least one datum")
        return ForwardBackwardCall(
            model_id=pb.one_str(message, 1),
            seq_id=pb.one_int(message, 2),
            loss_fn=loss_fn,
            loss_fn_config=_loss_fn_config(message),
            forward_only=bool(pb.one_int(message, 6)),
            data=data,
        )
    except pb.ProtoError as error:
        raise ServeError(f"malformed ForwardBackwardRequest protobuf: {error}") from error


def _batched_tensor(arrays: list[np.ndarray]) -> bytes:
    """`tinker_public.BatchedTensor`: the datums' arrays back to back, with byte offsets."""
    integer = arrays[0].dtype.kind in "iub"
    dtype, proto_dtype = (np.dtype("<i8"), _DTYPE_INT64) if integer else (np.dtype("<f4"), _DTYPE_FLOAT32)
    chunks = [np.ascontiguousarray(array, dtype=dtype).tobytes() for array in arrays]
    offsets = np.cumsum([0] + [len(chunk) for chunk in chunks], dtype=np.int64).astype("<i8").tobytes()
    return (
        pb.bytes_field(1, b"".join(chunks))
        + pb.bytes_field(2, offsets)
        + pb.int_field(3, proto_dtype)
        + pb.packed_ints_field(4, arrays[0].shape[1:])
    )


def _signature(output: Mapping[str, np.ndarray]) -> tuple:
    return tuple((name, np.asarray(v).dtype.kind in "iub", np.shape(v)[1:]) for name, v in sorted(output.items()))


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: Mapping[str, float]) -> bytes:
    """A protobuf `ForwardBackwardOutput`: one `ArrayRecord` per run of datums whose outputs share names, dtypes and
    trailing shapes (usually one for the whole call), and the metrics."""
    records = b""
    start = 0
    while start < len(outputs):
        end = start + 1
        while end < len(outputs) and _signature(outputs[end]) == _signature(outputs[start]):
            end += 1
        fields = b"".join(
            pb.bytes_field(
                2,
                pb.str_field(1, name)
                + pb.bytes_field(2, _batched_tensor([np.asarray(output[name]) for output in outputs[start:end]])),
            )
            for name in sorted(outputs[start])
        )
        records += pb.bytes_field(2, pb.str_field(1, "ArrayRecord") + fields + pb.int_field(3, end - start))
        start = end
    metric_entries = b"".join(
        pb.bytes_field(3, pb.str_field(1, name) + pb.double_field(2, float(value))) for name, value in metrics.items()
    )
    return pb.str_field(1, "ArrayRecord") + records + metric_entries


def prompt_tokens(prompt: ModelInputBody) -> np.ndarray:
    """A sampling prompt's token ids (text chunks only)."""
    tokens: list[int] = []
    for chunk in prompt.chunks:
        kind = chunk.get("type", "encoded_text")
        if kind != "encoded_text":
            raise ServeError(f"prompt: {kind} chunks are not supported (this server takes text tokens only)")
        if not isinstance(chunk.get("tokens"), list) or not all(type(t) is int for t in chunk["tokens"]):
            raise ServeError("prompt: an encoded_text chunk's tokens must be a list of ints")
        tokens.extend(chunk["tokens"])
    array = np.asarray(tokens, dtype=np.int64)
    if array.size == 0:
        raise ServeError("prompt has no tokens")
    _check_tokens(array, "prompt")
    return array


def sample_request(body: SampleBody, stop_token_ids: Callable[[Any], tuple[int, ...]]) -> SampleRequest:
    """The backend's `SampleRequest` for an `/api/v1/asample` body; `stop_token_ids` maps `SamplingParams.stop`."""
    unsupported = {
        "topk_prompt_logprobs": body.topk_prompt_logprobs > 0,
        "topk_sample_logprobs": body.topk_sample_logprobs > 0,
        "target_prompt_logprobs": body.target_prompt_logprobs is not None,
        "prompt_alt_tokens_k": body.prompt_alt_tokens_k > 0,
        "record_stability_info": bool(body.record_stability_info),
    }
    for name, requested in unsupported.items():
        if requested:
            raise ServeError(f"{name} is not supported by this server")
    prompt = prompt_tokens(body.prompt)
    params = body.sampling_params
    checks = {
        f"num_samples must be >= 1 (got {body.num_samples})": body.num_samples < 1,
        f"max_tokens must be >= 1 (got {params.max_tokens})": params.max_tokens is not None and params.max_tokens < 1,
        f"temperature must be >= 0 (got {params.temperature})": not params.temperature >= 0,
        f"top_p must be in (0, 1] (got {params.top_p})": not 0 < params.top_p <= 1,
        f"top_k must be -1 (no limit) or >= 1 (got {params.top_k})": params.top_k == 0 or params.top_k < -1,
    }
    for message, failed in checks.items():
        if failed:
            raise ServeError(message)
    last_n = body.prompt_logprobs_last_n
    if last_n is not None and not (body.prompt_logprobs and 1 <= last_n <= prompt.size - 1):
        raise ServeError(
            f"prompt_logprobs_last_n must be in [1, {prompt.size - 1}] with prompt_logprobs (got {last_n})"
        )
    defaults = SampleRequest(prompt=prompt)
    return SampleRequest(
        prompt=prompt,
        num_samples=body.num_samples,
        max_tokens=defaults.max_tokens if params.max_tokens is None else params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        stop_token_ids=stop_token_ids(params.stop),
        seed=None if params.seed is None else params.seed % SEED_RANGE,
        prompt_logprobs=bool(body.prompt_logprobs),
    )


def encode_sample_response(result: SampleResult, prompt_logprobs_last_n: int | None = None) -> bytes:
    """A protobuf `SampleResponse`; prompt logprobs before the last `prompt_logprobs_last_n` become NaN (None)."""
    out = b""
    for sequence in result.sequences:
        if sequence.stop_reason not in _STOP_REASONS:
            raise ValueError(f"backend stop_reason {sequence.stop_reason!r} is neither 'stop' nor 'length'")
        fields = (
            pb.int_field(1, _STOP_REASONS[sequence.stop_reason])
            + pb.bytes_field(2, np.asarray(sequence.tokens, dtype="<i4").tobytes())
            + pb.bytes_field(3, np.asarray(sequence.logprobs, dtype="<f4").tobytes())
        )
        out += pb.bytes_field(1, fields)
    if result.prompt_logprobs is not None:
        values = np.array([math.nan if v is None else v for v in result.prompt_logprobs], dtype="<f4")
        if prompt_logprobs_last_n is not None:
            values[: values.size - prompt_logprobs_last_n] = math.nan
        out += pb.bytes_field(2, values.tobytes())
    return out


def adam_step(body: OptimStepBody) -> AdamStep:
    """The backend's `AdamStep` for an `/api/v1/optim_step` body (other optimizers are refused)."""
    if body.adam_params is None:
        kind = (body.optimizer_params or {}).get("type", "unknown")
        raise ServeError(f"optimizer {kind!r} is not supported; this server runs Adam (AdamParams) only")
    values = body.adam_params.model_dump()
    bounds = {
        "learning_rate": (values["learning_rate"] >= 0, ">= 0"),
        "beta1": (0 <= values["beta1"] < 1, "in [0, 1)"),
        "beta2": (0 <= values["beta2"] < 1, "in [0, 1)"),
        "eps": (values["eps"] > 0, "> 0"),
        "weight_decay": (values["weight_decay"] >= 0, ">= 0"),
        "grad_clip_norm": (values["grad_clip_norm"] >= 0, ">= 0 (0: no clipping)"),
    }
    for name, (ok, expected) in bounds.items():
        if not (ok and math.isfinite(values[name])):
            raise ServeError(f"adam_params.{name} must be {expected} (got {values[name]})")
    return AdamStep(**values)
