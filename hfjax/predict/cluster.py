"""The cluster the auto-mapper plans for: hosts x devices per host, memory per device, and a `DeviceProfile`
(matmul FLOP/s, memory bandwidth, intra-host and inter-host link bandwidth).

Built-in profiles carry datasheet peaks (sources below) plus two stated assumptions: the fraction of peak FLOP/s a
large-model step reaches (`compute_efficiency`) and of peak memory/link bandwidth (`bandwidth_efficiency`). The CPU
profile is measured on the spot (`calibrate_cpu`), so its efficiencies are 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hfjax.typed_config import ConfigError

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Per-device speeds. Bandwidths are bytes/s in one direction, per device (what a ring collective's step
    moves). `collective_latency_s`: fixed cost of one collective call (matters for per-token decode all-reduces).
    `call_overhead_s`: fixed cost of one worker call of a role in a stage (dispatch, host transfers, Python; 0 in
    the built-in profiles, fitted by `hfjax automap --calibrate`).
    `shared_host`: the devices of a host time-share its cores (fake CPU devices): the rates are each device's
    share with all of the host's devices busy, a group of g of its n devices running alone gets n/g times them,
    communication does not overlap compute, and groups on the host do not run concurrently."""

    name: str
    matmul_flops: float
    memory_bandwidth: float
    intra_host_bandwidth: float
    inter_host_bandwidth: float
    collective_latency_s: float = 10e-6
    decode_layer_overhead_s: float = 0.0
    compute_efficiency: float = 1.0
    bandwidth_efficiency: float = 1.0
    source: str = ""
    shared_host: bool = False
    narrow_matmul_flops: tuple[tuple[int, float], ...] = ()
    call_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("matmul_flops", "memory_bandwidth", "intra_host_bandwidth", "inter_host_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DeviceProfile({self.name}).{name} must be > 0, got {getattr(self, name)!r}")
        try:
            narrow = tuple((int(width), float(flops)) for width, flops in self.narrow_matmul_flops)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"DeviceProfile({self.name}).narrow_matmul_flops must be (width, FLOP/s) pairs, got "
                f"{self.narrow_matmul_flops!r}"
            ) from error
        if any(width < 1 or not flops > 0 for width, flops in narrow):
            raise ValueError(f"DeviceProfile({self.name}).narrow_matmul_flops: widths >= 1, FLOP/s > 0, got {narrow}")
        object.__setattr__(self, "narrow_matmul_flops", narrow)
        for name in ("collective_latency_s", "decode_layer_overhead_s", "call_overhead_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"DeviceProfile({self.name}).{name} must be >= 0 seconds, got {getattr(self, name)!r}")
        for name in ("compute_efficiency", "bandwidth_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"DeviceProfile({self.name}).{name} must be in (0, 1], got {getattr(self, name)!r}")

    @property
    def flops(self) -> float:
        """Achievable matmul FLOP/s."""
        return self.matmul_flops * self.compute_efficiency

    def flops_at(self, width: float) -> float:
        """Achievable FLOP/s of matmuls whose per-device output is `width` wide."""
        points = sorted(self.narrow_matmul_flops)
        if not points or width >= points[-1][0]:
            return self.flops
        if width <= points[0][0]:
            return points[0][1] * self.compute_efficiency
        for (w0, f0), (w1, f1) in itertools.pairwise(points):
            if w0 <= width <= w1:
                fraction = math.log(width / w0) / math.log(w1 / w0)
                return (f0 + fraction * (f1 - f0)) * self.compute_efficiency
        raise AssertionError("unreachable: width lies between the first and last point")

    def bandwidth(self, kind: str) -> float:
        """Achievable bytes/s of `memory`, `intra` (host) or `inter` (host) traffic."""
        peak = {"memory": self.memory_bandwidth, "intra": self.intra_host_bandwidth, "inter": self.inter_host_bandwidth}
        return peak[kind] * self.bandwidth_efficiency


# Assumptions for datasheet profiles (not datasheet numbers): large dense transformer steps reach about half of
# peak bf16 FLOP/s (MFU 40-55% is what Megatron-style training reports on A100/H100), and about 80% of peak HBM
# and link bandwidth; one collective call costs about 10 us; a decode step's layer launches about 5 fused kernels
# at about 4 us each (20 us per layer).
_MFU, _BW_EFF, _LAYER_S = 0.5, 0.8, 20e-6

# name -> (profile, memory per device in bytes, devices per host)
BUILTIN: dict[str, tuple[DeviceProfile, int, int]] = {
    # "NVIDIA A100 Tensor Core GPU" datasheet (80GB SXM): BF16 tensor core 312 TFLOPS dense, HBM2e 80GB at
    # 2,039 GB/s, NVLink 600 GB/s (both directions: 300 GB/s each way). "NVIDIA DGX A100" datasheet: 8 GPUs per
    # host and 8 single-port ConnectX-6 200 Gb/s HDR InfiniBand NICs for compute, i.e. 25 GB/s per GPU each way.
    "a100-80gb": (
        DeviceProfile(
            "a100-80gb", 312e12, 2039e9, 300e9, 25e9, 10e-6, _LAYER_S, _MFU, _BW_EFF, "NVIDIA A100 / DGX A100"
        ),
        80 * GIB,
        8,
    ),
    # "NVIDIA H100 Tensor Core GPU" datasheet (H100 SXM): BF16 tensor core 1,979 TFLOPS with sparsity, 989.5
    # dense; HBM3 80GB at 3.35 TB/s; NVLink 900 GB/s (450 GB/s each way). "NVIDIA DGX H100" datasheet: 8 GPUs
    # and 8 ConnectX-7 400 Gb/s NICs per host, i.e. 50 GB/s per GPU each way.
    "h100": (
        DeviceProfile(
            "h100", 989.5e12, 3350e9, 450e9, 50e9, 10e-6, _LAYER_S, _MFU, _BW_EFF, "NVIDIA H100 SXM / DGX H100"
        ),
        80 * GIB,
        8,
    ),
    # Google Cloud "TPU v5e" documentation (system architecture): 197 TFLOPS bf16 per chip, 16 GB HBM2 at 819 GB/s
    # (later revisions print 800 GiB/s), inter-chip interconnect 1,600 Gbps = 200 GB/s per chip (400 GB/s
    # bidirectional in later revisions; we take 200 GB/s each way), 2D torus, 8 chips per host. Chips on other
    # hosts of the same slice are reached over ICI too, so inter-host = intra-host here (DCN only links slices).
    "tpu-v5e": (
        DeviceProfile(
            "tpu-v5e", 197e12, 819e9, 200e9, 200e9, 10e-6, _LAYER_S, _MFU, _BW_EFF, "Cloud TPU v5e documentation"
        ),
        16 * GIB,
        8,
    ),
    # Google Cloud "TPU v5p" documentation: 459 TFLOPS bf16 per chip, 95 GB HBM2e at 2,765 GB/s, inter-chip
    # interconnect 4,800 Gbps = 600 GB/s per chip (1,200 GB/s bidirectional in later revisions: 600 GB/s each
    # way), 3D torus, 4 chips per host; ICI spans hosts within a slice, as for v5e.
    "tpu-v5p": (
        DeviceProfile(
            "tpu-v5p", 459e12, 2765e9, 600e9, 600e9, 10e-6, _LAYER_S, _MFU, _BW_EFF, "Cloud TPU v5p documentation"
        ),
        95 * GIB,
        4,
    ),
}


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """`hosts` x `devices_per_host` devices of one kind, `device_memory_bytes` each."""

    hosts: int
    devices_per_host: int
    device_memory_bytes: int
    profile: DeviceProfile

    def __post_init__(self) -> None:
        for name in ("hosts", "devices_per_host", "device_memory_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ClusterSpec.{name} must be a positive integer, got {value!r}")

    @property
    def num_devices(self) -> int:
        return self.hosts * self.devices_per_host

    def link(self, span: int) -> str:
        """`intra` when a group of `span` consecutive devices (host-major numbering) fits in one host."""
        return "intra" if span <= self.devices_per_host else "inter"

    @classmethod
    def builtin(cls, name: str, hosts: int, devices_per_host: int | None = None) -> ClusterSpec:
        """A cluster of a built-in device kind (`a100-80gb`, `h100`, `tpu-v5e`, `tpu-v5p`)."""
        if name not in BUILTIN:
            raise ValueError(f"profile {name!r}: expected one of {sorted(BUILTIN)} or 'cpu'")
        profile, memory, per_host = BUILTIN[name]
        return cls(hosts, devices_per_host or per_host, memory, profile)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "cluster") -> ClusterSpec:
        """From `{hosts, devices_per_host?, device_memory_gib?, profile}`; `profile` is a built-in name, `cpu`
        (calibrated now on the local devices), or a mapping of `DeviceProfile` fields with an optional `base`
        built-in name whose fields it overrides."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a mapping with 'hosts' and 'profile', got {type(data).__name__}")
        known = {"hosts", "devices_per_host", "device_memory_gib", "profile"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown keys {unknown}; expected {sorted(known)}")
        spec = data.get("profile")
        if spec == "cpu":
            base = local_cpu()
            memory, per_host, profile = base.device_memory_bytes, base.devices_per_host, base.profile
        elif isinstance(spec, str):
            profile, memory, per_host = _builtin(spec, f"{where}.profile")
        elif isinstance(spec, Mapping):
            fields = dict(spec)
            base_name = fields.pop("base", None)
            if base_name is not None:
                base_profile, memory, per_host = _builtin(base_name, f"{where}.profile.base")
                fields = {**dataclasses.asdict(base_profile), **fields}
            else:
                memory, per_host = 0, 0
            valid = {f.name for f in dataclasses.fields(DeviceProfile)}
            bad = sorted(set(fields) - valid)
            if bad:
                raise ConfigError(f"{where}.profile: unknown fields {bad}; expected {sorted(valid)} and 'base'")
            fields.setdefault("name", "custom")
            try:
                profile = DeviceProfile(**fields)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{where}.profile: {exc}") from exc
        else:
            raise ConfigError(f"{where}.profile: expected a name ({sorted(BUILTIN)}, 'cpu') or a mapping, got {spec!r}")
        if "hosts" not in data:
            raise ConfigError(f"{where}.hosts: required (number of hosts)")
        try:
            memory = int(float(data["device_memory_gib"]) * GIB) if "device_memory_gib" in data else memory
            per_host = int(data.get("devices_per_host", per_host))
            hosts = int(data["hosts"])
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"{where}: hosts, devices_per_host and device_memory_gib must be numbers ({exc})"
            ) from exc
        for key, value in (("device_memory_gib", memory), ("devices_per_host", per_host)):
            if not value:
                raise ConfigError(f"{where}.{key}: required when the profile has no built-in base")
        try:
            return cls(hosts, per_host, memory, profile)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from exc

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterSpec:
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            reason = " ".join(str(exc).split())
            raise ConfigError(f"{path}: not a readable YAML file ({reason}); expected a cluster mapping") from exc
        return cls.from_dict(data, str(path))


def _builtin(name: str, where: str) -> tuple[DeviceProfile, int, int]:
    if name not in BUILTIN:
        raise ConfigError(f"{where}: unknown profile {name!r}; expected one of {sorted(BUILTIN)} or 'cpu'")
    return BUILTIN[name]


def _timed(fn: Any, arg: Any, budget_s: float) -> float:
    """Seconds per call of `fn(arg)` (blocking), after one warm-up, repeated for about `budget_s`."""
    import jax

    jax.block_until_ready(fn(arg))
    calls, start = 0, time.perf_counter()
    while True:
        jax.block_until_ready(fn(arg))
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s:
            return elapsed / calls


def _decode_layers(x: Any, weights: Any) -> Any:
    """A chain of tiny decoder layers (norm, attention over a few keys, gated MLP): a decode step's per-layer
    kernels at a size where their fixed cost, not their arithmetic, sets the time."""
    import jax
    import jax.numpy as jnp

    for wq, wk, w_up, w_down in weights:
        h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        scores = jax.nn.softmax((h @ wq) @ (h @ wk).swapaxes(-1, -2), axis=-1)
        x = x + scores @ h
        x = x + jax.nn.silu(x @ w_up) @ w_down
    return x


def calibrate_cpu(budget_s: float = 0.4, dtype: str = "float32") -> DeviceProfile:
    """Measures the local devices all busy at once (fake CPU devices share the host's cores):
    - FLOP/s: a batched matmul, one 384^3 product per device, and products 1024 x 384 by 384 x {48, 96, 192}
      (the narrow outputs of tensor-parallel shards);
    - memory bandwidth: the weight bytes per second a decode step's matmul streams (8 rows times a 32 MiB weight
      per device; a copy would also time its output's first-touch page faults, slow on a virtual machine);
    - decode overhead per layer: a jitted chain of tiny decoder layers, 8 rows of width 64 per device;
    - link bandwidth: a jitted all-gather (the collective the sharded programs run) of 512 KiB per device, less
      its fixed cost measured with a 4-byte shard; with one device nothing crosses a link, and its memory bandwidth
      stands in.
    About `budget_s` seconds plus compile time."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.local_devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    on_mesh = NamedSharding(mesh, PartitionSpec("d"))
    rng = np.random.default_rng(0)

    def put(*shape: int) -> jax.Array:
        return jax.device_put((rng.standard_normal(shape) / shape[-1] ** 0.5).astype(dtype), on_mesh)

    k = 384
    matmul_s = _timed(jax.jit(lambda x: x @ x), put(n, k, k), budget_s / 4)
    product = jax.jit(lambda x, w: x @ w)
    narrow = []
    for width in (48, 96, 192):
        weight = put(n, k, width)
        seconds = _timed(lambda x, weight=weight: product(x, weight), put(n, 1024, k), budget_s / 12)
        narrow.append((width, 2 * 1024 * k * width / seconds))
    rows, width, columns = 8, 1024, 8192  # 32 MiB of float32 weight per device
    weight = put(n, width, columns)
    stream_s = _timed(lambda x: product(x, weight), put(n, rows, width), budget_s / 4)
    layers, small = 8, 64
    weights = [tuple(put(n, small, small) for _ in range(4)) for _ in range(layers)]
    chain = jax.jit(_decode_layers)
    layer_s = _timed(lambda x: chain(x, weights), put(n, rows, small), budget_s / 6) / layers
    gather = jax.jit(
        jax.shard_map(
            lambda v: jax.lax.all_gather(v, "d", tiled=True),
            mesh=mesh,
            in_specs=PartitionSpec("d"),
            out_specs=PartitionSpec(),
            check_vma=False,  # all_gather's result is the same on every device
        )
    )
    shard_elems = 2**17  # 512 KiB of float32 per device
    gather_s = _timed(gather, put(n * shard_elems), budget_s / 6)
    latency_s = _timed(gather, jax.device_put(np.ones((n,), np.float32), on_mesh), budget_s / 6)
    memory_bandwidth = np.dtype(dtype).itemsize * width * columns / stream_s
    link = (n - 1) * 4 * shard_elems / max(gather_s - latency_s, 1e-9) if n > 1 else memory_bandwidth
    return DeviceProfile(
        name=f"cpu-{n}dev",
        matmul_flops=2 * k**3 / matmul_s,
        memory_bandwidth=memory_bandwidth,
        intra_host_bandwidth=link,
        inter_host_bandwidth=link,
        collective_latency_s=latency_s,
        decode_layer_overhead_s=layer_s,
        narrow_matmul_flops=(*narrow, (k, 2 * k**3 / matmul_s)),
        source=f"measured now on {n} local {devices[0].platform} devices ({dtype} matmul)",
        shared_host=devices[0].platform == "cpu",
    )


def local_cpu(budget_s: float = 1.5) -> ClusterSpec:
    """One host holding the local devices, memory split evenly between them, profile calibrated now."""
    import jax
    import psutil

    n = jax.local_device_count()
    return ClusterSpec(1, n, psutil.virtual_memory().total // n, calibrate_cpu(budget_s))
