"""Weight sync without Ray or models, on tiny arrays over the 8 fake CPU devices: the trainer's blocks of one
layout, checked and placed into another layout, equal the trainer's weights cast to the rollout's dtype bit for bit
(both swap modes); bad blocks (missing, overlapping, out of bounds, misshapen, unexpected) are refused from their
metadata alone, naming the parameter; a sync that fails on one process of a rollout group leaves every process on
the old version (the blocking path's `stage_weights`/`commit_weights`, and the mailbox's switch points)."""

from __future__ import annotations

import dataclasses
import re
import threading

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hfjax.config.roles import ActorConfig, RolloutConfig
from hfjax.controller.worker import WorkerInfo, construct_worker
from hfjax.trainer.rollout_stream import WeightMailbox
from hfjax.workers import weight_swap
from hfjax.workers.rollout import RolloutWorker
from hfjax.workers.weight_swap import WeightSwap
from hfjax.workers.weight_sync import (
    WeightShards,
    WeightSyncError,
    check_blocks,
    export_shards,
    param_paths,
    shard_region,
)

SHAPES = {"w": (16, 24), "b": (24,), "scale": ()}


def _mesh(shape, names, devices=None):
    devices = jax.devices()[: int(np.prod(shape))] if devices is None else devices
    return Mesh(np.asarray(devices).reshape(shape), names)


FSDP8 = {"w": P("x", None), "b": P("x"), "scale": P()}  # over 8 devices in a row
MESH_2X4 = {"w": P(None, "y"), "b": P("y"), "scale": P()}  # columns over 4, replicated over the other 2
ONE_DEVICE = {"w": P(), "b": P(), "scale": P()}


