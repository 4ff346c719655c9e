"""`OfflineGenerator`: continuous batching of many prompts over an engine's slots.

A prompt's samples (up to the slot count at once) are admitted together, when there are free slots for all of them
and free blocks in the engine's shared prompt pool for one copy of the prompt in each data shard they land in (they
go to as few shards as the free slots allow); the samples then read that one copy (`JaxEngine.insert`). A finished
sample frees its slot and its reference to the prompt at once (the prompt's blocks are free when its last sample
ends); freed slots are refilled in groups of at least `refill_batch` samples (or whatever is left), each group one
compiled prefill+insert per prompt-length bucket (short prompts are not padded to the group's longest) that prefills
each distinct prompt once. A bucket's samples run as the largest power of two that fits plus the rest (whole prompts
in each), their prompts' rows padded to a power of two (at least the layout's batch parts, so each part prefills rows
of its own) and the samples to another, so compiles stay few and little of the rows are padding. Each decode step
attends over the prompt blocks of the longest prompt running and the own blocks that the longest response has
reached, and is dispatched before the previous step's tokens are read (one step in flight), so the host's bookkeeping
runs while the device computes. Outputs come back in request order, `n` samples per prompt, each with its tokens,
logprobs and finish reason. The KV cache lives only inside `generate`: allocated when it
starts, freed when it returns (or fails), so it never sits beside the training step's memory.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from hfjax.rollout.engine import JaxEngine
from hfjax.rollout.interface import power_of_two_at_least
from hfjax.rollout.sampling import SamplerKind, SamplingError, SamplingParams

FINISH_STOP, FINISH_LENGTH, FINISH_REJECTED = "stop", "length", "rejected"
FINISH_INTERRUPTED = "interrupted"  # `generate(..., interrupt=...)` stopped before the sample ended


@dataclasses.dataclass
class SampleOutput:
    """One sample of one prompt: response tokens and their logprobs, and why it ended (`stop`, `length`,
    `interrupted` with the tokens so far, or `rejected` with `error` saying why the prompt could not run); `versions`
    is set by generation across weight versions (`hfjax.workers.partial_rollout`)."""

    request: int
    sample: int
    tokens: np.ndarray
    logprobs: np.ndarray
    finish_reason: str
    error: str | None = None
    versions: np.ndarray | None = None  # the policy version of each token (partial rollouts), else None
    # an engine that records routes: the experts each mixture-of-experts layer chose for the prompt's tokens and
    # every response token but the last (which no step ran on) [prompt + response - 1, moe layers, k], else None
    experts: np.ndarray | None = None


@dataclasses.dataclass
class _Running:
    request: int
    sample: int
    tokens: list[int]
    logprobs: list[float]
    experts: list[np.ndarray] = dataclasses.field(default_factory=list)  # the prompt's, then one per decode step


def free_decode_state(state: Any) -> None:
    """Deletes the decode state's buffers (those not already donated to a step)."""
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


def _row(array: np.ndarray | None, row: int) -> np.ndarray | None:
    return None if array is None else array[row]


def _no_tokens() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(0, np.int32), np.zeros(0, np.float32)


def _row_chunks(members: list[int], prompts: list[int]) -> list[list[int]]:
    """`members` (samples of `prompts[j]` each) cut into at most two calls whose row counts pad to powers of two with
    little waste: whole prompts' samples that fill at most the largest power of two that fits, then the rest (35
    samples of one prompt each run as 32 + 4, not 64). A prompt's samples stay in one call, which writes one copy of
    the prompt per data shard."""
    head = 1 << (len(members).bit_length() - 1)
    if head == len(members):
        return [members]
    by_prompt: dict[int, list[int]] = {}
    for j in members:
        by_prompt.setdefault(prompts[j], []).append(j)
    first: list[int] = []
    rest: list[int] = []
    for samples in by_prompt.values():
        (first if len(first) + len(samples) <= head else rest).extend(samples)
    return [chunk for chunk in (first, rest) if chunk]


def row_images(images: Sequence[np.ndarray | None] | None, requests: list[int], rows: int) -> np.ndarray | None:
    """The images of prompts `requests` as prefill rows [rows, images per row, channels, height, width] (row i holds
    prompt `requests[i]`'s; the rest, and the rows past them, zeros that are never read), images per row the most any
    prompt has rounded up to a power of two (bounding the compiled prefill shapes); None where they have none."""
    found = {i: np.asarray(images[r], np.float32) for i, r in enumerate(requests) if images and images[r] is not None}
    found = {i: x for i, x in found.items() if len(x)}
    if not found:
        return None
    shape = next(iter(found.values())).shape[1:]
    out = np.zeros((rows, power_of_two_at_least(max(len(x) for x in found.values())), *shape), np.float32)
    for i, x in found.items():
        out[i, : len(x)] = x
    return out


