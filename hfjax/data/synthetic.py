"""The quickstart's synthetic task, generated in code: multi-digit addition ("12+345=" -> "357") with a fixed seed,
written as disjoint RL train / held-out test prompt files in verl's schema plus an SFT file, and a small local BPE
tokenizer that keeps every digit a token of its own."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hfjax.data.records import write_rows

DATA_SOURCE = "hfjax/addition"
ALPHABET = "0123456789+="
SPLITS = ("train", "test", "sft")


@dataclass(frozen=True)
class AdditionTask:
    """Additions of two operands of `min_digits`..`max_digits` digits each; distinct problems, split into
    `num_train` RL prompts, `num_test` held-out prompts and `num_sft` supervised examples (no problem in two splits).
    The SFT answers come from a teacher that forgets the units carry (writes a + b - 10) on a `sft_carry_slip`
    fraction of the SFT problems that have one; RL prompts and the held-out split are scored against the true sum.
    """

    min_digits: int = 1
    max_digits: int = 3
    num_train: int = 1024
    num_test: int = 256
    num_sft: int = 2048
    seed: int = 0
    sft_carry_slip: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"expected 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if min(self.num_train, self.num_test, self.num_sft) < 0:
            raise ValueError(f"split sizes must be >= 0, got {self.num_train}, {self.num_test}, {self.num_sft}")
        if not 0.0 <= self.sft_carry_slip <= 1.0:
            raise ValueError(f"sft_carry_slip: expected a fraction in [0, 1], got {self.sft_carry_slip}")
        if self.num_problems > len(self.operands()) ** 2:
            raise ValueError(
                f"{self.num_problems} distinct problems requested but operands of {self.min_digits}-"
                f"{self.max_digits} digits only give {len(self.operands()) ** 2}"
            )

    @property
    def num_problems(self) -> int:
        return self.num_train + self.num_test + self.num_sft

    def operands(self) -> np.ndarray:
        """All operand values with `min_digits`..`max_digits` digits (0 counts as one digit)."""
        low = 0 if self.min_digits == 1 else 10 ** (self.min_digits - 1)
        return np.arange(low, 10**self.max_digits)


def addition_problems(task: AdditionTask) -> dict[str, list[tuple[int, int]]]:
    """Distinct (a, b) pairs per split, drawn with `task.seed`: each operand's digit count is uniform over
    `min_digits`..`max_digits`, then its value uniform among numbers of that many digits."""
    rng = np.random.default_rng(task.seed)
    widths = np.arange(task.min_digits, task.max_digits + 1)
    low = np.where(widths == 1, 0, 10 ** (widths - 1))
    seen: dict[tuple[int, int], None] = {}
    while len(seen) < task.num_problems:
        digits = rng.integers(0, len(widths), size=(task.num_problems, 2))
        values = rng.integers(low[digits], 10 ** widths[digits])
        for a, b in values.tolist():
            if len(seen) == task.num_problems:
                break
            seen.setdefault((a, b), None)
    pairs = list(seen)
    sizes = (task.num_train, task.num_test, task.num_sft)
    bounds = np.cumsum((0, *sizes))
    return {split: pairs[bounds[i] : bounds[i + 1]] for i, split in enumerate(SPLITS)}


def teacher_answers(task: AdditionTask, problems: list[tuple[int, int]]) -> list[int]:
    """The SFT teacher's answers: the true sum, except that a seeded `task.sft_carry_slip` fraction of the problems
    with a units carry (a % 10 + b % 10 >= 10) get a + b - 10, the sum with that carry forgotten."""
    slips = np.random.default_rng([task.seed, 1]).random(len(problems)) < task.sft_carry_slip
    carries = [a % 10 + b % 10 >= 10 for a, b in problems]
    return [a + b - 10 * int(slip and carry) for (a, b), slip, carry in zip(problems, slips, carries, strict=True)]


def question(a: int, b: int) -> str:
    """The prompt text of a problem."""
    return f"{a}+{b}="


def prompt_row(a: int, b: int, split: str, index: int) -> dict[str, Any]:
    """One RL prompt row in verl's schema; the ground truth is the sum's decimal digits."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question(a, b)}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index},
    }


def write_addition_task(task: AdditionTask, out_dir: str | Path) -> dict[str, Path]:
    """Writes `train.parquet`, `test.parquet` (prompt schema) and `sft.parquet` (`prompt`, `response`) under
    `out_dir`; returns the paths by split name."""
    out_dir = Path(out_dir)
    problems = addition_problems(task)
    paths = {
        split: write_rows(
            [prompt_row(a, b, split, i) for i, (a, b) in enumerate(problems[split])], out_dir / f"{split}.parquet"
        )
        for split in ("train", "test")
    }
    answers = teacher_answers(task, problems["sft"])
    sft_rows = [
        {"prompt": [{"role": "user", "content": question(a, b)}], "response": str(answer)}
        for (a, b), answer in zip(problems["sft"], answers, strict=True)
    ]
    paths["sft"] = write_rows(sft_rows, out_dir / "sft.parquet")
    return paths


def build_addition_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer (`hfjax.models.local_tokenizer`) with merges learnt only from the chat template's
    words, so digits, '+' and '=' stay one token each; `vocab_size` is an upper bound."""
    from hfjax.models.local_tokenizer import SIMPLE_CHAT_TEMPLATE, build_bpe_tokenizer

    template_words = ["user", "assistant", "system", ": ", "\n"]
    return build_bpe_tokenizer([*template_words, *ALPHABET], vocab_size, chat_template=SIMPLE_CHAT_TEMPLATE)
