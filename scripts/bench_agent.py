"""Multi-turn (agent) rollout throughput of `AgentGenerator` on the reference checkpoint: observations appended to the
running slots' KV caches (`append="extend"`) vs the whole history re-prefilled every turn (`append="reprefill"`),
same process, and how long the decoder waits on environments that call a slow tool.

Workload (standard): 64 trajectories (prompts of lengths 16..48, seed 0) x 4 model turns of 64 tokens (temperature
1.0, no stop tokens, so every turn is exactly 64 tokens) and 3 observations of 32 tokens (a synthetic environment:
random token ids from an rng seeded by the turn's text, done after the 4th turn), 352 trajectory tokens each; all 64
in flight (64 slots). One engine per append mode, both with the same settings (prefill limit 384: the longest
re-prefilled history is 48 + 3 x 64 + 3 x 32 = 336 tokens). Each mode is warmed up once (compiles excluded), then
timed `--repeats` times interleaved; medians. Then extend mode with a 50 ms tool (`time.sleep` in every step) on 16
environment threads and on one: the share of the rollout in which no slot could decode because every trajectory
waited on its environment. The floor printed beside the speed-up is the ratio of forward tokens the model runs in each
mode (decode + prefilled/appended tokens, before padding). Each rollout's time is also split into decode steps,
`engine.extend` calls, prefills (`generator.fill`), waits on environments and the rest (host work). Usage:
    python scripts/bench_agent.py [--ckpt DIR] [--repeats 3] [--out runs/bench/agent.json]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import reference_checkpoint, report

from hfjax.envs import Environment, StepResult

TRAJECTORIES, TURNS, TURN_TOKENS, OBS_TOKENS = 64, 4, 64, 32
MAX_TOKENS = TURNS * TURN_TOKENS + (TURNS - 1) * OBS_TOKENS  # 352
MAX_PREFILL = 384  # >= 48 + 3 * 64 + 3 * 32 = 336, the longest re-prefilled history
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


def median_stats(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, help="reference checkpoint (built under a temp dir when omitted)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rollouts per append mode (interleaved)")
    parser.add_argument("--tool-repeats", type=int, default=1, help="timed rollouts per tool setting (after warm-up)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/agent.json"))
    args = parser.parse_args()
    ckpt = args.ckpt or reference_checkpoint(Path(tempfile.gettempdir()) / "hfjax-reference-ckpt")

    import jax
    import numpy as np
    import transformers as tf
    from flax import nnx

    from hfjax.envs.agent_loop import AgentGenerator
    from hfjax.models import load_hf
    from hfjax.rollout import JaxEngine, OfflineGenerator, SamplingParams

    rng = np.random.default_rng(0)
    model = load_hf(ckpt, dtype="float32")
    cfg = model.config
    tokenizer = tf.AutoTokenizer.from_pretrained(ckpt)
    lengths = rng.integers(16, 49, TRAJECTORIES)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in lengths]
    rows: list[dict[str, Any]] = [{} for _ in prompts]
    _, params, _ = nnx.split(model, nnx.Param, ...)
    sampling = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=1.0, stop_token_ids=(), seed=0)

    engines, generators, timers = {}, {}, {}
    for mode in ("extend", "reprefill"):
        engine = JaxEngine(
            model, max_concurrent_decodes=TRAJECTORIES, max_prefill_length=MAX_PREFILL, max_new_tokens=MAX_TOKENS
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
            max_turns=TURNS,
            max_tokens=MAX_TOKENS,
            max_tokens_per_turn=TURN_TOKENS,
            env_kwargs={
                "vocab_size": cfg.vocab_size,
                "obs_tokens": OBS_TOKENS,
                "turns": TURNS,
                "tool_sleep_s": tool_sleep_s,
            },
            env_workers=workers,
            append=mode,
        )

    last: dict[str, list] = {}

    def rollout(name: str, mode: str, runner: AgentGenerator) -> dict[str, float]:
        timer = timers[mode]
        timer.reset()
        start = time.perf_counter()
        trajectories = runner.generate(prompts, rows, sampling)
        seconds = time.perf_counter() - start
        stats = runner.last_stats
        bad = [t for t in trajectories if t.finish_reason != "done" or t.turns != TURNS or len(t.tokens) != MAX_TOKENS]
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
        }

    # 1. extend vs reprefill, no tool: warm-up (compiles), then interleaved timed runs.
    runners = {mode: agent(mode) for mode in ("extend", "reprefill")}
    first_call_s = {}
    for mode, runner in runners.items():
        start = time.perf_counter()
        runner.generate(prompts, rows, sampling)
        first_call_s[mode] = time.perf_counter() - start
        print(f"warm-up {mode}: {first_call_s[mode]:.1f} s with compiles {dict(engines[mode].compiles)}", flush=True)
    compiles_warm = {mode: dict(engines[mode].compiles) for mode in engines}
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in runners}
    for repeat in range(args.repeats):
        for mode, runner in runners.items():
            runs[mode].append(rollout(mode, mode, runner))
            print(f"run {repeat + 1}/{args.repeats} {mode}: {runs[mode][-1]['seconds']:.2f} s", flush=True)
    compiles_timed = {mode: dict(engines[mode].compiles) for mode in engines}
    medians = {mode: median_stats(r) for mode, r in runs.items()}
    # Turn 1 runs alike in both modes (same prompt, same keys); later turns differ by design: a re-prefilled slot
    # restarts its sample's step count, so its draws reuse the keys of turn 1.
    same = sum(
        np.array_equal(a.tokens[:TURN_TOKENS], b.tokens[:TURN_TOKENS])
        for a, b in zip(last["extend"], last["reprefill"], strict=True)
    )

    # 2. Decoder wait on a 50 ms tool, extend mode: 16 environment threads, then one.
    tools = {"tool 50 ms, 16 workers": (TOOL_SLEEP_S, 16), "tool 50 ms, 1 worker": (TOOL_SLEEP_S, 1)}
    tool_runs: dict[str, list[dict[str, float]]] = {}
    for name, (sleep_s, workers) in tools.items():
        runner = agent("extend", sleep_s, workers)
        runner.generate(prompts, rows, sampling)  # warm-up: staggered appends may need new extend row counts
        before = dict(engines["extend"].compiles)
        tool_runs[name] = [rollout(name, "extend", runner) for _ in range(args.tool_repeats)]
        recompiled = {k: v - before.get(k, 0) for k, v in engines["extend"].compiles.items() if v != before.get(k, 0)}
        print(f"{name}: {tool_runs[name][-1]['seconds']:.2f} s, compiles in timed runs {recompiled}", flush=True)
    tool_medians = {name: median_stats(r) for name, r in tool_runs.items()}
    compiles_end = {mode: dict(engines[mode].compiles) for mode in engines}

    # Forward tokens each mode runs (before padding): prompts + decode + appended observations, vs prompts + decode +
    # every re-prefilled history (prompt + the turns and observations before it).
    decode_tokens = TRAJECTORIES * TURNS * TURN_TOKENS
    extend_forward = int(lengths.sum()) + decode_tokens + TRAJECTORIES * (TURNS - 1) * OBS_TOKENS
    histories = sum(int(p) + k * (TURN_TOKENS + OBS_TOKENS) for p in lengths for k in range(1, TURNS))
    reprefill_forward = int(lengths.sum()) + decode_tokens + histories
    token_ratio = reprefill_forward / extend_forward

    base = medians["extend"]["seconds"]
    table_rows = []
    for name, stats in (
        ("reprefill, no tool, 16 workers", medians["reprefill"]),
        ("extend, no tool, 16 workers", medians["extend"]),
        *((f"extend, {name}", stats) for name, stats in tool_medians.items()),
    ):
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
                s - base,
                medians["reprefill"]["seconds"] / s,
            ]
        )
    speedup = medians["reprefill"]["seconds"] / base
    report(
        f"agent rollouts: {TRAJECTORIES} trajectories x {TURNS} turns ({TURN_TOKENS} model + {OBS_TOKENS} env tokens),"
        f" {cfg.num_params / 1e6:.1f}M params, fp32, {jax.default_backend()}, medians of {args.repeats} "
        f"(tool rows: {args.tool_repeats})",
        [
            "rollout (append, tool, env threads)",
            "median s",
            "trajectory tokens/s",
            "model tokens/s",
            "decode steps",
            "env wait s",
            "env wait share",
            "s vs extend no tool",
            "speed-up vs reprefill",
        ],
        table_rows,
        args.out,
        {
            "workload": {
                "trajectories": TRAJECTORIES,
                "turns": TURNS,
                "tokens_per_turn": TURN_TOKENS,
                "tokens_per_observation": OBS_TOKENS,
                "max_tokens": MAX_TOKENS,
                "prompt_lengths": lengths.tolist(),
                "max_prefill_length": MAX_PREFILL,
                "tool_sleep_s": TOOL_SLEEP_S,
            },
            "speedup_extend_vs_reprefill": speedup,
            "forward_tokens": {"extend": extend_forward, "reprefill": reprefill_forward, "ratio": token_ratio},
            "medians": {**medians, **tool_medians},
            "runs": {**runs, **tool_runs},
            "first_call_s_with_compiles": first_call_s,
            "compiles_after_warmup": compiles_warm,
            "compiles_after_timed_runs": compiles_timed,
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
    for name, stats in (
        ("reprefill, no tool", medians["reprefill"]),
        ("extend, no tool", medians["extend"]),
        *((f"extend, {name}", stats) for name, stats in tool_medians.items()),
    ):
        table.add_row(
            name,
            f"{stats['seconds']:.3f}",
            *(f"{stats[f'{p}_s']:.3f} ({int(stats[f'{p}_calls'])})" for p in ("decode", "extend", "fill")),
            f"{stats['env_wait_seconds']:.3f}",
            f"{stats['other_s']:.3f}",
        )
    Console(width=160).print(table)
    step_ms = {mode: medians[mode]["decode_s"] / medians[mode]["decode_calls"] * 1e3 for mode in medians}
    print(
        f"extend vs reprefill: {speedup:.2f}x faster (target >= 2x); forward tokens {extend_forward:,} vs "
        f"{reprefill_forward:,} ({token_ratio:.2f}x, before padding); decode step "
        f"{step_ms['extend']:.1f} ms (extend) / {step_ms['reprefill']:.1f} ms (reprefill); "
        f"first turns identical in both modes {same}/{TRAJECTORIES}; compiles after warm-up {compiles_warm}, "
        f"after timed runs {compiles_timed}, at end {compiles_end}; first calls with compiles "
        f"{ {k: round(v, 1) for k, v in first_call_s.items()} } s"
    )


if __name__ == "__main__":
    main()
