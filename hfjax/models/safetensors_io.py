"""Streaming safetensors reading and writing, one tensor at a time, with bfloat16 through `ml_dtypes`.

Reading seeks to one tensor and reads it into a fresh numpy buffer, so host memory holds one tensor, not a file.
Writing takes tensors lazily from a callable, so a model is never gathered on the host whole.
Corrupt files raise `CheckpointError` naming the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from hfjax.parallel.transfer import aligned_empty

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, or does not match the model."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: file, dtype, shape and absolute byte offsets."""

    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(file: str) -> dict[str, TensorEntry]:
    """Parses and validates a safetensors header; returns tensor name -> entry."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise CheckpointError(f"{file}: corrupt safetensors file (shorter than its 8-byte header length)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(
                f"{file}: corrupt safetensors file (header length {header_len} exceeds the file size {size})"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{file}: corrupt safetensors file (header is not valid JSON: {e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors file (header is not a JSON object)")
    data_start = 8 + header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = (
                DTYPES[info["dtype"]],
                tuple(int(d) for d in info["shape"]),
                info["data_offsets"],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{file}: corrupt safetensors entry for {name!r}: {info!r}") from e
        if end - begin != math.prod(shape) * dtype.itemsize or begin < 0 or data_start + end > size:
            raise CheckpointError(
                f"{file}: corrupt safetensors entry for {name!r}: offsets [{begin}, {end}) do "
                f"not fit shape {shape} {info['dtype']} in a file of {size} bytes"
            )
        entries[name] = TensorEntry(file, dtype, shape, data_start + begin, data_start + end)
    return entries


def read_tensor(entry: TensorEntry) -> np.ndarray:
    """Reads one tensor into a new 64-byte-aligned host array (so that placing it on a CPU device is zero-copy)."""
    out = aligned_empty(entry.shape, entry.dtype)
    with open(entry.file, "rb") as f:
        f.seek(entry.start)
        got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
    if got != entry.end - entry.start:
        raise CheckpointError(f"{entry.file}: truncated tensor data ({got} of {entry.end - entry.start} bytes)")
    return out


def write_file(
    file: str,
    specs: Iterable[tuple[str, np.dtype, tuple[int, ...]]],
    fetch: Callable[[str], np.ndarray],
    metadata: dict[str, str] | None = None,
) -> None:
    """Writes tensors (name, dtype, shape) to one safetensors file, asking `fetch(name)` for each in turn."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    specs = list(specs)
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {
            "dtype": DTYPE_NAMES[np.dtype(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, dtype, shape in specs:
            array = np.ascontiguousarray(fetch(name))
            if array.dtype != np.dtype(dtype) or array.shape != tuple(shape):
                raise ValueError(f"tensor {name!r}: fetched {array.dtype}{array.shape}, planned {dtype}{shape}")
            f.write(memoryview(array.reshape(-1).view(np.uint8)))
