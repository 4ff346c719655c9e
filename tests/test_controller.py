"""The single controller: dispatch modes against hand-computed splits, in-process and Ray worker groups, futures
passed between groups, colocated roles against separate groups, a 2-process x 4-device JAX group against the
8-device single-process result, and failures (a raising worker, a killed process, wrong arguments)."""

import functools
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hfjax.controller import (
    DataProtoFuture,
    Dispatch,
    Execute,
    LocalWorkerGroup,
    RayWorkerGroup,
    ResourcePool,
    Worker,
    WorkerDiedError,
    WorkerError,
    colocate,
    register,
    register_dispatch_mode,
)
from hfjax.controller.dispatch import dispatch_mode
from hfjax.parallel.global_arrays import to_global, to_local
from hfjax.protocol import PADDING_ROWS, ROW_OFFSET, DataProto, unpad_outputs

pytest_plugins = ["support.ray_cluster"]  # the session-scoped `ray_cluster` fixture

SUM_OF_RANKS = register_dispatch_mode(
    "test_sum_of_ranks", lambda n, args, kwargs: ([args] * n, [kwargs] * n), lambda outputs: sum(outputs)
)


def _mesh_4x2() -> Mesh:
    """data 4 x tensor 2 over all devices in process order: each process's devices are adjacent on `data`."""
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)


@jax.jit
def _centered_features(x, w):
    """Row features minus their batch maximum: an all-reduce over `data`, across processes. (A max, unlike a sum,
    does not depend on the reduction order, so gloo and in-process collectives agree bitwise.)"""
    h = jnp.tanh(x @ w)
    return h - h.max(axis=0, keepdims=True)


