"""Dispatch modes: how a group call's arguments are split over the ranks and how their outputs are collected.

`Dispatch` names the built-in modes; `register_dispatch_mode` adds user modes. A dispatch function maps
`(world_size, args, kwargs)` to per-rank arguments (`Dispatched`); a collect function maps the list of per-rank
outputs to the call's result. Arguments may be `DataProtoFuture`s: they are split or merged as refs, never
fetched here.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, NamedTuple

from hfjax.controller.future import DataProtoFuture
from hfjax.protocol import DataProto, pad_to_divisor, placed_chunks


class Dispatch(enum.StrEnum):
    """Built-in dispatch modes (the names verl users know)."""

    ONE_TO_ALL = "one_to_all"  # every rank gets the same arguments; result: list of outputs
    ALL_TO_ALL = "all_to_all"  # each argument is a list with one value per rank; result: list of outputs
    DP_COMPUTE_PROTO = "dp_compute_proto"  # DataProto args padded, chunked by rank; outputs concatenated, unpadded
    # (each chunk's meta_info names its first row's index in the batch and its padding rows: ROW_OFFSET, PADDING_ROWS)
    DP_COMPUTE_PROTO_WITH_FUNC = "dp_compute_proto_with_func"  # first arg is a function sent to all ranks
    RANK_ZERO = "rank_zero"  # only rank 0 runs; result: its output


class Dispatched(NamedTuple):
    """Per-rank positional and keyword arguments, and the rows of padding the collected result must drop."""

    args: list[tuple[Any, ...]]
    kwargs: list[dict[str, Any]]
    pad_size: Any = 0


@dataclasses.dataclass(frozen=True)
class DispatchMode:
    """A registered dispatch mode; `row_chunks` marks modes whose outputs are row chunks of one DataProto."""

    name: str
    dispatch_fn: Callable[[int, tuple[Any, ...], dict[str, Any]], Any]
    collect_fn: Callable[[list[Any]], Any]
    row_chunks: bool = False

    def dispatch(self, world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Dispatched:
        """Runs the dispatch function and checks it returned one argument set per rank."""
        out = Dispatched(*self.dispatch_fn(world_size, args, kwargs))
        if len(out.args) != world_size or len(out.kwargs) != world_size:
            raise ValueError(
                f"dispatch mode {self.name!r} returned {len(out.args)} argument tuples and {len(out.kwargs)} keyword "
                f"dicts for {world_size} ranks"
            )
        return out


_MODES: dict[str, DispatchMode] = {}


def register_dispatch_mode(
    name: str,
    dispatch_fn: Callable[[int, tuple[Any, ...], dict[str, Any]], Any],
    collect_fn: Callable[[list[Any]], Any],
) -> str:
    """Registers a user dispatch mode usable as `@register(dispatch_mode=name)`; returns `name`.

    `dispatch_fn(world_size, args, kwargs)` returns `(per_rank_args, per_rank_kwargs)` (lists of length world_size)
    or a `Dispatched`; `collect_fn(outputs)` merges the list of per-rank outputs.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_dispatch_mode: name must be a non-empty str, got {name!r}")
    if name in _MODES:
        raise ValueError(f"dispatch mode {name!r} is already registered")
    _MODES[name] = DispatchMode(name, dispatch_fn, collect_fn)
    return name


def dispatch_mode(mode: str | Dispatch) -> DispatchMode:
    """The registered mode named `mode`."""
    name = mode.value if isinstance(mode, Dispatch) else mode
    if name not in _MODES:
        raise ValueError(f"unknown dispatch mode {mode!r}; registered: {sorted(_MODES)}")
    return _MODES[name]


def _whole(value: Any) -> Any:
    return value.merged() if isinstance(value, DataProtoFuture) else value


