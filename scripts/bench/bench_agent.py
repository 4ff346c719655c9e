"""Multi-turn (agent) rollout throughput of `AgentGenerator` on the reference checkpoint: observations appended to the
running slots' KV caches (`append="extend"`) vs the whole history re-prefilled every turn (`append="reprefill"`),
same process, and how long the decoder waits on environments that call a slow tool.

Workload (standard): 64 trajectories (prompts of lengths 16..48, seed 0) x 4 model turns of 64 tokens (temperature
1.0, no stop tokens, so every turn is exactly 64 tokens) and 3 observations of 32 tokens (a synthetic environment:
random token ids from an rng seeded by the turn's text, done after the 4th turn), 352 trajectory tokens each; all 64
in flight (64 slots). One engine per append mode, both with the same settings (prefill limit 384: the longest
re-prefilled history is 48 + 3 x 64 + 3 x 32 = 336 tokens). Four configurations: reprefill and extend with instant
environments, and extend with a 50 ms tool (`time.sleep` in every step) on 16 environment threads and on one, where
the env wait share is the share of the rollout in which no slot could decode because every trajectory in a slot
waited on its environment. Each mode is warmed up once and the shapes that staggered appends can take (every
power-of-two row count) are compiled beforehand, so compiles are excluded (the table counts any in timed runs; the
JSON has the programs the first rollout compiled, `extend` among them, and the engine's bound on extend programs); then
the four run in turn `--repeats` times; medians. The floor printed beside the speed-up is the ratio of forward tokens
the model runs in each mode (decode + prefilled or appended tokens, before padding). Each rollout's time is also split
into decode steps, `engine.extend` calls, prefills (`generator.fill`), waits on environments and the rest (host
work). Usage:
    python scripts/bench/bench_agent.py [--ckpt DIR] [--repeats 3] [--out runs/bench/agent.json] [--tiny]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import default_checkpoint, parse_args, report

from hfjax.envs import Environment, StepResult

TRAJECTORIES, TURNS, TURN_TOKENS, OBS_TOKENS = 64, 4, 64, 32
LONGEST_PROMPT = 48
TOOL_SLEEP_S = 0.05


class ToolEnv(Environment):
    """`turns` steps; each returns `obs_tokens` token ids in [3, vocab_size) drawn from an rng seeded by `seed`, the
    turn and the turn's text (so trajectories differ and a rerun draws the same), and the last one ends the
    trajectory. `tool_sleep_s` > 0: every step first sleeps that long (a tool call)."""

    def __init__(
        self,
        vocab_size: int,
        obs_tokens: int = OBS_TOKENS,
        turns: int = TURNS,
        tool_sleep_s: float = 0.0,
        seed: int = 0,
    ):
        self.vocab_size, self.obs_tokens, self.turns = vocab_size, obs_tokens, turns
        self.tool_sleep_s, self.seed, self.turn = tool_sleep_s, seed, 0

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, action: str) -> StepResult:
        import numpy as np

        self.turn += 1
        if self.tool_sleep_s > 0:
            time.sleep(self.tool_sleep_s)
        if self.turn >= self.turns:
            return StepResult(done=True)
        rng = np.random.default_rng([self.seed, self.turn, zlib.crc32(action.encode())])
        return StepResult(observation=rng.integers(3, self.vocab_size, self.obs_tokens).tolist())


class PhaseTimer:
    """Wall time of the engine calls a rollout makes, per phase: wraps methods of an instance so each call blocks
    until its result is ready (the agent loop reads every result right away, so this adds no waiting of its own)."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def wrap(self, obj: Any, method: str, phase: str) -> None:
        import jax

        fn = getattr(obj, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = jax.block_until_ready(fn(*args, **kwargs))
            self.seconds[phase] += time.perf_counter() - start
            self.calls[phase] += 1
            return out

        setattr(obj, method, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def prefill_limit(turns: int, turn_tokens: int, obs_tokens: int) -> int:
    """The engines' prefill limit: the longest re-prefilled history (the longest prompt and every turn and observation
    before the last turn) rounded up to a multiple of 128 (384 for the standard workload's 336)."""
    longest = LONGEST_PROMPT + (turns - 1) * (turn_tokens + obs_tokens)
    return -(-longest // 128) * 128


def median_stats(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, help="reference checkpoint (built under a temp dir when omitted)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rollouts per configuration (interleaved)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/agent.json"))
    parser.add_argument("--trajectories", type=int, default=TRAJECTORIES)
    parser.add_argument("--turns", type=int, default=TURNS, help="model turns per trajectory")
    parser.add_argument("--turn-tokens", type=int, default=TURN_TOKENS, help="tokens per model turn")
    parser.add_argument("--obs-tokens", type=int, default=OBS_TOKENS, help="tokens per observation")
    args = parse_args(parser, tiny={"repeats": 1, "trajectories": 2, "turns": 2, "turn_tokens": 8, "obs_tokens": 4})
    ckpt = default_checkpoint(args.ckpt, args.tiny)
    trajectories, turns, turn_tokens, obs_tokens = args.trajectories, args.turns, args.turn_tokens, args.obs_tokens
    max_tokens = turns * turn_tokens + (turns - 1) * obs_tokens
    max_prefill = prefill_limit(turns, turn_tokens, obs_tokens)

    import jax
    import numpy as np
    import transformers as tf
    from flax import nnx

    from hfjax.envs.agent_loop import AgentGenerator
    from hfjax.models import load_hf
    from hfjax.rollout import JaxEngine, OfflineGenerator, SamplingParams
    from hfjax.rollout.generator import free_decode_state
    from hfjax.rollout.sampling import SamplerKind

    xla_compiles = [0]  # every XLA compile in the process, also those that no engine counter sees

    def count_compile(event: str, _seconds: float, **_: Any) -> None:
        xla_compiles[0] += event.endswith("backend_compile_duration")

    jax.monitoring.register_event_duration_secs_listener(count_compile)
    rng = np.random.default_rng(0)
    model = load_hf(ckpt, dtype="float32")
    cfg = model.config
    tokenizer = tf.AutoTokenizer.from_pretrained(ckpt)
    lengths = rng.integers(16, LONGEST_PROMPT + 1, trajectories)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in lengths]
    rows: list[dict[str, Any]] = [{} for _ in prompts]
    _, params, _ = nnx.split(model, nnx.Param, ...)
    sampling = SamplingParams(max_new_tokens=max_tokens, temperature=1.0, stop_token_ids=(), seed=0)

    engines, generators, timers = {}, {}, {}
    for mode in ("extend", "reprefill"):
        engine = JaxEngine(
            model, max_concurrent_decodes=trajectories, max_prefill_length=max_prefill, max_new_tokens=max_tokens
        )
        generator = OfflineGenerator(engine, params, progress=False)
        timer = PhaseTimer()
        timer.wrap(engine, "generate", "decode")
        timer.wrap(engine, "extend", "extend")
        timer.wrap(generator, "fill", "fill")
        engines[mode], generators[mode], timers[mode] = engine, generator, timer

    def agent(mode: str, tool_sleep_s: float = 0.0, workers: int = 16) -> AgentGenerator:
        return AgentGenerator(
            generators[mode],
            ToolEnv,
            tokenizer,
            max_turns=turns,
            max_tokens=max_tokens,
            max_tokens_per_turn=turn_tokens,
            env_kwargs={
                "vocab_size": cfg.vocab_size,
                "obs_tokens": obs_tokens,
                "turns": turns,
                "tool_sleep_s": tool_sleep_s,
            },
            env_workers=workers,
            append=mode,
        )

    last: dict[str, list] = {}

    def rollout(name: str, mode: str, runner: AgentGenerator) -> dict[str, float]:
        timer, compiles, xla = timers[mode], sum(engines[mode].compiles.values()), xla_compiles[0]
        timer.reset()
        start = time.perf_counter()
        trajectories = runner.generate(prompts, rows, sampling)
        seconds = time.perf_counter() - start
        stats = runner.last_stats
        bad = [t for t in trajectories if t.finish_reason != "done" or t.turns != turns or len(t.tokens) != max_tokens]
        if bad:
            print(
                f"warning: {name}: {len(bad)} trajectories off the workload, e.g. {bad[0].finish_reason!r} after "
                f"{bad[0].turns} turns, {len(bad[0].tokens)} tokens ({bad[0].error})"
            )
        last[name] = trajectories
        phases = {f"{p}_s": timer.seconds[p] for p in ("decode", "extend", "fill")}
        phases.update({f"{p}_calls": float(timer.calls[p]) for p in ("decode", "extend", "fill")})
        other = seconds - sum(phases[f"{p}_s"] for p in ("decode", "extend", "fill")) - stats["env_wait_seconds"]
        return {
            "seconds": seconds,
            "trajectory_tokens": stats["response_tokens"] + stats["env_tokens"],
            "response_tokens": stats["response_tokens"],
            "env_tokens": stats["env_tokens"],
            "decode_steps": stats["decode_steps"],
            "appends": stats["appends"],
            "appended_tokens": stats["appended_tokens"],
            "env_wait_seconds": stats["env_wait_seconds"],
            "env_wait_share": stats["env_wait_share"],
            **phases,
            "other_s": other,
            "compiles": float(sum(engines[mode].compiles.values()) - compiles),
            "xla_compiles": float(xla_compiles[0] - xla),
        }

    # Warm-up: one rollout per mode (compiles), timed apart.
    configs = {  # name: (append mode, tool sleep, environment threads)
        "reprefill, no tool, 16 threads": ("reprefill", 0.0, 16),
        "extend, no tool, 16 threads": ("extend", 0.0, 16),
        "extend, tool 50 ms, 16 threads": ("extend", TOOL_SLEEP_S, 16),
        "extend, tool 50 ms, 1 thread": ("extend", TOOL_SLEEP_S, 1),
    }
    runners = {name: agent(mode, sleep_s, workers) for name, (mode, sleep_s, workers) in configs.items()}
    first_call_s, first_compiles = {}, {}
    # (padded width, end of the longest row past its slot's prompt) of each warm-up `engine.extend`
    extends: set[tuple[int, int]] = set()
    timed_extend = engines["extend"].extend

    def seen_extend(*args: Any, **kwargs: Any) -> Any:
        prompts = engines["extend"].pool.prompt_lengths[np.asarray(kwargs["slots"])]  # in the shared prompt pool
        ends = np.asarray(kwargs["starts"]) + np.asarray(kwargs["true_length"]) - prompts
        extends.add((np.shape(kwargs["padded_tokens"])[-1], int(ends.max())))
        return timed_extend(*args, **kwargs)

    engines["extend"].extend = seen_extend
    for mode in ("extend", "reprefill"):
        start = time.perf_counter()
        runners[f"{mode}, no tool, 16 threads"].generate(prompts, rows, sampling)
        first_call_s[mode] = time.perf_counter() - start
        first_compiles[mode] = dict(engines[mode].compiles)
        print(f"warm-up {mode}: {first_call_s[mode]:.1f} s with compiles {dict(engines[mode].compiles)}", flush=True)
    engines["extend"].extend = timed_extend
    # Appends that arrive staggered (environment threads finishing apart, slow tools) batch fewer rows, so the shapes
    # of a rollout depend on timing: compile every power-of-two row count now, for `engine.extend` each (width, cache
    # blocks reached) the warm-up appended with, for `fill` each prefill bucket of a re-prefilled history.
    counts = [1 << i for i in range(trajectories.bit_length())]
    engine, state = engines["extend"], engines["extend"].init_decode_state()
    shapes = {(width, -(-end // engine.block)): (width, end) for width, end in sorted(extends)}
    for width, end in shapes.values():
        for count in counts:
            state, _ = jax.block_until_ready(
                engine.extend(
                    params,
                    state,
                    slots=np.arange(count),
                    padded_tokens=np.zeros((count, width), np.int32),
                    true_length=np.full(count, width),
                    starts=np.full(count, max(0, end - width)),  # empty slots: no prompt, own positions
                    steps=np.zeros(count),
                    kind=SamplerKind.of(sampling),
                )
            )
    free_decode_state(state)
    generator, state = generators["reprefill"], engines["reprefill"].init_decode_state()
    steps = turn_tokens + obs_tokens
    buckets = sorted({engines["reprefill"].bucket(int(p) + k * steps) for p in lengths for k in range(1, turns)})
    for bucket in buckets:
        for count in counts:
            histories = [np.full(bucket, 3, np.int32) for _ in range(count)]
            state, _ = generator.fill(
                state, histories, [(j, 0) for j in range(count)], list(range(count)), sampling, np.arange(count)
            )
    free_decode_state(state)
    compiles_warm = {mode: dict(engines[mode].compiles) for mode in engines}
    print(
        f"compiles after warm-up (extend width, blocks {sorted(shapes)}; history buckets {buckets}): {compiles_warm}",
        flush=True,
    )

    # Timed: every configuration in turn, `--repeats` rounds, so that machine noise falls on all of them alike.
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    for repeat in range(args.repeats):
        for name, (mode, _, _) in configs.items():
            runs[name].append(rollout(name, mode, runners[name]))
            run = runs[name][-1]
            print(
                f"run {repeat + 1}/{args.repeats} {name}: {run['seconds']:.2f} s, compiles {int(run['compiles'])} "
                f"(XLA {int(run['xla_compiles'])})",
                flush=True,
            )
    compiles_end = {mode: dict(engines[mode].compiles) for mode in engines}
    medians = {name: median_stats(r) for name, r in runs.items()}
    ext, rep = medians["extend, no tool, 16 threads"], medians["reprefill, no tool, 16 threads"]
    # Turn 1 runs alike in both modes (same prompt, same keys); later turns differ by design: a re-prefilled turn
    # samples with a key of its own (`hfjax.envs.agent_loop.turn_request`), steps from 0.
    same = sum(
        np.array_equal(a.tokens[:turn_tokens], b.tokens[:turn_tokens])
        for a, b in zip(last["extend, no tool, 16 threads"], last["reprefill, no tool, 16 threads"], strict=True)
    )

    # Forward tokens each mode runs (before padding): prompts + decode + appended observations, vs prompts + decode +
    # every re-prefilled history (prompt + the turns and observations before it).
    decode_tokens = trajectories * turns * turn_tokens
    extend_forward = int(lengths.sum()) + decode_tokens + trajectories * (turns - 1) * obs_tokens
    histories = sum(int(p) + k * (turn_tokens + obs_tokens) for p in lengths for k in range(1, turns))
    reprefill_forward = int(lengths.sum()) + decode_tokens + histories
    token_ratio = reprefill_forward / extend_forward

    table_rows = []
    for name, stats in medians.items():
        s = stats["seconds"]
        table_rows.append(
            [
                name,
                s,
                stats["trajectory_tokens"] / s,
                stats["response_tokens"] / s,
                int(stats["decode_steps"]),
                stats["env_wait_seconds"],
                stats["env_wait_share"],
                s - ext["seconds"],
                rep["seconds"] / s,
                "{} / {}".format(*(sum(int(run[k]) for run in runs[name]) for k in ("compiles", "xla_compiles"))),
            ]
        )
    speedup = rep["seconds"] / ext["seconds"]
    report(
        f"agent rollouts: {trajectories} trajectories x {turns} turns ({turn_tokens} model + {obs_tokens} env tokens),"
        f" {cfg.num_params / 1e6:.1f}M params, fp32, {jax.default_backend()}, medians of {args.repeats}",
        [
            "append, tool, env threads",
            "median s",
            "trajectory tok/s",
            "model tok/s",
            "decode steps",
            "env wait s",
            "env wait share",
            "s - extend no tool",
            "speed-up vs reprefill",
            "compiles timed (traces / XLA)",
        ],
        table_rows,
        args.out,
        {
            "workload": {
                "trajectories": trajectories,
                "turns": turns,
                "tokens_per_turn": turn_tokens,
                "tokens_per_observation": obs_tokens,
                "max_tokens": max_tokens,
                "prompt_lengths": lengths.tolist(),
                "max_prefill_length": max_prefill,
                "tool_sleep_s": TOOL_SLEEP_S,
            },
            "speedup_extend_vs_reprefill": speedup,
            "forward_tokens": {"extend": extend_forward, "reprefill": reprefill_forward, "ratio": token_ratio},
            "medians": medians,
            "runs": runs,
            "first_call_s_with_compiles": first_call_s,
            "compiles_first_rollout": first_compiles,
            "extend_program_bound": engines["extend"].extend_shapes.program_bound,
            "compiles_after_warmup": compiles_warm,
            "compiles_at_end": compiles_end,
            "identical_first_turns_extend_vs_reprefill": int(same),
            "kv_cache_bytes_per_device": engines["extend"].kv_cache_bytes_per_device(),
        },
    )

    from rich.console import Console
    from rich.table import Table

    table = Table(title="where a rollout's time goes (medians, s; calls in brackets)")
    for col in ("rollout", "total", "decode steps", "engine.extend", "prefill (fill)", "env wait", "other (host)"):
        table.add_column(col)
    for name, stats in medians.items():
        table.add_row(
            name,
            f"{stats['seconds']:.3f}",
            *(f"{stats[f'{p}_s']:.3f} ({int(stats[f'{p}_calls'])})" for p in ("decode", "extend", "fill")),
            f"{stats['env_wait_seconds']:.3f}",
            f"{stats['other_s']:.3f}",
        )
    Console(width=160).print(table)
    print(
        f"extend vs reprefill: {speedup:.2f}x faster (target >= 2x); forward tokens {extend_forward:,} vs "
        f"{reprefill_forward:,} ({token_ratio:.2f}x, before padding); decode step "
        f"{ext['decode_s'] / ext['decode_calls'] * 1e3:.1f} ms (extend) / "
        f"{rep['decode_s'] / rep['decode_calls'] * 1e3:.1f} ms (reprefill); engine.extend "
        f"{ext['extend_s'] / max(ext['extend_calls'], 1) * 1e3:.0f} ms per call; first turns identical in both modes "
        f"{same}/{trajectories}; compiles after warm-up {compiles_warm}, at end {compiles_end}; first calls with "
        f"compiles { {k: round(v, 1) for k, v in first_call_s.items()} } s"
    )


if __name__ == "__main__":
    main()
