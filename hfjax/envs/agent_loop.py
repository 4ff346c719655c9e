"""`AgentGenerator`: multi-turn rollouts of environments over the engine's slots, with continuous batching.

A trajectory (one sample of one prompt, with its own environment instance) holds a slot from its first token to its
end. A model turn ends at a stop token, at `max_tokens_per_turn` or at the trajectory's token budget; its text goes to
the environment's `step`, which runs on a thread pool while the other slots keep decoding (a slow tool stalls only its
own trajectory). The observation's tokens are appended to the slot with `JaxEngine.extend`, after the turn's last
token (sampled, so not in the cache yet): the history is read from the cache, never re-prefilled, and the same call
samples the next turn's first token. Environment tokens are in the trajectory with `response_mask` 0 and logprob 0;
each step's reward sits on the last model token of the turn it answered. Model token k of a trajectory is drawn with
its sample's key at step k, so a trajectory's tokens do not depend on what else ran beside it. An engine that
records routes (routing replay) gives each trajectory the experts every token that ran chose (`SampleOutput.experts`:
its prompt's, its model tokens' and its observations', all but the last token's).
While no slot can decode, the steps that end within `COALESCE_S` of the first are appended in one call.
A step with no result `env_step_timeout_s` after it was submitted (waiting for a free worker included) ends its
trajectory as `env_error`; Python cannot stop its thread, so the thread runs on until the step returns (then the
environment is closed), and a process exits only once such threads have returned; `last_stats["env_timeouts"]`
counts them.
`append="reprefill"` instead refills the slot with the whole history as a new prompt at every turn: the baseline that
`scripts/bench/bench_agent.py` measures against. Each re-prefilled turn samples with a key of its own (`turn_request`: a
negative request id, which no sample's first turn uses), its steps counted from 0.
"""

from __future__ import annotations

import concurrent.futures as futures
import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import jax
import numpy as np

from hfjax.envs.base import Environment, StepResult, check_step_result
from hfjax.envs.chat import observation_tokens, prompt_tokens
from hfjax.envs.tool_env import with_model_parser
from hfjax.envs.trajectory import FINISH_DONE, FINISH_ENV_ERROR, FINISH_LENGTH, FINISH_MAX_TURNS, Trajectory
from hfjax.rollout.generator import FINISH_REJECTED, OfflineGenerator, free_decode_state
from hfjax.rollout.sampling import SamplerKind, SamplingError, SamplingParams

log = logging.getLogger(__name__)

COALESCE_S = 0.005  # while no slot can decode, steps that end this soon after the first are appended with it


@dataclasses.dataclass
class _Live:
    """A trajectory in a slot: its tokens so far and the environment step in flight (if any)."""

    request: int
    sample: int
    env: Environment
    prompt: np.ndarray
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    rewards: list[float] = dataclasses.field(default_factory=list)
    experts: list[np.ndarray] = dataclasses.field(default_factory=list)  # routes of the tokens run so far, in order
    turn_start: int = 0
    model_tokens: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    step: futures.Future | None = None
    step_deadline: float = math.inf  # time.monotonic() by which `step` must have returned

    @property
    def cached(self) -> int:
        """Positions of the slot's cache that hold this trajectory (all but its last sampled token)."""
        return len(self.prompt) + len(self.tokens) - 1


