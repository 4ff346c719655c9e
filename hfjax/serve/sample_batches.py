"""Sampling requests checked and gathered into engine calls: requests with equal settings share one `generate`
(their prompts decode side by side in the engine's slots), each sampling as it would alone. A seeded request samples
with request index 0 of its seed, so equal seeds give equal samples whatever else is in the call; unseeded requests
of one call share a fresh seed and take request indices 0, 1, ... (independent samples)."""

from __future__ import annotations

import dataclasses

import numpy as np

from hfjax.rollout import SamplingParams
from hfjax.serve.backend import SampleRequest, ServeError
from hfjax.serve.config import ServeConfig


@dataclasses.dataclass
class EngineCall:
    """One `generate` over the prompts of `members` (indices into the requests) with request indices `requests`."""

    sampling: SamplingParams
    members: list[int]
    requests: list[int]


def sampling_params(request: SampleRequest, config: ServeConfig, vocab_size: int, seed: int) -> SamplingParams:
    """The engine's settings of `request` (`seed` where it has none); `ServeError` naming a bad field."""
    prompt = np.asarray(request.prompt).reshape(-1)
    checks = (
        ("prompt", 1 <= len(prompt) <= config.max_prompt_tokens,
         f"1..{config.max_prompt_tokens} tokens (the server's max_prompt_tokens)", len(prompt)),
        ("prompt", prompt.size == 0 or (prompt.min() >= 0 and prompt.max() < vocab_size),
         f"token ids in [0, {vocab_size})", prompt.tolist()[:8]),
        ("sampling_params.max_tokens", 1 <= request.max_tokens <= config.max_new_tokens,
         f"1..{config.max_new_tokens} (the server's max_new_tokens)", request.max_tokens),
        ("num_samples", request.num_samples >= 1, ">= 1", request.num_samples),
    )  # fmt: skip
    for field, ok, expected, got in checks:
        if not ok:
            raise ServeError(f"{field}: expected {expected}, got {got}")
    try:
        return SamplingParams(max_new_tokens=request.max_tokens, temperature=request.temperature,
                              top_k=max(0, request.top_k), top_p=request.top_p,
                              stop_token_ids=tuple(request.stop_token_ids), n=request.num_samples,
                              seed=seed if request.seed is None else request.seed)  # fmt: skip
    except ValueError as exc:
        raise ServeError(f"sampling_params: {exc}", status=422) from None


def engine_calls(requests: list[SampleRequest], settings: dict[int, SamplingParams]) -> list[EngineCall]:
    """The `generate` calls that sample the requests whose checked settings are `settings` (request index -> its
    settings; the others failed their checks), in first-seen order."""
    calls: dict[tuple[SamplingParams, bool], EngineCall] = {}
    for i, sampling in settings.items():
        seeded = requests[i].seed is not None
        call = calls.setdefault((sampling, seeded), EngineCall(sampling, [], []))
        call.members.append(i)
        call.requests.append(0 if seeded else len(call.requests))
    return list(calls.values())
