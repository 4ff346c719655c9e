"""Scaling read from compiled programs (not timed): the actor's loss-and-gradient, its log-prob pass and the engine's
decode step of a small model (4 layers, 8 heads, a 32k vocabulary) on 8 fake devices. Under `data=2,fsdp=4` and
`fsdp=4,tensor=2` and `fsdp=4,sequence=2` (positions split over the sequence axis) each device does about 1/8 of
one device's FLOPs, and under `data=2,fsdp=4` the collectives are
the weights' (gathers of parameters, reductions of gradients), never an activation's or the logits'. The engine's
largest prefill under `data=4` does about 1/4 of one device's FLOPs on each device (each data shard prefills its
own rows). Marked `compile_target` (the compile-target phase of CI, libtpu): the same holds for the update of the
shipped Qwen2.5-0.5B v5e-8 config at its real width, vocabulary and row length, compiled for v5e chips."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
from collections.abc import Iterator

import jax
import pytest
from support.settings import REPO

import hfjax.models.transformer as transformer
from hfjax.automap.compiled.programs import AbstractModel, actor_programs, bytes_per_device, engine_programs
from hfjax.config.rl import load_rl_config
from hfjax.models.config import ModelConfig
from hfjax.models.presets import NAMED_CONFIGS
from hfjax.parallel import Layout

SHAPE = ModelConfig(
    family="llama",
    vocab_size=32000,
    hidden_size=256,
    intermediate_size=704,
    num_layers=4,
    num_heads=8,
    num_kv_heads=8,
    head_dim=32,
    rms_norm_eps=1e-5,
)
PROGRAMS = ("loss+grad", "log probs", "decode")
LAYOUTS = {
    "1 device": (
        {"mesh": {"fsdp": 1}, "rules": "fsdp", "devices": [0]},
        {"mesh": {"data": 1}, "rules": "dp_tp_gen", "devices": [0]},
    ),
    "data=2,fsdp=4": ({"mesh": {"data": 2, "fsdp": 4}, "rules": "fsdp"}, {"mesh": {"data": 8}, "rules": "dp_tp_gen"}),
    "fsdp=4,tensor=2": (
        {"mesh": {"fsdp": 4, "tensor": 2}, "rules": "fsdp_tp"},
        {"mesh": {"data": 4, "tensor": 2}, "rules": "dp_tp_gen"},
    ),
    "fsdp=4,sequence=2": (
        {"mesh": {"fsdp": 4, "sequence": 2}, "rules": "fsdp"},
        {"mesh": {"data": 8}, "rules": "dp_tp_gen"},
    ),
}
COLLECTIVE = re.compile(r"= (\([^=]*\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(")
ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


@functools.cache
def compiled_programs(name: str) -> dict[str, jax.stages.Compiled]:
    """The three programs compiled under one of `LAYOUTS`, the LM head in two chunks (of 32 positions, or of a
    device's share of them under a sequence axis) under every layout: XLA's cost analysis counts a loop's body once
    whatever its trip count, so the same trip count makes the counts comparable (and with one chunk, one device's
    program would fold the backward's recomputed logits into the forward's, which a partitioned program does not)."""
    train, gen = LAYOUTS[name]
    cfg = _rl_config()
    with chunks_of(32 // Layout.from_config(train).axis_size("sequence")):  # a device's positions: the same two chunks
        traces = actor_programs(cfg, SHAPE, Layout.from_config(train), Layout.from_config(gen))
        return {t.program.split(" ")[0] if t.program.startswith("decode") else t.program: t.traced.lower().compile()
                for t in traces if t.program.startswith(PROGRAMS)}  # fmt: skip


@contextlib.contextmanager
def chunks_of(positions: int) -> Iterator[None]:
    """The chunked LM head takes `positions` positions per chunk whatever the rows per device, so that programs under
    two layouts run their chunk loops the same number of times (cost analysis counts a loop's body once)."""
    chunk_length = transformer.chunk_length
    transformer.chunk_length = lambda tokens, rows: positions
    try:
        yield
    finally:
        transformer.chunk_length = chunk_length


def _rl_config():
    """The run every program here is compiled for: 16 slots, 64-token prompts and responses, micro-batches of 8."""
    return load_rl_config(
        {
            "actor": {"model_path": "unused", "micro_batch_size": 8, "ppo_mini_batch_size": 8},
            "data": {"max_prompt_length": 64},
            "rollout": {"response_length": 64, "slots": 16, "n": 2},
        }
    )


def flops(compiled: jax.stages.Compiled) -> float:
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


@pytest.mark.parametrize("layout", ["data=2,fsdp=4", "fsdp=4,tensor=2", "fsdp=4,sequence=2"])
@pytest.mark.parametrize("program", PROGRAMS)
def test_flops_per_device_split_eight_ways(layout, program):
    one, eight = flops(compiled_programs("1 device")[program]), flops(compiled_programs(layout)[program])
    assert eight <= 1.15 * one / 8, f"{program} under {layout}: {eight:.3e} FLOPs per device, one device {one:.3e}"


def _collectives(hlo: str) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """(kind, (dtype, shape) of each of its result arrays) of every collective in an HLO module's text."""
    return [
        (kind, [(dtype, tuple(int(n) for n in dims.split(",") if n)) for dtype, dims in ARRAY.findall(result)])
        for result, kind in COLLECTIVE.findall(hlo)
    ]


@pytest.mark.parametrize("program", ["loss+grad", "log probs"])
def test_fsdp_moves_weights_not_activations(program):
    """Under data=2,fsdp=4 the programs all-reduce only gradients (arrays of a weight's or its shard's size,
    some reshaped as [heads * head_dim, embed]; XLA:CPU does not turn them into reduce-scatters) and scalars, gather
    about the weights twice (forward and backward), and gather or reduce no [rows, length, ...] activation: the
    embeddings, looked up where the table's `embed` shards live, reach rows split over both batch axes by all-to-all
    (the lookup as first written had the partitioner gather the [rows, length, embed] embeddings whole)."""
    program = compiled_programs("data=2,fsdp=4")[program]
    # a weight's gradient, or that of its fsdp shard (all-reduced over data)
    weight_sizes = {math.prod(leaf.shape) // parts for leaf in jax.tree.leaves(_abstract_params()) for parts in (1, 4)}
    collectives = _collectives(program.as_text())
    reduced = [s for kind, arrays in collectives if kind == "all-reduce" for _, s in arrays]
    activations = [s for s in reduced if math.prod(s) > 1 and math.prod(s) not in weight_sizes]
    assert not activations, f"all-reduces of non-weight arrays: {activations}"
    length = _rl_config().data.max_prompt_length + _rl_config().rollout.response_length
    gathered_activations = [
        (kind, dtype, s)
        for kind, arrays in collectives
        for dtype, s in arrays
        if kind != "all-to-all" and dtype.startswith(("f", "bf")) and length in s
    ]
    assert not gathered_activations, f"gathers or reductions of [rows, length, ...] activations: {gathered_activations}"
    gathered = sum(math.prod(s) * 4 for kind, arrays in collectives if kind == "all-gather" for _, s in arrays)
    weights = bytes_per_device(_abstract_params()) * 8  # float32 master: what one device gathers of every weight
    assert gathered <= 2.2 * weights, (gathered, weights)
    assert sum(math.prod(s) * 4 for s in reduced) <= 1.2 * weights


@pytest.mark.parametrize("program", ["loss+grad", "log probs"])
def test_tensor_parallelism_never_collects_the_vocabulary(program):
    """Under fsdp=4,tensor=2 the LM head's logits, its kernel and its gradient stay split over `tensor`: no
    collective moves an array with a dimension of the whole vocabulary (the log-softmax reduces [rows, chunk]
    statistics over `tensor` instead). A layout whose rules leave `tensor` unused fails here: each device then
    computes the whole [rows, chunk, vocab] logits."""
    collectives = _collectives(compiled_programs("fsdp=4,tensor=2")[program].as_text())
    whole = [(kind, s) for kind, arrays in collectives for _, s in arrays if SHAPE.vocab_size in s]
    assert not whole, f"collectives of whole-vocabulary arrays: {whole}"


def _abstract_params():
    from flax import nnx

    from hfjax.models.hf import abstract_model

    return nnx.split(abstract_model(SHAPE, "causal_lm"), nnx.Param, ...)[1]


def _prefill_flops(gen_layout: dict) -> float:
    """Per-device FLOPs of the engine's largest fused prefill-and-insert (16 prompts of 64 tokens) under a layout."""
    layout = Layout.from_config(gen_layout)
    params = AbstractModel.build(SHAPE, "causal_lm", layout, "float32", None).params
    prefill = next(engine_programs(_rl_config(), SHAPE, layout, params, 0))
    assert prefill.program == "prefill 16 x 64"
    return flops(prefill.traced.lower().compile())


def test_prefill_split_over_data_axis():
    """Each of 4 data shards prefills its own rows: per-device FLOPs about a quarter of one device's."""
    one = _prefill_flops({"mesh": {"data": 1}, "rules": "dp_tp_gen", "devices": [0]})
    four = _prefill_flops({"mesh": {"data": 4}, "rules": "dp_tp_gen", "devices": [0, 1, 2, 3]})
    assert four <= 1.15 * one / 4, f"prefill under data=4: {four:.3e} FLOPs per device, one device {one:.3e}"


def _tpu_update_flops(target: str, train: dict, gen: dict) -> float:
    """Per-chip FLOPs of the actor's loss-and-gradient of the shipped Qwen2.5-0.5B v5e-8 GRPO config (its width,
    vocabulary, 1,536-token rows, bfloat16 compute; two of its 24 layers, micro-batches of 8 rows), compiled for a
    TPU target with libtpu: the partitioner and the kernels of the chip, not the CPU's."""
    from hfjax.automap.compiled import parse_target, target_devices

    cfg = load_rl_config(str(REPO / "configs/gsm8k/qwen2.5-0.5b-grpo-tpu-v5e-8.yaml"), ["actor.micro_batch_size=8"])
    qwen = NAMED_CONFIGS["qwen2.5-0.5b"]
    shape = dataclasses.replace(qwen, num_layers=2, sliding_windows=qwen.sliding_windows and qwen.sliding_windows[:2])
    devices = target_devices(parse_target(target))
    train_layout, gen_layout = (Layout.from_config(c).on_devices(devices) for c in (train, gen))
    # the TPU kernels' own precision (conftest asks for the highest); six chunks of the head under both layouts
    with jax.default_matmul_precision("default"), chunks_of(256):
        update = next(t for t in actor_programs(cfg, shape, train_layout, gen_layout) if t.program == "loss+grad")
        return flops(update.traced.lower().compile())


@pytest.mark.compile_target
def test_fsdp_splits_the_update_eight_ways_on_a_tpu_v5e_8():
    """At real shapes, compiled for TPU: under `fsdp: 8` each v5e chip does at most 1.15/8 of the FLOPs one chip
    does for the same micro-batch (the rows split, the weights are gathered, nothing is computed twice)."""
    one = _tpu_update_flops(
        "v5e:1x1", {"mesh": {"fsdp": 1}, "rules": "fsdp"}, {"mesh": {"data": 1}, "rules": "dp_tp_gen"}
    )
    eight = _tpu_update_flops(
        "v5e:2x4", {"mesh": {"fsdp": 8}, "rules": "fsdp"}, {"mesh": {"data": 8}, "rules": "dp_tp_gen"}
    )
    assert eight <= 1.15 * one / 8, f"loss+grad under fsdp=8 on v5e: {eight:.3e} FLOPs per chip, one chip {one:.3e}"
