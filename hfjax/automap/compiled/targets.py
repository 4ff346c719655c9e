"""Compile-only devices for a named hardware target, so that a CPU machine lowers and compiles programs for a TPU slice
or a GPU host it does not have (memory analysis, sharding and layout checks before renting the hardware).

A target name is either a TPU `<generation>:<topology>` as libtpu spells it (`v5e:2x4`, `v5p:2x2x1`, `v6e:2x4`,
`v4:2x2x1`), or a GPU from `GPU_TARGETS` with an optional `x<N>` for N GPUs on one host (`h100`, `h100x8`,
`a100-80gbx8`). `parse_target` only parses (no plugin needed); `target_devices` loads libtpu or the CUDA plugin and
returns the target's compile-only `jax.Device`s: build a `Mesh` over them, then `jax.jit(f).lower(...).compile()` with
`ShapeDtypeStruct` arguments. Run with `JAX_PLATFORMS=cpu` so that JAX does not try to run on the plugins' hardware.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import re
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import jax

GIB = 1 << 30
INSTALL_HINT = 'pip install "hfjax[compile]"'
MAX_GPUS_PER_HOST = 8
MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
GPU_DEFAULT_MEM_FRACTION = 0.75  # JAX preallocates 75% of a GPU's total memory unless the variable above says otherwise


class TargetError(ValueError):
    """A target name that does not parse, or a target whose compile-only devices cannot be made here."""


class TpuGeneration(NamedTuple):
    """What a TPU generation's topology looks like and how much HBM its compiler lets one device use."""

    dims: int  # topology rank: 2 (AxB) for the "lite" chips, 3 (AxBxC) for the others
    host_chips: int  # the most chips one host has: a topology of at most this many chips is one host
    chip_config: str  # libtpu's `chip_config_name`: "megacore" makes one device of a chip's two TensorCores
    device_memory_bytes: int


# HBM per device: the limit libtpu 0.0.42.1 enforces when compiling, as its "exceeds available HBM (...)" error prints
# it (measured by compiling ever larger outputs); the nominal HBM per chip (Google Cloud TPU docs) in each comment.
TPU_GENERATIONS: dict[str, TpuGeneration] = {
    "v4": TpuGeneration(3, 4, "megacore", int(30.75 * GIB)),  # 32 GiB per chip, one megacore device per chip
    "v5e": TpuGeneration(2, 8, "default", int(15.75 * GIB)),  # 16 GiB per chip
    "v5p": TpuGeneration(3, 4, "megacore", int(95.74 * GIB)),  # 95 GiB per chip, one megacore device per chip
    "v6e": TpuGeneration(2, 8, "default", int(31.25 * GIB)),  # 32 GiB per chip
}


class GpuModel(NamedTuple):
    """A GPU that `target_devices` can compile for: its target config file and its memory."""

    config_file: str  # in hfjax/automap/compiled/gpu_targets/: a stream_executor.GpuTargetConfigProto in text format
    device_memory_bytes: int


# Total memory as the CUDA runtime reports it (`cudaMemGetInfo` total; the `device_memory_size` of XLA's own specs in
# xla/backends/gpu/target_config/specs/), repeated in each config file.
GPU_TARGETS: dict[str, GpuModel] = {
    "h100": GpuModel("h100.txtpb", 84_942_979_072),  # H100 SXM5, "80 GB" HBM3
    "a100-80gb": GpuModel("a100-80gb.txtpb", 85_100_068_864),  # A100 SXM4, "80 GB" HBM2e
}

_TPU_NAME = re.compile(r"(?P<kind>v\w+):(?P<topology>\d+(?:x\d+)*)")
_CLOUD_NAME = re.compile(r"v\d\w*-\d+")
_GPU_NAME = re.compile(r"(?P<kind>[a-z0-9-]+?)(?:x(?P<count>\d+))?")


@dataclass(frozen=True)
class Target:
    """A hardware target: its platform, device count and the memory one device offers a program."""

    name: str  # as the user typed it
    platform: str  # "tpu" or "cuda"
    kind: str  # TPU generation ("v5e") or GPU model ("h100")
    topology: tuple[int, ...]  # TPU chip grid (2, 4); GPU (partitions, hosts, GPUs per host) as the plugin takes it
    num_devices: int
    device_memory_bytes: int  # per device (see TPU_GENERATIONS and GPU_TARGETS for where each figure comes from)
    memory_fraction: float = 1.0  # of device_memory_bytes that JAX lets a program use

    @property
    def usable_bytes(self) -> int:
        """Bytes per device that a program may use: the device's memory times the fraction JAX takes of it."""
        return int(self.device_memory_bytes * self.memory_fraction)


def accepted_targets() -> str:
    """A sentence that lists the target names `parse_target` takes."""
    tpu = ", ".join(f"{kind}:{'x'.join(['N'] * gen.dims)}" for kind, gen in TPU_GENERATIONS.items())
    gpu = ", ".join(GPU_TARGETS)
    return (
        f"a TPU slice as <generation>:<topology> ({tpu}; e.g. v5e:2x4, v5p:2x2x1) or a GPU host as <gpu>[x<N>] "
        f"with <gpu> one of {gpu} and N from 1 to {MAX_GPUS_PER_HOST} GPUs (e.g. h100, h100x8)"
    )


