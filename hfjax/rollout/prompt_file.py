"""Prompt files for `hfjax generate`: JSONL rows in, token ids through the tokenizer, JSONL results out.

A row is `{"prompt": "text"}` (sent through the chat template as one user message), `{"messages": [{role, content},
...]}` (chat template), `{"text": "..."}` (raw text, no template) or `{"input_ids": [ints]}`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hfjax.rollout.generator import SampleOutput

PROMPT_KEYS = ("prompt", "messages", "text", "input_ids")


class PromptFileError(ValueError):
    """A prompt file row that cannot be read."""


def _ids(row: dict[str, Any], tokenizer: Any, where: str) -> list[int]:
    if "input_ids" in row:
        ids = row["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise PromptFileError(f"{where}: 'input_ids' must be a list of integers")
        return ids
    if tokenizer is None:
        raise PromptFileError(f"{where}: text prompts need a tokenizer in the model directory")
    if "text" in row:
        return list(tokenizer(row["text"], add_special_tokens=False)["input_ids"])
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:  # "messages", or "prompt" as a list of messages (verl's schema, the rows hfjax's data commands write)
        messages = row["messages"] if prompt is None else prompt
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
        raise PromptFileError(f"{where}: 'messages' must be a list of {{role, content}} objects")
    if not getattr(tokenizer, "chat_template", None):
        raise PromptFileError(f"{where}: the tokenizer has no chat template; give 'text' or 'input_ids' instead")
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def read_prompts(path: str | Path, tokenizer: Any) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """Rows and their token ids; an unreadable row raises an error naming the file and its line number."""
    rows, ids = [], []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}: line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{where}: not valid JSON ({e})") from e
        if not isinstance(row, dict) or not any(k in row for k in PROMPT_KEYS):
            raise PromptFileError(f"{where}: expected an object with one of the keys {PROMPT_KEYS}")
        rows.append(row)
        ids.append(_ids(row, tokenizer, where))
    return rows, ids


def write_results(path: str | Path, rows: list[dict[str, Any]], outputs: list[SampleOutput], tokenizer: Any) -> None:
    """One JSON line per sample: the prompt row's fields, the response ids, text, logprobs and finish reason; for a
    multi-turn trajectory also its `response_mask` (0 on the environment's tokens), `reward`, `turns`, `tool_calls`
    and `tool_errors`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for out in outputs:
            record = {
                **rows[out.request],
                "index": out.request,
                "sample": out.sample,
                "response_ids": out.tokens.tolist(),
                "logprobs": [round(float(x), 6) for x in out.logprobs],
                "finish_reason": out.finish_reason,
            }
            if tokenizer is not None:
                record["response"] = tokenizer.decode(out.tokens.tolist(), skip_special_tokens=True)
            if out.error:
                record["error"] = out.error
            if hasattr(out, "response_mask"):  # a multi-turn trajectory (hfjax.envs)
                record["response_mask"] = out.response_mask.tolist()
                record["reward"] = float(out.reward)
                record.update({key: int(getattr(out, key)) for key in ("turns", "tool_calls", "tool_errors")})
            f.write(json.dumps(record) + "\n")
