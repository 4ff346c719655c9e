"""The preflight's check of prompt lengths: the prompts of `data.train_files` and `data.val_files`, tokenized as the
run tokenizes them (`hfjax.data.prompts.tokenize_prompt_rows`), against `data.max_prompt_length` and what
`data.truncation` does with longer ones, so that a dataset the run cannot use fails before Ray starts.

Rows are tokenized a chunk at a time and the check stops as soon as the answer is known: with `filter`, once enough
prompts fit (one chunk, usually); with `left` or `right` (every prompt is kept) after the first chunk (its chat
template renders); with `error` at the first longer prompt, or after `ERROR_CHECK_ROWS` rows, leaving the rest to the
run (a dataset that passes is not tokenized twice in full). Only a `filter` dataset that the run cannot use is read
to its end, which the run would have done before failing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hfjax.config.rl import DataConfig
from hfjax.data.prompts import tokenize_prompt_rows
from hfjax.data.records import RowRef
from hfjax.typed_config import ConfigError

CHUNK_ROWS = 1024  # rows tokenized at a time
ERROR_CHECK_ROWS = 8 * CHUNK_ROWS  # with truncation=error, rows checked before the run (which checks them all)


def check_prompt_lengths(
    rows: Sequence[tuple[RowRef, dict[str, Any]]],
    field: str,
    tokenizer: Any,
    data: DataConfig,
    needed: tuple[int, str],
) -> None:
    """Raises ConfigError when the run could not use the prompts `rows` of config `field`: with `truncation: error`
    a prompt longer than `data.max_prompt_length` (naming its file and row), with `filter` fewer prompts that fit
    than `needed` (how many, and what needs them: `(16, "one batch (data.train_batch_size)")`). No rows (no
    `data.val_files`, say) need nothing."""
    if not rows:
        return
    limit, truncation = data.max_prompt_length, data.truncation
    lengths: list[int] = []
    fitting = 0
    for start in range(0, len(rows), CHUNK_ROWS):
        chunk = rows[start : start + CHUNK_ROWS]
        chunk_lengths = [len(ids) for ids in tokenize_prompt_rows(tokenizer, chunk)[2]]
        lengths += chunk_lengths
        fitting += sum(n <= limit for n in chunk_lengths)
        if truncation == "error" and fitting < len(lengths):
            first = next(i for i, n in enumerate(chunk_lengths) if n > limit)
            raise _stops_on(
                chunk[first][0], chunk_lengths[first], len(lengths) - fitting, len(lengths), rows, field, data
            )
        if truncation in ("left", "right") or (truncation == "filter" and fitting >= needed[0]):
            return
        if truncation == "error" and len(lengths) >= ERROR_CHECK_ROWS:
            return
    if truncation == "filter" and fitting < needed[0]:
        raise _too_few_fit(sorted(lengths), fitting, needed, rows, field, data)


def _files(rows: Sequence[tuple[RowRef, dict[str, Any]]]) -> str:
    return ", ".join(dict.fromkeys(ref.file for ref, _ in rows))


def _stops_on(
    ref: RowRef,
    tokens: int,
    longer: int,
    checked: int,
    rows: Sequence[tuple[RowRef, dict[str, Any]]],
    field: str,
    data: DataConfig,
) -> ConfigError:
    """The run's `truncation: error` failure on the prompt at `ref`, found among the first `checked` rows."""
    among = f"of the {checked} prompts" if checked == len(rows) else f"of the first {checked} of {len(rows)} prompts"
    return ConfigError(
        f"data.max_prompt_length={data.max_prompt_length}: {ref}: the prompt has {tokens} tokens with the chat "
        f"template, and data.truncation=error stops the run on it ({longer} {among} of {field} are longer); raise "
        "data.max_prompt_length, or set data.truncation to filter, left or right"
    )


def _too_few_fit(
    lengths: list[int],
    fitting: int,
    needed: tuple[int, str],
    rows: Sequence[tuple[RowRef, dict[str, Any]]],
    field: str,
    data: DataConfig,
) -> ConfigError:
    """Fewer than `needed` of all the prompts (`lengths`, sorted) fit: data.truncation=filter would drop the rest."""
    count, purpose = needed
    return ConfigError(
        f"data.max_prompt_length={data.max_prompt_length}: {len(lengths) - fitting} of the {len(lengths)} prompts of "
        f"{field} ({_files(rows)}) are longer with the chat template and data.truncation=filter drops them, leaving "
        f"{fitting} where {purpose} needs {count}; set data.max_prompt_length to at least {lengths[count - 1]} "
        "(or data.truncation to left or right)"
    )
