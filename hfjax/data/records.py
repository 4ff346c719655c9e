"""Dataset files and rows: reads and writes parquet or JSONL rows, and checks a row's fields so that a malformed row
fails with its file, 1-based row number and field name. Owns `DataError`, `RowRef`, `read_rows`, `write_rows` and
the field parsers."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUFFIXES = (".parquet", ".jsonl")


class DataError(ValueError):
    """A dataset file or row that does not match the expected schema."""


@dataclass(frozen=True)
class RowRef:
    """Where a row came from: its file and 1-based row number (the line number for JSONL)."""

    file: str
    row: int

    def __str__(self) -> str:
        return f"{self.file}: row {self.row}"

    def error(self, field: str, expected: str, got: Any) -> DataError:
        """An error naming this row, the field, what was expected and what was found."""
        return DataError(f"{self}: field '{field}': expected {expected}, got {_short(got)}")


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def as_paths(files: str | Path | Sequence[str | Path]) -> list[Path]:
    """One path or a sequence of paths as a list of `Path`s."""
    return [Path(files)] if isinstance(files, str | Path) else [Path(f) for f in files]


def read_rows(files: str | Path | Sequence[str | Path]) -> list[tuple[RowRef, dict[str, Any]]]:
    """All rows of the given parquet or JSONL files, in order, each with its `RowRef`. JSONL blank lines are skipped
    (row numbers stay line numbers)."""
    out: list[tuple[RowRef, dict[str, Any]]] = []
    for path in as_paths(files):
        if path.suffix not in SUFFIXES:
            raise DataError(f"{path}: unsupported file type {path.suffix!r}; expected one of {', '.join(SUFFIXES)}")
        if not path.is_file():
            raise DataError(f"{path}: no such file")
        out.extend(_read_parquet(path) if path.suffix == ".parquet" else _read_jsonl(path))
    return out


def _read_parquet(path: Path) -> list[tuple[RowRef, dict[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DataError(f"{path}: not a readable parquet file ({exc})") from exc
    try:
        rows = table.to_pylist()
    except UnicodeDecodeError:
        raise _parquet_utf8_error(path, table) from None
    return [(RowRef(str(path), i + 1), row) for i, row in enumerate(rows)]


def _parquet_utf8_error(path: Path, table: Any) -> DataError:
    """The error naming the first row of `table` (a pyarrow Table read from `path`) with a string that is not valid
    UTF-8, and its column (found by halving the rows: about two conversions of the table)."""

    def decode_error(start: int, stop: int, columns: Sequence[str] | None = None) -> UnicodeDecodeError | None:
        part = table.slice(start, stop - start)
        try:
            (part if columns is None else part.select(columns)).to_pylist()
        except UnicodeDecodeError as exc:
            return exc
        return None

    start, stop = 0, table.num_rows  # the first bad row is in [start, stop)
    while stop - start > 1:
        middle = (start + stop) // 2
        start, stop = (start, middle) if decode_error(start, middle) else (middle, stop)
    found = [(name, exc) for name in table.column_names if (exc := decode_error(start, start + 1, [name]))]
    name, exc = found[0]
    return DataError(f"{RowRef(str(path), start + 1)}: field '{name}' is {_not_utf8(exc)}")


def _not_utf8(exc: UnicodeDecodeError) -> str:
    """What is wrong with the bytes `exc` failed on, e.g. "not valid UTF-8 (0xff at byte 3: invalid start byte);
    expected UTF-8 text"."""
    byte = exc.object[exc.start]
    return f"not valid UTF-8 (0x{byte:02x} at byte {exc.start + 1}: {exc.reason}); expected UTF-8 text"


def _read_jsonl(path: Path) -> list[tuple[RowRef, dict[str, Any]]]:
    out = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            ref = RowRef(str(path), line_no)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{ref}: {_not_utf8(exc)}") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{ref}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
            if not isinstance(row, dict):
                raise DataError(f"{ref}: expected a JSON object, got {type(row).__name__}")
            out.append((ref, row))
    return out


def write_rows(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Writes rows to parquet or JSONL (by the path's suffix), creating parent directories; returns the path."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; expected one of {', '.join(SUFFIXES)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = list(rows)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return path


def require(row: dict[str, Any], ref: RowRef, field: str) -> Any:
    """The value of a required field (missing or null is an error)."""
    if row.get(field) is None:
        raise DataError(f"{ref}: missing required field '{field}' (fields present: {sorted(row)})")
    return row[field]


def parse_str(value: Any, ref: RowRef, field: str) -> str:
    """A string field."""
    if not isinstance(value, str):
        raise ref.error(field, "a string", value)
    return value


def parse_mapping(value: Any, ref: RowRef, field: str) -> dict[str, Any]:
    """An optional mapping field (null is an empty mapping)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ref.error(field, "a mapping", value)
    return value


def parse_messages(value: Any, ref: RowRef, field: str) -> list[dict[str, str]]:
    """Chat messages: a non-empty list of {role, content} strings, or a plain string (one user message). Other keys
    of a message are dropped."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ref.error(field, "a non-empty list of {role, content} messages or a string", value)
    messages = []
    for i, message in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise ref.error(where, "a {role, content} message", message)
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ref.error(f"{where}.role", "a non-empty string", role)
        if not isinstance(content, str):
            raise ref.error(f"{where}.content", "a string", content)
        messages.append({"role": role, "content": content})
    return messages


def parse_response(value: Any, ref: RowRef, field: str) -> str:
    """A response: a string, or a list holding exactly one assistant message (its content is the response)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1:
        message = parse_messages(value, ref, field)[0]
        if message["role"] == "assistant":
            return message["content"]
    raise ref.error(field, "a string or a list of one {role: assistant, content} message", value)