class OfflineGenerator:
    """Generates responses for lists of token-id prompts with `engine`, using `params` (swap with `update_params`).
    `eos_token_ids` (default: the model config's) are the stop ids used when `SamplingParams.stop_token_ids` is None."""

    def __init__(
        self,
        engine: JaxEngine,
        params: Any,
        *,
        eos_token_ids: Sequence[int] | None = None,
        refill_batch: int | None = None,
        progress: bool = True,
    ):
        self.engine = engine
        self.params = params
        self.eos_token_ids = tuple(engine.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.refill_batch = refill_batch or max(1, engine.max_concurrent_decodes // 8)
        self.progress = progress
        self.last_stats: dict[str, float] = {}
        self._pool_peak = 0  # the most prompt pool blocks in use during the last `generate`

    def update_params(self, params: Any) -> None:
        """New weights for the next `generate`; same shapes and shardings never recompile."""
        self.params = params

    def check_prompt(self, prompt: np.ndarray) -> str | None:
        """Why `prompt` cannot run (empty, longer than the engine's prefill limit), or None."""
        if len(prompt) == 0:
            return "empty prompt; expected at least one token"
        if len(prompt) > self.engine.max_prefill_length:
            return f"prompt of {len(prompt)} tokens exceeds max_prefill_length {self.engine.max_prefill_length}"
        return None

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        first_request: int | Sequence[int] = 0,
        interrupt: Callable[[], bool] | None = None,
        check_every: int = 8,
        images: Sequence[np.ndarray | None] | None = None,
    ) -> list[SampleOutput]:
        """Samples `sampling.n` responses per prompt; returns them request-major (prompt 0's samples first).
        A prompt that cannot run (empty, too long) gives `rejected` samples with the reason instead of failing the
        batch. Prompt i samples with the keys of request `first_request + i` (its index in a larger batch, so that a
        batch split over several generators samples what one generator would; a sequence gives each prompt its own
        request index). `interrupt`, asked every
        `check_every` decode steps, stops the loop when it returns True: every sample not yet ended comes back
        `interrupted` with its tokens so far (none for those that had not started). With a vision-language model,
        `images[i]` [n, channels, height, width] (or None) are prompt i's images, read in place of its placeholders
        once, at its prefill, for all its samples."""
        capacity = self.engine.capacity - self.engine.max_prefill_length
        if sampling.max_new_tokens > capacity:
            raise SamplingError(
                f"sampling.max_new_tokens: {sampling.max_new_tokens} exceeds the engine's max_new_tokens {capacity}"
            )
        prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
        results: dict[tuple[int, int], SampleOutput] = {}
        queue: deque[tuple[int, list[int]]] = deque()  # (request, samples): admitted together
        group = self.engine.max_concurrent_decodes
        for r, prompt in enumerate(prompts):
            error = self.check_prompt(prompt)
            if error is not None:
                for i in range(sampling.n):
                    results[r, i] = SampleOutput(r, i, *_no_tokens(), FINISH_REJECTED, error)
                continue
            queue.extend((r, list(range(i, min(i + group, sampling.n)))) for i in range(0, sampling.n, group))
        if isinstance(first_request, int):
            request_ids = np.arange(first_request, first_request + len(prompts), dtype=np.int64)
        else:
            request_ids = np.asarray(first_request, np.int64).reshape(-1)
            if len(request_ids) != len(prompts):
                raise SamplingError(f"first_request: {len(request_ids)} request ids for {len(prompts)} prompts")
        if images is not None and len(images) != len(prompts):
            raise SamplingError(f"images: {len(images)} entries for {len(prompts)} prompts; expected one per prompt")
        ordered, steps, seconds = self._run(
            prompts, queue, results, sampling, request_ids, interrupt, check_every, images
        )
        self.last_stats = {
            "decode_steps": steps,
            "seconds": seconds,
            "response_tokens": sum(len(o.tokens) for o in ordered),
            "kv_cache_bytes_per_device": self.engine.kv_cache_bytes_per_device(),
            "prompt_pool_blocks_peak": self._pool_peak,
        }
        return ordered

    def _admit(self, prompts: list[np.ndarray], queue: deque[tuple[int, list[int]]], free: list[int]
               ) -> tuple[list[tuple[int, int]], list[int], int]:  # fmt: skip
        """The groups at the head of `queue` that fit now, in order: (request, sample) pairs, their slots (a group's
        in as few data shards as the free slots allow) and how many groups. A group fits when there are free slots
        for all its samples and free pool blocks for its prompt in each shard they land in."""
        pool = self.engine.pool
        spare = [pool.free_blocks(part) for part in range(pool.parts)]
        open_slots: dict[int, list[int]] = {part: [] for part in range(pool.parts)}
        for slot in free:
            open_slots[pool.part_of(slot)].append(slot)
        batch: list[tuple[int, int]] = []
        targets: list[int] = []
        for groups, (r, samples) in enumerate(queue):
            chosen: list[int] = []
            for part in sorted(open_slots, key=lambda p: -len(open_slots[p])):
                chosen += open_slots[part][: len(samples) - len(chosen)]
            need, parts = pool.blocks_for(len(prompts[r])), {pool.part_of(slot) for slot in chosen}
            if len(chosen) < len(samples) or any(spare[part] < need for part in parts):
                return batch, targets, groups
            for part in parts:
                spare[part] -= need
            for slot in chosen:
                open_slots[pool.part_of(slot)].remove(slot)
            batch += [(r, i) for i in samples]
            targets += chosen
        return batch, targets, len(queue)

    def _run(
        self,
        prompts: list[np.ndarray],
        queue: deque[tuple[int, list[int]]],
        results: dict[tuple[int, int], SampleOutput],
        sampling: SamplingParams,
        request_index: np.ndarray,
        interrupt: Callable[[], bool] | None = None,
        check_every: int = 8,
        images: Sequence[np.ndarray | None] | None = None,
    ) -> tuple[list[SampleOutput], int, float]:
        """The continuous-batching loop over `queue`, from a new empty decode state (donated step by step; the last
        one is freed when this returns or fails). Returns the outputs in request order, decode steps and seconds."""
        stops = sampling.stops(self.eos_token_ids)
        slots = self.engine.max_concurrent_decodes
        free = list(range(slots))
        running: dict[int, _Running] = {}
        kind = SamplerKind.of(sampling)
        steps, started = 0, time.perf_counter()
        self._pool_peak = 0
        bar = tqdm(
            total=sum(len(samples) for _, samples in queue),
            desc="generate",
            unit="sample",
            disable=not self.progress,
            leave=False,
        )

        def finish(slot: int, reason: str) -> None:
            run = running.pop(slot)
            tokens, logprobs = np.array(run.tokens, np.int32), np.array(run.logprobs, np.float32)
            experts = np.concatenate(run.experts) if run.experts else None
            results[run.request, run.sample] = SampleOutput(
                run.request, run.sample, tokens, logprobs, reason, experts=experts
            )
            free.append(slot)
            self.engine.release([slot])
            bar.update(1)

        def record(slot: int, token: int, logprob: float, experts: np.ndarray | None = None) -> None:
            run = running[slot]
            if experts is not None:  # the routes of the step's input: the last token so far
                run.experts.append(experts[None])
            run.tokens.append(token)
            run.logprobs.append(logprob)
            if token in stops:
                finish(slot, FINISH_STOP)
            elif len(run.tokens) >= sampling.max_new_tokens:
                finish(slot, FINISH_LENGTH)

        state = self.engine.init_decode_state()
        try:
            pending: tuple[Any, dict[int, _Running]] | None = None  # the step in flight, and who it ran for
            since_check = 0  # decode steps since `interrupt` was last asked
            while queue or running:
                check = interrupt is not None and since_check >= check_every  # then no step goes out until asked
                if check and pending is None:
                    since_check, check = 0, False
                    if interrupt():
                        for slot in list(running):
                            finish(slot, FINISH_INTERRUPTED)
                        for r, samples in queue:
                            for i in samples:
                                results[r, i] = SampleOutput(r, i, *_no_tokens(), FINISH_INTERRUPTED)
                        break
                batch, targets, groups = self._admit(prompts, queue, free) if queue and free else ([], [], 0)
                if batch and (len(batch) >= self.refill_batch or not running or groups == len(queue)):
                    for _ in range(groups):
                        queue.popleft()
                    for slot in targets:
                        free.remove(slot)
                    state, first = self.fill(state, prompts, batch, targets, sampling, request_index, images)
                    self._pool_peak = max(self._pool_peak, self.engine.pool.used_blocks)
                    tokens, logprobs, routes = first
                    for j, (slot, (r, i)) in enumerate(zip(targets, batch, strict=True)):
                        running[slot] = _Running(r, i, [], [], [] if routes is None else [routes[j]])
                        record(slot, int(tokens[j]), float(logprobs[j]))
                elif queue and not running:  # an empty engine holds any one group: only a broken pool gets here
                    raise SamplingError(f"generate: request {queue[0][0]} fits no free slots and prompt pool blocks")
                ahead = int(pending is not None)
                if not check and any(len(run.tokens) + ahead < sampling.max_new_tokens for run in running.values()):
                    # dispatched before the step in flight is read, so host bookkeeping overlaps device work; a slot
                    # that finishes in the step in flight computes one discarded token here
                    context = max(len(run.tokens) for run in running.values()) + ahead  # positions past the prompts
                    state, out = self.engine.generate(self.params, state, kind, context)
                    steps, since_check = steps + 1, since_check + 1
                    dispatched = (out, dict(running))
                else:
                    dispatched = None
                if pending is not None:
                    out, ran = pending
                    tokens, logprobs, experts = jax.device_get((out.tokens, out.logprobs, out.experts))
                    for slot, run in ran.items():
                        if running.get(slot) is run:
                            record(slot, int(tokens[slot]), float(logprobs[slot]), _row(experts, slot))
                pending = dispatched
        finally:
            bar.close()
            free_decode_state(state)
        return [results[key] for key in sorted(results)], steps, time.perf_counter() - started

    def fill(
        self,
        state: Any,
        prompts: list[np.ndarray],
        batch: list[tuple[int, int]],
        targets: list[int],
        sampling: SamplingParams,
        request_index: np.ndarray,
        images: Sequence[np.ndarray | None] | None = None,
    ) -> tuple[Any, tuple[np.ndarray, np.ndarray, list[np.ndarray] | None]]:
        """Prefills the distinct prompts of `batch` ((request, sample) pairs) and inserts every sample into its target
        slot of `state` (also for loops of other kinds, e.g. multi-turn rollouts), one compiled call per prefill length
        bucket (a short prompt is not padded to the batch's longest). Returns each sample's first
        token and logprob, in batch order, and with an engine that records routes each sample's prompt routes
        [prompt length, moe layers, k] (else None)."""
        groups: dict[int, list[int]] = {}
        for j, (r, _) in enumerate(batch):
            groups.setdefault(self.engine.bucket(len(prompts[r])), []).append(j)
        tokens, logprobs = np.zeros(len(batch), np.int32), np.zeros(len(batch), np.float32)
        routes: list[Any] | None = [None] * len(batch) if self.engine.record_experts else None
        for length, members in sorted(groups.items()):
            for chunk in _row_chunks(members, [r for r, _ in batch]):
                group = [batch[j] for j in chunk]
                slots = [targets[j] for j in chunk]
                state, first = self._fill_bucket(state, prompts, group, slots, length, sampling, request_index, images)
                tokens[chunk], logprobs[chunk] = first[0][: len(chunk)], first[1][: len(chunk)]
                for n, j in enumerate(chunk if routes is not None else ()):
                    routes[j] = first[2][n, : len(prompts[batch[j][0]])]
        return state, (tokens, logprobs, routes)

    def _fill_bucket(
        self,
        state: Any,
        prompts: list[np.ndarray],
        batch: list[tuple[int, int]],
        targets: list[int],
        length: int,
        sampling: SamplingParams,
        request_index: np.ndarray,
        images: Sequence[np.ndarray | None] | None = None,
    ) -> tuple[Any, tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """`fill` for samples whose prompts all pad to `length`: one prefill row per distinct prompt (the samples
        share it), rows bucketed to a power of two, at least the engine's `batch_parts` (so that each part of the batch
        mesh axes prefills rows of its own), and the samples bucketed to a power of two; the rows' images with them
        (`row_images`)."""
        requests = list(dict.fromkeys(r for r, _ in batch))
        rows_of = {r: row for row, r in enumerate(requests)}
        parts = self.engine.batch_parts
        width = -(-power_of_two_at_least(len(requests)) // parts) * parts
        tokens = np.zeros((width, length), np.int32)
        lengths = np.ones(width, np.int32)
        request_ids = np.zeros(width, np.int32)
        for row, r in enumerate(requests):
            tokens[row, : len(prompts[r])] = prompts[r]
            lengths[row] = len(prompts[r])
            request_ids[row] = request_index[r]
        samples = power_of_two_at_least(len(batch))
        slot_ids = np.full(samples, self.engine.max_concurrent_decodes, np.int32)  # out of range: dropped
        rows = np.zeros(samples, np.int32)
        sample_ids = np.zeros(samples, np.int32)
        for j, ((r, i), slot) in enumerate(zip(batch, targets, strict=True)):
            slot_ids[j], rows[j], sample_ids[j] = slot, rows_of[r], i
        state, first = self.engine.prefill_insert(
            self.params, state, tokens, lengths, sampling, request_ids, slot_ids, rows, sample_ids,
            row_images(images, requests, width),
        )  # fmt: skip
        return state, jax.device_get((first.tokens, first.logprobs, first.experts))
