"""`DataProto`: the batch that flows on the dataflow edges between the controller and worker groups.

A `DataProto` holds `batch` (numeric numpy arrays sharing the first dimension), `non_tensor_batch` (numpy arrays,
usually of dtype object, for strings and dicts, with the same first dimension) and `meta_info` (a plain dict).
Row operations return views where numpy can (`select`, `chunk`, `split`, slicing), so dispatching a batch makes no
copy; it pickles as a dataclass of numpy arrays, which Ray sends as zero-copy pickle-5 buffers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

METRICS_KEY = "metrics"
ROW_OFFSET = "dp_row_offset"  # meta_info of a DP chunk: the index of its first row in the whole batch
PADDING_ROWS = "dp_padding_rows"  # meta_info of a DP chunk: how many of its last rows are padding
ROW_IN_LOSS = "row_in_loss"  # batch key of an update: False on rows kept out of its loss and its row count


def _values_equal(a: Any, b: Any) -> bool:
    """Structural equality that also compares numpy arrays (used for union and meta_info merges)."""
    if a is b:
        return True
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _object_array(values: Any) -> np.ndarray:
    """A 1-D object array with one element per row (never broadcast into more dimensions), or `values` if it
    already is a numpy array."""
    if isinstance(values, np.ndarray):
        return values
    values = list(values)
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


@dataclasses.dataclass(frozen=True)
class DataProtoItem:
    """One row of a `DataProto` (what `data[i]` gives for an integer `i`)."""

    batch: dict[str, Any]
    non_tensor_batch: dict[str, Any]
    meta_info: dict[str, Any]


@dataclasses.dataclass(eq=False, repr=False)
class DataProto:
    """A batch of rows: `batch` (numeric arrays), `non_tensor_batch` (object arrays), `meta_info` (a dict).

    Every array in `batch` and `non_tensor_batch` has the same first dimension, the batch size (`len(data)`).
    Methods return new `DataProto`s that share arrays with this one where possible; only `reorder` changes `self`.
    Arrays received from Ray workers are read-only views of the object store: copy before writing in place.
    """

    batch: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    non_tensor_batch: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    meta_info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {}
        for field, arrays in (("batch", self.batch), ("non_tensor_batch", self.non_tensor_batch)):
            for key, value in arrays.items():
                if not isinstance(value, np.ndarray) or value.ndim == 0:
                    raise TypeError(
                        f"DataProto.{field}[{key!r}]: expected a numpy array with a batch dimension, "
                        f"got {type(value).__name__}{getattr(value, 'shape', '')}"
                    )
                if field == "batch" and value.dtype == object:
                    raise TypeError(
                        f"DataProto.batch[{key!r}] has dtype object: put strings and other Python "
                        "objects in non_tensor_batch"
                    )
                sizes[f"{field}[{key!r}]"] = value.shape[0]
        if len(set(sizes.values())) > 1:
            raise ValueError(f"DataProto arrays must share the first dimension, got {sizes}")
        if self.non_tensor_batch.keys() & self.batch.keys():
            raise ValueError(
                f"keys {sorted(self.non_tensor_batch.keys() & self.batch.keys())} are in both batch and "
                "non_tensor_batch"
            )

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, Any] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> DataProto:
        """Builds a DataProto from array-likes (`np.asarray`, no copy for numpy input) and sequences of Python
        objects (stored as 1-D object arrays, one element per row)."""
        return cls(
            batch={k: np.asarray(v) for k, v in (tensors or {}).items()},
            non_tensor_batch={k: _object_array(v) for k, v in (non_tensors or {}).items()},
            meta_info=dict(meta_info or {}),
        )

    def __len__(self) -> int:
        for arrays in (self.batch, self.non_tensor_batch):
            for value in arrays.values():
                return value.shape[0]
        return 0

    def nbytes(self) -> int:
        """Bytes of the numeric arrays in `batch` (what a dispatch moves, strings aside)."""
        return sum(value.nbytes for value in self.batch.values())

    def __repr__(self) -> str:
        def shapes(arrays: dict[str, np.ndarray]) -> str:
            return "{" + ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in arrays.items()) + "}"

        return (
            f"DataProto(len={len(self)}, batch={shapes(self.batch)}, "
            f"non_tensor_batch={shapes(self.non_tensor_batch)}, meta_info keys={sorted(self.meta_info)})"
        )

    def _rows(self, index: Any) -> DataProto:
        return DataProto(
            {k: v[index] for k, v in self.batch.items()},
            {k: v[index] for k, v in self.non_tensor_batch.items()},
            dict(self.meta_info),
        )

    def __getitem__(self, index: int | slice | Sequence[int] | np.ndarray) -> DataProto | DataProtoItem:
        """`data[i]` gives a `DataProtoItem`; a slice, integer array, list of ints or boolean mask gives a
        DataProto (slices are views, index arrays copy the selected rows)."""
        if isinstance(index, (int, np.integer)):
            if not -len(self) <= index < len(self):
                raise IndexError(f"row {index} out of range for a DataProto of {len(self)} rows")
            return DataProtoItem(
                {k: v[index] for k, v in self.batch.items()},
                {k: v[index] for k, v in self.non_tensor_batch.items()},
                dict(self.meta_info),
            )
        if isinstance(index, slice):
            return self._rows(index)
        index = np.asarray(index)
        if index.dtype != bool and not np.issubdtype(index.dtype, np.integer):
            raise TypeError(
                f"DataProto index: expected an int, slice, integer array or boolean mask, got {index.dtype}"
            )
        return self._rows(index)

    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
    ) -> DataProto:
        """A DataProto with only the named keys (None keeps all of that part); shares the arrays."""

        def pick(part: dict[str, Any], keys: Iterable[str] | None, name: str) -> dict[str, Any]:
            if keys is None:
                return dict(part)
            missing = [k for k in keys if k not in part]
            if missing:
                raise KeyError(f"{name} has no keys {missing}; available: {sorted(part)}")
            return {k: part[k] for k in keys}

        return DataProto(
            pick(self.batch, batch_keys, "batch"),
            pick(self.non_tensor_batch, non_tensor_batch_keys, "non_tensor_batch"),
            pick(self.meta_info, meta_info_keys, "meta_info"),
        )

    def pop(
        self,
        batch_keys: Iterable[str] = (),
        non_tensor_batch_keys: Iterable[str] = (),
        meta_info_keys: Iterable[str] = (),
    ) -> DataProto:
        """Removes the named keys from this DataProto and returns them as a new one."""
        keys = {"batch": list(batch_keys), "non_tensor_batch": list(non_tensor_batch_keys)}
        keys["meta_info"] = list(meta_info_keys)
        popped = self.select(keys["batch"], keys["non_tensor_batch"], keys["meta_info"])
        for name, names in keys.items():
            for k in names:
                del getattr(self, name)[k]
        return popped

    def union(self, other: DataProto) -> DataProto:
        """All keys of both; a key present in both must hold equal values, else ValueError names it."""
        both_have_rows = (self.batch or self.non_tensor_batch) and (other.batch or other.non_tensor_batch)
        if both_have_rows and len(other) != len(self):
            raise ValueError(f"union: batch sizes differ ({len(self)} vs {len(other)})")
        merged = []
        for name in ("batch", "non_tensor_batch", "meta_info"):
            mine, theirs = getattr(self, name), getattr(other, name)
            for k in mine.keys() & theirs.keys():
                if not _values_equal(mine[k], theirs[k]):
                    raise ValueError(f"union: {name}[{k!r}] differs between the two DataProtos")
            merged.append({**mine, **theirs})
        return DataProto(*merged)

    def chunk(self, chunks: int) -> list[DataProto]:
        """Splits into `chunks` equal parts (views); the batch size must divide evenly."""
        if not isinstance(chunks, (int, np.integer)) or chunks < 1:
            raise ValueError(f"chunk: chunks must be a positive int, got {chunks!r}")
        if len(self) % chunks:
            raise ValueError(
                f"chunk: {len(self)} rows cannot be split into {chunks} equal chunks; pad first with "
                "pad_to_divisor(data, chunks)"
            )
        size = len(self) // chunks
        return [self[i * size : (i + 1) * size] for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Splits into parts of `split_size` rows (views); the last part may be shorter."""
        if not isinstance(split_size, (int, np.integer)) or split_size < 1:
            raise ValueError(f"split: split_size must be a positive int, got {split_size!r}")
        return [self[start : start + split_size] for start in range(0, len(self), split_size)]

    @staticmethod
    def concat(parts: Sequence[DataProto]) -> DataProto:
        """Concatenates rows; `meta_info["metrics"]` dicts merge into one dict of lists (lists are extended,
        scalars appended); other meta_info keys must agree across parts. One part is returned as is."""
        if not parts:
            raise ValueError("concat: expected at least one DataProto")
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        for i, p in enumerate(parts[1:], start=1):
            if p.batch.keys() != first.batch.keys() or p.non_tensor_batch.keys() != first.non_tensor_batch.keys():
                raise ValueError(
                    f"concat: part {i} has keys {sorted(p.batch) + sorted(p.non_tensor_batch)}, part 0 "
                    f"has {sorted(first.batch) + sorted(first.non_tensor_batch)}"
                )
        batch = {k: np.concatenate([p.batch[k] for p in parts]) for k in first.batch}
        non_tensor = {k: np.concatenate([p.non_tensor_batch[k] for p in parts]) for k in first.non_tensor_batch}
        return DataProto(batch, non_tensor, _merge_meta_info([p.meta_info for p in parts]))

    def repeat(self, repeat_times: int, interleave: bool = True) -> DataProto:
        """Each row `repeat_times` times: interleaved `[a, a, b, b]` or tiled `[a, b, a, b]`."""
        if not isinstance(repeat_times, (int, np.integer)) or repeat_times < 1:
            raise ValueError(f"repeat: repeat_times must be a positive int, got {repeat_times!r}")
        index = np.arange(len(self))
        index = np.repeat(index, repeat_times) if interleave else np.tile(index, repeat_times)
        return self._rows(index)

    def reorder(self, indices: Sequence[int] | np.ndarray) -> None:
        """Permutes the rows of this DataProto in place: row i becomes old row `indices[i]`."""
        indices = np.asarray(indices)
        if indices.shape != (len(self),) or not np.array_equal(np.sort(indices), np.arange(len(self))):
            raise ValueError(f"reorder: expected a permutation of range({len(self)}), got shape {indices.shape}")
        reordered = self._rows(indices)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch


