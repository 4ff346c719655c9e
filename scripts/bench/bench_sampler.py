"""One sampler step (temperature 1, top-k and top-p) over [slots, vocab] logits: the bisection filters against the
`lax.top_k` candidate filters, on this machine's default backend.

Per method: median wall time of the jitted step and the compiled program's 'bytes accessed' (XLA's cost analysis
counts a loop body once and a conditional as its larger branch, so the bytes are read from a compile with the
bisection loops unrolled and the candidates' conditional replaced by its first branch, the one this workload runs).
The last row is the candidates' fallback alone (a full sort), which runs only when a row needs more than the
candidates. Usage:
    python scripts/bench/bench_sampler.py [--slots 640] [--vocab 151936] [--top-k 50] [--top-p 0.9] [--repeats 3]
        [--tiny]
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import interleaved_medians, parse_args, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=640)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/sampler.json"))
    args = parse_args(parser, tiny={"slots": 8, "vocab": 1000, "repeats": 1})

    import jax
    import jax.numpy as jnp
    import numpy as np

    from hfjax.rollout.sampling import SamplerKind, SamplingParams, sample_key, sample_tokens
    from hfjax.rollout.token_filters import CANDIDATES, _filter_over_candidates

    rows = args.slots
    kind = SamplerKind.of(SamplingParams(top_k=args.top_k, top_p=args.top_p))
    logits = jax.device_put((np.random.default_rng(0).normal(size=(rows, args.vocab)) * 3).astype(np.float32))
    settings = (
        jax.jit(sample_key)(*(np.arange(rows, dtype=np.int32),) * 3),
        jnp.ones(rows, jnp.int32),
        jnp.ones(rows, jnp.float32),
        jnp.full(rows, args.top_k, jnp.int32),
        jnp.full(rows, args.top_p, jnp.float32),
    )

    def step(method: str) -> Callable[..., Any]:
        return functools.partial(sample_tokens, kind=kind, filter_method=method)

    def sorted_filter(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
        return _filter_over_candidates(x, top_k, top_p, kind, args.vocab)[0]  # the fallback branch

    steps = {method: jax.jit(step(method)) for method in ("bisection", "candidates")}
    fallback = "candidates fallback: full sort (filter only)"
    calls = {name: functools.partial(fn, logits, *settings) for name, fn in steps.items()}
    calls[fallback] = functools.partial(jax.jit(sorted_filter), logits, *settings[3:])
    tokens = {name: np.asarray(steps[name](logits, *settings)[0]) for name in steps}
    same_tokens = bool((tokens["bisection"] == tokens["candidates"]).all())
    medians = interleaved_medians(
        {name: lambda f=f: jax.block_until_ready(f()) for name, f in calls.items()}, args.repeats
    )

    def bytes_accessed(fn: Callable[..., Any], *inputs: jax.Array) -> float:
        """'bytes accessed' of a fresh compile of `fn` (not jitted before, so traced afresh under the patches)."""
        unrolled = functools.partial(jax.lax.fori_loop, unroll=True)
        with (
            mock.patch.object(jax.lax, "fori_loop", unrolled),
            mock.patch.object(jax.lax, "cond", lambda _, first, __: first()),
        ):
            cost = jax.jit(fn).lower(*inputs).compile().cost_analysis()
        return float((cost[0] if isinstance(cost, list) else cost)["bytes accessed"])

    traffic = {
        "bisection": bytes_accessed(step("bisection"), logits, *settings),
        "candidates": bytes_accessed(step("candidates"), logits, *settings),
        fallback: bytes_accessed(sorted_filter, logits, *settings[3:]),
    }
    logits_bytes = logits.size * 4
    table = [
        [
            name,
            medians[name] * 1e3,
            traffic[name] / 1e9,
            traffic[name] / logits_bytes,
            medians["bisection"] / medians[name],
        ]
        for name in calls
    ]
    report(
        f"sampler step {rows} x {args.vocab}, top-k {args.top_k}, top-p {args.top_p}, {jax.default_backend()}, "
        f"{CANDIDATES} candidates, same tokens: {same_tokens}",
        ["method", "median ms", "GB accessed", "logits reads", "speed-up vs bisection"],
        table,
        args.out,
        {"slots": rows, "vocab": args.vocab, "top_k": args.top_k, "top_p": args.top_p, "same_tokens": same_tokens},
    )
    if not same_tokens:
        raise SystemExit("the two filter methods sampled different tokens")


if __name__ == "__main__":
    main()
