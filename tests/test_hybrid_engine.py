"""HybridEngine on 8 fake CPU devices: bitwise round trips, containment, bytes moved against the formulas,
buffer release, logits under the gen layout, the naive mode, and (hosts simulated by a device -> host map) a
generation order that keeps every data-parallel replica on one host, contained where such an order is."""

import gc
import logging
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.checkpoints import left_padded_batch, relative_error, save_hf_model

from hfjax.models import load_hf
from hfjax.models.lora import LoraConfig, LoraParam, add_lora
from hfjax.optim import TrainState, compile_counts
from hfjax.optim.train_state import frozen_flags, place_params
from hfjax.parallel import HybridEngine, Layout, hybrid_engine
from hfjax.parallel.host_local import replica_positions, stationary_layout
from hfjax.parallel.host_memory import to_memory_kind
from hfjax.parallel.layout import LayoutError
from hfjax.parallel.shard_math import containing_order
from hfjax.predict.transition import transition_bytes

WIDE = dict(vocab_size=128, num_attention_heads=8, num_key_value_heads=8, hidden_size=64, intermediate_size=96)
CONTAINED_PAIRS = {
    "fsdp8->data8": ({"mesh": {"fsdp": 8}, "rules": "fsdp"}, {"mesh": {"data": 8}, "rules": "dp_tp_gen"}),
    "fsdp4tp2->data4tp2": (
        {"mesh": {"fsdp": 4, "tensor": 2}, "rules": "fsdp_tp"},
        {"mesh": {"data": 4, "tensor": 2}, "rules": "dp_tp_gen"},
    ),
    "fsdp2tp4->data4tp2": (
        {"mesh": {"fsdp": 2, "tensor": 4}, "rules": "fsdp_tp"},
        {"mesh": {"data": 4, "tensor": 2}, "rules": "dp_tp_gen"},
    ),
    "dp2fsdp2tp2->data8": (
        {"mesh": {"data": 2, "fsdp": 2, "tensor": 2}, "rules": "fsdp_tp"},
        {"mesh": {"data": 8}, "rules": "dp_tp_gen"},
    ),
    "tp8->data2tp4": ({"mesh": {"tensor": 8}, "rules": "tp"}, {"mesh": {"data": 2, "tensor": 4}, "rules": "tp"}),
}
EXPERT_PAIRS = {
    "expert4fsdp2->data2expert4": (
        {"mesh": {"fsdp": 2, "expert": 4}, "rules": "fsdp_tp"},
        {"mesh": {"data": 2, "expert": 4}, "rules": "dp_tp_gen"},
    ),
    "expert8->data8": ({"mesh": {"expert": 8}, "rules": "fsdp_tp"}, {"mesh": {"data": 8}, "rules": "dp_tp_gen"}),
    "expert2fsdp2tp2->data2expert2tp2": (
        {"mesh": {"fsdp": 2, "expert": 2, "tensor": 2}, "rules": "fsdp_tp"},
        {"mesh": {"data": 2, "expert": 2, "tensor": 2}, "rules": "dp_tp_gen"},
    ),
}
UNCONTAINED = (
    {"mesh": {"fsdp": 4, "tensor": 2}, "rules": "fsdp_tp"},
    {"mesh": {"data": 2, "tensor": 4}, "rules": "dp_tp_gen"},
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_hf_model(tmp_path_factory.mktemp("engine"), "llama", **WIDE)[1]


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _live_bytes_per_device(before=()):
    """Bytes per device of the live arrays, leaving out those in `before` (arrays alive earlier, held by the caller
    so that their ids are not reused): what an earlier test left alive does not count."""
    gc.collect()
    skip = {id(a) for a in before}
    per_device = {}
    for array in jax.live_arrays():
        if id(array) in skip:
            continue
        for shard in array.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    return per_device


def _pointers(array):
    return [shard.data.unsafe_buffer_pointer() for shard in array.addressable_shards]


def _blocks(n_shards_train, n_shards_gen, nbytes):
    return nbytes // n_shards_gen - nbytes // n_shards_train


def _parts(layout, spec):
    axes = [a for e in spec if e for a in ((e,) if isinstance(e, str) else e)]
    return math.prod(layout.axis_size(a) for a in axes)


@pytest.mark.parametrize("name", sorted(CONTAINED_PAIRS))
def test_round_trip_is_bitwise_and_contained(checkpoint, name):
    _check_round_trip(checkpoint, name, *CONTAINED_PAIRS[name])


@pytest.mark.parametrize("name", sorted(EXPERT_PAIRS))
def test_expert_weights_round_trip_bitwise_and_contained(tmp_path_factory, name):
    """The same for a mixture of experts (Qwen3-MoE, 8 experts) between expert-parallel layouts: the expert axis
    keeps each device's training block of the experts inside its generation block."""
    moe = save_hf_model(tmp_path_factory.mktemp("moe"), "qwen3_moe", vocab_size=128, mlp_only_layers=[])[1]
    _check_round_trip(moe, name, *EXPERT_PAIRS[name])


def _check_round_trip(checkpoint, name, train, gen):
    model = load_hf(checkpoint, layout=train)
    params = nnx.state(model, nnx.Param)
    before = _host(params)
    engine = HybridEngine(train, gen, params)
    assert engine.account.contained
    train_shardings = [x.sharding for x in jax.tree.leaves(params)]

    # Containment, checked from the index maps: every device's train block lies inside its gen block.
    for leaf, ts, gs in zip(jax.tree.leaves(params), engine.train_shardings, engine.gen_shardings, strict=True):
        gen_map = gs.devices_indices_map(leaf.shape)
        for device, t_index in ts.devices_indices_map(leaf.shape).items():
            for dim, (t, g) in enumerate(zip(t_index, gen_map[device], strict=True)):
                t0, t1 = t.start or 0, leaf.shape[dim] if t.stop is None else t.stop
                g0, g1 = g.start or 0, leaf.shape[dim] if g.stop is None else g.stop
                assert g0 <= t0 and t1 <= g1, (name, device, dim)

    # Bytes moved per device: the per-parameter formula bytes/gen_parts - bytes/train_parts, exactly.
    formula = sum(
        _blocks(_parts(engine.train_layout, ts.spec), _parts(engine.gen_layout, gs.spec), leaf.nbytes)
        for leaf, ts, gs in zip(jax.tree.leaves(params), engine.train_shardings, engine.gen_shardings, strict=True)
    )
    assert set(engine.account.received_bytes.values()) == {formula}

    buffers = [_pointers(x) for x in jax.tree.leaves(params)]
    gen_params = engine.to_gen(params)
    # each training array is freed, or placed alike in both layouts (e.g. q/k norms) and is its gen array
    for leaf, gen_leaf, pointers in zip(jax.tree.leaves(params), jax.tree.leaves(gen_params), buffers, strict=True):
        assert leaf.is_deleted() or _pointers(gen_leaf) == pointers, name
    shared = {i for i, leaf in enumerate(jax.tree.leaves(params)) if not leaf.is_deleted()}
    gen_leaves = jax.tree.leaves(gen_params)
    for i, (leaf, want, value) in enumerate(zip(gen_leaves, engine.gen_shardings, before, strict=True)):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
        for shard in leaf.addressable_shards:  # each device's own block, replicas included, holds the right values
            assert np.array_equal(np.asarray(shard.data).view(np.uint8), value[shard.index].view(np.uint8)), name
        # Every device holds its own copy, also of blocks that several devices share (replicated dimensions); a
        # shared array is the loader's, whose replicas on fake CPU devices may be one host buffer
        pointers = _pointers(leaf)
        assert len(set(pointers)) == len(pointers) or i in shared, name
    with jax.transfer_guard("disallow"):  # to_train copies nothing across devices (nor to/from host)
        back = engine.to_train(gen_params)
    assert all(x.is_deleted() for i, x in enumerate(jax.tree.leaves(gen_params)) if i not in shared)
    for got, want, sharding in zip(jax.tree.leaves(back), before, train_shardings, strict=True):
        assert got.sharding.is_equivalent_to(sharding, got.ndim)
        assert np.array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))
    stats = engine.stats()
    assert stats["redundant_bytes_per_device"] == 0 and stats["uncontained_bytes_per_device"] == 0
    assert len(stats["to_gen_s"]) == len(stats["to_train_s"]) == 1
    assert stats["keeps_host_memory"]  # CPU devices under glibc: transitions reuse freed host memory