def _params(mesh, specs, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    values = {name: rng.standard_normal(shape).astype(dtype) for name, shape in SHAPES.items()}
    return {name: jax.device_put(values[name], NamedSharding(mesh, specs[name])) for name in SHAPES}


def _split(shards: WeightShards, processes: int) -> list[WeightShards]:
    """One process's export as `processes` trainer processes' parts (each sends some blocks, all the shapes)."""
    return [WeightShards(shards.shapes, shards.blocks[p::processes]) for p in range(processes)]


def _bits(array) -> np.ndarray:
    array = np.asarray(array)
    return array.view(f"u{array.dtype.itemsize}")


LAYOUTS = [
    ((8,), ("x",), FSDP8, (2, 4), ("x", "y"), MESH_2X4),
    ((2, 4), ("x", "y"), MESH_2X4, (8,), ("x",), FSDP8),
    ((1,), ("x",), ONE_DEVICE, (2, 4), ("x", "y"), MESH_2X4),
]


@pytest.mark.parametrize("mode", ["atomic", "in_place"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layouts", LAYOUTS, ids=["fsdp8_to_2x4", "2x4_to_fsdp8", "one_to_2x4"])
def test_blocks_placed_into_another_layout_equal_the_trainers_cast_bitwise(layouts, dtype, mode):
    source_shape, source_names, source_specs, target_shape, target_names, target_specs = layouts
    master = _params(_mesh(source_shape, source_names), source_specs)  # float32, cast on export
    parts = _split(export_shards(master, dtype), 2)
    target_mesh = _mesh(target_shape, target_names)
    rollout = _params(target_mesh, target_specs, dtype=ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
    old = list(rollout.values())
    swap = WeightSwap(mode)
    swap.stage(1, parts, rollout)
    new = swap.settle(1, 0, rollout, [])
    assert all(leaf.is_deleted() for leaf in old)
    for name, leaf in new.items():
        want = np.asarray(master[name]).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
        assert leaf.sharding == NamedSharding(target_mesh, target_specs[name]), name
        for shard in leaf.addressable_shards:  # every device's copy, not just the gathered whole
            np.testing.assert_array_equal(_bits(shard.data), _bits(want[shard.index]), err_msg=name)


def test_a_shard_inside_one_block_is_a_view_of_it_and_one_across_blocks_a_new_array():
    block = np.arange(24, dtype=np.float32).reshape(4, 6)
    blocks = [(((0, 4), (0, 6)), block), (((4, 8), (0, 6)), block + 100)]
    inside = shard_region(blocks, ((1, 3), (2, 6)), np.float32)
    assert np.shares_memory(inside, block)
    np.testing.assert_array_equal(inside, block[1:3, 2:6])
    across = shard_region(blocks, ((2, 6), (0, 3)), np.float32)
    np.testing.assert_array_equal(across, np.concatenate([block[2:, :3], block[:2, :3] + 100]))


BIG = (2**16, 2**15)  # 8 GiB of float32: any allocation of its size would show


HALVES = [(0, BIG[0] // 2), (BIG[0] // 2, BIG[0])]


def _big_blocks(rows: list[tuple[int, int]]) -> WeightShards:
    """Blocks of whole rows of the big parameter `w` as zero-stride views (no memory behind them)."""
    blocks = [("w", ((a, b), (0, BIG[1])), np.broadcast_to(np.zeros((), np.uint32), (b - a, BIG[1]))) for a, b in rows]
    return WeightShards({"w": (BIG, "float32")}, blocks)


@pytest.fixture
def no_big_allocations(monkeypatch):
    """numpy's array constructors refuse anything of 2**20 elements or more while the test runs."""
    for name in ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "full_like"):
        original = getattr(np, name)

        def guarded(*args, _original=original, _name=name, **kwargs):
            out = _original(*args, **kwargs)
            assert out.size < 2**20, f"np.{_name} allocated {out.size} elements"
            return out

        monkeypatch.setattr(np, name, guarded)


def test_the_check_reads_metadata_only(no_big_allocations):
    blocks = check_blocks([_big_blocks(HALVES)], {"w": (BIG, "float32")})
    assert [index for index, _ in blocks["w"]] == [
        ((0, BIG[0] // 2), (0, BIG[1])),
        ((BIG[0] // 2, BIG[0]), (0, BIG[1])),
    ]
    assert all(block.dtype == np.float32 for _, block in blocks["w"])


BAD = {
    "missing": ([_big_blocks([(0, 100)])], "elements missing"),
    "overlapping": ([_big_blocks([(0, 40000), (30000, BIG[0])])], "overlap"),
    "out_of_bounds": ([_big_blocks([(0, BIG[0] // 2), (BIG[0] // 2, BIG[0] + 1)])], "lies outside"),
    "wrong_block_shape": (
        [WeightShards({"w": (BIG, "float32")}, [("w", ((0, BIG[0]), (0, BIG[1])), np.zeros((2, 2), np.uint32))])],
        "does not fit its index",
    ),
    "no_block": ([WeightShards({"w": (BIG, "float32")}, [])], "no block of it arrived"),
    "wrong_dtype": ([dataclasses.replace(_big_blocks(HALVES), shapes={"w": (BIG, "bfloat16")})], "the trainer sent"),
    "extra_parameter": ([_big_blocks(HALVES), WeightShards({"extra": ((2,), "float32")}, [])], "extra"),
    "extra_block": (
        [_big_blocks(HALVES), WeightShards({}, [("extra", ((0, 2),), np.zeros(2, np.uint32))])],
        "extra",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_blocks_are_refused_naming_the_parameter(case, no_big_allocations):
    parts, words = BAD[case]
    named = "extra" if case.startswith("extra") else "w"
    with pytest.raises(WeightSyncError, match=re.escape(words)) as err:
        check_blocks(parts, {"w": (BIG, "float32")})
    assert named in str(err.value)


def test_in_place_failing_part_way_says_so_until_a_sync_succeeds(monkeypatch):
    mesh = _mesh((2, 4), ("x", "y"))
    master = _params(mesh, MESH_2X4, seed=1)
    rollout = _params(mesh, MESH_2X4)
    swap = WeightSwap("in_place")
    swap.stage(1, [export_shards(master, "float32")], rollout)
    place, calls = weight_swap.place_param, []

    def fail_second(blocks, like):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device out of memory")
        return place(blocks, like)

    monkeypatch.setattr(weight_swap, "place_param", fail_second)
    with pytest.raises(WeightSyncError, match="holds no whole version") as err:
        swap.settle(1, 0, rollout, [])
    assert "after replacing 1 of 3" in str(err.value) and "device out of memory" in str(err.value)
    assert swap.incomplete is not None
    monkeypatch.setattr(weight_swap, "place_param", place)
    swap.stage(2, [export_shards(master, "float32")], rollout)  # the old tree, some leaves freed: still its layout
    new = swap.settle(2, 0, rollout, [])
    assert swap.incomplete is None
    for name in SHAPES:
        np.testing.assert_array_equal(np.asarray(new[name]), np.asarray(master[name]), err_msg=name)


def _rollout_process(rank: int, devices: list) -> RolloutWorker:
    """A rollout worker of a two-process group, holding tiny weights on `devices` (no model, no engine)."""
    worker = construct_worker(RolloutWorker, WorkerInfo(rank, 2), (ActorConfig(), RolloutConfig()), {})
    worker.policy = type("Policy", (), {})()
    worker.policy.params = _params(_mesh((4,), ("y",), devices), {"w": P(None, "y"), "b": P("y"), "scale": P()})
    worker.generator = type("Generator", (), {"update_params": lambda self, params: None})()
    return worker


def _values(worker) -> dict[str, np.ndarray]:
    return {path: np.asarray(leaf) for path, leaf in param_paths(worker.policy.params)}


@pytest.fixture
def group():
    """Two rollout processes (devices 0-3 and 4-7) on version 0, the trainer's version-1 parts, and a bad copy of
    them (a block missing)."""
    workers = [_rollout_process(rank, jax.devices()[4 * rank : 4 * rank + 4]) for rank in range(2)]
    master = _params(_mesh((8,), ("x",)), FSDP8, seed=1)
    parts = [export_shards(master, "float32")]
    bad = [dataclasses.replace(parts[0], blocks=parts[0].blocks[1:])]
    return workers, parts, bad, {path: np.asarray(leaf) for path, leaf in param_paths(master)}


def test_a_sync_failing_on_one_process_leaves_every_process_on_the_old_version(group):
    workers, parts, bad, master = group
    before = [_values(w) for w in workers]
    reports = [workers[0].stage_weights(1, *parts), workers[1].stage_weights(1, *bad)]
    assert reports[0]["error"] is None and "rank 1: parameter" in reports[1]["error"]
    for worker, values in zip(workers, before, strict=True):
        with pytest.raises(WeightSyncError, match="keeps serving version 0 on every process: rank 1: parameter"):
            worker.commit_weights(1, *reports)
        assert worker.version == 0 and worker.swap.staged is None
        for path, value in _values(worker).items():
            np.testing.assert_array_equal(value, values[path], err_msg=path)
    reports = [worker.stage_weights(2, *parts) for worker in workers]  # a good sync then switches both
    for worker in workers:
        assert worker.commit_weights(2, *reports)["version"] == 2 and worker.version == 2
        for path, value in _values(worker).items():
            np.testing.assert_array_equal(value, master[path], err_msg=path)


class _Actor:
    """A mailbox as the rollout processes see a Ray actor (`mailbox.method.remote(...)`), one call at a time."""

    def __init__(self, mailbox):
        self.mailbox, self.lock = mailbox, threading.Lock()

    def __getattr__(self, name):
        def remote(*args):
            with self.lock:
                return getattr(self.mailbox, name)(*args)

        return type("Method", (), {"remote": staticmethod(remote)})()


class _FailingSwap(WeightSwap):
    def stage(self, version, parts, params):
        raise WeightSyncError("device out of memory")


def test_mailbox_switches_both_processes_at_the_same_point_or_neither(group, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda value: value)  # the stand-in actor answers with values, not refs
    workers, parts, _, master = group
    mailbox = WeightMailbox(processes=2)
    for worker in workers:
        worker.mailbox, worker.point = _Actor(mailbox), (1, 0, 0)
    mailbox.publish(1, parts)

    def at_the_next_point() -> list:
        outcomes = [[], []]

        def ask(worker, out):
            try:
                out.append(worker._switch() if worker._switch_due() else None)
            except WeightSyncError as exc:
                out.append(exc)

        threads = [threading.Thread(target=ask, args=pair) for pair in zip(workers, outcomes, strict=True)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        return [out[0] for out in outcomes]

    workers[1].swap = _FailingSwap()
    failed = at_the_next_point()
    assert all(isinstance(e, WeightSyncError) and "keeps serving version 0" in str(e) for e in failed), failed
    assert "rank 1: device out of memory" in str(failed[0])
    assert [w.version for w in workers] == [0, 0] and workers[0].swap.staged is None
    workers[1].swap = WeightSwap()
    assert at_the_next_point() == [1, 1]  # the next point decides the switch again
    assert [w.version for w in workers] == [1, 1] and [w.point for w in workers] == [(1, 1, 0)] * 2
    for worker in workers:
        for path, value in _values(worker).items():
            np.testing.assert_array_equal(value, master[path], err_msg=path)


def test_mailbox_decides_each_point_once_for_every_process():
    mailbox = WeightMailbox(processes=2)
    mailbox.publish(0, ["v0"])
    assert mailbox.decide(0, (1, 0, 0), 0) is None and mailbox.decide(1, (1, 0, 0), 0) is None  # on it already
    mailbox.publish(1, ["v1"])
    assert mailbox.decide(0, (1, 0, 3), 0) == ((1, 0, 3), 1, ["v1"])  # the furthest process decides its point
    assert mailbox.decide(1, (1, 0, 2), 0) is None  # behind it, version 0 is still in force
    mailbox.publish(2, ["v2"])
    assert mailbox.decide(1, (1, 0, 3), 0) == ((1, 0, 3), 1, ["v1"])  # at the same point the same answer
    assert mailbox.report(0, (1, 0, 3), None) is None  # waits for process 1
    assert mailbox.report(1, (1, 0, 3), None) == [] and mailbox.outcome((1, 0, 3)) == []

    assert mailbox.decide(0, (1, 1, 1), 1) == ((1, 1, 1), 2, ["v2"])
    assert mailbox.decide(1, (1, 1, 1), 1) == ((1, 1, 1), 2, ["v2"])
    assert mailbox.report(0, (1, 1, 1), "rank 0: device out of memory") is None
    assert mailbox.report(1, (1, 1, 1), None) == ["rank 0: device out of memory"]  # both drop it
    mailbox.finish(0, 1)
    mailbox.finish(1, 1)

    assert mailbox.decide(0, (2, 0, 0), 1) == ((2, 0, 0), 2, ["v2"])  # version 1 in force: tried again
    mailbox.finish(1, 2)  # process 1 ended call 2 before reaching that point
    assert mailbox.report(0, (2, 0, 0), None) == []  # so process 0 switches alone
    assert [s.point for s in mailbox.switches] == [(2, 0, 0)] and mailbox.settled == 1  # the passed are forgotten
