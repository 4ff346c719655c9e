"""Partial rollouts: generation that moves to newer weights part way (asynchronous RL with in-flight weight updates).

`generate_across_versions` runs the generator with an interrupt that fires when a newer policy version is published;
the samples not yet ended then continue under the new weights as new requests (prompt + tokens so far, so the KV
cache of the continuation is computed by the new weights), and so on until every sample ended. A sample's tokens are
the concatenation of each version's tokens; its log probs are those of the policy that sampled each token; its
per-token versions say which. Continuations sample with their own keys (round `k` uses seed + k, request
`(first + prompt) * n + sample`), so no random stream is reused. The engine must take prompts as long as the prompt
plus the response (`max_prefill_length`).
Imports `hfjax.rollout` only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from hfjax.rollout import OfflineGenerator, SamplingParams
from hfjax.rollout.generator import FINISH_INTERRUPTED, FINISH_LENGTH, FINISH_REJECTED, FINISH_STOP, SampleOutput


def _extend(out: SampleOutput, more: SampleOutput, version: int, budget: int) -> SampleOutput:
    """`sample` continued by `more`, cut to the sample's remaining `budget` of tokens (a continuation call runs to
    the largest budget among its rows)."""
    tokens, logprobs = more.tokens[:budget], more.logprobs[:budget]
    if more.finish_reason in (FINISH_STOP, FINISH_REJECTED) and len(more.tokens) <= budget:
        reason = more.finish_reason
    elif more.finish_reason == FINISH_INTERRUPTED and len(more.tokens) < budget:
        reason = FINISH_INTERRUPTED
    else:
        reason = FINISH_LENGTH
    return SampleOutput(
        out.request,
        out.sample,
        np.concatenate([out.tokens, tokens]).astype(np.int32),
        np.concatenate([out.logprobs, logprobs]).astype(np.float32),
        reason,
        more.error,
        np.concatenate([out.versions, np.full(len(tokens), version, np.int32)]),
    )


def generate_across_versions(
    generator: OfflineGenerator,
    prompts: Sequence[np.ndarray],
    sampling: SamplingParams,
    first_request: int,
    *,
    version: int,
    newer: Callable[[], bool],
    load_newest: Callable[[], int],
    check_every: int = 8,
) -> list[SampleOutput]:
    """Samples as `generator.generate` would, moving to the newest weights whenever `newer()` says there are some
    (asked every `check_every` decode steps): `load_newest()` installs them in the generator and returns their
    version. `version` is the version of the generator's weights at the start. Outputs in request order, each with
    the version of every token (`SampleOutput.versions`)."""
    prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    outputs = generator.generate(prompts, sampling, first_request, interrupt=newer, check_every=check_every)
    samples = [dataclasses.replace(o, versions=np.full(len(o.tokens), version, np.int32)) for o in outputs]
    rounds = 0
    while True:
        waiting = [i for i, s in enumerate(samples) if s.finish_reason == FINISH_INTERRUPTED]
        if not waiting:
            return samples
        version, rounds = load_newest(), rounds + 1
        budgets = [sampling.max_new_tokens - len(samples[i].tokens) for i in waiting]
        resumed = [np.concatenate([prompts[samples[i].request], samples[i].tokens]) for i in waiting]
        ids = [(first_request + samples[i].request) * sampling.n + samples[i].sample for i in waiting]
        continued = dataclasses.replace(sampling, n=1, max_new_tokens=max(budgets), seed=sampling.seed + rounds)
        more = generator.generate(resumed, continued, ids, interrupt=newer, check_every=check_every)
        for i, budget, out in zip(waiting, budgets, more, strict=True):
            samples[i] = _extend(samples[i], out, version, budget)