class AgentGenerator:
    """Runs `env_cls(**env_kwargs)` trajectories over `generator`'s engine and weights. `tokenizer` decodes turns and
    renders observations; a trajectory ends after `max_turns` model turns or `max_tokens` tokens after its prompt
    (model and environment tokens together); a turn ends at `max_tokens_per_turn` (default: no limit but the budget).
    `env_workers` threads run environment steps, each step within `env_step_timeout_s` seconds. A `ToolEnvironment`
    that names no parser gets the one of the model's family (`with_model_parser`)."""

    def __init__(
        self,
        generator: OfflineGenerator,
        env_cls: type[Environment],
        tokenizer: Any,
        *,
        max_turns: int,
        max_tokens: int,
        max_tokens_per_turn: int | None = None,
        env_kwargs: dict[str, Any] | None = None,
        env_workers: int = 16,
        env_step_timeout_s: float = 600.0,
        append: Literal["extend", "reprefill"] = "extend",
    ):
        self.generator, self.engine = generator, generator.engine
        self.env_cls, self.tokenizer = env_cls, tokenizer
        self.env_kwargs = with_model_parser(env_cls, dict(env_kwargs or {}), self.engine.config.family)
        if not 0 < env_step_timeout_s < math.inf:
            raise SamplingError(
                f"agent.env_step_timeout_s: expected a positive number of seconds, got {env_step_timeout_s}"
            )
        self.env_step_timeout_s = env_step_timeout_s
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.max_tokens_per_turn = max_tokens_per_turn or max_tokens
        self.env_workers, self.append = env_workers, append
        budget = self.engine.capacity - self.engine.max_prefill_length
        if max_tokens > budget:
            raise SamplingError(f"agent.max_tokens: {max_tokens} exceeds the engine's max_new_tokens {budget}")
        self.last_stats: dict[str, float] = {}

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        rows: Sequence[dict[str, Any]],
        sampling: SamplingParams,
        first_request: int | Sequence[int] = 0,
    ) -> list[Trajectory]:
        """`sampling.n` trajectories per prompt, request-major. Row i (its dataset columns) goes to each of its
        environments' `reset`; when that returns an observation it replaces prompt i. Prompt i samples with the keys
        of request `first_request + i` (or `first_request[i]`)."""
        if len(rows) != len(prompts):
            raise SamplingError(f"agent rollout: {len(rows)} rows for {len(prompts)} prompts")
        request_ids = (
            np.arange(first_request, first_request + len(prompts))
            if isinstance(first_request, int)
            else np.asarray(first_request).reshape(-1)
        )
        pool = futures.ThreadPoolExecutor(self.env_workers, thread_name_prefix="env")
        try:
            return self._run(
                [np.asarray(p, np.int32).reshape(-1) for p in prompts], list(rows), sampling, request_ids, pool
            )
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------------------- the loop
    def _run(self, prompts, rows, sampling, request_ids, pool) -> list[Trajectory]:
        engine, params = self.engine, self.generator.params
        stops = sampling.stops(self.generator.eos_token_ids)
        kind = SamplerKind.of(sampling)
        queue = deque((r, i) for r in range(len(prompts)) for i in range(sampling.n))
        free, live = list(range(engine.max_concurrent_decodes)), {}
        done: dict[tuple[int, int], Trajectory] = {}
        stats = {"decode_steps": 0, "appends": 0, "appended_tokens": 0, "env_wait_seconds": 0.0, "env_timeouts": 0}
        started = time.perf_counter()

        def finish(slot: int, reason: str, error: str | None = None) -> None:
            run = live.pop(slot)
            done[run.request, run.sample] = _trajectory(run, reason, error)
            if run.step is None:
                run.env.close()
            else:  # a step still running (timed out): its environment closes when it returns, not under it
                run.step.add_done_callback(lambda _, env=run.env: env.close())
            free.append(slot)

        def record(slot: int, token: int, logprob: float) -> None:
            run = live[slot]
            _append(run, [token], [logprob], model=True)
            run.model_tokens += 1
            turn = run.tokens[run.turn_start :]
            if token in stops or len(turn) >= self.max_tokens_per_turn or len(run.tokens) >= self.max_tokens:
                run.turns += 1
                run.step = pool.submit(self._env_step, run.env, turn[:-1] if token in stops else turn)
                run.step_deadline = time.monotonic() + self.env_step_timeout_s

        state = engine.init_decode_state()
        try:
            while queue or live:
                if queue and free:
                    state = self._start(state, queue, free, live, done, prompts, rows, sampling, request_ids, record)
                if live and all(run.step is not None for run in live.values()):  # no slot can decode: wait
                    waiting, steps = time.perf_counter(), [run.step for run in live.values()]
                    first_deadline = min(run.step_deadline for run in live.values())
                    left = max(0.0, first_deadline - time.monotonic())
                    futures.wait(steps, timeout=left, return_when=futures.FIRST_COMPLETED)
                    futures.wait(steps, timeout=COALESCE_S)  # the decoder idles anyway: one append for more of them
                    stats["env_wait_seconds"] += time.perf_counter() - waiting
                self._end_overdue(live, finish, stats)
                ready = [slot for slot, run in live.items() if run.step is not None and run.step.done()]
                if ready:
                    state = self._observe(state, ready, live, finish, record, sampling, request_ids, kind, stats)
                decoding = [slot for slot, run in live.items() if run.step is None]
                if decoding:
                    context = max(live[s].cached for s in decoding) + 1
                    state, out = engine.generate(params, state, kind, context)
                    stats["decode_steps"] += 1
                    tokens, logprobs, experts = jax.device_get((out.tokens, out.logprobs, out.experts))
                    for slot in decoding:
                        if experts is not None:  # the routes of the token this step ran on
                            live[slot].experts.append(experts[slot][None])
                        record(slot, int(tokens[slot]), float(logprobs[slot]))
        finally:
            for run in live.values():
                run.env.close()
            free_decode_state(state)
        ordered = [done[key] for key in sorted(done)]
        seconds = time.perf_counter() - started
        self.last_stats = {
            **stats,
            "seconds": seconds,
            "response_tokens": sum(int(t.response_mask.sum()) for t in ordered),
            "env_tokens": sum(int(len(t.tokens) - t.response_mask.sum()) for t in ordered),
            "env_wait_share": stats["env_wait_seconds"] / max(seconds, 1e-9),
            "kv_cache_bytes_per_device": engine.kv_cache_bytes_per_device(),
        }
        return ordered

    def _end_overdue(self, live, finish, stats) -> None:
        """Ends as `env_error` the trajectories whose environment step is past its deadline."""
        now = time.monotonic()
        for slot in [s for s, run in live.items() if run.step is not None and not run.step.done()]:
            if now >= live[slot].step_deadline:
                stats["env_timeouts"] += 1
                name = type(live[slot].env).__name__
                log.warning("environment %s: a step ran past env_step_timeout_s; its trajectory ends", name)
                finish(slot, FINISH_ENV_ERROR, f"{name}.step: no result within {self.env_step_timeout_s:g} s")

    def _start(self, state, queue, free, live, done, prompts, rows, sampling, request_ids, record) -> Any:
        """Resets the environments of as many queued trajectories as there are free slots and prefills them (one
        prefill per distinct prompt)."""
        distinct: dict[tuple[int, ...], int] = {}
        batch, targets, firsts, runs = [], [], [], []
        while queue and free:
            r, i = queue.popleft()
            env = self.env_cls(**self.env_kwargs)
            try:
                first = env.reset(rows[r])
                prompt = prompts[r] if first is None else self._render(first)
            except Exception as exc:  # a broken environment ends its trajectory, named, not the batch
                env.close()
                done[r, i] = _failed(r, i, FINISH_ENV_ERROR, f"{self.env_cls.__name__}.reset: {exc!r}")
                continue
            error = self.generator.check_prompt(prompt)
            if error is not None:
                env.close()
                done[r, i] = _failed(r, i, FINISH_REJECTED, error)
                continue
            key = distinct.setdefault((r, *prompt.tolist()), len(distinct))  # samples of one prompt: one prefill
            if key == len(firsts):
                firsts.append(prompt)
            batch.append((key, i))
            targets.append(free.pop(0))
            runs.append(_Live(r, i, env, prompt))
        if not batch:
            return state
        requests = np.array([request_ids[run.request] for run in runs], np.int64)
        by_key = np.zeros(len(firsts), np.int64)
        for (key, _), request in zip(batch, requests, strict=True):
            by_key[key] = request
        state, (tokens, logprobs, routes) = self.generator.fill(state, firsts, batch, targets, sampling, by_key)
        for j, (slot, run, token, logprob) in enumerate(zip(targets, runs, tokens, logprobs, strict=True)):
            live[slot] = run
            run.experts = [] if routes is None else [routes[j]]  # the prompt's
            record(slot, int(token), float(logprob))
        return state

    def _env_step(self, env: Environment, turn: list[int]) -> tuple[StepResult, list[int]] | Exception:
        """One environment step on the turn's decoded text, and its observation's tokens (on a pool thread, off the
        decoding loop); an exception is returned."""
        try:
            text = self.tokenizer.decode(turn, skip_special_tokens=False)
            result = check_step_result(env.step(text), type(env).__name__)
            tokens = [] if result.done else self._observation(result.observation)
            return result, tokens
        except Exception as exc:  # reported as the trajectory's env_error, never raised into the loop
            return exc

    def _observation(self, observation: Any) -> list[int]:
        return observation_tokens(self.tokenizer, observation, self.generator.eos_token_ids)

    def _render(self, first: Any) -> np.ndarray:
        if isinstance(first, list) and first and isinstance(first[0], dict):
            return np.asarray(prompt_tokens(self.tokenizer, first), np.int32)
        if isinstance(first, str):
            return np.asarray(self.tokenizer.encode(first, add_special_tokens=False), np.int32)
        return np.asarray(first, np.int32).reshape(-1)

    def _observe(self, state, ready, live, finish, record, sampling, request_ids, kind, stats) -> Any:
        """Takes the finished environment steps of `ready` slots: ends trajectories or appends their observations."""
        appends: list[tuple[int, list[int]]] = []
        for slot in ready:
            run = live[slot]
            outcome, run.step = run.step.result(), None
            if isinstance(outcome, Exception):
                log.warning("environment %s failed; its trajectory ends: %r", type(run.env).__name__, outcome)
                finish(slot, FINISH_ENV_ERROR, f"{type(run.env).__name__}.step: {outcome!r}")
                continue
            result, tokens = outcome
            run.rewards[-1] += result.reward
            run.tool_calls += int(result.info.get("tool_calls", 0))
            run.tool_errors += int(result.info.get("tool_errors", 0))
            if result.done:
                finish(slot, FINISH_DONE)
            elif run.turns >= self.max_turns:
                finish(slot, FINISH_MAX_TURNS)
            elif not tokens or len(run.tokens) + len(tokens) + 1 > self.max_tokens:
                finish(slot, FINISH_LENGTH)  # no room for the observation and one model token after it
            else:
                appends.append((slot, tokens))
        if not appends:
            return state
        stats["appends"] += 1
        stats["appended_tokens"] += sum(len(tokens) for _, tokens in appends)
        if self.append == "reprefill":
            return self._reprefill(state, appends, live, record, sampling, request_ids)
        return self._extend(state, appends, live, record, kind)

    def _extend(self, state, appends, live, record, kind) -> Any:
        """Appends each observation (after the turn's last token) to its slot; records the next turn's first token.
        The engine pads the call to one of its few compiled extend shapes."""
        padded = np.zeros((len(appends), max(len(tokens) + 1 for _, tokens in appends)), np.int32)
        lengths, starts, steps, slots = (np.zeros(len(appends), np.int32) for _ in range(4))
        for j, (slot, tokens) in enumerate(appends):
            run = live[slot]
            padded[j, : len(tokens) + 1] = [run.tokens[-1], *tokens]
            lengths[j], starts[j], steps[j], slots[j] = len(tokens) + 1, run.cached, run.model_tokens, slot
            _append_observation(run, tokens)
        state, out = self.engine.extend(
            self.generator.params,
            state,
            slots=slots,
            padded_tokens=padded,
            true_length=lengths,
            starts=starts,
            steps=steps,
            kind=kind,
        )
        tokens, logprobs, experts = jax.device_get((out.tokens, out.logprobs, out.experts))
        for j, (slot, _) in enumerate(appends):
            if experts is not None:  # the turn's last token's and the observation's routes
                live[slot].experts.append(experts[j, : lengths[j]])
            record(slot, int(tokens[j]), float(logprobs[j]))
        return state

    def _reprefill(self, state, appends, live, record, sampling, request_ids) -> Any:
        """The baseline: each slot refilled with its whole history as a new prompt, sampled with its turn's key."""
        histories, batch, requests = [], [], []
        for j, (slot, tokens) in enumerate(appends):
            run = live[slot]
            _append_observation(run, tokens)
            histories.append(np.concatenate([run.prompt, run.tokens]).astype(np.int32))
            batch.append((j, run.sample))
            requests.append(turn_request(int(request_ids[run.request]), run.turns + 1, self.max_turns))
        targets = [slot for slot, _ in appends]
        state, (tokens, logprobs, routes) = self.generator.fill(
            state, histories, batch, targets, sampling, np.asarray(requests)
        )
        for j, (slot, token, logprob) in enumerate(zip(targets, tokens, logprobs, strict=True)):
            if routes is not None:  # the whole history ran again: its routes are this prefill's
                live[slot].experts = [routes[j]]
            record(slot, int(token), float(logprob))
        return state


