"""How weights should move between two worker groups: Ray's object store against JAX's transfer server.

Two Ray actors stand for the groups, each its own process and JAX world of 4 fake CPU devices. The trainer holds
the policy (random values with the shapes of the 25.8M-parameter reference Llama, float32 or bfloat16) split over
its devices along the first axis (FSDP-like); the rollout receives it replicated over its devices (data-parallel
generation) or split along the last axis (tensor-parallel-like). Per (transport, dtype, rollout layout): one warm-up
transfer, then `--repeats` timed ones, end to end as the driver sees them (until the rollout's method returns with
its arrays ready); median seconds, against a floor of one host memory copy of the same bytes (`np.copyto`).

- object store: the trainer returns the host numpy view of each distinct shard (bfloat16 viewed as uint16, so that
  every array travels out-of-band); the rollout gets them as a Ray argument, assembles each array on the host and
  `jax.device_put`s it onto its layout.
- transfer server: `jax.experimental.transfer` servers bound to 127.0.0.1 in both groups; the trainer offers its
  arrays with `await_pull(uuid, arrays)`, the rollout `connect`s and `pull`s them. A pull moves the sender's shards
  as they are, so the rollout pulls into the trainer's layout on its own devices and then `jax.device_put`s to its
  layout (both parts timed too). Pulling straight into another layout is probed once per layout (bfloat16).

The last transfer of each row is checked (crc32 of every array) against the trainer's. Writes runs/bench/transport.json.
Usage:
    python scripts/bench/bench_transport.py [--repeats 5] [--out runs/bench/transport.json] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import parse_args

ENV = {"env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}}
LAYOUTS = {"fsdp": 0, "replicated": None, "tensor": -1}  # name -> axis split over the 4 devices (None: replicated)
TIMEOUT = 120


def llama_shapes(hidden=512, layers=6, heads=8, head_dim=64, kv_heads=4, mlp=1376, vocab=8192) -> dict[str, tuple]:
    shapes = {"embed": (vocab, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {p + "q": (hidden, heads * head_dim), p + "k": (hidden, kv_heads * head_dim)}
        shapes |= {p + "v": (hidden, kv_heads * head_dim), p + "o": (heads * head_dim, hidden)}
        shapes |= {p + "gate": (hidden, mlp), p + "up": (hidden, mlp), p + "down": (mlp, hidden)}
        shapes |= {p + "attn_norm": (hidden,), p + "mlp_norm": (hidden,)}
    return shapes | {"final_norm": (hidden,), "lm_head": (vocab, hidden)}


class Group:
    """One worker group: 4 fake CPU devices, a transfer server on loopback, and the arrays it holds."""

    def __init__(self):
        import jax

        self.jax, self.mesh, self.arrays, self.server, self.last = jax, jax.make_mesh((4,), ("x",)), {}, None, []
        self.conns = {}

    def sharding(self, shape, layout):
        from jax.sharding import NamedSharding, PartitionSpec

        axis = LAYOUTS[layout]
        spec = [None] * len(shape)
        if axis is not None and shape[axis] % 4 == 0:
            spec[axis] = "x"
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def start_server(self) -> str:
        from jax.experimental import transfer

        client = self.jax.devices()[0].client
        kw = {"address": "127.0.0.1:0", "transport_addresses": ["127.0.0.1:0"]}
        self.server = transfer.start_transfer_server(client, **kw)
        return self.server.address()

    def api(self) -> dict[str, str]:
        from jax._src.lib import _jax

        docs = [_jax.start_transfer_server.__doc__, _jax.TransferServer._await_pull_flat.__doc__]
        docs += [_jax.TransferServer.connect.__doc__, _jax.TransferConnection._pull_flat.__doc__]
        return {doc.split("(")[0].strip(): doc.strip().splitlines()[0] for doc in docs}

    def make(self, shapes, dtype) -> list[int]:  # the trainer's weights, in its (fsdp) layout; returns crc32s
        rng = np.random.default_rng(0)
        self.arrays = {}
        for name, shape in shapes.items():
            host = rng.standard_normal(shape, np.float32).astype(self.jax.numpy.dtype(dtype))
            self.arrays[name] = self.jax.device_put(host, self.sharding(shape, "fsdp"))
        return self.checksums(self.arrays.values())

    def checksums(self, arrays) -> list[int]:
        return [zlib.crc32(np.ascontiguousarray(np.asarray(a)).view(np.uint8)) for a in arrays]

    def last_checksums(self) -> list[int]:
        return self.checksums(self.last)

    # object store
    def export(self) -> list[list]:  # per array: [(index as (start, stop) per axis, host shard), ...]
        out = []
        for a in self.arrays.values():
            shards = {}
            for s in a.addressable_shards:
                key = tuple(sl.indices(n)[:2] for sl, n in zip(s.index, a.shape, strict=True))
                host = np.asarray(s.data)  # zero-copy view of a CPU shard
                shards.setdefault(key, host.view(np.uint16) if host.dtype.itemsize == 2 else host)
            out.append(list(shards.items()))
        return out

    def load(self, parts, shapes, dtype, layout) -> dict[str, float]:
        start, dtype, out = time.perf_counter(), self.jax.numpy.dtype(dtype), []
        for shards, shape in zip(parts, shapes.values(), strict=True):
            if len(shards) == 1:
                full = shards[0][1]
            else:
                full = np.empty(shape, shards[0][1].dtype)
                for key, host in shards:
                    full[tuple(slice(*k) for k in key)] = host
            out.append(self.jax.device_put(full.view(dtype), self.sharding(shape, layout)))
        self.last = self.jax.block_until_ready(out)
        return {"place": time.perf_counter() - start}

    # transfer server
    def offer(self, uuid: int) -> None:
        self.server.await_pull(uuid, list(self.arrays.values()))

    def pull(self, address, uuid, shapes, dtype, via, layout) -> dict[str, float]:
        import datetime

        start = time.perf_counter()
        if address not in self.conns:  # one connection per peer, made on the first (warm-up) pull
            self.conns[address] = self.server.connect(address)
        conn = self.conns[address]
        dtype = self.jax.numpy.dtype(dtype)
        avals = [self.jax.ShapeDtypeStruct(s, dtype, sharding=self.sharding(s, via)) for s in shapes.values()]
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=60)
        got = self.jax.block_until_ready(conn.pull(uuid, avals, timeout=deadline))
        pulled = time.perf_counter()
        if via != layout:
            got = self.jax.block_until_ready([self.jax.device_put(a, self.sharding(a.shape, layout)) for a in got])
        self.last = got
        return {"pull": pulled - start, "reshard": time.perf_counter() - pulled}


def error_text(e: Exception) -> str:  # the last line of a (Ray-wrapped) error: the exception and its message
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def median_times(fn, repeats: int) -> tuple[float, dict[str, float]]:
    fn()  # warm-up
    walls, parts = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        parts.append(fn())
        walls.append(time.perf_counter() - start)
    return statistics.median(walls), {k: statistics.median(p[k] for p in parts) for k in parts[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/transport.json"))
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the Llama shapes (MLP 2.6875x)")
    parser.add_argument("--layers", type=int, default=6)
    args = parse_args(parser, tiny={"repeats": 1, "hidden": 64, "layers": 1})

    import ml_dtypes
    import ray
    from rich.console import Console
    from rich.table import Table

    shapes = llama_shapes(hidden=args.hidden, layers=args.layers, mlp=args.hidden * 43 // 16)
    params = sum(int(np.prod(s)) for s in shapes.values())
    ray.init(include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="bench-transport-"))
    actor = ray.remote(num_cpus=0, runtime_env=ENV)(Group)
    trainer, rollout = actor.remote(), actor.remote()
    result = {"params": params, "repeats": args.repeats, "devices_per_group": 4, "rows": [], "probes": []}
    result["floor"], errors, uuid = {}, {}, 0
    try:
        result["api"] = ray.get(trainer.api.remote(), timeout=TIMEOUT)
        try:
            addr = ray.get(trainer.start_server.remote(), timeout=TIMEOUT)
            result["addresses"] = [addr, ray.get(rollout.start_server.remote(), timeout=TIMEOUT)]
        except Exception as e:  # the transfer server rows then carry this error
            addr, errors["transfer server"] = None, f"start_transfer_server: {type(e).__name__}: {e}"
        for dtype in ("float32", "bfloat16"):
            want = ray.get(trainer.make.remote(shapes, dtype), timeout=TIMEOUT)
            nbytes = params * np.dtype(getattr(ml_dtypes, dtype, dtype)).itemsize
            src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
            floor, _ = median_times(lambda src=src, dst=dst: np.copyto(dst, src) or {}, args.repeats)
            result["floor"][dtype] = floor
            for layout in ("replicated", "tensor"):

                def by_store(layout=layout, dtype=dtype):
                    ref = trainer.export.remote()
                    return ray.get(rollout.load.remote(ref, shapes, dtype, layout), timeout=TIMEOUT)

                def by_server(layout=layout, dtype=dtype):
                    nonlocal uuid
                    uuid += 1
                    ray.get(trainer.offer.remote(uuid), timeout=TIMEOUT)
                    return ray.get(rollout.pull.remote(addr, uuid, shapes, dtype, "fsdp", layout), timeout=TIMEOUT)

                for transport, fn in (("object store", by_store), ("transfer server", by_server)):
                    row = {"transport": transport, "dtype": dtype, "layout": layout, "mib": nbytes / 2**20}
                    try:
                        if transport in errors:
                            raise RuntimeError(errors[transport])
                        row["median_s"], row["parts_median_s"] = median_times(fn, args.repeats)
                        row["x_floor"] = row["median_s"] / floor
                        row["bitwise_equal"] = ray.get(rollout.last_checksums.remote(), timeout=TIMEOUT) == want
                    except Exception as e:
                        row["error"] = error_text(e)
                    result["rows"].append(row)
        for layout in ("replicated", "tensor") if addr else ():  # pulling straight into another layout (bf16)
            uuid += 1
            probe = {"dtype": dtype, "pull_into": layout}
            try:
                ray.get(trainer.offer.remote(uuid), timeout=TIMEOUT)
                ref = rollout.pull.remote(addr, uuid, shapes, dtype, layout, layout)
                probe["seconds"] = ray.get(ref, timeout=TIMEOUT)["pull"]
                probe["bitwise_equal"] = ray.get(rollout.last_checksums.remote(), timeout=TIMEOUT) == want
            except Exception as e:
                probe["error"] = error_text(e)
            result["probes"].append(probe)
    finally:
        ray.shutdown()

    table = Table(title=f"Weight transport, {params / 1e6:.1f}M params, 4 -> 4 CPU devices (median of {args.repeats})")
    for col in ("transport", "dtype", "receiver layout", "MiB", "median s", "x floor", "parts (median s)", "ok"):
        table.add_column(col, justify="right" if col in ("MiB", "median s", "x floor") else "left")
    for r in result["rows"]:
        if "error" in r:
            table.add_row(r["transport"], r["dtype"], r["layout"], f"{r['mib']:.1f}", "-", "-", r["error"][:80], "")
            continue
        parts = " ".join(f"{k} {v:.3f}" for k, v in r["parts_median_s"].items())
        cells = [f"{r['mib']:.1f}", f"{r['median_s']:.3f}", f"{r['x_floor']:.1f}", parts, str(r["bitwise_equal"])]
        table.add_row(r["transport"], r["dtype"], r["layout"], *cells)
    for dtype, floor in result["floor"].items():
        table.add_row(
            "floor (np.copyto)",
            dtype,
            "-",
            f"{params * (4 if dtype == 'float32' else 2) / 2**20:.1f}",
            f"{floor:.3f}",
            "1.0",
            "",
            "",
        )
    console = Console(width=150)
    console.print(table)
    for p in result["probes"]:
        outcome = p.get("error") or f"{p['seconds']:.3f} s, bitwise equal: {p['bitwise_equal']}"
        console.print(f"direct pull into {p['pull_into']} ({p['dtype']}): {outcome}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
