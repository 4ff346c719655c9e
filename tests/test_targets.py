"""hfjax.compiled.targets: parsing target names (no plugin needed), and, marked `compile_target`, compiling a sharded
program for compile-only TPU and GPU devices (needs `pip install "hfjax[compile]"`: libtpu and the CUDA plugin)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support.settings import REPO, run_command

from hfjax.compiled import targets
from hfjax.compiled.targets import GIB, INSTALL_HINT, Target, TargetError, parse_target, target_devices
from hfjax.models.presets import NAMED_CONFIGS


@pytest.mark.parametrize(
    ("name", "platform", "kind", "devices", "memory"),
    [
        ("v5e:2x4", "tpu", "v5e", 8, 15.75 * GIB),
        ("v5p:2x2x1", "tpu", "v5p", 4, 95.74 * GIB),
        ("v6e:2x4", "tpu", "v6e", 8, 31.25 * GIB),
        ("v4:2x2x2", "tpu", "v4", 8, 30.75 * GIB),
        ("v5e:16x16", "tpu", "v5e", 256, 15.75 * GIB),
        ("h100", "cuda", "h100", 1, 84_942_979_072),
        ("h100x8", "cuda", "h100", 8, 84_942_979_072),
        ("A100-80GBx4", "cuda", "a100-80gb", 4, 85_100_068_864),
    ],
)
def test_parse_target(name: str, platform: str, kind: str, devices: int, memory: float) -> None:
    target = parse_target(name)
    assert (target.name, target.platform, target.kind, target.num_devices) == (name, platform, kind, devices)
    assert target.device_memory_bytes == int(memory)


def test_usable_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(targets.MEM_FRACTION_ENV, raising=False)
    assert parse_target("v5e:2x4").usable_bytes == int(15.75 * GIB)  # TPU: all of what libtpu allows
    h100 = parse_target("h100x8")
    assert h100.memory_fraction == 0.75 and h100.usable_bytes == int(84_942_979_072 * 0.75)
    monkeypatch.setenv(targets.MEM_FRACTION_ENV, ".9")
    assert parse_target("h100").usable_bytes == int(84_942_979_072 * 0.9)
    monkeypatch.setenv(targets.MEM_FRACTION_ENV, "1.5")
    with pytest.raises(TargetError, match=r"XLA_PYTHON_CLIENT_MEM_FRACTION='1\.5'"):
        parse_target("h100")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("v5litepod-8", "'v5litepod-8' is a Cloud TPU accelerator type"),
        ("v5p-8", "v5p-8 is v5p:2x2x1"),
        ("v7x:2x2", "unknown TPU generation 'v7x'"),
        ("v5e:2x2x1", "a v5e topology is v5e:NxN"),
        ("v5p:2x2", "a v5p topology is v5p:NxNxN"),
        ("v6e:0x4", "N >= 1"),
        ("h200", "unknown target 'h200'"),
        ("h100x16", "16 GPUs on one host is out of range"),
        ("h100x0", "0 GPUs on one host"),
        ("", "unknown target ''"),
    ],
)
def test_parse_target_errors(name: str, message: str) -> None:
    with pytest.raises(TargetError, match=message):
        parse_target(name)


def test_errors_list_accepted_names() -> None:
    with pytest.raises(ValueError) as info:  # TargetError is a ValueError
        parse_target("tpu-v5")
    for accepted in ("v5e:NxN", "v5p:NxNxN", "h100", "a100-80gb", "x<N>"):
        assert accepted in str(info.value)


@pytest.mark.parametrize("name", ["v5e:2x4", "h100x8"])
def test_missing_plugin_names_pip_command(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(targets, "_installed", lambda module: False)
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    with pytest.raises(TargetError, match=f"compiling for '{name}' needs .*: {re.escape(INSTALL_HINT)}"):
        target_devices(parse_target(name))


def _compile_matmul(devices: list[jax.Device]) -> jax.stages.Compiled:
    """x [512, 2048] sharded over "data" times w [2048, 4096] sharded over "model", on a 2 x n/2 mesh, in bf16."""
    mesh = Mesh(np.array(devices).reshape(2, -1), ("data", "model"))
    x = jax.ShapeDtypeStruct((512, 2048), jnp.bfloat16, sharding=NamedSharding(mesh, P("data", None)))
    w = jax.ShapeDtypeStruct((2048, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "model")))
    out = NamedSharding(mesh, P("data", "model"))
    return jax.jit(lambda x, w: jax.nn.relu(x @ w), out_shardings=out).lower(x, w).compile()


def _check_matmul_memory(compiled: jax.stages.Compiled) -> None:
    stats = compiled.memory_analysis()  # per device: half of x, a quarter of w, an eighth of the output
    assert stats.argument_size_in_bytes == 512 * 2048 * 2 // 2 + 2048 * 4096 * 2 // 4
    assert stats.output_size_in_bytes == 512 * 4096 * 2 // 8


@pytest.mark.compile_target
def test_compile_for_v5e() -> None:
    target = parse_target("v5e:2x4")
    devices = target_devices(target)
    assert len(devices) == 8 and target_devices(target) == devices
    assert {d.platform for d in devices} == {"tpu"} and devices[0].device_kind == "TPU v5 lite"
    assert {d.process_index for d in devices} == {0}  # a v5e 2x4 slice is one host
    _check_matmul_memory(_compile_matmul(devices))


@pytest.mark.compile_target
def test_v5e_memory_limit_is_libtpus() -> None:
    """A program just under the target's usable bytes compiles; one just over it runs out of HBM."""
    target = parse_target("v5e:2x2")
    mesh = Mesh(np.array(target_devices(target)), ("x",))
    replicated = NamedSharding(mesh, P())

    def compile_output(size: int) -> None:
        jax.jit(lambda: jnp.zeros((size,), jnp.int8), out_shardings=replicated).lower().compile()

    compile_output(target.usable_bytes - 16 * 2**20)
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
        compile_output(target.usable_bytes + 16 * 2**20)


