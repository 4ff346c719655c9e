"""Partial rollouts: generation that moves to newer weights part way (asynchronous RL with in-flight weight updates).

`generate_across_versions` runs the generator with an interrupt that fires when a newer policy version is published;
the samples not yet ended then continue under the new weights as new requests (prompt + tokens so far, so the KV
cache of the continuation is computed by the new weights), and so on until every sample ended. A sample's tokens are
the concatenation of each version's tokens; its log probs are those of the policy that sampled each token; its
per-token versions say which. With an engine that records routes (routing replay), each position keeps the experts
of the weights that first ran it: the prompt's and the first version's tokens' from the first version, each
continuation's new positions from its own (the continuation re-runs the prefix, whose new routes are not kept).
Continuations sample with keys of their own (`continuation_request`): a sample's
key is its step's seed folded with a request id and a sample index, and a step's own requests are numbered from 0,
while a continuation's request id is negative and numbers its (sample, round) pair, so no random stream is reused,
within a step or across steps. One call follows at most `CONTINUATION_ROUNDS` weight changes: its last round runs
every sample to its end under the weights it has. The engine must take prompts as long as the prompt plus the
response (`max_prefill_length`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from hfjax.rollout import OfflineGenerator, SamplingParams
from hfjax.rollout.generator import FINISH_INTERRUPTED, FINISH_LENGTH, FINISH_REJECTED, FINISH_STOP, SampleOutput

CONTINUATION_ROUNDS = 128  # weight changes one generation call follows at most
CONTINUED_SAMPLES = 2**24  # sample indices (request * n + sample) a continuation's request id can number


def continuation_request(request: int, sample: int, n: int, round_: int) -> int:
    """The request id that round `round_` (1 to `CONTINUATION_ROUNDS`) of the continuation of sample `sample` of
    request `request` (of a step sampling `n` per request) samples with, under the step's own seed. Negative, unlike
    the step's own request ids, so its key (seed, id, sample 0) is the key of no step's sample; one-to-one in
    (request * n + sample, round), so no two continuations of a step share one; within int32, the engine's width."""
    index = request * n + sample
    if not 0 <= index < CONTINUED_SAMPLES or not 1 <= round_ <= CONTINUATION_ROUNDS:
        raise ValueError(
            f"partial rollout: sample {index} (request {request} x n={n} + sample {sample}), round {round_}: expected "
            f"a sample below {CONTINUED_SAMPLES} and a round from 1 to {CONTINUATION_ROUNDS}"
        )
    return -1 - (index * CONTINUATION_ROUNDS + round_ - 1)


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
    experts = None
    if out.experts is not None and more.experts is not None:  # each position keeps the routes of its first run
        experts = np.concatenate([out.experts, more.experts[len(out.experts) :][: len(tokens)]])
    return SampleOutput(
        out.request,
        out.sample,
        np.concatenate([out.tokens, tokens]).astype(np.int32),
        np.concatenate([out.logprobs, logprobs]).astype(np.float32),
        reason,
        more.error,
        np.concatenate([out.versions, np.full(len(tokens), version, np.int32)]),
        experts,
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
    (asked every `check_every` decode steps; not in round `CONTINUATION_ROUNDS`, which ends every sample):
    `load_newest()` installs them in the generator and returns their version. `version` is the version of the
    generator's weights at the start. Outputs in request order, each with the version of every token
    (`SampleOutput.versions`)."""
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
        ids = [
            continuation_request(first_request + samples[i].request, samples[i].sample, sampling.n, rounds)
            for i in waiting
        ]
        continued = dataclasses.replace(sampling, n=1, max_new_tokens=max(budgets))
        interrupt = newer if rounds < CONTINUATION_ROUNDS else None
        more = generator.generate(resumed, continued, ids, interrupt=interrupt, check_every=check_every)
        for i, budget, out in zip(waiting, budgets, more, strict=True):
            samples[i] = _extend(samples[i], out, version, budget)
