"""The agent quickstart's synthetic task, generated in code: two-digit multiplication ("37*48" -> 1776), which a small
model cannot do in its head but can with a calculator tool (`hfjax/envs/examples/calculator.py`). Written as disjoint
RL train / held-out test prompt files in verl's schema and an SFT file of demonstrations of the tool-call format
(Hermes/Qwen `<tool_call>{"name": ..., "arguments": ...}</tool_call>`), with a small local tokenizer whose chat
template closes each assistant turn with its stop token (so an observation appended after the model's stop token
is exactly the template's rendering of the conversation) and keeps every digit a token of its own."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hfjax.data.records import write_rows

DATA_SOURCE = "hfjax/calculator"
TOOL_NAME = "calculator"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}{% if m['role'] == 'assistant' %}</s>{% endif %}"
    "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass(frozen=True)
class MultiplicationTask:
    """Products of two `digits`-digit numbers; distinct problems split into `num_train` RL prompts, `num_test`
    held-out prompts and `num_sft` demonstrations. The demonstrating teacher calls the calculator and copies its
    result on `1 - sft_no_tool` of them; on the rest it answers at once with a guess (the product with one digit
    wrong), as a model that has not learnt when the tool pays would. RL prompts and the held-out split are scored
    against the true product."""

    digits: int = 2  # digits of each factor
    num_train: int = 2048  # RL prompts
    num_test: int = 256  # held-out prompts (validation accuracy)
    num_sft: int = 1024  # SFT demonstrations
    seed: int = 0  # seed of the problems, splits and the teacher's choices
    sft_no_tool: float = 0.85  # fraction of demonstrations answered by a guess without the tool

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 4:
            raise ValueError(f"digits: expected 1..4, got {self.digits}")
        if min(self.num_train, self.num_test, self.num_sft) < 0:
            raise ValueError(f"split sizes must be >= 0, got {self.num_train}, {self.num_test}, {self.num_sft}")
        if not 0.0 <= self.sft_no_tool <= 1.0:
            raise ValueError(f"sft_no_tool: expected a fraction in [0, 1], got {self.sft_no_tool}")
        available = (9 * 10 ** (self.digits - 1)) ** 2
        if self.num_train + self.num_test + self.num_sft > available:
            raise ValueError(f"{self.num_train + self.num_test + self.num_sft} problems requested, {available} exist")


def problems(task: MultiplicationTask) -> dict[str, list[tuple[int, int]]]:
    """Distinct (a, b) pairs per split, drawn with `task.seed`."""
    low, high = 10 ** (task.digits - 1), 10**task.digits
    rng = np.random.default_rng(task.seed)
    total = task.num_train + task.num_test + task.num_sft
    codes = rng.choice((high - low) ** 2, size=total, replace=False)
    pairs = [(low + int(c) // (high - low), low + int(c) % (high - low)) for c in codes]
    bounds = np.cumsum((0, task.num_train, task.num_test, task.num_sft))
    return {split: pairs[bounds[i] : bounds[i + 1]] for i, split in enumerate(("train", "test", "sft"))}


def question(a: int, b: int) -> str:
    return f"{a}*{b}"


def tool_call(expression: str) -> str:
    """The assistant's turn that calls the calculator on `expression`."""
    body = json.dumps({"name": TOOL_NAME, "arguments": {"expression": expression}})
    return f"{CALL_OPEN}{body}{CALL_CLOSE}"


def wrong_guess(product: int, rng: np.random.Generator) -> int:
    """`product` with one of its digits changed (never the leading digit to 0)."""
    digits = list(str(product))
    i = int(rng.integers(len(digits)))
    choices = [d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0")]
    digits[i] = str(rng.choice(choices))
    return int("".join(digits))


def prompt_row(a: int, b: int, split: str, index: int) -> dict[str, Any]:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question(a, b)}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a * b)},
        "extra_info": {"split": split, "index": index},
    }


def demonstrations(task: MultiplicationTask, pairs: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """SFT rows: a tool demonstration is two rows (the question -> the call; the question, call and the tool's
    result -> the answer), a guess is one (the question -> the wrong product)."""
    rng = np.random.default_rng([task.seed, 2])
    rows = []
    for a, b in pairs:
        user = {"role": "user", "content": question(a, b)}
        if rng.random() < task.sft_no_tool:
            rows.append({"prompt": [user], "response": str(wrong_guess(a * b, rng))})
            continue
        call = tool_call(question(a, b))
        rows.append({"prompt": [user], "response": call})
        turns = [
            user,
            {"role": "assistant", "content": call},
            {"role": "tool", "name": TOOL_NAME, "content": str(a * b)},
        ]
        rows.append({"prompt": turns, "response": str(a * b)})
    return rows


def write_multiplication_task(task: MultiplicationTask, out_dir: str | Path) -> dict[str, Path]:
    """Writes `train.parquet`, `test.parquet` (prompt schema) and `sft.parquet` (`prompt`, `response`) under
    `out_dir`; returns the paths by split name."""
    out_dir = Path(out_dir)
    split = problems(task)
    paths = {
        name: write_rows(
            [prompt_row(a, b, name, i) for i, (a, b) in enumerate(split[name])], out_dir / f"{name}.parquet"
        )
        for name in ("train", "test")
    }
    paths["sft"] = write_rows(demonstrations(task, split["sft"]), out_dir / "sft.parquet")
    return paths


def build_tool_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer (`hfjax.models.local_tokenizer`) with merges learnt from the chat template's words
    and the tool call's fixed JSON (so the call costs few tokens) but never across digits, `<tool_call>` and
    `</tool_call>` as special tokens of their own, and `CHAT_TEMPLATE`."""
    from hfjax.models.local_tokenizer import build_bpe_tokenizer

    scaffold = tool_call("").split(CALL_OPEN)[1].split(CALL_CLOSE)[0]
    words = ["user", "assistant", "tool", ":", "\n", *scaffold.split('""'), *"0123456789*"]
    tokenizer = build_bpe_tokenizer(words * 4, vocab_size, chat_template=CHAT_TEMPLATE)
    tokenizer.add_tokens([CALL_OPEN, CALL_CLOSE], special_tokens=True)
    return tokenizer