@pytest.mark.compile_target
@pytest.mark.parametrize("name", ["v5p:2x2x1", "v6e:2x4", "v4:2x2x1"])
def test_tpu_generations_resolve(name: str) -> None:
    target = parse_target(name)
    devices = target_devices(target)
    assert len(devices) == target.num_devices and {d.platform for d in devices} == {"tpu"}


@pytest.mark.compile_target
def test_compile_for_h100x8() -> None:
    target = parse_target("h100x8")
    devices = target_devices(target)
    assert len(devices) == 8 and target_devices(target) == devices
    assert {d.platform for d in devices} == {"gpu"} and devices[0].device_kind == "NVIDIA H100 80GB HBM3"
    assert devices[0].compute_capability == "9.0" and {d.process_index for d in devices} == {0}
    _check_matmul_memory(_compile_matmul(devices))


@pytest.mark.compile_target
def test_heads_wider_than_128_compile_for_h100_as_xla_attention() -> None:
    """Gemma 3's 256-wide heads: jax allows cuDNN past 128 only when the process itself runs on a Hopper GPU (it reads
    the local backend, not the program's devices), so compiled here for an H100 the attention runs as xla, and the
    program compiles (it raised NotImplementedError in jax's cuDNN check before)."""
    from hfjax.models.attention import causal_attention
    from hfjax.models.program import program_layout
    from hfjax.parallel import Layout

    layout = Layout.from_config({"mesh": {"fsdp": 1}, "rules": "fsdp"}).on_devices(target_devices(parse_target("h100")))
    one = NamedSharding(layout.mesh, P())
    q = jax.ShapeDtypeStruct((2, 64, 4, 256), jnp.bfloat16, sharding=one)
    kv = jax.ShapeDtypeStruct((2, 64, 1, 256), jnp.bfloat16, sharding=one)
    valid = jax.ShapeDtypeStruct((2, 64), jnp.int32, sharding=one)
    with program_layout(layout):
        attend = jax.jit(lambda q, k, v, m: causal_attention(q, k, v, valid=m))
        text = attend.lower(q, kv, kv, valid).compile().as_text()
    assert "__cudnn$fmha" not in text


