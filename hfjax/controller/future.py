"""`DataProtoFuture`: the output of a non-blocking worker-group call, not fetched to the controller.

It holds one part per executing rank (Ray `ObjectRef`s, or plain values for `LocalWorkerGroup`), the dispatch mode's
collect function and the padding its dispatch added. Another group's method can take it as an argument: row chunks
go straight to the ranks when the world sizes match (Ray resolves the refs on the worker side); otherwise a zero-CPU
Ray task merges and re-chunks them inside the cluster. The controller fetches data only in `get()`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from hfjax.protocol import DataProto, pad_to_divisor, placed_chunks, unpad_outputs


def _merge(collect: Callable[[list[Any]], Any], padding: Any, *parts: Any) -> Any:
    out = collect(list(parts))
    return unpad_outputs(out, padding) if padding else out


def _rechunk(collect: Callable[[list[Any]], Any], padding: Any, chunks: int, *parts: Any) -> tuple[Any, ...]:
    data = _merge(collect, padding, *parts)
    if not isinstance(data, DataProto):
        raise TypeError(f"cannot split a {type(data).__name__} into {chunks} row chunks: expected a DataProto")
    padded, new_pad = pad_to_divisor(data, chunks)
    return (*placed_chunks(padded, chunks, new_pad), (new_pad, len(padded)))


@functools.cache
def _ray_task(fn: Callable[..., Any]) -> Any:
    import ray

    return ray.remote(num_cpus=0)(fn)


@dataclasses.dataclass
class DataProtoFuture:
    """Pending outputs of one group call: `get()` fetches, collects and unpads them.

    `parts`: one per executing rank (ObjectRefs when `on_ray`, else values). `collect`: merges the fetched parts.
    `pad_size`: the padding to drop after collecting (see `unpad_outputs`: `(pad_rows, padded_rows)` of the input
    or a row count; an ObjectRef to one when it was computed in the cluster). `row_chunks`: the parts are
    consecutive row chunks of one DataProto (the DP dispatch modes).
    `fetch`: turns parts into values, raising the failing rank's error.
    """

    parts: list[Any]
    collect: Callable[[list[Any]], Any]
    pad_size: Any = 0
    row_chunks: bool = False
    fetch: Callable[[list[Any]], list[Any]] = list
    on_ray: bool = False

    def get(self) -> Any:
        """Fetches the parts to the caller and returns the collected, unpadded result."""
        out = self.collect(self.fetch(self.parts))
        pad_size = self.pad_size
        if self.on_ray and not isinstance(pad_size, (int, tuple)):  # a ref, computed in the cluster
            import ray

            pad_size = ray.get(pad_size)
        return unpad_outputs(out, pad_size) if pad_size else out

    def chunks(self, chunks: int) -> tuple[list[Any], Any]:
        """`chunks` row chunks of the result, padded to equal size, and the padding; as refs when on Ray. The
        parts go on as they are only to a single rank: several ranks need chunks that know their place
        (`placed_chunks`)."""
        if self.row_chunks and len(self.parts) == chunks == 1:
            return list(self.parts), self.pad_size
        if not self.on_ray:
            padded, pad_size = pad_to_divisor(self.get(), chunks)
            return placed_chunks(padded, chunks, pad_size), (pad_size, len(padded))
        refs = (
            _ray_task(_rechunk).options(num_returns=chunks + 1).remote(self.collect, self.pad_size, chunks, *self.parts)
        )
        return refs[:chunks], refs[chunks]

    def merged(self) -> Any:
        """The whole result: the value itself, or on Ray an ObjectRef to it computed inside the cluster."""
        if not self.on_ray:
            return self.get()
        return _ray_task(_merge).remote(self.collect, self.pad_size, *self.parts)
