"""Deterministic, resumable batching: `BatchLoader` shuffles a dataset's rows with a permutation drawn from
(seed, epoch), cuts it into batches, and saves its position as a small dict so a resumed run sees exactly the batches
an uninterrupted run would."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from hfjax.data.records import DataError
from hfjax.data.tokenize import Batch


class Collatable(Protocol):
    """What the loader needs from a dataset (the prompt, SFT and preference datasets all are)."""

    def __len__(self) -> int: ...

    def collate(self, indices: Any) -> Batch: ...


class BatchLoader:
    """Batches of `batch_size` rows of `dataset`, in a shuffled order that depends only on (seed, epoch).

    Iterating yields the rest of the current epoch, then moves to the next epoch, so
    `for epoch in range(loader.epoch, total_epochs): for batch in loader: ...` is the training loop, resumed or not.
    `state_dict()` taken after a batch is processed, loaded into a fresh loader, continues with the next batch.
    With `drop_last` the rows past the last full batch of an epoch are skipped (they land in other batches in other
    epochs); without it the last batch is smaller.
    """

    def __init__(
        self, dataset: Collatable, batch_size: int, *, seed: int = 0, shuffle: bool = True, drop_last: bool = True
    ):
        n = len(dataset)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"batch_size: expected a positive int, got {batch_size!r}")
        if drop_last and n < batch_size:
            raise DataError(f"the dataset has {n} rows, fewer than batch_size {batch_size} (with drop_last)")
        self.dataset, self.batch_size = dataset, batch_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch, self.batch = 0, 0

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The row order of an epoch: a permutation seeded by (seed, epoch), or 0..n-1 without shuffling."""
        n = len(self.dataset)
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    def batch_indices(self) -> Iterator[np.ndarray]:
        """Row indices of the remaining batches of the current epoch; the position advances before each yield."""
        order = self.order(self.epoch)
        while self.batch < len(self):
            rows = order[self.batch * self.batch_size : (self.batch + 1) * self.batch_size]
            self.batch += 1
            if self.batch == len(self):
                self.epoch, self.batch = self.epoch + 1, 0
                yield rows
                return
            yield rows

    def __iter__(self) -> Iterator[Batch]:
        for rows in self.batch_indices():
            yield self.dataset.collate(rows)

    def _identity(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "num_rows": len(self.dataset),
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def state_dict(self) -> dict[str, Any]:
        """The position (next batch to yield) and what the order depends on; plain ints and bools."""
        return {"epoch": self.epoch, "batch": self.batch, **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from a saved position. The seed, row count, batch size, shuffle and drop_last must match the
        loader that saved it (else the order would differ silently)."""
        for key, now in self._identity().items():
            if state.get(key) != now:
                raise DataError(f"data loader state: {key} was {state.get(key)!r} when saved but is {now!r} now")
        epoch, batch = state.get("epoch"), state.get("batch")
        if not isinstance(epoch, int) or epoch < 0 or not isinstance(batch, int) or not 0 <= batch < len(self):
            raise DataError(f"data loader state: expected epoch >= 0 and 0 <= batch < {len(self)}, got {state}")
        self.epoch, self.batch = epoch, batch
