"""Hugging Face checkpoint I/O: `load_hf`, `save_hf`, `load_tokenizer`.

`load_hf` validates the whole checkpoint against the model (names and shapes) before allocating device memory, then
reads one tensor at a time and puts it straight onto its `NamedSharding`. `save_hf` fetches one tensor at a time and
writes safetensors (sharded above `max_shard_bytes`) plus `config.json` into a temporary directory that replaces
the target only once complete. The embedding and LM head are read into the first `vocab_size` rows of their
`padded_vocab_size` rows (the rest zero) and written back without the padding, so HF round trips are exact.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from tqdm.auto import tqdm

from hfjax.models.config import ModelConfig, config_from_hf
from hfjax.models.safetensors_io import CheckpointError, TensorEntry, read_header, read_tensor, write_file
from hfjax.models.transformer import HEAD_CLASSES
from hfjax.parallel.layout import Layout
from hfjax.parallel.transfer import aligned_empty

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
HEAD_PARAMS = {"causal_lm": ("lm_head",), "seq_cls": ("score",), "token_cls": ("score", "score_bias")}
DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3


@dataclass(frozen=True)
class ParamMapping:
    """One HF tensor <-> one model parameter. Both store weights `[out, in]`, so converting is a reshape:
    `bias` tensors (and fused head dimensions) are flat in HF. A `vocab` tensor has the HF checkpoint's `hf_rows`
    rows, ours `padded_vocab_size` (the padding rows are zero and never written)."""

    hf_name: str
    path: tuple[str | int, ...]
    kind: str = "same"  # "same", "bias", "vocab", "q_kernel" / "o_kernel" (the heads dims fused in HF), "expert"
    hf_rows: int = 0  # a "vocab" tensor's rows in HF: the true vocabulary size
    expert: int = 0  # an "expert" tensor's index along the first dimension of its stacked parameter

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.kind == "expert":  # ours [experts, out, in] -> HF one expert's [out, in]
            return shape[1:]
        if self.kind == "q_kernel":  # ours [heads, head_dim, embed] -> HF [heads*head_dim, embed]
            return math.prod(shape[:-1]), shape[-1]
        if self.kind == "o_kernel":  # ours [embed, heads, head_dim] -> HF [embed, heads*head_dim]
            return shape[0], math.prod(shape[1:])
        if self.kind == "vocab":
            return self.hf_rows, *shape[1:]
        return (math.prod(shape),) if self.kind == "bias" else shape

    def to_model(self, array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        if self.kind != "vocab" or array.shape[0] == shape[0]:
            return array.reshape(shape)
        padded = aligned_empty(shape, array.dtype)
        padded[: self.hf_rows] = array
        padded[self.hf_rows :] = 0
        return padded

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        if self.kind == "expert":
            return array[self.expert]
        return array[: self.hf_rows] if self.kind == "vocab" else array.reshape(self.hf_shape(array.shape))


# The HF names of a mixture-of-experts layer's router and experts (under `model.layers.{i}.`) per family, and of each
# expert's gate, up and down projections.
MOE_HF_NAMES = {
    "qwen3_moe": ("mlp.gate", "mlp.experts", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts", {"gate": "w1", "up": "w3", "down": "w2"}),
}


def _mlp_plan(cfg: ModelConfig, index: int) -> list[ParamMapping]:
    """Layer `index`'s MLP tensors: the dense gated MLP, or the router and every expert's projections."""
    hf, ours = f"model.layers.{index}.", ("model", "layers", index, "mlp")
    if cfg.moe_layers[index]:
        router, experts, projections = MOE_HF_NAMES[cfg.family]
        plan = [ParamMapping(f"{hf}{router}.weight", (*ours, "router_kernel"))]
        for proj, hf_proj in projections.items():
            plan += [
                ParamMapping(f"{hf}{experts}.{e}.{hf_proj}.weight", (*ours, f"{proj}_kernel"), "expert", expert=e)
                for e in range(cfg.num_experts)
            ]
        return plan
    plan = []
    for proj in ("gate", "up", "down"):
        plan.append(ParamMapping(f"{hf}mlp.{proj}_proj.weight", (*ours, f"{proj}_kernel")))
        if cfg.mlp_bias:
            plan.append(ParamMapping(f"{hf}mlp.{proj}_proj.bias", (*ours, f"{proj}_bias"), "bias"))
    return plan


def param_plan(cfg: ModelConfig, head: str) -> list[ParamMapping]:
    """The HF name and conversion of every parameter of a model with this config and head kind."""
    plan = [ParamMapping("model.embed_tokens.weight", ("model", "embed_tokens"), "vocab", cfg.vocab_size)]
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", ("model", "layers", i)
        for proj in "qkvo":
            plan.append(
                ParamMapping(
                    f"{hf}self_attn.{proj}_proj.weight",
                    (*ours, "self_attn", f"{proj}_kernel"),
                    "o_kernel" if proj == "o" else "q_kernel",
                )
            )
        biases = ("q", "k", "v") * cfg.qkv_bias + ("o",) * cfg.o_bias
        plan += [
            ParamMapping(f"{hf}self_attn.{p}_proj.bias", (*ours, "self_attn", f"{p}_bias"), "bias") for p in biases
        ]
        if cfg.qk_norm:
            plan += [
                ParamMapping(f"{hf}self_attn.{n}.weight", (*ours, "self_attn", n, "weight"))
                for n in ("q_norm", "k_norm")
            ]
        plan += _mlp_plan(cfg, i)
        norms = ("input_layernorm", "post_attention_layernorm")
        norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm") if cfg.sandwich_norms else ()
        plan += [ParamMapping(f"{hf}{n}.weight", (*ours, n, "weight")) for n in norms]
    plan.append(ParamMapping("model.norm.weight", ("model", "norm", "weight")))
    if head == "causal_lm" and not cfg.tie_word_embeddings:
        plan.append(ParamMapping("lm_head.weight", ("lm_head",), "vocab", cfg.vocab_size))
    if head in ("seq_cls", "token_cls"):
        plan.append(ParamMapping("score.weight", ("score",)))
    if head == "token_cls":
        plan.append(ParamMapping("score.bias", ("score_bias",), "bias"))
    return plan


def checked_dtype(value: Any, field: str) -> jnp.dtype:
    """`value` as a dtype the models take (float32, bfloat16, float16), else ValueError naming `field`."""
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise ValueError(f"{field}: unknown dtype {value!r}; expected float32, bfloat16 or float16") from e
    if dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"{field}: dtype {value!r} is not supported; expected float32, bfloat16 or float16")
    return dtype


def read_config(path: str | os.PathLike) -> tuple[ModelConfig, str]:
    """Reads `config.json` of a checkpoint directory; returns the config and the checkpoint's head kind."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no config.json; expected a Hugging Face model directory")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from e
    return config_from_hf(raw, str(file))


