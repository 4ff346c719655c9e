"""Flax NNX decoder family (Llama, Qwen2/3, Mistral, Gemma 2/3, mixtures of experts) with causal-LM, score and value
heads, Gemma 3's vision-language model; HF checkpoint I/O."""

from hfjax.models.config import ARCHITECTURES, ModelConfig, RopeConfig, UnsupportedModelError, config_from_hf
from hfjax.models.hf import load_hf, load_tokenizer, read_config, save_hf
from hfjax.models.safetensors_io import CheckpointError
from hfjax.models.transformer import CausalLM, Critic, SequenceClassifier, positions_from_mask
from hfjax.models.vision_lm import VisionLanguageLM, load_vision_lm, save_vision_lm

__all__ = [
    "ARCHITECTURES",
    "CausalLM",
    "CheckpointError",
    "Critic",
    "ModelConfig",
    "RopeConfig",
    "SequenceClassifier",
    "UnsupportedModelError",
    "VisionLanguageLM",
    "config_from_hf",
    "load_hf",
    "load_tokenizer",
    "load_vision_lm",
    "positions_from_mask",
    "read_config",
    "save_hf",
    "save_vision_lm",
]