def _merge_meta_info(infos: Sequence[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    metrics: dict[str, list[Any]] = {}
    for i, info in enumerate(infos):
        for k, v in info.items():
            if k in (ROW_OFFSET, PADDING_ROWS):  # where a chunk sat in its batch: meaningless once joined
                continue
            if k == METRICS_KEY:
                for name, value in v.items():
                    metrics.setdefault(name, []).extend(value if isinstance(value, list) else [value])
            elif k not in merged:
                merged[k] = v
            elif not _values_equal(merged[k], v):
                raise ValueError(f"concat: meta_info[{k!r}] of part {i} differs from an earlier part")
    if metrics:
        merged[METRICS_KEY] = metrics
    return merged


def pad_to_divisor(data: DataProto, divisor: int) -> tuple[DataProto, int]:
    """Pads `data` with copies of its first rows (cyclically) to a multiple of `divisor`; returns the padded
    DataProto (`data` itself when no padding is needed) and the number of rows added."""
    if not isinstance(divisor, (int, np.integer)) or divisor < 1:
        raise ValueError(f"pad_to_divisor: divisor must be a positive int, got {divisor!r}")
    if len(data) == 0:
        raise ValueError(f"pad_to_divisor: cannot pad an empty DataProto to a multiple of {divisor}")
    pad_size = -len(data) % divisor
    if pad_size == 0:
        return data, 0
    index = np.concatenate([np.arange(len(data)), np.arange(pad_size) % len(data)])
    return data._rows(index), pad_size


def placed_chunks(padded: DataProto, chunks: int, pad_size: int) -> list[DataProto]:
    """`padded.chunk(chunks)`, each chunk's meta_info telling its `ROW_OFFSET` in the batch and how many of its last
    rows are padding (`PADDING_ROWS`; the batch's last `pad_size` rows are)."""
    size = len(padded) // chunks
    real = len(padded) - pad_size
    out = []
    for r, part in enumerate(padded.chunk(chunks)):
        padding = min(size, max(0, (r + 1) * size - real))
        meta = {**part.meta_info, ROW_OFFSET: r * size, PADDING_ROWS: padding}
        out.append(DataProto(part.batch, part.non_tensor_batch, meta))
    return out


def unpad_outputs(data: DataProto, padding: int | tuple[int, int]) -> DataProto:
    """Drops the rows that padding produced: `padding` is `(pad_rows, padded_rows)` of the padded input, whose last
    `pad_rows` rows were padding (each input row gave `len(data) / padded_rows` output rows, e.g. n samples of a
    prompt), or a plain count of trailing output rows."""
    if isinstance(padding, tuple):
        pad_rows, padded_rows = padding
        if len(data) % padded_rows:
            raise ValueError(
                f"unpad_outputs: {len(data)} output rows are not a whole number per input row ({padded_rows} rows)"
            )
        padding = pad_rows * (len(data) // padded_rows)
    return unpad(data, padding)


def unpad(data: DataProto, pad_size: int) -> DataProto:
    """Drops the last `pad_size` rows (a view); the inverse of `pad_to_divisor`."""
    if not 0 <= pad_size <= len(data):
        raise ValueError(f"unpad: pad_size must be in [0, {len(data)}], got {pad_size}")
    return data[: len(data) - pad_size] if pad_size else data
