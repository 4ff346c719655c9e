"""Builds tiny random Hugging Face checkpoints and tokenizers locally (no downloads) for tests, and damages saved
orbax steps (`flip_bytes`). PyTorch and transformers are imported where they are used: a Ray worker that unpickles a
worker class defined in a test module imports that module and what it imports, and these two take seconds."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch
    import transformers as tf

PREFIX = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mistral": "Mistral",
    "gemma2": "Gemma2",
    "gemma3": "Gemma3",
    "qwen3_moe": "Qwen3Moe",
    "mixtral": "Mixtral",
}
SOFTCAPS = {"attn": 0.2, "final": 1.0}
GEMMA3_ROPES = {  # local and global rotary bases far apart, so that a layer reading the other's table shows
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
CONFIG_CLASS = {"gemma3": "Gemma3TextConfig"}  # else PREFIX + "Config"
MODEL_CLASS = {("gemma3", "SequenceClassification"): "Gemma3TextForSequenceClassification"}  # else PREFIX + For + head
# Gemma at tiny size: 16-wide heads, a query scale that is not head_dim's, a sliding layer then a global one, and
# soft caps small enough to change the numbers (Gemma 2's defaults, 50 and 30, would not at these magnitudes)
GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"])
# Mixtures of experts at tiny size: Qwen3-MoE with 8 experts of width 32, top-2, and a dense MLP in layer 1;
# Mixtral with 4 experts of width 96, top-2
FAMILY_DEFAULTS = {
    "gemma2": dict(GEMMA, attn_logit_softcapping=SOFTCAPS["attn"], final_logit_softcapping=SOFTCAPS["final"]),
    "gemma3": dict(GEMMA, rope_parameters=GEMMA3_ROPES),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}
BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    pad_token_id=0,
)


def hf_config(family: str, **overrides: Any) -> tf.PretrainedConfig:
    import transformers as tf

    kwargs = {**BASE, **FAMILY_DEFAULTS.get(family, {}), **overrides}
    if family in ("qwen3", "mistral", "qwen3_moe", "mixtral") and "head_dim" not in kwargs:
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    return getattr(tf, CONFIG_CLASS.get(family, f"{PREFIX[family]}Config"))(**kwargs)


def build_hf_model(family: str, head: str = "CausalLM", seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random transformers model in float32 eval mode, with eager attention; a mixture of experts' router has
    standard-normal weights, so that its top-k choices are far from ties."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    config = hf_config(family, **overrides)
    config._attn_implementation = "eager"
    cls = getattr(tf, MODEL_CLASS.get((family, head), f"{PREFIX[family]}For{head}"))
    model = cls(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so that a dropped one shows in the logits
        for name, p in model.named_parameters():
            if name.endswith(".gate.weight"):  # a router: `mlp.gate`, `block_sparse_moe.gate`
                p.copy_(torch.randn_like(p))
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def save_hf_model(tmp_path: Path, family: str, head: str = "CausalLM", seed: int = 0, **overrides: Any):
    model = build_hf_model(family, head, seed, **overrides)
    out = tmp_path / f"{family}-{head}-{seed}"
    model.save_pretrained(out)
    return model, out


def left_padded_batch(vocab: int, lengths: list[int], seed: int = 0, pad_id: int = 0):
    """Random token ids (never the pad id) left-padded to the longest length; returns ids, mask, positions."""
    rng = np.random.default_rng(seed)
    width = max(lengths)
    ids = np.full((len(lengths), width), pad_id, np.int32)
    mask = np.zeros((len(lengths), width), np.int32)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = rng.integers(1, vocab, n)
        mask[row, width - n :] = 1
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return ids, mask, positions


def torch_logits(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(
            input_ids=torch.as_tensor(ids, dtype=torch.long),
            attention_mask=torch.as_tensor(mask),
            position_ids=torch.as_tensor(positions, dtype=torch.long),
        )
    return out.logits.float().numpy()


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def flip_bytes(step_dir: Path, item: str = "params", count: int = 64) -> str:
    """Inverts `count` bytes in the middle of the largest array data file of `item` in an orbax checkpoint step
    (sizes unchanged); returns its path relative to the step."""
    files = [f for f in (step_dir / item).rglob("*") if f.is_file() and f.parent.name == "d"]
    data = max(files, key=lambda f: f.stat().st_size)
    with open(data, "r+b") as handle:
        middle = data.stat().st_size // 2
        handle.seek(middle)
        flipped = bytes(b ^ 0xFF for b in handle.read(count))
        handle.seek(middle)
        handle.write(flipped)
    return data.relative_to(step_dir).as_posix()