def turn_request(request: int, turn: int, max_turns: int) -> int:
    """The request id that re-prefilled turn `turn` (2 to `max_turns`) of request `request`'s trajectories samples
    with (its sample index and the step's seed as the first turn's): negative, unlike every request's own id, and
    one-to-one in (request, turn), so no turn replays another's random numbers; within int32, the engine's width."""
    index = request * max_turns + turn - 2
    if not 2 <= turn <= max_turns or not 0 <= index < 2**31:
        raise SamplingError(
            f"agent rollout: turn {turn} of request {request} with max_turns={max_turns}: expected a turn from 2 to "
            f"max_turns and request x max_turns below 2**31"
        )
    return -1 - index


def _append(run: _Live, tokens: list[int], logprobs: list[float], model: bool) -> None:
    run.tokens += tokens
    run.logprobs += logprobs
    run.mask += [int(model)] * len(tokens)
    run.rewards += [0.0] * len(tokens)


def _append_observation(run: _Live, tokens: list[int]) -> None:
    """The environment's tokens (masked out of the loss, logprob 0); the next model turn starts after them."""
    _append(run, tokens, [0.0] * len(tokens), model=False)
    run.turn_start = len(run.tokens)


def _trajectory(run: _Live, reason: str, error: str | None) -> Trajectory:
    return Trajectory(
        run.request,
        run.sample,
        np.asarray(run.tokens, np.int32),
        np.asarray(run.logprobs, np.float32),
        reason,
        error,
        prompt=run.prompt,
        response_mask=np.asarray(run.mask, np.int32),
        rewards=np.asarray(run.rewards, np.float32),
        turns=run.turns,
        tool_calls=run.tool_calls,
        tool_errors=run.tool_errors,
        experts=np.concatenate(run.experts) if run.experts else None,
    )


def _failed(request: int, sample: int, reason: str, error: str) -> Trajectory:
    return Trajectory(request, sample, np.zeros(0, np.int32), np.zeros(0, np.float32), reason, error)
