"""How a rollout process switches its weights to a new version: staged first, then switched, or dropped.

A sync has two phases across the processes of a rollout group. `WeightSwap.stage` checks the trainer's blocks
(`hfjax.workers.weight_sync.check_blocks`, metadata only) and stages them while the old weights keep serving; then,
once every process's stage outcome is known, `WeightSwap.settle` switches (every process staged) or drops the staged
copy (any one failed: the error says the rollout keeps serving the old version). Where the processes learn each
other's outcome is the caller's business (`RolloutWorker.commit_weights` on the blocking path, the `WeightMailbox`
on the partial-rollout path). Two ways to stage (`async.weight_swap`):

- `atomic` (default): the new weights are placed on the devices beside the old ones; the switch only rebinds and
  frees the old. A failure anywhere, placement included, leaves the old version serving. Device peak: two copies of
  the weights.
- `in_place`: the checked blocks stay on the host (the received blocks themselves, no copy); the switch replaces
  the parameters one at a time, freeing each old one before placing the new. Device peak: the weights plus one
  parameter. Checking happens before anything is freed, so bad blocks still leave the old version serving; but a
  placement that fails part way (the device out of memory, say) leaves the process with some new parameters and
  some freed ones: `incomplete` then says so, the worker refuses to generate, and the next sync that succeeds
  restores a whole version.

Host memory on either path: the received blocks (the rollout copy's bytes, in the object store) plus at most one
device shard of one parameter at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from hfjax.workers.weight_sync import Block, WeightShards, WeightSyncError, check_blocks, param_paths, place_param

SWAP_MODES = ("atomic", "in_place")


@dataclasses.dataclass
class StagedWeights:
    """A checked version: its blocks by parameter path (`in_place`) or its arrays already on the devices
    (`atomic`, in the parameters' tree order)."""

    version: int
    blocks: dict[str, list[Block]] | None = None
    placed: list[jax.Array] | None = None


class WeightSwap:
    """One process's side of a weight sync in `mode` (see the module docstring)."""

    def __init__(self, mode: str = "atomic") -> None:
        if mode not in SWAP_MODES:
            raise ValueError(f"weight_swap: expected one of {', '.join(SWAP_MODES)}, got {mode!r}")
        self.mode = mode
        self.staged: StagedWeights | None = None
        self.incomplete: str | None = None  # why the devices hold no whole version (an `in_place` switch failed)

    def stage(self, version: int, parts: list[WeightShards], params: Any) -> None:
        """Checks `parts` against `params` (paths, shapes, dtypes, exact cover) and stages them as `version`,
        replacing any copy staged before; `params` keep serving. Raises `WeightSyncError` (nothing staged)."""
        self.drop()
        leaves = param_paths(params)
        expected = {path: (tuple(leaf.shape), np.dtype(leaf.dtype).name) for path, leaf in leaves}
        blocks = check_blocks(parts, expected)
        if self.mode == "in_place":
            self.staged = StagedWeights(version, blocks=blocks)
            return
        placed: list[jax.Array] = []
        try:
            for path, leaf in leaves:
                placed.append(place_param(blocks[path], leaf))
        except Exception as exc:
            for array in placed:
                array.delete()
            raise WeightSyncError(f"placing parameter {path} failed: {exc}") from exc
        self.staged = StagedWeights(version, placed=placed)

    def drop(self) -> None:
        """Frees the staged copy, if any."""
        if self.staged is not None and self.staged.placed is not None:
            for array in self.staged.placed:
                array.delete()
        self.staged = None

    def settle(self, version: int, serving: int, params: Any, errors: list[str]) -> Any:
        """Phase two, given the stage errors of every process of the group (empty: all staged `version`): the new
        parameters tree, the old one freed; else drops the staged copy and raises `WeightSyncError` saying the
        rollout keeps serving `serving`."""
        if errors:
            self.drop()
            raise WeightSyncError(
                f"weight sync to version {version} failed; the rollout keeps serving version {serving} on every "
                f"process: {'; '.join(errors)}"
            )
        staged, self.staged = self.staged, None
        if staged is None or staged.version != version:
            raise WeightSyncError(f"weight sync to version {version}: this process has not staged it")
        leaves, treedef = jax.tree.flatten(params)
        if staged.placed is not None:
            for leaf in leaves:
                leaf.delete()
            return jax.tree.unflatten(treedef, staged.placed)
        return jax.tree.unflatten(treedef, self._replace(version, staged.blocks, params))

    def _replace(self, version: int, blocks: dict[str, list[Block]], params: Any) -> list[jax.Array]:
        """`in_place`: frees each old parameter, then places its new one; records `incomplete` if one fails."""
        new = []
        for count, (path, leaf) in enumerate(param_paths(params)):
            if not leaf.is_deleted():
                leaf.delete()
            try:
                new.append(place_param(blocks[path], leaf))
            except Exception as exc:
                self.incomplete = (
                    f"weight sync to version {version} failed placing parameter {path} after replacing {count} of "
                    f"{len(blocks)} in place: this process holds no whole version until a sync succeeds"
                )
                raise WeightSyncError(f"{self.incomplete}: {exc}") from exc
        self.incomplete = None
        return new
