"""hfjax.automap.compiled.targets: parsing target names (no plugin needed), `hfjax compile`'s report of a program that
fails to compile (on this machine's CPU devices standing in for the target's), and, marked `compile_target`, compiling a
sharded program for compile-only TPU and GPU devices (needs `pip install "hfjax[compile]"`: libtpu and the CUDA
plugin)."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support.settings import REPO, run_command
from support.tiny_models import TINY

from hfjax.automap.compiled import report, targets
from hfjax.automap.compiled.failures import MESSAGE_CHARS, PROGRAM_KINDS, classify, knob, program_kind
from hfjax.automap.compiled.programs import ProgramMemory, ProgramTrace, measure
from hfjax.automap.compiled.targets import GIB, INSTALL_HINT, Target, TargetError, parse_target, target_devices
from hfjax.cli.main import main
from hfjax.config.rl import load_rl_config
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


def test_the_lean_schedule_is_a_libtpu_flag_chosen_before_libtpu_loads(monkeypatch, capsys) -> None:
    """`hfjax compile --lean` adds libtpu's scheduler limit to LIBTPU_INIT_ARGS (once, beside the user's flags) before
    a TPU target loads libtpu; once one has, and for a GPU target, it is refused with a line naming the option."""
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_jf_dump_to=/tmp/x")
    monkeypatch.setattr(targets._tpu_devices, "cache_info", lambda: functools._CacheInfo(0, 0, None, 0))
    targets.schedule_lean()
    targets.schedule_lean()
    assert os.environ["LIBTPU_INIT_ARGS"].split() == ["--xla_jf_dump_to=/tmp/x", targets.LEAN_SCHEDULE_FLAG]
    monkeypatch.setattr(targets._tpu_devices, "cache_info", lambda: functools._CacheInfo(0, 1, None, 1))
    with pytest.raises(TargetError, match="before the first TPU target is loaded"):
        targets.schedule_lean()
    assert main(["compile", str(REPO / "configs/gsm8k/qwen2.5-0.5b-grpo-1gpu.yaml"), "--target", "h100", "--lean"]) == 2
    assert "--lean: a TPU target's option (libtpu's scheduler), got 'h100'" in capsys.readouterr().err


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
@pytest.mark.parametrize("block", [2176, 8192])
def test_decode_kernel_compiles_for_tpu_at_any_block_size(block: int) -> None:
    """The Pallas decode kernel for one v5p chip at Llama-3.1-8B's 1k + 16k shape (64 slots, 4 kv heads and 16 query
    heads per device, 8 own blocks of 2,176 positions and a prompt block read in a shared pool of 16 blocks; the
    kernel that took each block whole needed 19.17 MiB of its 16 MiB scoped VMEM) and with blocks of 8,192 (74k
    positions): the kernel streams sub-blocks through its grid, so it compiles, with the same few temporaries,
    whatever the block size."""
    from jax.sharding import SingleDeviceSharding

    from hfjax.models import attention_pallas

    device = SingleDeviceSharding(target_devices(parse_target("v5p:2x2x1"))[0])
    slots, kv_heads, d, blocks = 64, 4, 128, 8

    def spec(*shape: int, dtype=jnp.bfloat16) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=device)

    def decode(q, keys, values, lengths, prompts, pool_keys, pool_values, table):
        pool = (pool_keys, pool_values, table)
        return attention_pallas.decode_attention(q, keys, values, lengths, None, prompts, pool=pool, interpret=False)

    args = (
        spec(slots, 1, 4 * kv_heads, d),
        [spec(slots, kv_heads, d, block)] * blocks,
        [spec(slots, kv_heads, block, d)] * blocks,
        spec(slots, dtype=jnp.int32),
        spec(slots, dtype=jnp.int32),
        spec(1, 16, kv_heads, d, block),
        spec(1, 16, kv_heads, block, d),
        spec(slots, 1, dtype=jnp.int32),
    )
    compiled = jax.jit(decode).lower(*args).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 4 * 2**20


def _split_attention_gradient(target: str, implementation: str) -> jax.stages.Lowered:
    """Attention's loss-and-gradient at 32,768 positions of Qwen2.5-1.5B's heads (12 query, 2 kv, 128 wide) on
    `target`'s 8 devices, rows over `fsdp: 2` and positions over `sequence: 4`, lowered with `implementation`."""
    from hfjax.models.attention import causal_attention
    from hfjax.models.program import program_layout
    from hfjax.parallel import Layout

    devices = target_devices(parse_target(target))
    layout = Layout.from_config({"mesh": {"fsdp": 2, "sequence": 4}, "rules": "fsdp"}).on_devices(devices)
    positions = NamedSharding(layout.mesh, P("fsdp", "sequence"))
    t = 32768
    q = jax.ShapeDtypeStruct((2, t, 12, 128), jnp.bfloat16, sharding=positions)
    kv = jax.ShapeDtypeStruct((2, t, 2, 128), jnp.bfloat16, sharding=positions)
    valid = jax.ShapeDtypeStruct((2, t), jnp.int32, sharding=NamedSharding(layout.mesh, P("fsdp")))

    def loss(q, k, v, valid):
        with program_layout(layout):
            out = causal_attention(q, k, v, valid=valid, implementation=implementation)
        return out.astype(jnp.float32).sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, valid)


