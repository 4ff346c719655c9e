"""A LoRA model's adapters as a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`) that
`peft.PeftModel.from_pretrained` loads onto the transformers base model.

PEFT names an adapter after the module it adapts, `base_model.model.<module path>.lora_A.weight` [rank, in] and
`lora_B.weight` [out, rank], and scales it by `lora_alpha / r`: hfjax's A and B flattened to those shapes, the same
scale (`hfjax.models.lora`). A vision-language model's adapters sit on its language model only: transformers 5
keeps that decoder at `model.language_model.*` (hfjax's `language_model.model.*`), and `target_modules` is a pattern
that matches its projections alone (the vision tower has `q_proj`s of its own).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from hfjax.models.hf import host_value
from hfjax.models.lora import LORA_SITES, LoraConfig, LoraParam
from hfjax.models.vision_lm import VisionLanguageLM

ADAPTER_NAMES = {adapter_attr: target for target, (_, adapter_attr, _) in LORA_SITES.items()}


def peft_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's adapters by PEFT's tensor names, float32 numpy arrays of PEFT's shapes."""
    tensors = {}
    for path, value in nnx.to_flat_state(nnx.state(model, LoraParam)):
        *module, adapter_attr, matrix = (str(p) for p in path)
        array = host_value(value[...]).astype(np.float32)
        rank = array.shape[0] if matrix == "a" else array.shape[-1]
        shaped = array.reshape(rank, -1) if matrix == "a" else array.reshape(-1, rank)
        name = ".".join(
            ["base_model.model", *torch_module(module), ADAPTER_NAMES[adapter_attr], f"lora_{matrix.upper()}", "weight"]
        )
        tensors[name] = np.ascontiguousarray(shaped)
    return tensors


def torch_module(module: list[str]) -> list[str]:
    """The path of one of hfjax's modules in the transformers model: the same, but for a vision-language model's
    decoder (`language_model.model.*`), which transformers 5 keeps at `model.language_model.*`."""
    if module[:2] == ["language_model", "model"]:
        return ["model", "language_model", *module[2:]]
    return module


def target_modules(model: nnx.Module, cfg: LoraConfig) -> list[str] | str:
    """PEFT's `target_modules` for `model`'s adapters: the projections' names, or for a vision-language model a
    pattern matching them in its language model only."""
    if isinstance(model, VisionLanguageLM):
        return rf"model\.language_model\.layers\.\d+\.(self_attn|mlp)\.({'|'.join(sorted(cfg.targets))})"
    return sorted(cfg.targets)


def save_peft(model: nnx.Module, cfg: LoraConfig, path: str | os.PathLike, base_model: str) -> Path:
    """Writes the adapters of `model` (added with `cfg`) as a PEFT adapter directory for the transformers model at
    `base_model`; a non-empty `path` is replaced only once the new directory is complete."""
    tensors = peft_tensors(model)
    if not tensors:
        raise ValueError("save_peft: the model has no LoRA adapters (actor.lora.rank is 0)")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "target_modules": target_modules(model, cfg),
        "lora_dropout": cfg.dropout,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    target = Path(path)
    tmp = target.parent / f".{target.name}.partial-{os.getpid()}"
    if jax.process_index() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    return target