def checkpoint_index(path: str | os.PathLike) -> dict[str, TensorEntry]:
    """Tensor name -> location over a single `model.safetensors` or the files of an index."""
    root = Path(path)
    if (root / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((root / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{root / INDEX_FILE}: corrupt index ({e!r})") from e
        entries: dict[str, TensorEntry] = {}
        for file in sorted(set(weight_map.values())):
            if not (root / file).is_file():
                raise CheckpointError(f"{root / INDEX_FILE}: names file {file!r}, which does not exist")
            entries.update(read_header(str(root / file)))
        return entries
    if (root / SINGLE_FILE).is_file():
        return read_header(str(root / SINGLE_FILE))
    raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}; hfjax reads safetensors checkpoints only")


def check_tensors(
    plan: list[ParamMapping],
    shapes: dict[tuple, tuple[int, ...]],
    index: dict[str, TensorEntry],
    fresh: set[str],
    ignorable: set[str],
    path: str,
) -> None:
    """Raises `CheckpointError` listing every tensor of `plan` (parameter shapes `shapes`) that the checkpoint
    `index` lacks or holds in another shape, and every checkpoint tensor the plan does not read (but `ignorable`);
    the `fresh` ones are not read."""
    problems = []
    wanted = {m.hf_name for m in plan if m.hf_name not in fresh}
    missing = [
        f"{m.hf_name} {m.hf_shape(shapes[m.path])}" for m in plan if m.hf_name in wanted and m.hf_name not in index
    ]
    unexpected = [f"{n} {index[n].shape}" for n in sorted(set(index) - wanted - ignorable)]
    mis_shaped = [
        f"{m.hf_name}: checkpoint {index[m.hf_name].shape}, model expects {m.hf_shape(shapes[m.path])}"
        for m in plan
        if m.hf_name in wanted and m.hf_name in index and index[m.hf_name].shape != m.hf_shape(shapes[m.path])
    ]
    for title, items in (
        ("missing tensors", missing),
        ("unexpected tensors", unexpected),
        ("mis-shaped tensors", mis_shaped),
    ):
        if items:
            problems.append(f"{title}: " + ", ".join(items))
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match the model: " + "; ".join(problems))


def _place(array: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    if isinstance(sharding, NamedSharding):
        return jax.make_array_from_callback(array.shape, sharding, lambda idx: array[idx])
    return jax.device_put(array, sharding)


def abstract_model(cfg: ModelConfig, head: str, dtype: Any = "float32", param_dtype: Any = None) -> nnx.Module:
    """The model with `jax.ShapeDtypeStruct` parameters (no memory allocated), for planning shardings."""
    return HEAD_CLASSES[head](
        cfg,
        dtype=checked_dtype(dtype, "dtype"),
        param_dtype=checked_dtype(param_dtype or dtype, "param_dtype"),
        rngs=None,
    )


@dataclasses.dataclass(frozen=True)
class CheckedCheckpoint:
    """What `check_checkpoint` read: the model config and head, the abstract model, the tensor plan, the checkpoint's
    tensor index and the names of the head tensors that are initialised fresh instead of read."""

    config: ModelConfig
    head: str
    model: nnx.Module
    plan: list[ParamMapping]
    index: dict[str, TensorEntry]
    fresh: set[str]


def check_checkpoint(
    path: str | os.PathLike, head: str | None = None, dtype: Any = "float32", param_dtype: Any = None
) -> CheckedCheckpoint:
    """Checks an HF checkpoint directory against the model its `config.json` describes (with `head`, as `load_hf`
    builds it) from the safetensors headers alone: every tensor present, none unexpected, each of the model's shape,
    each within its file. Reads no tensor data and allocates no device memory; raises `CheckpointError` (or
    ValueError for a bad config or head)."""
    cfg, ckpt_head = read_config(path)
    head = head or ckpt_head
    if head not in HEAD_CLASSES:
        raise ValueError(f"load_hf(head={head!r}): expected one of {sorted(HEAD_CLASSES)}")
    if head != ckpt_head and head != "causal_lm":
        cfg = dataclasses.replace(cfg, num_labels=1)
    model = abstract_model(cfg, head, dtype, param_dtype)
    plan = param_plan(cfg, head)
    index = checkpoint_index(path)
    fresh = {m.hf_name for m in plan if m.path[0] in HEAD_PARAMS[head]} if head != ckpt_head else set()
    ignorable = {"lm_head.weight"} if head != "causal_lm" or cfg.tie_word_embeddings else set()
    shapes = {p: v.shape for p, v in nnx.to_flat_state(nnx.state(model))}
    check_tensors(plan, shapes, index, fresh, ignorable, str(path))
    return CheckedCheckpoint(cfg, head, model, plan, index, fresh)


def load_hf(
    path: str | os.PathLike,
    *,
    dtype: Any = "float32",
    param_dtype: Any = None,
    layout: Layout | Mapping[str, Any] | None = None,
    head: str | None = None,
    seed: int = 0,
) -> nnx.Module:
    """Loads an HF checkpoint directory as a `CausalLM`, `SequenceClassifier` or `Critic` (by its architecture,
    or `head` = `causal_lm` | `seq_cls` | `token_cls` to build another head on the same backbone, whose new head
    weights are initialised from `seed`). Parameters go straight to their shardings under `layout` (else the first
    device), one tensor at a time, stored in `param_dtype` (default: `dtype`)."""
    compute_dtype = checked_dtype(dtype, "load_hf(dtype)")
    storage_dtype = checked_dtype(param_dtype or dtype, "load_hf(param_dtype)")
    checked = check_checkpoint(path, head, compute_dtype, storage_dtype)
    std = float(checked.config.hf_config.get("initializer_range", 0.02))
    return load_planned(checked.model, checked.plan, checked.index, path, layout, checked.fresh, std, seed)


def load_planned(
    model: nnx.Module,
    plan: list[ParamMapping],
    index: dict[str, TensorEntry],
    path: str | os.PathLike,
    layout: Layout | Mapping[str, Any] | None = None,
    fresh: Collection[str] = (),
    std: float = 0.02,
    seed: int = 0,
) -> nnx.Module:
    """The abstract `model` (`jax.ShapeDtypeStruct` parameters) with every parameter read by `plan` from the
    checkpoint tensors `index` (those named in `fresh` drawn from N(0, `std`), biases zero), in the parameters'
    dtypes, placed by `layout` (else on the first device) one tensor at a time."""
    graphdef, abstract_state = nnx.split(model)
    if layout is not None:
        shardings = dict(nnx.to_flat_state(Layout.from_config(layout).shardings(abstract_state)))
    else:
        shardings = None
    flat = dict(nnx.to_flat_state(abstract_state))
    rng = np.random.default_rng(seed)
    default_sharding = SingleDeviceSharding(jax.devices()[0])
    values = {}
    stacked: dict[tuple, np.ndarray] = {}  # experts' parameters, filled one expert's tensor at a time
    for mapping in tqdm(plan, desc=f"loading {Path(path).name}", unit="tensor", disable=None, leave=False):
        var = flat[mapping.path]
        if mapping.hf_name in fresh:
            hf_shape = mapping.hf_shape(var.shape)
            is_bias = mapping.kind == "bias"
            host = np.zeros(hf_shape, np.float32) if is_bias else rng.normal(0, std, hf_shape).astype(np.float32)
        else:
            host = read_tensor(index[mapping.hf_name])
        if mapping.kind == "expert":
            buffer = stacked.setdefault(mapping.path, aligned_empty(var.shape, var.dtype))
            buffer[mapping.expert] = host
            if mapping.expert < var.shape[0] - 1:
                continue
            host = stacked.pop(mapping.path)
        host = mapping.to_model(host, var.shape)
        host = np.ascontiguousarray(host.astype(var.dtype, copy=False))
        values[mapping.path] = _place(host, shardings[mapping.path] if shardings else default_sharding)
    state = nnx.from_flat_state([(p, v.replace(value=values[p])) for p, v in flat.items()])
    return nnx.merge(graphdef, state)


def host_value(value: jax.Array) -> np.ndarray:
    """A (possibly multi-host) array as one numpy array on every process."""
    if not value.is_fully_addressable:
        from jax.experimental import multihost_utils

        value = multihost_utils.process_allgather(value, tiled=True)
    return np.asarray(jax.device_get(value))


def save_hf(
    model: nnx.Module,
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    tokenizer: Any = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Writes `config.json` and safetensors (an index and numbered files above `max_shard_bytes`) that
    transformers loads; optionally the tokenizer. An existing non-empty directory needs `overwrite=True` and is
    replaced only after the new checkpoint is complete."""
    cfg: ModelConfig = model.config
    out_dtype = checked_dtype(dtype or model.param_dtype, "save_hf(dtype)")
    config = cfg.to_hf_dict(model.head_kind, str(np.dtype(out_dtype)))
    return save_planned(model, param_plan(cfg, model.head_kind), config, path, out_dtype, tokenizer, max_shard_bytes,
                        overwrite)  # fmt: skip


def save_planned(
    model: nnx.Module,
    plan: list[ParamMapping],
    config: Mapping[str, Any],
    path: str | os.PathLike,
    out_dtype: jnp.dtype,
    tokenizer: Any = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """`save_hf` of any model: its parameters written by `plan` in `out_dtype`, with `config` as `config.json`."""
    target = Path(path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise FileExistsError(f"save_hf: {target} exists and is not empty; pass overwrite=True to replace it")
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    specs = [(m.hf_name, np.dtype(out_dtype), m.hf_shape(flat[m.path].shape)) for m in plan]
    by_name = {m.hf_name: m for m in plan}
    last: dict[tuple, np.ndarray] = {}  # the parameter fetched last: an expert's neighbours read it again

    def fetch(name: str) -> np.ndarray:
        mapping = by_name[name]
        if mapping.path not in last:
            last.clear()
            last[mapping.path] = host_value(flat[mapping.path][...])
        return mapping.to_hf(last[mapping.path]).astype(out_dtype)

    files: list[list[tuple[str, np.dtype, tuple[int, ...]]]] = [[]]
    used = 0
    for spec in specs:
        nbytes = math.prod(spec[2]) * spec[1].itemsize
        if files[-1] and used + nbytes > max_shard_bytes:
            files.append([])
            used = 0
        files[-1].append(spec)
        used += nbytes
    is_writer = jax.process_index() == 0
    tmp = target.parent / f".{target.name}.partial-{os.getpid()}"
    if is_writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    names = (
        [SINGLE_FILE]
        if len(files) == 1
        else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    )
    for file_name, file_specs in tqdm(
        list(zip(names, files, strict=True)), desc=f"saving {target.name}", unit="file", disable=None, leave=False
    ):
        if is_writer:
            write_file(str(tmp / file_name), file_specs, fetch)
        else:
            for name, _, _ in file_specs:
                fetch(name)  # every process joins the gathers of sharded arrays
    if not is_writer:
        return target
    if len(files) > 1:
        total = sum(math.prod(s[2]) * s[1].itemsize for s in specs)
        weight_map = {s[0]: f for f, file_specs in zip(names, files, strict=True) for s in file_specs}
        (tmp / INDEX_FILE).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    (tmp / "config.json").write_text(json.dumps(dict(config), indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    if target.exists():
        old = target.parent / f".{target.name}.replaced-{os.getpid()}"
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old)
    else:
        tmp.rename(target)
    return target


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The checkpoint's tokenizer through `transformers.AutoTokenizer` (local files only, chat template kept)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot load a tokenizer ({e})") from e
