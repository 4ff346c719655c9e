"""Flax NNX decoder family (Llama, Qwen2, Qwen3, Mistral) with causal-LM, score and value heads; HF checkpoint I/O."""

from hfjax.models.config import ARCHITECTURES, ModelConfig, RopeConfig, UnsupportedModelError, config_from_hf
from hfjax.models.hf import load_hf, load_tokenizer, read_config, save_hf
from hfjax.models.safetensors_io import CheckpointError
from hfjax.models.transformer import CausalLM, Critic, SequenceClassifier, positions_from_mask

__all__ = [
    "ARCHITECTURES",
    "CausalLM",
    "CheckpointError",
    "Critic",
    "ModelConfig",
    "RopeConfig",
    "SequenceClassifier",
    "UnsupportedModelError",
    "config_from_hf",
    "load_hf",
    "load_tokenizer",
    "positions_from_mask",
    "read_config",
    "save_hf",
]
