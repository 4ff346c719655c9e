"""GSM8K conversion: the public JSONL files (`train.jsonl`, `test.jsonl`, rows with `question` and `answer`, the
answer ending in `#### <number>`) to verl's prompt schema in parquet, plus SFT files (prompt, full worked answer).
Used by `hfjax data gsm8k`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hfjax.data.records import DataError, RowRef, parse_str, read_rows, require, write_rows

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")


def final_answer(answer: str, ref: RowRef) -> str:
    """The number after the last `####` of a GSM8K answer, without thousands separators."""
    _, sep, tail = answer.rpartition("####")
    value = tail.strip().replace(",", "")
    if not sep or not value:
        raise ref.error("answer", "a worked answer ending in '#### <number>'", answer[-60:])
    return value


def gsm8k_rows(ref: RowRef, row: dict[str, Any], split: str, index: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The prompt-schema row and the SFT row of one GSM8K example."""
    question = parse_str(require(row, ref, "question"), ref, "question")
    answer = parse_str(require(row, ref, "answer"), ref, "answer")
    prompt = [{"role": "user", "content": f"{question} {INSTRUCTION}"}]
    prompt_row = {
        "data_source": DATA_SOURCE,
        "prompt": prompt,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": final_answer(answer, ref)},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }
    return prompt_row, {"prompt": prompt, "response": answer}


def split_files(in_dir: Path, split: str) -> list[Path]:
    """The files of `split` in `in_dir`: GSM8K's own `{split}.jsonl`, or the Hub dataset's parquet shards
    (`main/{split}-*.parquet`, also directly in `in_dir`)."""
    if (in_dir / f"{split}.jsonl").is_file():
        return [in_dir / f"{split}.jsonl"]
    return sorted(in_dir.glob(f"main/{split}-*.parquet")) or sorted(in_dir.glob(f"{split}-*.parquet"))


def convert_gsm8k(in_dir: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """Converts each split found in `in_dir` (`split_files`) to `{split}.parquet` (prompt schema) and
    `sft_{split}.parquet` in `out_dir`; returns the written paths by name. At least one split must exist."""
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    found = {split: files for split in SPLITS if (files := split_files(in_dir, split))}
    if not found:
        raise DataError(
            f"{in_dir}: expected train.jsonl and/or test.jsonl (GSM8K's question/answer JSONL), or the Hub dataset's "
            "main/train-*.parquet and main/test-*.parquet"
        )
    written = {}
    for split, files in found.items():
        converted = [gsm8k_rows(ref, row, split, i) for i, (ref, row) in enumerate(read_rows(files))]
        written[split] = write_rows([p for p, _ in converted], out_dir / f"{split}.parquet")
        written[f"sft_{split}"] = write_rows([s for _, s in converted], out_dir / f"sft_{split}.parquet")
    return written
