"""Command-line arguments shared by the commands that name a model and a mesh (`inspect`, `layouts`, `generate`):
`--mesh AXIS=SIZE,...` with `--rules`, and a model given as a Hugging Face directory or a named size."""

from __future__ import annotations

import argparse
import json
from typing import Any


def parse_mesh(text: str) -> dict[str, int]:
    """`--mesh`'s `AXIS=SIZE[,AXIS=SIZE...]` as a dict."""
    mesh = {}
    for item in text.split(","):
        name, _, size = item.partition("=")
        if not size.isdigit():
            raise SystemExit(f"--mesh: expected AXIS=SIZE[,AXIS=SIZE...], e.g. fsdp=4,tensor=2; got {text!r}")
        mesh[name.strip()] = int(size)
    return mesh


def layout_config(args: argparse.Namespace) -> dict[str, Any]:
    """The `Layout.from_config` form of `--mesh` and `--rules`."""
    rules: Any = args.rules
    if rules.startswith("["):
        rules = json.loads(rules)
    return {"mesh": parse_mesh(args.mesh), "rules": rules}


def abstract_params_for(model: str, dtype: str, lora_rank: int = 0) -> Any:
    """Abstract parameters (no memory) of a Hugging Face directory or a named size such as `llama-200m`; with
    `lora_rank`, float32 LoRA adapters of that rank on every projection beside them."""
    from pathlib import Path

    from flax import nnx

    from hfjax.models.hf import abstract_model, read_config
    from hfjax.models.lora import LoraConfig, add_lora
    from hfjax.models.presets import named_config

    if Path(model).is_dir():
        cfg, head = read_config(model)
    else:
        cfg, head = named_config(model), "causal_lm"
    if not lora_rank:
        return nnx.state(abstract_model(cfg, head, dtype), nnx.Param)
    adapted = nnx.eval_shape(lambda: add_lora(abstract_model(cfg, head, dtype), LoraConfig(rank=lora_rank)))
    return nnx.state(adapted, nnx.Param)
