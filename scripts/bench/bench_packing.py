"""Actor-update throughput with padded micro-batches against packed ones (`actor.packed_row_tokens`), on the
reference checkpoint and a batch whose responses spread evenly from 8 to 512 tokens (prompts 16..64 tokens).

Every mode runs the same update (one optimizer step over the whole batch, GRPO's PPO-clip loss) in its own worker
on this machine's default devices; modes are timed in turn (median of `--repeats` after one warm-up update), and
tokens/s counts real tokens (prompt and response) only. Modes: `padded` (micro-batches of `--micro` rows at the full
width), `trimmed` (the same, grouped by length and cut to the longest real row: the default `trim_padding`) and
`packed N` (rows of at most N tokens). Usage:
    python scripts/bench/bench_packing.py [--sequences 64] [--micro 8] [--row-tokens 1152 2304] [--repeats 2] [--tiny]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import default_checkpoint, interleaved_medians, parse_args, report

PROMPT_WIDTH = 64


def rollout_batch(sequences: int, shortest: int, longest: int, vocab: int, seed: int = 0) -> dict[str, Any]:
    """An RL batch of `sequences` rows: prompts of 16..64 random tokens, responses spread evenly over
    shortest..longest tokens (shuffled), random advantages and old log probs."""
    import numpy as np

    from hfjax.rollout.generator import SampleOutput
    from hfjax.workers.sequences import assemble

    rng = np.random.default_rng(seed)
    prompt_lengths = rng.integers(16, PROMPT_WIDTH + 1, sequences)
    ids = np.zeros((sequences, PROMPT_WIDTH), np.int32)
    mask = np.zeros_like(ids)
    for row, n in enumerate(prompt_lengths):
        ids[row, PROMPT_WIDTH - n :] = rng.integers(3, vocab, n)
        mask[row, PROMPT_WIDTH - n :] = 1
    lengths = rng.permutation(np.linspace(shortest, longest, sequences).astype(int))
    outputs = [
        SampleOutput(i, 0, rng.integers(3, vocab, n).astype(np.int32), np.zeros(n, np.float32), "length")
        for i, n in enumerate(lengths)
    ]
    batch = assemble(ids, mask, outputs, 1, longest, 0)
    batch["advantages"] = rng.standard_normal(batch["responses"].shape).astype(np.float32)
    batch["old_log_probs"] = -rng.random(batch["responses"].shape).astype(np.float32)
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, default=None, help="default: the reference checkpoint (built once)")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--shortest", type=int, default=8)
    parser.add_argument("--longest", type=int, default=512)
    parser.add_argument("--micro", type=int, default=8, help="rows per padded micro-batch")
    parser.add_argument("--row-tokens", type=int, nargs="+", default=[1152, 2304], help="packed row sizes")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/packing.json"))
    args = parse_args(parser, tiny={"sequences": 8, "longest": 48, "micro": 4, "row_tokens": [128], "repeats": 1})

    import jax
    import numpy as np

    from hfjax.config.roles import ActorConfig, RolloutConfig
    from hfjax.controller import LocalWorkerGroup
    from hfjax.protocol import DataProto
    from hfjax.workers.actor import ActorRolloutRefWorker

    ckpt = default_checkpoint(args.ckpt, args.tiny)
    modes = {"padded": dict(trim_padding=False), "trimmed": dict(trim_padding=True)}
    modes.update({f"packed {n}": dict(packed_row_tokens=n) for n in args.row_tokens})
    rollout = RolloutConfig(response_length=args.longest)
    groups = {}
    for name, settings in modes.items():
        actor = ActorConfig(
            model_path=str(ckpt), ppo_mini_batch_size=args.sequences, micro_batch_size=args.micro, **settings
        )
        groups[name] = LocalWorkerGroup(ActorRolloutRefWorker, actor, rollout, "actor", max_prompt_length=PROMPT_WIDTH)
        groups[name].init_model()
    vocab = groups["padded"].worker.policy.config.vocab_size
    batch = rollout_batch(args.sequences, args.shortest, args.longest, vocab)
    tokens = int(batch["attention_mask"].sum())
    losses = {}

    def update(name: str) -> Any:
        def run() -> None:
            metrics = groups[name].update_actor(DataProto.from_dict(dict(batch))).meta_info["metrics"]
            losses.setdefault(name, metrics["actor/pg_loss"])  # the first update's: the same parameters everywhere

        return run

    seconds = interleaved_medians({name: update(name) for name in modes}, args.repeats, warmup=1)
    padded = seconds["padded"]
    rows = [[name, seconds[name] * 1e3, tokens / seconds[name], padded / seconds[name], losses[name]] for name in modes]
    same = bool(np.allclose([losses[n] for n in modes], losses["padded"], rtol=1e-4, atol=1e-6))
    report(
        f"actor update, {args.sequences} sequences, responses {args.shortest}..{args.longest} tokens, "
        f"{tokens:,} real tokens, {jax.device_count()} {jax.default_backend()} device(s)",
        ["mode", "update ms", "tokens/s", "speed-up vs padded", "pg_loss"],
        rows,
        args.out,
        {"same_loss": same, "real_tokens": tokens, "sequences": args.sequences},
    )
    if not same:
        raise SystemExit(f"the modes' first-update losses differ: {losses}")


if __name__ == "__main__":
    main()
