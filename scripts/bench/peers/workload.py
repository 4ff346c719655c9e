"""The prompts of the hfjax-vs-TRL GRPO comparison, built the same way for both sides (seed 0, deterministic).

Each prompt is one user message: a short instruction asking for numbers, then words drawn from the reference
tokenizer's vocabulary while the prompt, rendered with the tokenizer's chat template (generation prompt included),
stays within a target length drawn uniformly from (instruction length, max_prompt_tokens] tokens; no prompt is longer
than `max_prompt_tokens`, so neither side truncates or drops one. The prompts are written as verl-schema parquet
(`hfjax.data.write_rows`): hfjax reads it as `data.train_files`, `trl_grpo.py` reads the same file.
Usage (either virtualenv):
    python scripts/bench/peers/workload.py [--ckpt DIR] [--out runs/peers/workload.parquet] [--prompts 64] [--tiny]
Imports transformers (the tokenizer), numpy and `hfjax.data` (no JAX); `scripts/bench/bench_common.py` builds the
checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts" / "bench")]
from bench_common import default_checkpoint, parse_args  # noqa: E402

DEFAULT_OUT = ROOT / "runs" / "peers" / "workload.parquet"
DATA_SOURCE = "peers/digits"
INSTRUCTION = "Count letters:"


def checkpoint(ckpt: Path | None, tiny: bool = False) -> Path:
    """`ckpt`, or the benchmark reference checkpoint (`tiny`: its tiny variant), built once under the temp dir."""
    return default_checkpoint(ckpt, tiny)


def vocabulary_words(tokenizer: Any, min_letters: int = 3) -> list[str]:
    """Alphabetic tokens of at least `min_letters` letters (fewer where the vocabulary has no token that long, as
    the tiny reference tokenizer's) from the tokenizer's vocabulary, in token-id order."""
    tokens = [tokenizer.decode([token_id]).strip() for token_id in range(len(tokenizer))]
    alphabetic = [text for text in tokens if text.isascii() and text.isalpha()]
    if not alphabetic:
        raise SystemExit(f"{tokenizer.name_or_path}: the vocabulary has no alphabetic tokens to build prompts from")
    shortest = min(min_letters, max(len(text) for text in alphabetic))
    return [text for text in alphabetic if len(text) >= shortest]


def prompt_length(tokenizer: Any, text: str) -> int:
    """Tokens of `text` as a user message rendered with the chat template and its generation prompt."""
    messages = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def build_prompts(tokenizer: Any, n: int = 64, max_prompt_tokens: int = 64, seed: int = 0) -> list[str]:
    """`n` prompt texts (see the module docstring), the same for the same tokenizer and seed."""
    import numpy as np

    shortest = prompt_length(tokenizer, INSTRUCTION)
    if shortest >= max_prompt_tokens:
        raise SystemExit(f"max_prompt_tokens={max_prompt_tokens}: the instruction alone takes {shortest} tokens")
    rng = np.random.default_rng(seed)
    words = vocabulary_words(tokenizer)
    prompts = []
    for target in rng.integers(shortest + 1, max_prompt_tokens + 1, size=n):
        text = INSTRUCTION
        while True:
            longer = f"{text} {words[rng.integers(len(words))]}"
            if prompt_length(tokenizer, longer) > target:
                break
            text = longer
        prompts.append(text)
    return prompts


def verl_rows(prompts: list[str]) -> list[dict[str, Any]]:
    """The prompts as rows in verl's schema (no ground truth: the reward is a rule on the response alone)."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": text}],
            "ability": "digits",
            "reward_model": {"style": "rule", "ground_truth": ""},
            "extra_info": {"split": "train", "index": i},
        }
        for i, text in enumerate(prompts)
    ]


def write_workload(ckpt: Path, out: Path, n: int = 64, max_prompt_tokens: int = 64, seed: int = 0) -> Path:
    """Builds the prompts with `ckpt`'s tokenizer and writes them to `out` (parquet or JSONL); returns `out`."""
    import transformers

    from hfjax.data import write_rows

    tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt)
    prompts = build_prompts(tokenizer, n, max_prompt_tokens, seed)
    lengths = [prompt_length(tokenizer, p) for p in prompts]
    print(f"{n} prompts, {min(lengths)}..{max(lengths)} tokens (mean {sum(lengths) / n:.1f}) -> {out}")
    return write_rows(verl_rows(prompts), out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--ckpt", type=Path, help="checkpoint whose tokenizer to use (default: the benchmark reference one)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parse_args(parser, tiny={"prompts": 4})
    write_workload(checkpoint(args.ckpt, args.tiny), args.out, args.prompts, args.max_prompt_tokens, args.seed)


if __name__ == "__main__":
    main()
