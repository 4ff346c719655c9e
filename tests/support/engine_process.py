"""One process of the two-process HybridEngine test: python engine_process.py PROCESS_ID NUM_PROCESSES PORT.
Each process owns 4 fake CPU devices; collectives go through gloo."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import numpy as np
from flax import nnx

from hfjax.parallel import HybridEngine, Layout

SHAPES = {
    "embed": ((64, 96), ("embed", "mlp")),
    "heads": ((64, 8, 16), ("embed", "heads", "head_dim")),
    "norm": ((64,), ("embed",)),
}


def main(process_id: int, num_processes: int, port: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    train = {"mesh": {"fsdp": 2, "tensor": 4}, "rules": "fsdp_tp"}
    gen = {"mesh": {"data": 4, "tensor": 2}, "rules": "dp_tp_gen"}
    abstract = {k: nnx.Param(jax.ShapeDtypeStruct(s, np.float32), logical_axes=a) for k, (s, a) in SHAPES.items()}
    rng = np.random.default_rng(0)  # same values on every process
    host = {k: rng.standard_normal(s).astype(np.float32) for k, (s, _) in SHAPES.items()}
    layout = Layout.from_config(train)
    params = {
        k: jax.make_array_from_callback(host[k].shape, layout.sharding(a, host[k].shape), lambda idx, k=k: host[k][idx])
        for k, (_, a) in SHAPES.items()
    }
    engine = HybridEngine(train, gen, abstract)
    assert engine.account.contained
    gen_params = engine.to_gen(params)
    for k, array in gen_params.items():
        assert array.sharding.is_equivalent_to(engine.gen_layout.sharding(SHAPES[k][1]), array.ndim)
        for shard in array.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), host[k][shard.index]), (k, shard.device)
    back = engine.to_train(gen_params)
    for k, array in back.items():
        assert array.sharding.is_equivalent_to(layout.sharding(SHAPES[k][1]), array.ndim)
        for shard in array.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), host[k][shard.index]), (k, shard.device)
    print(f"OK process {process_id}: received {engine.stats()['received_bytes_per_device']} bytes per device")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