def _one_to_all(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Dispatched:
    args = tuple(_whole(a) for a in args)
    kwargs = {k: _whole(v) for k, v in kwargs.items()}
    return Dispatched([args] * world_size, [kwargs] * world_size)


def _per_rank(world_size: int, where: str, value: Any) -> list[Any]:
    if isinstance(value, DataProtoFuture):
        if len(value.parts) != world_size:
            raise ValueError(f"ALL_TO_ALL {where}: a future of {len(value.parts)} parts for {world_size} ranks")
        return list(value.parts)
    if not isinstance(value, (list, tuple)) or len(value) != world_size:
        raise TypeError(
            f"ALL_TO_ALL {where}: expected a list of {world_size} per-rank values, got {type(value).__name__}"
            + (f" of length {len(value)}" if isinstance(value, (list, tuple)) else "")
        )
    return list(value)


def _all_to_all(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Dispatched:
    per_arg = [_per_rank(world_size, f"argument {i}", a) for i, a in enumerate(args)]
    per_kwarg = {k: _per_rank(world_size, f"argument {k!r}", v) for k, v in kwargs.items()}
    return Dispatched(
        [tuple(a[r] for a in per_arg) for r in range(world_size)],
        [{k: v[r] for k, v in per_kwarg.items()} for r in range(world_size)],
    )


def _split_rows(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Dispatched:
    """Pads every DataProto argument to a multiple of world_size and gives rank r its r-th chunk (`placed_chunks`);
    the padding to drop from the outputs is `(pad_rows, padded_rows)` (see `unpad_outputs`)."""
    named = {**{f"argument {i}": a for i, a in enumerate(args)}, **{f"argument {k!r}": v for k, v in kwargs.items()}}
    lengths = {}
    for where, value in named.items():
        if isinstance(value, DataProto):
            if len(value) == 0:
                raise ValueError(f"DP dispatch {where}: cannot split an empty DataProto over {world_size} processes")
            lengths[where] = len(value)
        elif not isinstance(value, DataProtoFuture):
            raise TypeError(
                f"DP dispatch {where}: expected a DataProto or DataProtoFuture, got {type(value).__name__} "
                "(pass scalars in meta_info)"
            )
    if len(set(lengths.values())) > 1:
        raise ValueError(f"DP dispatch: DataProto arguments have different batch sizes {lengths}")
    chunked, known_pads, future_pads = {}, [], []
    for where, value in named.items():
        if isinstance(value, DataProto):
            padded, pad_size = pad_to_divisor(value, world_size)
            chunked[where] = placed_chunks(padded, world_size, pad_size)
            known_pads.append((pad_size, len(padded)) if pad_size else 0)
        else:
            chunked[where], pad_size = value.chunks(world_size)
            future_pads.append(pad_size)
    ranks_args = [tuple(chunked[f"argument {i}"][r] for i in range(len(args))) for r in range(world_size)]
    ranks_kwargs = [{k: chunked[f"argument {k!r}"][r] for k in kwargs} for r in range(world_size)]
    return Dispatched(ranks_args, ranks_kwargs, (known_pads or future_pads or [0])[0])


def _split_rows_with_func(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Dispatched:
    if not args or not callable(args[0]):
        raise TypeError("DP_COMPUTE_PROTO_WITH_FUNC: the first argument must be a function sent to every rank")
    rest = _split_rows(world_size, args[1:], kwargs)
    return Dispatched([(args[0], *a) for a in rest.args], rest.kwargs, rest.pad_size)


def _concat_outputs(outputs: list[Any]) -> DataProto:
    for rank, out in enumerate(outputs):
        if not isinstance(out, DataProto):
            raise TypeError(f"DP dispatch: rank {rank} returned {type(out).__name__}; expected a DataProto")
    return DataProto.concat(outputs)


def _rank_zero_output(outputs: list[Any]) -> Any:
    return outputs[0]


_MODES.update(
    {
        Dispatch.ONE_TO_ALL.value: DispatchMode(Dispatch.ONE_TO_ALL.value, _one_to_all, list),
        Dispatch.ALL_TO_ALL.value: DispatchMode(Dispatch.ALL_TO_ALL.value, _all_to_all, list),
        Dispatch.DP_COMPUTE_PROTO.value: DispatchMode(
            Dispatch.DP_COMPUTE_PROTO.value, _split_rows, _concat_outputs, row_chunks=True
        ),
        Dispatch.DP_COMPUTE_PROTO_WITH_FUNC.value: DispatchMode(
            Dispatch.DP_COMPUTE_PROTO_WITH_FUNC.value, _split_rows_with_func, _concat_outputs, row_chunks=True
        ),
        Dispatch.RANK_ZERO.value: DispatchMode(Dispatch.RANK_ZERO.value, _one_to_all, _rank_zero_output),
    }
)