@pytest.mark.compile_target
def test_splash_attention_split_by_position_compiles_for_v5e() -> None:
    """Attention's loss-and-gradient at 32,768 positions of Qwen2.5-1.5B's heads (12 query, 2 kv, 128 wide), the
    positions split over `sequence: 4` and rows over `fsdp: 2` of a v5e-8: the splash kernels run per shard (one
    per query offset) and compile with under 0.1 GiB of temporaries per chip (xla attention would hold a float32
    [rows, heads, 8,192, 32,768] score block per device)."""
    with jax.default_matmul_precision("default"):  # conftest's "highest" would reach splash's bf16 dots (Mosaic: no)
        lowered = _split_attention_gradient("v5e:2x4", "pallas_tpu")
        assert "tpu_custom_call" in lowered.as_text()
        assert lowered.compile().memory_analysis().temp_size_in_bytes < 0.1 * 2**30


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
def test_cudnn_attention_split_by_position_compiles_for_h100x8() -> None:
    """Attention's loss-and-gradient at 32,768 positions of Qwen2.5-1.5B's heads (12 query, 2 kv, 128 wide), the
    positions split over `sequence: 4` and rows over `fsdp: 2` of 8 H100s: cuDNN's fused kernels run per position
    shard forward and backward, with under 1.25 GiB of temporaries per GPU (the bias of 8,192 queries x 32,768 keys
    and its gradient, 1 GiB in bf16: 1.08 GiB compiled); xla attention, which ran there before, compiles with 42 GiB
    (float32 [heads, 8,192, 32,768] scores, 12 GiB, and what their gradient needs)."""
    compiled = _split_attention_gradient("h100x8", "cudnn").compile()
    kernels = set(re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', compiled.as_text()))
    assert any(k.endswith("Backward") for k in kernels) and any(not k.endswith("Backward") for k in kernels), kernels
    assert compiled.memory_analysis().temp_size_in_bytes < 1.25 * 2**30


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
def test_a_decode_step_of_narrow_heads_copies_no_cache_on_a_tpu(tmp_path: Path) -> None:
    """The Llama-3.2-1B v5e-8 config's decode step (head_dim 64; 64 slots of 128 + 128 positions here), compiled
    lean: its temporaries stay under a tenth of the KV cache. With the Pallas kernel, which reads value blocks
    row-major where the chip keeps them positions-minor, XLA relaid out every cache block every layer and step (2.76
    GiB of temporaries beside a 2.25 GiB cache at full size); such heads run the step as xla unless the kernel is
    named."""
    config = str(REPO / "configs/gsm8k/llama-3.2-1b-grpo-tpu-v5e-8.yaml")
    shape = ["data.max_prompt_length=128", "rollout.slots=64", "rollout.response_length=128"]
    report = tmp_path / "report.json"
    options = ["--target", "v5e:2x4", "--lean", "--json", str(report), "--programs", "rollout decode"]
    run_command(["compile", config, *shape, *options], tmp_path / "compile.log", timeout_s=600)
    (decode,) = json.loads(report.read_text())["programs"]
    model = NAMED_CONFIGS["llama-3.2-1b"]
    cache = 64 // 8 * 256 * model.num_layers * model.num_kv_heads * model.head_dim * 2 * 2  # a device's, bfloat16
    assert decode["program"] == "decode 64 slots"
    assert decode["temporaries"] < cache / 10, (decode, cache)


@pytest.mark.compile_target
def test_a100_config_loads() -> None:
    devices = target_devices(parse_target("a100-80gbx2"))
    assert [d.device_kind for d in devices] == ["NVIDIA A100-SXM4-80GB"] * 2 and devices[0].compute_capability == "8.0"


def test_target_is_hashable_and_frozen() -> None:
    target = parse_target("v5e:2x4")
    assert {target: 1}[Target(**vars(target))] == 1
    with pytest.raises(AttributeError):
        target.num_devices = 4  # type: ignore[misc]


SCOPED_VMEM = "RESOURCE_EXHAUSTED: CompileTimeScopedVmemOom ... Scoped allocation with size 19.17M and limit 16.00M"
DECODE_KNOB = "HFJAX_ATTENTION=xla (XLA attention instead of the Pallas kernel), or fewer rollout.slots / a shorter "
DECODE_KNOB += "rollout.response_length"


def test_a_scoped_vmem_error_is_classified_with_its_knob() -> None:
    """The Pallas TPU decode kernel's compile error: class "scoped VMEM", its line as it is (short enough), and for a
    decode program the attention and the decode shapes to turn."""
    assert classify(jax.errors.JaxRuntimeError(SCOPED_VMEM)) == ("scoped VMEM", SCOPED_VMEM)
    assert knob("scoped VMEM", "rollout", "decode 256 slots") == DECODE_KNOB
    # a long first line would be trimmed past the sizes: the line that holds them instead
    long = f"RESOURCE_EXHAUSTED: CompileTimeScopedVmemOom: {'x' * 300}\n\nScoped allocation with size 19.17M and limit "
    long += "16.00M exceeded scoped vmem limit by 3.17M."
    error_class, message = classify(jax.errors.JaxRuntimeError(long))
    assert error_class == "scoped VMEM" and message.startswith("Scoped allocation with size 19.17M and limit 16.00M")


@pytest.mark.parametrize(
    ("error", "error_class", "message"),
    [
        (
            jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used "
                "17.25G of 15.75G hbm. Exceeded hbm capacity by 1.50G.\n\nTotal hbm usage >= 17.75G:"
            ),
            "out of memory",
            "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 17.25G "
            "of 15.75G hbm. Exceeded hbm capacity by 1.50G.",
        ),
        (ValueError("\n  dot_general requires contracting dimensions to have the same shape, got (64,) and (32,).  "),
         "shape", "dot_general requires contracting dimensions to have the same shape, got (64,) and (32,)."),
        (TypeError("one of\ntwo lines"), "shape", "one of"),
        (NotImplementedError("UNIMPLEMENTED: " + "y" * 400), "NotImplementedError", f"UNIMPLEMENTED: {'y' * 142}..."),
        (RuntimeError(""), "RuntimeError", "RuntimeError"),
    ],
)  # fmt: skip
def test_error_classes_and_first_lines(error: Exception, error_class: str, message: str) -> None:
    assert classify(error) == (error_class, message)
    assert len(message) <= MESSAGE_CHARS