@pytest.mark.compile_target
def test_cudnn_attention_and_its_gradient_compile_for_h100x8() -> None:
    """bfloat16 attention with rows split over 8 GPUs takes cuDNN's fused kernels forward and backward, and moves
    nothing between devices. JAX reads cuDNN's version while tracing it: the `compile` extra brings the library
    (without it: "cuDNN not found")."""
    from hfjax.models.attention import causal_attention
    from hfjax.models.program import program_layout
    from hfjax.parallel import Layout

    layout = Layout.from_config({"mesh": {"fsdp": 8}, "rules": "fsdp"}).on_devices(
        target_devices(parse_target("h100x8"))
    )
    rows = NamedSharding(layout.mesh, P("fsdp"))
    q = jax.ShapeDtypeStruct((16, 128, 8, 64), jnp.bfloat16, sharding=rows)
    kv = jax.ShapeDtypeStruct((16, 128, 2, 64), jnp.bfloat16, sharding=rows)
    valid = jax.ShapeDtypeStruct((16, 128), jnp.int32, sharding=rows)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array) -> jax.Array:
        return causal_attention(q, k, v, valid=valid).astype(jnp.float32).sum()

    with program_layout(layout):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, valid).compile().as_text()
    kernels = set(re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', text))
    assert any(k.endswith("Backward") for k in kernels) and any(not k.endswith("Backward") for k in kernels), kernels
    assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute", text)


@pytest.mark.compile_target
@pytest.mark.parametrize("name", ["h100", "v5e:1x1"])
def test_the_optimizer_step_updates_its_donated_buffers_in_place(name: str) -> None:
    """The AdamW step (clipping, the update, the skip of a non-finite step) needs no temporaries of the parameters'
    size on an accelerator: it writes the donated parameters and moments in place. With the skip as a `lax.cond`, the
    H100 program held three float32 copies of the parameters (5.5 GiB of a Qwen2.5-0.5B GRPO step's 14.7 GiB peak)."""
    from hfjax.optim import OptimConfig, make_optimizer
    from hfjax.optim.train_state import apply_program, frozen

    device = jax.sharding.SingleDeviceSharding(target_devices(parse_target(name))[0])
    params = {"w": jnp.zeros((2048, 4096), jnp.float32), "b": jnp.zeros((4096,), jnp.float32)}  # 32 MiB
    optimizer = make_optimizer(OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=1.0), None)
    opt_state = jax.eval_shape(optimizer.init, params)
    on_target = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device)  # noqa: E731
    params, opt_state = jax.tree.map(on_target, params), jax.tree.map(on_target, opt_state)
    shardings = frozen((jax.tree.map(lambda _: device, params), jax.tree.map(lambda _: device, opt_state)))
    compiled = (
        apply_program(donate=True)
        .lower(params, opt_state, params, optimizer=optimizer, grad_clip=1.0, shardings=shardings)
        .compile()
    )
    assert compiled.memory_analysis().temp_size_in_bytes < (2048 * 4096 + 4096) * 4 / 8


@pytest.mark.compile_target
def test_the_prefill_writes_the_prompt_pool_one_pool_at_a_time(tmp_path: Path) -> None:
    """The engine's fused prefill and insert for a v5e-8 (prompt rows split over data=8) gathers each layer's keys
    and values to every data shard and writes them into its pool. Written one pool after another (`write_prompts`),
    one pool's gathered rows are alive at a time: 20 MiB of temporaries here. Unordered, XLA gathered every pool's rows
    while the forward ran and wrote them all at the end: 164 MiB here (all 12 pools' rows are 192 MiB); at full size
    12.06 GiB against 5.23 GiB for the Qwen2.5-0.5B v5e-8 config's prefill, which then did not fit. Compiled by
    `hfjax compile --programs` in a process of its own (the user's XLA flags and matmul precision)."""
    config = str(REPO / "configs/gsm8k/qwen2.5-0.5b-grpo-tpu-v5e-8.yaml")
    shape = [
        "actor.model_path=bench-25m",
        "data.max_prompt_length=128",
        "rollout.slots=256",
        "rollout.response_length=64",
    ]
    report = tmp_path / "report.json"
    options = ["--target", "v5e:2x4", "--json", str(report), "--programs", "rollout prefill"]
    run_command(["compile", config, *shape, *options], tmp_path / "compile.log", timeout_s=600)
    (prefill,) = json.loads(report.read_text())["programs"]
    model = NAMED_CONFIGS["bench-25m"]
    pool_rows = 256 * 128 * model.num_kv_heads * model.head_dim * 2  # one pool's rows (bfloat16) on every part
    assert prefill["program"] == "prefill 256 x 128"
    assert prefill["temporaries"] < 2 * model.num_layers * pool_rows / 4, prefill


@pytest.mark.compile_target
def test_a100_config_loads() -> None:
    devices = target_devices(parse_target("a100-80gbx2"))
    assert [d.device_kind for d in devices] == ["NVIDIA A100-SXM4-80GB"] * 2 and devices[0].compute_capability == "8.0"


def test_target_is_hashable_and_frozen() -> None:
    target = parse_target("v5e:2x4")
    assert {target: 1}[Target(**vars(target))] == 1
    with pytest.raises(AttributeError):
        target.num_devices = 4  # type: ignore[misc]
