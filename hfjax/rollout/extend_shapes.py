"""The shapes that `JaxEngine.extend` runs at, so that appends of any length compile few programs.

An extend compiles one full-model program per (rows, width, live cache blocks, sampler kind). `ExtendShapes` rounds
each call up to buckets: rows to powers of two up to the slot count, the width (the longest row's tokens) to the
prefill buckets (16, 24, 32, 48, 64, 96, ...: `prefill_buckets`) up to the cache's capacity, and the live blocks to
powers of two up to the cache's block count. It keeps the shapes compiled so far; once there are `max_programs`, a
call runs at the cheapest compiled shape of its sampler kind that is at least as large in every dimension. Where none
is, it compiles the elementwise maximum of the call's shape and the compiled shapes of its kind, which then covers
them all; so each compile past the cap raises that maximum by a bucket in some dimension, and an engine whose calls use
one sampler kind compiles at most `max_programs + len(row_sizes) + len(widths) + len(live_sizes) - 2` extend programs
(`program_bound`; each further kind adds at most `program_bound - max_programs`).

Padding changes no token or log prob: padding rows name no slot (written nowhere), padding tokens sit after each row's
last real token (causal attention keeps them out of every real token's result; their cache writes land past the
slot's new length, where no later step reads before overwriting), and extra live blocks hold positions past every
real query, masked.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hfjax.rollout.interface import prefill_buckets
from hfjax.rollout.sampling import SamplerKind, SamplingError


class ExtendShape(NamedTuple):
    """The static shape of one compiled extend: rows, tokens per row, cache blocks read and the sampler kind."""

    rows: int
    width: int
    live: int
    kind: SamplerKind

    def covers(self, other: ExtendShape) -> bool:
        """Whether a call of shape `other` can run padded up to this one."""
        return (
            self.kind == other.kind
            and self.rows >= other.rows
            and self.width >= other.width
            and self.live >= other.live
        )

    @property
    def cost(self) -> tuple[int, int]:
        """What padding up to this shape costs, for choosing among those that cover a call: tokens, then blocks."""
        return self.rows * self.width, self.live


def powers_of_two_to(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `limit`, then `limit` itself."""
    return (*(1 << i for i in range(max(0, limit - 1).bit_length())), limit)


def _round_up(value: int, sizes: tuple[int, ...], name: str) -> int:
    """The smallest of `sizes` (ascending) that holds `value`."""
    if value > sizes[-1]:
        raise SamplingError(f"extend: {value} {name}, expected at most {sizes[-1]}")
    return next(size for size in sizes if size >= value)


class ExtendShapes:
    """The extend shapes an engine of `slots` slots and `blocks` cache blocks (`capacity` positions) has compiled,
    and the shape each call runs at (module docstring): at most `max_programs` before padding up to a compiled one."""

    def __init__(self, *, slots: int, capacity: int, blocks: int, max_programs: int):
        if not isinstance(max_programs, int) or max_programs < 1:
            raise SamplingError(f"engine.max_extend_programs: expected an integer >= 1, got {max_programs!r}")
        self.row_sizes = powers_of_two_to(slots)
        self.widths = prefill_buckets(capacity)
        self.live_sizes = powers_of_two_to(blocks)
        self.max_programs = max_programs
        self.compiled: list[ExtendShape] = []

    @property
    def program_bound(self) -> int:
        """The most extend programs compiled for calls of one sampler kind, whatever their shapes (module docstring)."""
        return self.max_programs + len(self.row_sizes) + len(self.widths) + len(self.live_sizes) - 2

    def bucket(self, rows: int, width: int, live: int, kind: SamplerKind) -> ExtendShape:
        """The bucketed shape of a call of `rows` rows, `width` tokens in its longest row and `live` blocks reached."""
        return ExtendShape(
            _round_up(rows, self.row_sizes, "rows (slots)"),
            _round_up(width, self.widths, "tokens in a row (the cache's capacity)"),
            _round_up(live, self.live_sizes, "cache blocks"),
            kind,
        )

    def choose(self, rows: int, width: int, live: int, kind: SamplerKind) -> ExtendShape:
        """The shape a call runs at: its bucket when compiled or under the cap; past the cap, the cheapest compiled
        shape that covers it, or else (compiled now) the elementwise maximum of it and its kind's compiled shapes."""
        wanted = self.bucket(rows, width, live, kind)
        if wanted in self.compiled:
            return wanted
        if len(self.compiled) >= self.max_programs:
            covering = [shape for shape in self.compiled if shape.covers(wanted)]
            if covering:
                return min(covering, key=lambda shape: shape.cost)
            same_kind = [shape for shape in self.compiled if shape.kind == kind]
            wanted = ExtendShape(
                *(max(getattr(s, field) for s in (wanted, *same_kind)) for field in ("rows", "width", "live")), kind
            )
        self.compiled.append(wanted)
        return wanted


def pad_extend(
    shape: ExtendShape,
    empty_slot: int,
    slots: np.ndarray,
    tokens: np.ndarray,
    lengths: np.ndarray,
    starts: np.ndarray,
    steps: np.ndarray,
) -> tuple[np.ndarray, ...]:
    """An extend's host arrays at `shape`: tokens cut or zero-padded to its width, then padding rows (slot
    `empty_slot`, out of range: written nowhere; one token at position 0; step 0) up to its rows."""
    tokens = tokens[:, : shape.width]
    tokens = np.pad(tokens, ((0, shape.rows - len(tokens)), (0, shape.width - tokens.shape[1])))

    def rows(values: np.ndarray, fill: int) -> np.ndarray:
        return np.concatenate([values, np.full(shape.rows - len(values), fill, np.int32)]).astype(np.int32)

    return rows(slots, empty_slot), tokens, rows(lengths, 1), rows(starts, 0), rows(steps, 0)