def test_a_program_that_fails_to_trace_keeps_its_error() -> None:
    """An error while tracing one program is that program's (the generator of a role's programs goes on to the
    next), raised again when it is compiled."""

    def trace() -> None:
        raise ValueError("dot_general requires contracting dimensions to have the same shape")

    failing = ProgramTrace.of("actor", "log probs", trace, 0)
    assert isinstance(failing.error, ValueError) and failing.result is None
    with pytest.raises(ValueError, match="contracting dimensions"):
        measure(failing)


def test_an_update_over_its_memory_is_told_to_rematerialise_first() -> None:
    """The compile check's remat recommendation: an actor update over 90% of the chip with `remat: none` (or `dots`)
    names `actor.remat: full` first; with `full` already set it names the micro-batch and the layout instead; other
    programs over the limit keep their own knobs."""
    target = parse_target("v5e:2x4")
    over = ProgramMemory("actor", "loss+grad", int(target.usable_bytes), 0, 0, 0, 0, 0.0, 0.0)
    small = ProgramMemory("rollout", "decode 8 slots", 1 << 20, 0, 0, 0, 0, 0.0, 0.0)
    for setting in ("none", "dots"):
        (line,) = report.fits([over, small], target, {"actor": setting, "critic": "none"})
        assert line.startswith("does not fit: actor loss+grad needs 15.75 GiB of 14.18 GiB")
        assert f"try actor.remat: full (it is '{setting}') first, then actor.micro_batch_size" in line
    (line,) = report.fits([over], target, {"actor": "full", "critic": "none"})
    assert "remat" not in line and "try actor.micro_batch_size, more fsdp (or a sequence axis" in line
    decode = ProgramMemory("rollout", "decode 8 slots", int(target.usable_bytes), 0, 0, 0, 0, 0.0, 0.0)
    (line,) = report.fits([decode], target, {"actor": "none", "critic": "none"})
    assert "try fewer rollout.slots" in line and "remat" not in line