def test_table2_formula_when_every_parameter_shards_on_both_axes():
    """A tree whose every parameter is sharded over fsdp x tensor in training and tensor in generation: bytes
    moved = M/t_g - M/(f t) and peak = M/t_g per device, the paper's Table 2 with FSDP."""
    tree = {
        f"w{i}": nnx.Param(jax.ShapeDtypeStruct((64 * (i + 1), 96), np.float32), logical_axes=("embed", "mlp"))
        for i in range(4)
    }
    total = sum(64 * (i + 1) * 96 * 4 for i in range(4))
    for (f, t), t_g in (((4, 2), 2), ((2, 4), 2), ((2, 4), 4), ((1, 8), 4), ((8, 1), 1)):
        engine = HybridEngine(
            {"mesh": {"fsdp": f, "tensor": t}, "rules": "fsdp_tp"},
            {"mesh": {"data": 8 // t_g, "tensor": t_g}, "rules": "dp_tp_gen"},
            tree,
        )
        stats = engine.stats()
        assert stats["received_bytes_per_device"] == total // t_g - total // (f * t), (f, t, t_g)
        assert stats["peak_param_bytes_per_device"] == total // t_g
        assert stats["contained"]


def test_transition_bytes_equal_the_engines_account_contained_or_not():
    """The cost model's per-device bytes of a transition (`transition_bytes`: in, and back in `to_train`) against the
    engine's account from the shardings, for a tree whose every parameter fsdp shards on one dimension and tensor
    parallelism on the other: Table 2 where the training shard fits in the generation shard, and the pairs where it
    cannot (fsdp8 -> tensor 4, the v5e-8 LoRA config's pair)."""
    tree = {
        f"w{i}": nnx.Param(jax.ShapeDtypeStruct((64 * (i + 1), 96), np.float32), logical_axes=("embed", "mlp"))
        for i in range(4)
    }
    total = sum(64 * (i + 1) * 96 * 4 for i in range(4))
    for (f, t), t_g in (((8, 1), 4), ((4, 2), 4), ((2, 4), 2), ((1, 8), 4), ((8, 1), 1), ((2, 4), 8)):
        train = {"mesh": {"fsdp": f, "tensor": t}, "rules": "fsdp_tp"}
        gen = {"mesh": {"data": 8 // t_g, "tensor": t_g}, "rules": "dp_tp_gen"}
        stats = HybridEngine(train, gen, tree).stats()
        received, back = transition_bytes(total, Layout.from_config(train), Layout.from_config(gen))
        assert (stats["received_bytes_per_device"], stats["uncontained_bytes_per_device"]) == (received, back)
        assert (back == 0) == (t % t_g == 0) == stats["contained"], (f, t, t_g)


def test_gen_params_give_the_same_logits(checkpoint):
    train, gen = CONTAINED_PAIRS["fsdp2tp4->data4tp2"]
    model = load_hf(checkpoint, layout=train)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids, mask, _ = left_padded_batch(128, [16, 9, 4, 12, 16, 1, 7, 11], seed=3)
    forward = jax.jit(lambda p, i, m: nnx.merge(graphdef, p, rest)(i, m))
    expected = np.asarray(forward(params, ids, mask))
    engine = HybridEngine(train, gen, params)
    gen_params = engine.to_gen(params)
    batch = engine.gen_layout.sharding(("batch", "length"), ids.shape)
    got = np.asarray(forward(gen_params, jax.device_put(ids, batch), jax.device_put(mask, batch)))
    v = mask.astype(bool)
    assert relative_error(got[v], expected[v]) <= 1e-5


def test_no_training_buffers_alive_during_generation(checkpoint):
    train, gen = CONTAINED_PAIRS["fsdp4tp2->data4tp2"]
    gc.collect()
    earlier = jax.live_arrays()
    params = nnx.state(load_hf(checkpoint, layout=train), nnx.Param)
    engine = HybridEngine(train, gen, params)
    gen_params = engine.to_gen(params)
    del params
    live = _live_bytes_per_device(earlier)  # the arrays this test made that are still alive
    gen_bytes = engine.stats()["gen_bytes_per_device"]
    for device_id, nbytes in live.items():
        assert nbytes <= gen_bytes + 4096, device_id
    assert max(live.values()) >= gen_bytes  # the gen copy itself is there
    shard_bytes = [s.data.nbytes for leaf in jax.tree.leaves(gen_params) for s in leaf.addressable_shards]
    assert engine.stats()["gen_bytes_total"] == sum(shard_bytes)
    del gen_params


@pytest.mark.parametrize(
    "mode,gen_dtype", [("zero_redundancy", None), ("naive", None), ("zero_redundancy", "bfloat16")]
)
def test_one_device_transitions_relabel_the_mesh_without_copying(checkpoint, mode, gen_dtype):
    """On one device (the 1-GPU configs) every training shard is already in place for generation, but under
    another mesh: to_gen must hand the generation programs arrays of the gen mesh (a program cannot mix meshes),
    share the training buffers where no cast is needed, and free nothing that the other side still reads."""
    train, gen = {"mesh": {"fsdp": 1}, "devices": [0]}, {"mesh": {"data": 1}, "devices": [0]}
    model = load_hf(checkpoint, layout=train)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    before = _host(params)
    engine = HybridEngine(train, gen, params, mode=mode, gen_dtype=gen_dtype)
    gen_params = engine.to_gen(params)
    for leaf, sharding in zip(jax.tree.leaves(gen_params), engine.gen_shardings, strict=True):
        assert leaf.sharding == sharding and not leaf.is_deleted()
    if gen_dtype is None:  # no copy: the gen arrays are the training buffers
        for t, g in zip(jax.tree.leaves(params), jax.tree.leaves(gen_params), strict=True):
            assert g.addressable_data(0).unsafe_buffer_pointer() == t.addressable_data(0).unsafe_buffer_pointer()
    ids, mask, _ = left_padded_batch(128, [5, 3], seed=1)
    batch = engine.gen_layout.sharding(("batch", "length"), ids.shape)
    forward = jax.jit(lambda p, i, m: nnx.merge(graphdef, p, rest)(i, m))
    forward(gen_params, jax.device_put(ids, batch), jax.device_put(mask, batch)).block_until_ready()
    back = engine.to_train(gen_params)
    for leaf, sharding, want in zip(jax.tree.leaves(back), engine.train_shardings, before, strict=True):
        assert leaf.sharding == sharding
        assert np.asarray(leaf).tobytes() == want.tobytes()


def test_uncontained_pair_falls_back_and_still_round_trips(checkpoint, caplog):
    train, gen = UNCONTAINED  # t_g = 4 does not divide t = 2
    params = nnx.state(load_hf(checkpoint, layout=train), nnx.Param)
    before = _host(params)
    with caplog.at_level(logging.WARNING):
        engine = HybridEngine(train, gen, params)
    assert "no device order" in caplog.text and not engine.account.contained
    default = HybridEngine(train, gen, params, mode="naive")
    assert engine.stats()["received_bytes_per_device"] <= default.stats()["received_bytes_per_device"]
    back = engine.to_train(engine.to_gen(params))
    for got, want in zip(jax.tree.leaves(back), before, strict=True):
        assert np.array_equal(np.asarray(got), want)


def test_naive_mode_keeps_training_buffers(checkpoint):
    train, gen = CONTAINED_PAIRS["fsdp2tp4->data4tp2"]
    params = nnx.state(load_hf(checkpoint, layout=train), nnx.Param)
    engine = HybridEngine(train, gen, params, mode="naive")
    gen_params = engine.to_gen(params)
    assert not any(x.is_deleted() for x in jax.tree.leaves(params))
    stats = engine.stats()
    assert stats["redundant_bytes_per_device"] == stats["train_bytes_per_device"] > 0
    assert stats["peak_param_bytes_per_device"] == stats["gen_bytes_per_device"] + stats["train_bytes_per_device"]
    assert engine.to_train(gen_params) is params
    with pytest.raises(RuntimeError, match="call to_gen first"):
        engine.to_train(gen_params)
    # With t_g < t the default (consecutive gen-TP groups) order does not contain the train shards: more bytes
    # move than under HybridFlow's order (gen-TP groups at stride t / t_g).
    assert not stats["contained"]
    zero = HybridEngine(train, gen, params)
    assert stats["received_bytes_per_device"] > zero.stats()["received_bytes_per_device"]
    assert zero.stats()["gen_device_order"] == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="checks the CPU backend's behaviour")
def test_host_offload_round_trip_and_cpu_message(caplog):
    layout = Layout.from_config({"mesh": {"fsdp": 8}, "rules": "fsdp"})
    values = np.arange(64, dtype=np.float32).reshape(8, 8)
    x = jax.device_put(values, layout.sharding(("embed", None)))
    host = to_memory_kind({"mu": x, "count": 3}, "pinned_host")
    assert host["mu"].sharding.memory_kind == "pinned_host" and host["count"] == 3
    assert x.is_deleted()  # the source buffers are released once the copies exist
    back = to_memory_kind(host, "device")
    assert back["mu"].sharding.memory_kind == "device" and np.array_equal(np.asarray(back["mu"]), values)
    assert host["mu"].is_deleted()
    x = jax.device_put(values, layout.sharding(("embed", None)))
    tree = {"w": nnx.Param(jax.ShapeDtypeStruct((8, 8), np.float32), logical_axes=("embed", "mlp"))}
    with caplog.at_level(logging.WARNING):
        engine = HybridEngine({"mesh": {"fsdp": 8}}, {"mesh": {"data": 8}}, tree, offload_optimizer=True)
    assert "no host memory separate from device memory" in caplog.text
    assert engine.offload({"mu": x})["mu"] is x


def _next_token_nll(model, batch):
    logits = model(batch["input_ids"], batch["attention_mask"])
    logp = jax.nn.log_softmax(logits[:, :-1].astype(np.float32))
    picked = jnp.take_along_axis(logp, batch["input_ids"][:, 1:, None], axis=-1)[..., 0]
    mask = batch["attention_mask"][:, 1:]
    return -(picked * mask).sum() / mask.sum(), {}


@pytest.mark.skipif(
    jax.devices()[0].platform == "cpu",
    reason="needs host memory separate from device memory (GPU/TPU): run with JAX_PLATFORMS=cuda or tpu",
)
def test_optimizer_offload_frees_device_memory_and_training_resumes_bitwise(checkpoint):
    n = jax.device_count()
    layout = Layout.from_config({"mesh": {"fsdp": n}, "rules": "fsdp"})
    ids, mask, _ = left_padded_batch(128, [16, 9, 4, 12, 16, 1, 7, 11], seed=3)
    batch = {"input_ids": ids, "attention_mask": mask}
    offloaded, kept = (TrainState(load_hf(checkpoint, layout=layout), layout, optax.adam(1e-2), 1.0) for _ in "ab")
    for state in (offloaded, kept):
        for _ in range(2):  # the second call adds a dispatch-cache entry (no compile): steady state from here
            state.update(_next_token_nll, [batch])
    engine = HybridEngine(layout, {"mesh": {"data": n}, "rules": "dp_tp_gen"}, offloaded.params, offload_optimizer=True)
    assert engine.offload_optimizer
    device = jax.local_devices()[0]
    opt_bytes = sum(
        s.data.nbytes for x in jax.tree.leaves(offloaded.opt_state) for s in x.addressable_shards if s.device == device
    )
    expected, sources = _host(offloaded.opt_state), jax.tree.leaves(offloaded.opt_state)
    gc.collect()
    in_use = device.memory_stats()["bytes_in_use"]
    offloaded.opt_state = engine.offload(offloaded.opt_state)
    assert all(x.is_deleted() for x in sources)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(offloaded.opt_state)} == {"pinned_host"}
    assert in_use - device.memory_stats()["bytes_in_use"] >= opt_bytes > 0
    offloaded.opt_state = engine.reload(offloaded.opt_state)
    for got, want in zip(jax.tree.leaves(offloaded.opt_state), expected, strict=True):
        assert got.sharding.memory_kind == "device" and np.array_equal(np.asarray(got), want)
    compiled = compile_counts()
    for state in (offloaded, kept):
        state.update(_next_token_nll, [batch])
    assert compile_counts() == compiled  # the reloaded state runs the same compiled step
    for got, want in zip(_host(offloaded.params), _host(kept.params), strict=True):
        assert np.array_equal(got, want)


def test_bad_engine_arguments():
    tree = {"w": nnx.Param(jax.ShapeDtypeStruct((8, 8), np.float32), logical_axes=("embed", "mlp"))}
    with pytest.raises(ValueError, match="mode='fast'"):
        HybridEngine({"mesh": {"fsdp": 8}}, {"mesh": {"data": 8}}, tree, mode="fast")
    with pytest.raises(ValueError, match="gen_layout has 4 devices"):
        HybridEngine({"mesh": {"fsdp": 8}}, {"mesh": {"data": 4}, "devices": [0, 1, 2, 3]}, tree)
    with pytest.raises(ValueError, match=r"stationary: expected one flag per parameter \(1\), got 2"):
        HybridEngine({"mesh": {"fsdp": 8}}, {"mesh": {"data": 8}}, tree, stationary=[True, False])


TP8 = {"mesh": {"tensor": 8}, "rules": "tp"}
GEN_2X4 = {"mesh": {"data": 2, "tensor": 4}, "rules": "tp"}
SMALL_TREE = {
    "up": nnx.Param(jax.ShapeDtypeStruct((16, 32), np.float32), logical_axes=("embed", "mlp")),
    "down": nnx.Param(jax.ShapeDtypeStruct((32, 16), np.float32), logical_axes=("mlp", "embed")),
}


def _replica_hosts(layout, hosts, order=None):
    """The hosts of each replica of `layout` in its device order (or `order`)."""
    order = layout.device_ids if order is None else order
    return [sorted({hosts[order[p]] for p in replica}) for replica in replica_positions(layout)]


def _containing(train, gen):
    """The containing device order of `SMALL_TREE` (what the engine takes on one host)."""
    train, gen = Layout.from_config(train), Layout.from_config(gen)
    specs = [tuple(train.spec(leaf.get_metadata()["logical_axes"])) for leaf in SMALL_TREE.values()]
    gen_specs = [tuple(gen.spec(leaf.get_metadata()["logical_axes"])) for leaf in SMALL_TREE.values()]
    return containing_order(train, gen, specs, gen_specs)


def _contained(engine):
    """Every device's training block of every parameter lies inside its generation block (from the shardings)."""
    for shape, train, gen in zip(engine.shapes, engine.train_shardings, engine.gen_shardings, strict=True):
        train_blocks, gen_blocks = train.devices_indices_map(shape), gen.devices_indices_map(shape)
        for device, blocks in train_blocks.items():
            for t, g in zip(blocks, gen_blocks[device], strict=True):
                if not ((g.start or 0) <= (t.start or 0) and (t.stop or math.inf) <= (g.stop or math.inf)):
                    return False
    return True


@pytest.mark.parametrize("mode", ["zero_redundancy", "naive"])
def test_generation_replicas_stay_on_one_host(monkeypatch, caplog, mode):
    """Training tensor=8 on 2 hosts x 4 devices, generation data=2 x tensor=4: the containing order puts every
    replica on both hosts, so the engine takes a host-local one (uncontained: to_train moves bytes back); naive mode
    reorders a gen mesh whose data axis is innermost."""
    hosts = {i: i // 4 for i in range(8)}
    monkeypatch.setattr(hybrid_engine, "device_hosts", lambda layout: hosts)
    gen = GEN_2X4 if mode == "zero_redundancy" else {"mesh": {"tensor": 4, "data": 2}, "rules": "tp"}
    with caplog.at_level(logging.WARNING):
        engine = HybridEngine(TP8, gen, SMALL_TREE, mode=mode)
    assert _replica_hosts(engine.gen_layout, hosts) == [[0], [1]]
    # what the engine would take on one host, the containing order or the gen mesh's own: replicas on both hosts
    before = _containing(TP8, gen) if mode == "zero_redundancy" else list(range(8))
    assert _replica_hosts(Layout.from_config(gen), hosts, before) == [[0, 1], [0, 1]]
    if mode == "zero_redundancy":
        assert "keeps each data-parallel replica on one host" in caplog.text and not _contained(engine)


def test_a_contained_host_local_order_is_preferred(monkeypatch):
    """Hosts interleaved so that each holds one device of every pair of training shards: the containing order spans
    both hosts, but swapping devices between equal generation shards makes it host-local and still contained."""
    hosts = dict(enumerate((0, 1, 0, 1, 1, 0, 1, 0)))
    monkeypatch.setattr(hybrid_engine, "device_hosts", lambda layout: hosts)
    assert _replica_hosts(Layout.from_config(GEN_2X4), hosts, _containing(TP8, GEN_2X4)) == [[0, 1], [0, 1]]
    engine = HybridEngine(TP8, GEN_2X4, SMALL_TREE)
    assert _replica_hosts(engine.gen_layout, hosts) == [[0], [1]]
    assert engine.account.contained and _contained(engine)


def test_generation_that_no_host_order_fits_is_an_error(monkeypatch):
    monkeypatch.setattr(hybrid_engine, "device_hosts", lambda layout: {i: i // 4 for i in range(8)})
    with pytest.raises(LayoutError, match=r"has data=1, which 2 hosts cannot share"):
        HybridEngine(TP8, {"mesh": {"tensor": 8}, "rules": "tp"}, SMALL_TREE)


def test_a_stationary_base_on_a_training_order_that_splits_replicas_is_an_error(monkeypatch):
    """Generation tensor=4 x data=2 (data innermost) on the training order of 2 hosts x 4 devices puts each replica
    on both hosts; a stationary base cannot be reordered, so the engine refuses and names the setting."""
    monkeypatch.setattr(hybrid_engine, "device_hosts", lambda layout: {i: i // 4 for i in range(8)})
    with pytest.raises(LayoutError, match=r"rollout\.lora_base_layout: .* spreads a data-parallel replica"):
        HybridEngine(TP8, {"mesh": {"tensor": 4, "data": 2}, "rules": "tp"}, SMALL_TREE, stationary=[True, False])


def test_stationary_parameters_stay_in_the_generation_layout_and_never_move(checkpoint):
    """A LoRA base kept in the generation layout (fsdp4 x tensor2 training, data2 x tensor4 generation, on the
    training device order): `to_gen` and `to_train` hand back its very buffers, the adapters go and come back bit for
    bit, the engine counts their bytes alone as received (a plain engine gathers the base too), the generation copy
    gives the logits of the unsharded model, and a base left in the training layout is refused."""
    train, gen = (Layout.from_config(x) for x in UNCONTAINED)
    model = add_lora(load_hf(checkpoint), LoraConfig(rank=4), seed=0)
    for path, b in nnx.to_flat_state(nnx.state(model, LoraParam)):
        if path[-1] == "b":  # a fresh B is zero
            b[...] = jnp.asarray(np.random.default_rng(len(path)).normal(0, 0.05, b.shape), jnp.float32)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids, mask, _ = left_padded_batch(128, [16, 9, 4, 12, 16, 1, 7, 11], seed=3)
    forward = jax.jit(lambda p, i, m: nnx.merge(graphdef, p, rest)(i, m))
    expected = np.asarray(forward(params, ids, mask))
    flags = frozen_flags(params, LoraParam)
    base_layout = stationary_layout(train, gen)
    placed = place_params(params, train, LoraParam, base_layout)
    engine = HybridEngine(train, gen, placed, stationary=flags)
    assert engine.gen_layout == base_layout and sum(flags) and not all(flags)
    before = _host(placed)
    pointers = [_pointers(x) for x in jax.tree.leaves(placed)]
    gen_params = engine.to_gen(placed)
    adapters_gen = [g for g, still in zip(jax.tree.leaves(gen_params), flags, strict=True) if not still]
    base_gen = [g for g, still in zip(jax.tree.leaves(gen_params), flags, strict=True) if still]
    for leaf, sharding, pointer, still in zip(
        jax.tree.leaves(gen_params), engine.gen_shardings, pointers, flags, strict=True
    ):
        assert leaf.sharding == sharding and (_pointers(leaf) == pointer) == still
    stats = engine.stats()
    per_device_adapters = max(sum(s.data.nbytes for a in adapters_gen for s in a.addressable_shards if s.device == d)
                              for d in engine.gen_layout.mesh.devices.reshape(-1))  # fmt: skip
    assert 0 < stats["received_bytes_per_device"] <= per_device_adapters
    assert stats["stationary_bytes_per_device"] == sum(leaf.addressable_shards[0].data.nbytes for leaf in base_gen)
    plain = HybridEngine(train, gen, jax.device_put(params, train.shardings(params))).stats()
    assert (
        plain["received_bytes_per_device"]
        > stats["received_bytes_per_device"] + stats["stationary_bytes_per_device"] // 2
    )
    batch = engine.gen_layout.sharding(("batch", "length"), ids.shape)
    got = np.asarray(forward(gen_params, jax.device_put(ids, batch), jax.device_put(mask, batch)))
    v = mask.astype(bool)
    assert relative_error(got[v], expected[v]) <= 1e-5
    back = engine.to_train(gen_params)
    for leaf, sharding, pointer, still, want in zip(
        jax.tree.leaves(back), engine.train_shardings, pointers, flags, before, strict=True
    ):
        assert leaf.sharding == sharding and (_pointers(leaf) == pointer) == still
        assert np.asarray(leaf).tobytes() == want.tobytes()
    with pytest.raises(ValueError, match=r"stationary parameter .* must stay in the generation layout"):
        engine.to_gen(jax.device_put(params, train.shardings(params)))


def test_two_processes_with_gloo(tmp_path):
    """2 processes x 4 fake CPU devices under jax.distributed: to_gen all-gathers across processes, to_train
    slices locally; every local shard is checked against the source values in each process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).parent / "support" / "engine_process.py"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i), "2", str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for i, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, out[-3000:]
        assert f"OK process {i}" in out