def _weights(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((16, 6)).astype(np.float32) / 4


class ShardedWorker(Worker):
    """One process of a group over 8 global devices: a tensor-sharded weight and data-sharded batches."""

    def __init__(self, seed: int):
        self.mesh = _mesh_4x2()
        host_w = _weights(seed)
        self.w = jax.make_array_from_callback(
            host_w.shape, NamedSharding(self.mesh, P(None, "tensor")), host_w.__getitem__
        )

    @register(Dispatch.DP_COMPUTE_PROTO)
    def features(self, data: DataProto) -> DataProto:
        x = to_global(data.batch["x"], NamedSharding(self.mesh, P("data")))
        return DataProto.from_dict({"y": to_local(_centered_features(x, self.w))})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def tag(self, data: DataProto) -> DataProto:
        n = len(data)
        return DataProto.from_dict({"y": data.batch["x"] * 2 + 1, "rank": np.full(n, self.rank), "rows": np.full(n, n)})

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def slow_double(self, data: DataProto) -> DataProto:
        time.sleep(data.meta_info.get("sleep_s", 0.0))
        return DataProto.from_dict({"x": data.batch["x"] * 2}, meta_info={"metrics": {"rows": len(data)}})

    @register(Dispatch.ONE_TO_ALL)
    def topology(self) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "process_index": jax.process_index(),
            "devices": jax.device_count(),
            "local_devices": len(self.local_devices),
            "pid": os.getpid(),
        }

    @register(Dispatch.ONE_TO_ALL)
    def count_rows(self, data: DataProto) -> int:
        return len(data)

    @register(Dispatch.ALL_TO_ALL)
    def scaled(self, value: float, factor: float) -> float:
        return value * factor + self.rank

    @register(Dispatch.RANK_ZERO)
    def leader(self) -> tuple:
        return (self.rank, jax.process_index())

    @register(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def leader_pid(self) -> int:
        return os.getpid()

    @register(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def map_rows(self, fn, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": fn(data.batch["x"]), "rank": np.full(len(data), self.rank)})

    @register(SUM_OF_RANKS)
    def rank_times(self, value: int) -> int:
        return self.rank * value + 1

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"boom from rank {self.rank}")
        return self.rank


class AffineRole(Worker):
    """A role with its own seeded weights and call counter."""

    def __init__(self, seed: int, offset: float = 0.0):
        self.w = jnp.asarray(_weights(seed))
        self.offset, self.calls = offset, 0

    @register(Dispatch.DP_COMPUTE_PROTO)
    def apply(self, data: DataProto) -> DataProto:
        self.calls += 1
        y = np.asarray(jax.jit(lambda x, w: jnp.tanh(x @ w))(data.batch["x"], self.w)) + self.offset
        return DataProto.from_dict({"y": y, "calls": np.full(len(data), self.calls)})

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def add_one(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"x": data.batch["x"] + 1}, meta_info=data.meta_info)

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


class Sleeper(Worker):
    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


def batch(n: int, seed: int = 0) -> DataProto:
    x = np.random.default_rng(seed).standard_normal((n, 16)).astype(np.float32)
    return DataProto.from_dict({"x": x}, {"id": [f"row{i}" for i in range(n)]})


# --- dispatch modes, without any group ------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_dp_dispatch_pads_chunks_and_unpads(world_size):
    mode = dispatch_mode(Dispatch.DP_COMPUTE_PROTO)
    for n in range(1, 12):
        data, extra = batch(n, seed=n), batch(n, seed=100 + n)
        out = mode.dispatch(world_size, (data,), {"extra": extra})
        size = -(-n // world_size)
        pad = size * world_size - n
        assert out.pad_size == ((pad, size * world_size) if pad else 0)
        for r in range(world_size):
            expected_rows = [i % n for i in range(r * size, (r + 1) * size)]
            assert np.array_equal(out.args[r][0].batch["x"], data.batch["x"][expected_rows])
            assert np.array_equal(out.kwargs[r]["extra"].batch["x"], extra.batch["x"][expected_rows])
            meta = out.args[r][0].meta_info
            padding_rows = sum(1 for i in range(r * size, (r + 1) * size) if i >= n)
            assert (meta[ROW_OFFSET], meta[PADDING_ROWS]) == (r * size, padding_rows)
        if pad == 0:  # no padding needed: the chunks are views, the controller copies nothing
            assert all(np.shares_memory(a[0].batch["x"], data.batch["x"]) for a in out.args)
        collected = mode.collect_fn([a[0] for a in out.args])
        assert np.array_equal(unpad_outputs(collected, out.pad_size).batch["x"], data.batch["x"])
        assert ROW_OFFSET not in collected.meta_info
        # a method giving 3 rows per input row (rollout.n = 3): the padding rows' outputs go, all of them
        tripled = mode.collect_fn([a[0].repeat(3) for a in out.args])
        assert np.array_equal(unpad_outputs(tripled, out.pad_size).batch["x"], data.repeat(3).batch["x"])


def test_dispatch_errors():
    mode = dispatch_mode(Dispatch.DP_COMPUTE_PROTO)
    with pytest.raises(ValueError, match="cannot split an empty DataProto over 2 processes"):
        mode.dispatch(2, (DataProto.from_dict({"x": np.zeros((0, 3))}),), {})
    with pytest.raises(TypeError, match="argument 1: expected a DataProto or DataProtoFuture, got int"):
        mode.dispatch(2, (batch(4), 3), {})
    with pytest.raises(ValueError, match="different batch sizes"):
        mode.dispatch(2, (batch(4), batch(5)), {})
    with pytest.raises(
        TypeError, match="ALL_TO_ALL argument 0: expected a list of 2 per-rank values, got list of length 3"
    ):
        dispatch_mode(Dispatch.ALL_TO_ALL).dispatch(2, ([1, 2, 3],), {})
    with pytest.raises(TypeError, match="the first argument must be a function"):
        dispatch_mode(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC).dispatch(2, (batch(4),), {})
    with pytest.raises(ValueError, match="unknown dispatch mode 'nope'"):
        register(dispatch_mode="nope")
    with pytest.raises(ValueError, match="already registered"):
        register_dispatch_mode(SUM_OF_RANKS, list, list)
    with pytest.raises(ValueError, match="execute_mode must be ALL"):
        register(Dispatch.DP_COMPUTE_PROTO, execute_mode="rank_zero")


def test_resource_pool_split_merge_and_process_env(monkeypatch):
    pool = ResourcePool([4, 2, 2])
    parts = pool.split([1, 2])
    assert [p.devices_per_host for p in parts] == [[4], [2, 2]] and [p.world_size for p in parts] == [1, 2]
    assert ResourcePool.merge(*parts).devices_per_host == [4, 2, 2]
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8")
    assert parts[1].process_env(1) == {
        "XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
    }
    assert ResourcePool([8], device="gpu").process_env(0) == {"JAX_PLATFORMS": "cuda"}
    with pytest.raises(ValueError, match="must be positive and sum to 3 hosts"):
        pool.split([1, 1])
    with pytest.raises(ValueError, match="one device kind"):
        ResourcePool.merge(pool, ResourcePool([1], device="gpu"))
    with pytest.raises(ValueError, match=r"device: expected one of \('cpu', 'gpu', 'tpu'\), got 'npu'"):
        ResourcePool([1], device="npu")
    with pytest.raises(ValueError, match="devices_per_host: expected positive ints"):
        ResourcePool([2, 0])


# --- in-process groups ----------------------------------------------------------------------------------------


def test_local_group_methods_futures_and_errors():
    group = LocalWorkerGroup(AffineRole, 7, offset=0.5)
    data = batch(5, seed=1)
    out = group.apply(data)
    assert np.allclose(out.batch["y"], np.tanh(data.batch["x"] @ _weights(7)) + 0.5, atol=1e-6)
    future = group.add_one(data)
    assert isinstance(future, DataProtoFuture)
    shifted = DataProto.from_dict({"x": data.batch["x"] + 1})
    assert np.array_equal(future.get().batch["x"], shifted.batch["x"])
    assert np.array_equal(group.apply(future).batch["y"], group.apply(shifted).batch["y"])
    assert group.pid() == [os.getpid()]
    with pytest.raises(TypeError, match=r"AffineRole.apply\(self, data.*: missing a required argument: 'data'"):
        group.apply()
    with pytest.raises(TypeError, match="argument 0: expected a DataProto"):
        group.apply(np.ones(3))
    with pytest.raises(WorkerError, match=r"(?s)AffineRole.apply failed on rank 0 of 1:.*KeyError: 'x'"):
        group.apply(DataProto.from_dict({"z": np.ones(2)}))
    with pytest.raises(WorkerError, match=r"(?s)AffineRole.__init__ failed on rank 0.*TypeError"):
        LocalWorkerGroup(AffineRole)


def test_local_colocated_roles_match_separate_groups():
    roles = colocate(
        {"policy": functools.partial(AffineRole, 1), "critic": functools.partial(AffineRole, 2, offset=3.0)}
    )
    together = roles.spawn()
    separate = {"policy": LocalWorkerGroup(AffineRole, 1), "critic": LocalWorkerGroup(AffineRole, 2, offset=3.0)}
    for step in range(2):
        data = batch(6, seed=10 + step)
        for name in ("policy", "critic"):
            a, b = together[name].apply(data), separate[name].apply(data)
            assert np.array_equal(a.batch["y"], b.batch["y"]) and np.array_equal(a.batch["calls"], b.batch["calls"])
    assert not np.allclose(together["policy"].apply(data).batch["y"], together["critic"].apply(data).batch["y"])
    with pytest.raises(ValueError, match="must be a Python identifier"):
        colocate({"a.b": AffineRole})


def test_global_arrays_round_trip_in_one_process():
    mesh = _mesh_4x2()
    x = np.random.default_rng(2).standard_normal((8, 6)).astype(np.float32)
    tree = to_global(
        {"x": x, "w": x[:, :2]}, {"x": NamedSharding(mesh, P("data", "tensor")), "w": NamedSharding(mesh, P())}
    )
    assert tree["x"].sharding.spec == P("data", "tensor") and tree["x"].shape == (8, 6)
    back = to_local(tree)
    assert np.array_equal(back["x"], x) and np.array_equal(back["w"], x[:, :2])


# --- Ray worker groups ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded_group(ray_cluster):
    group = RayWorkerGroup(ResourcePool([4, 4]), ShardedWorker, 3)
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def colocated(ray_cluster):
    roles = colocate(
        {"policy": functools.partial(AffineRole, 1), "critic": functools.partial(AffineRole, 2, offset=3.0)}
    )
    return roles.spawn(ResourcePool([2]))


@pytest.mark.ray
def test_two_processes_match_eight_devices_in_one(sharded_group):
    topology = sharded_group.topology()
    assert [t["rank"] for t in topology] == [t["process_index"] for t in topology] == [0, 1]
    assert {(t["world_size"], t["devices"], t["local_devices"]) for t in topology} == {(2, 8, 4)}
    assert len({t["pid"] for t in topology} | {os.getpid()}) == 3
    data = batch(16, seed=4)
    remote = sharded_group.features(data).batch["y"]
    mesh = _mesh_4x2()
    x = jax.device_put(data.batch["x"], NamedSharding(mesh, P("data")))
    w = jax.device_put(_weights(3), NamedSharding(mesh, P(None, "tensor")))
    local = np.asarray(_centered_features(x, w))
    h = np.tanh(data.batch["x"].astype(np.float64) @ _weights(3).astype(np.float64))
    assert np.allclose(remote, h - h.max(axis=0), rtol=0, atol=1e-5)
    assert np.array_equal(remote, local)


@pytest.mark.ray
def test_ray_dispatch_modes(sharded_group):
    for n in (1, 2, 3, 7):
        data = batch(n, seed=n)
        out = sharded_group.tag(data)
        size = -(-n // 2)
        assert np.array_equal(out.batch["y"], data.batch["x"] * 2 + 1)
        assert out.batch["rank"].tolist() == [i // size for i in range(n)]
        assert set(out.batch["rows"].tolist()) == {size}
    assert sharded_group.count_rows(batch(5)) == [5, 5]
    assert sharded_group.scaled([1.5, 2.5], factor=[2.0, 4.0]) == [3.0, 11.0]
    assert sharded_group.leader() == (0, 0)
    assert sharded_group.leader_pid() == [sharded_group.pids[0]]
    data = batch(3, seed=9)
    mapped = sharded_group.map_rows(np.square, data)
    assert np.array_equal(mapped.batch["y"], data.batch["x"] ** 2) and mapped.batch["rank"].tolist() == [0, 0, 1]
    assert sharded_group.rank_times(5) == (0 * 5 + 1) + (1 * 5 + 1)
    with pytest.raises(TypeError, match=r"ShardedWorker.tag.*too many positional arguments"):
        sharded_group.tag(batch(2), batch(2))


@pytest.mark.ray
def test_futures_pass_between_groups_without_waiting(sharded_group, colocated):
    data = batch(5, seed=6)
    data.meta_info["sleep_s"] = 1.5
    start = time.perf_counter()
    doubled = sharded_group.slow_double(data)  # 2 row chunks, the second with one padding row
    plus_one = colocated["critic"].add_one(doubled)  # 2 ranks -> 1 rank: re-chunked inside the cluster
    submit_s = time.perf_counter() - start
    assert isinstance(plus_one, DataProtoFuture) and submit_s < 1.0, submit_s
    result = plus_one.get()
    assert np.array_equal(result.batch["x"], data.batch["x"] * 2 + 1)
    assert result.meta_info["metrics"] == {"rows": [3, 3]}
    tagged = sharded_group.tag(doubled)  # same world size: the refs go straight to the ranks
    assert (
        np.array_equal(tagged.batch["y"], data.batch["x"] * 4 + 1)
        and tagged.batch["rank"].tolist() == [0] * 3 + [1] * 2
    )
    assert sharded_group.count_rows(doubled) == [5, 5]  # ONE_TO_ALL: the whole unpadded result, merged in the cluster


@pytest.mark.ray
def test_ray_colocated_roles_match_separate_groups(colocated):
    separate = {"policy": LocalWorkerGroup(AffineRole, 1), "critic": LocalWorkerGroup(AffineRole, 2, offset=3.0)}
    for step in range(2):
        data = batch(7, seed=20 + step)
        for name in ("policy", "critic"):
            a, b = colocated[name].apply(data), separate[name].apply(data)
            assert np.array_equal(a.batch["y"], b.batch["y"]) and np.array_equal(a.batch["calls"], b.batch["calls"])
    assert colocated["policy"].pid() == colocated["critic"].pid() != [os.getpid()]


@pytest.mark.ray
def test_worker_exception_names_rank_and_traceback(sharded_group):
    with pytest.raises(WorkerError, match=r"ShardedWorker.fail_on failed on rank 1 of 2") as info:
        sharded_group.fail_on(1)
    assert info.value.rank == 1 and "in fail_on" in info.value.remote_traceback
    assert "ValueError: boom from rank 1" in info.value.remote_traceback
    assert sharded_group.fail_on(5) == [0, 1]  # the group survives an exception


@pytest.mark.ray
def test_killed_worker_is_reported_while_others_hang(ray_cluster):
    group = RayWorkerGroup(ResourcePool([1, 1]), Sleeper)
    try:
        pending = group.nap(600.0)
        os.kill(group.pids[1], signal.SIGKILL)
        start = time.perf_counter()
        with pytest.raises(WorkerDiedError, match=r"Sleeper.nap failed on rank 1 of 2:\nthe worker process died"):
            pending.get()
        with pytest.raises(WorkerDiedError, match="rank 1"):
            group.nap(0.0).get()
        assert time.perf_counter() - start < 30
    finally:
        group.shutdown()