def test_every_knob_names_config_keys_that_exist() -> None:
    """Each dotted key a knob names (`actor.micro_batch_size`, `reward.cost_model.layout`) is a key of the config."""
    cfg = load_rl_config({"actor": {"model_path": "unused"}, "algorithm": {"name": "ppo"}})
    train, scores = ("loss+grad", "optimizer step"), ("scores",)
    groups = {"actor": (*train, "log probs", "ref log probs"), "critic": (*train, "values"),
              "rollout": ("prefill 8 x 16", "decode 8 slots"), "reward": scores, "cost": scores}  # fmt: skip
    assert {program_kind(p) for programs in groups.values() for p in programs} == set(PROGRAM_KINDS)
    classes = ("scoped VMEM", "VMEM", "out of memory", "shape", "RuntimeError")
    remats = (None, "none", "dots", "full")
    texts = {knob(c, g, p, r) for c in classes for g, programs in groups.items() for p in programs for r in remats}
    keys = {k for text in texts for k in re.findall(r"\b(?:actor|critic|rollout|data|reward)(?:\.[a-z_]+)+", text)}
    assert {"actor.remat", "rollout.slots", "reward.cost_model.micro_batch_size"} <= keys
    for key in keys:
        functools.reduce(getattr, key.split("."), cfg)  # AttributeError names a key that does not exist


def test_a_program_that_fails_to_compile_is_one_line_of_the_report(tmp_path, monkeypatch, capsys) -> None:
    """`hfjax compile` where the decode step fails to compile (the XLA error of a Pallas decode kernel over its scoped
    VMEM, raised here for it alone, on this machine's 8 CPU devices standing in for a v5e-8's): one row names the
    program, the error class and the knob; the other programs are compiled and reported with their figures, in the
    table and the JSON; the exit code is 1, and no traceback is printed (the debug log holds it)."""
    monkeypatch.setitem(NAMED_CONFIGS, "tiny-test", TINY)
    monkeypatch.setattr(report, "target_devices", lambda target: jax.devices())
    real_measure = report.measure

    def measure(trace):
        if trace.program.startswith("decode"):
            trace.traced  # noqa: B018 (traced, as for real)
            raise jax.errors.JaxRuntimeError(SCOPED_VMEM)
        return real_measure(trace)

    monkeypatch.setattr(report, "measure", measure)
    config = {
        "actor": {"model_path": "tiny-test", "micro_batch_size": 2, "ppo_mini_batch_size": 2},
        "data": {"max_prompt_length": 16, "train_batch_size": 2},
        "rollout": {"n": 2, "response_length": 8, "slots": 8},
        "algorithm": {"name": "grpo"},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    args = ["compile", str(tmp_path / "run.yaml"), "--target", "v5e:2x4", "--json", str(tmp_path / "report.json")]
    assert main(args) == 1
    captured = capsys.readouterr()
    out = captured.out
    assert "Traceback" not in out + captured.err
    named = [line for line in out.splitlines() if "decode 8 slots" in line and "failed to compile" in line]
    assert named == [f"rollout  {'decode 8 slots':<22} failed to compile (scoped VMEM): try {DECODE_KNOB}"]
    assert f"         {SCOPED_VMEM}" in out.splitlines()
    others = [("actor", "loss+grad"), ("actor", "optimizer step"), ("actor", "log probs")]
    others.append(("rollout", "prefill 8 x 16"))
    for group, name in others:
        (row,) = [line for line in out.splitlines() if line.startswith(f"{group:<8} {name:<22} ")]
        figures = row[32:].split()  # args, outputs, temps, resident, peak (GiB), GFLOP
        assert len(figures) == 6 and all(float(f) >= 0 for f in figures), row
    assert "(1 program failed to compile)" in out
    written = json.loads((tmp_path / "report.json").read_text())
    assert [(p["group"], p["program"]) for p in written["programs"]] == others
    assert all(p["peak"] > 0 for p in written["programs"])
    assert written["failed"] == [
        {"group": "rollout", "program": "decode 8 slots", "error_class": "scoped VMEM", "message": SCOPED_VMEM,
         "knob": DECODE_KNOB}
    ]  # fmt: skip
    assert written["fits"] is False
    try:  # `hfjax --debug compile`: the same report, and the failure's traceback in the log
        assert main(["--debug", *args]) == 1
        assert "Traceback" in capsys.readouterr().err
    finally:
        logging.getLogger("hfjax.automap.compiled").setLevel(logging.NOTSET)