def parse_target(name: str) -> Target:
    """The `Target` that `name` names; raises TargetError naming the bad value and what is accepted. Pure parsing:
    needs neither libtpu nor the CUDA plugin."""
    text = name.strip().lower()
    if match := _TPU_NAME.fullmatch(text):
        return _tpu_target(name, match["kind"], tuple(int(d) for d in match["topology"].split("x")))
    if (match := _GPU_NAME.fullmatch(text)) and match["kind"] in GPU_TARGETS:
        count = int(match["count"] or 1)
        if not 1 <= count <= MAX_GPUS_PER_HOST:
            raise TargetError(
                f"target {name!r}: {count} GPUs on one host is out of range; expected {accepted_targets()}"
            )
        model = GPU_TARGETS[match["kind"]]
        return Target(name, "cuda", match["kind"], (1, 1, count), count, model.device_memory_bytes, _gpu_fraction())
    if _CLOUD_NAME.fullmatch(text):
        raise TargetError(
            f"target {name!r} is a Cloud TPU accelerator type, not a topology: give <generation>:<topology> "
            f"(v5litepod-8 is v5e:2x4, v5p-8 is v5p:2x2x1); expected {accepted_targets()}"
        )
    raise TargetError(f"unknown target {name!r}: expected {accepted_targets()}")


def _tpu_target(name: str, kind: str, topology: tuple[int, ...]) -> Target:
    gen = TPU_GENERATIONS.get(kind)
    if gen is None:
        raise TargetError(f"target {name!r}: unknown TPU generation {kind!r}; expected {accepted_targets()}")
    if len(topology) != gen.dims or min(topology) < 1:
        shape = "x".join(["N"] * gen.dims)
        raise TargetError(f"target {name!r}: a {kind} topology is {kind}:{shape} with N >= 1 chips per axis")
    return Target(name, "tpu", kind, topology, math.prod(topology), gen.device_memory_bytes)


def _gpu_fraction() -> float:
    raw = os.environ.get(MEM_FRACTION_ENV)
    if raw is None:
        return GPU_DEFAULT_MEM_FRACTION
    try:
        fraction = float(raw)
    except ValueError:
        fraction = -1.0
    if not 0.0 < fraction <= 1.0:
        raise TargetError(f"{MEM_FRACTION_ENV}={raw!r} is not a fraction in (0, 1]")
    return fraction


# libtpu's scheduler keeps at most this percent of a chip's memory for what it schedules ahead of need: weight
# gathers prefetched layers early, collective-matmul output buffers allocated at the start of a backward. By default it
# fills the room a program leaves (a Llama-3.2-1B update under fsdp 8: 10.31 GiB compiled, 5.32 with this flag)
LEAN_SCHEDULE_FLAG = "--xla_tpu_scheduler_percent_shared_memory_limit=1"


def schedule_lean() -> None:
    """Makes libtpu, when it loads in this process, schedule every program at its leanest (`LEAN_SCHEDULE_FLAG`):
    the memory a program needs, not what the default schedule fills when it has room. Raises TargetError once a TPU
    target has loaded libtpu (its flags are read once)."""
    if _tpu_devices.cache_info().currsize:
        raise TargetError("the lean TPU schedule must be chosen before the first TPU target is loaded in a process")
    flags = os.environ.get("LIBTPU_INIT_ARGS", "")
    if LEAN_SCHEDULE_FLAG not in flags.split():
        os.environ["LIBTPU_INIT_ARGS"] = f"{flags} {LEAN_SCHEDULE_FLAG}".strip()


def target_devices(target: Target) -> list[jax.Device]:
    """The compile-only devices of `target` (the same objects on every call, so meshes over them compare equal).
    Raises TargetError, with the pip command to run, where the target's plugin is not installed."""
    devices = _tpu_devices(target) if target.platform == "tpu" else _gpu_devices(target)
    if len(devices) != target.num_devices:
        raise TargetError(f"target {target.name!r}: expected {target.num_devices} devices, got {len(devices)}")
    return list(devices)  # a copy: the cached list stays as the plugin made it


def _missing(target: Target, what: str) -> TargetError:
    return TargetError(f"compiling for {target.name!r} needs {what}, which is not installed here: {INSTALL_HINT}")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


@functools.cache
def _tpu_devices(target: Target) -> list[jax.Device]:
    if not (_installed("libtpu") or os.environ.get("TPU_LIBRARY_PATH")):
        raise _missing(target, "libtpu (jax[tpu])")
    # libtpu takes a lock file per machine: let a second process (a test run next to a compile) load it too
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    gen = TPU_GENERATIONS[target.kind]
    options: dict[str, object] = {"chip_config_name": gen.chip_config}
    if target.num_devices <= gen.host_chips:  # one host (libtpu's default host is 2x2x1 chips)
        options["chips_per_host_bounds"] = (*target.topology, 1, 1)[:3]
    name = f"{target.kind}:{'x'.join(map(str, target.topology))}"
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name, **options).devices)
    except Exception as e:  # libtpu refuses a topology with a JaxRuntimeError (INVALID_ARGUMENT)
        raise TargetError(f"target {target.name!r}: libtpu could not make topology {name!r}: {e}") from e


@functools.cache
def _gpu_devices(target: Target) -> list[jax.Device]:
    if not (_installed("jax_plugins.xla_cuda12") or _installed("jax_plugins.xla_cuda13")):
        raise _missing(target, "the CUDA PJRT plugin (jax-cuda12-plugin)")
    from jax.experimental import topologies

    config = resources.files(__package__).joinpath("gpu_targets", GPU_TARGETS[target.kind].config_file).read_text()
    # topology is <partitions>x<hosts per partition>x<GPUs per host>; the plugin ignores topology_name
    shape = "x".join(map(str, target.topology))
    try:
        topology = topologies.get_topology_desc(platform="cuda", topology=shape, target_config=config)
    except NotImplementedError as e:  # the plugin did not register (a cuda13 plugin next to a cuda12 one, ...)
        raise _missing(target, "a working CUDA PJRT plugin") from e
    except Exception as e:
        raise TargetError(f"target {target.name!r}: the CUDA plugin could not make topology {shape!r}: {e}") from e
    return list(topology.devices)
