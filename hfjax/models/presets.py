"""Named model shapes (public configs of well-known checkpoints, and the benchmark sizes) for planning layouts
and benchmarks without a checkpoint on disk. Weights are never implied: these are shapes only."""

from __future__ import annotations

from pathlib import Path

from hfjax.models.config import ModelConfig, RopeConfig, config_from_hf
from hfjax.models.vision_lm import VisionLanguageConfig, is_vision_language_checkpoint, vision_lm_config

LLAMA3_ROPE = RopeConfig(
    theta=500000.0,
    rope_type="llama3",
    factor=32.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

NAMED_CONFIGS: dict[str, ModelConfig] = {
    # 25.8M parameters: the benchmarks' reference checkpoint (scripts/bench/make_reference_ckpt.py builds it with
    # weights).
    "bench-25m": ModelConfig(
        family="llama",
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1376,
        num_layers=6,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        rms_norm_eps=1e-5,
    ),
    # ~207M parameters: the resharding benchmark's model.
    "llama-200m": ModelConfig(
        family="llama",
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_layers=12,
        num_heads=16,
        num_kv_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
    ),
    "qwen2.5-0.5b": ModelConfig(
        family="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rope=RopeConfig(theta=1e6),
        tie_word_embeddings=True,
        qkv_bias=True,
    ),
    "qwen2.5-1.5b": ModelConfig(
        family="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
        rope=RopeConfig(theta=1e6),
        tie_word_embeddings=True,
        qkv_bias=True,
    ),
    "llama-3.2-1b": ModelConfig(
        family="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope=LLAMA3_ROPE,
        tie_word_embeddings=True,
    ),
    "llama-3.1-8b": ModelConfig(
        family="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=8192),
    ),
    # Gemma 3 1B, from its config.json as published (read by the same parser as a checkpoint's)
    "gemma-3-1b": config_from_hf(
        {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "vocab_size": 262144,
            "hidden_size": 1152,
            "intermediate_size": 6912,
            "num_hidden_layers": 26,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 256,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "rope_theta": 1000000,
            "rope_local_base_freq": 10000,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "tie_word_embeddings": True,
            "pad_token_id": 0,
            "eos_token_id": [1, 106],
        },
        "gemma-3-1b",
    )[0],
    # Qwen3-30B-A3B: 48 mixture-of-experts layers of 128 experts, 8 per token (3.3B of 30.5B parameters active)
    "qwen3-30b-a3b": config_from_hf(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": False,
            "eos_token_id": 151645,
        },
        "qwen3-30b-a3b",
    )[0],
}

# Vision-language models (Gemma 3 4B: a 27-layer SigLIP tower on 896 x 896 images, 4,096 patches pooled to 256 soft
# tokens, and a 34-layer language model); their language models are named shapes above too
NAMED_VISION_CONFIGS: dict[str, VisionLanguageConfig] = {
    "gemma-3-4b": VisionLanguageConfig.from_hf(
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "mm_tokens_per_image": 256,
            "image_token_index": 262144,
            "boi_token_index": 255999,
            "eoi_token_index": 256000,
            "text_config": {
                "model_type": "gemma3_text",
                "vocab_size": 262208,
                "hidden_size": 2560,
                "intermediate_size": 10240,
                "num_hidden_layers": 34,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "head_dim": 256,
                "hidden_activation": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": 256,
                "sliding_window": 1024,
                "sliding_window_pattern": 6,
                "rope_theta": 1000000,
                "rope_local_base_freq": 10000,
                "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                "rms_norm_eps": 1e-6,
                "max_position_embeddings": 131072,
                "attn_logit_softcapping": None,
                "final_logit_softcapping": None,
                "pad_token_id": 0,
                "eos_token_id": [1, 106],
            },
            "vision_config": {
                "model_type": "siglip_vision_model",
                "hidden_size": 1152,
                "intermediate_size": 4304,
                "num_hidden_layers": 27,
                "num_attention_heads": 16,
                "image_size": 896,
                "patch_size": 14,
                "vision_use_head": False,
            },
        },
        "gemma-3-4b",
    ),
}
NAMED_CONFIGS |= {name: vision.text for name, vision in NAMED_VISION_CONFIGS.items()}


def named_config(name: str) -> ModelConfig:
    """The `ModelConfig` of a named shape; raises naming the known ones."""
    if name not in NAMED_CONFIGS:
        raise ValueError(
            f"unknown model name {name!r}; expected a Hugging Face directory or one of {sorted(NAMED_CONFIGS)}"
        )
    return NAMED_CONFIGS[name]


# Hub ids of the shipped configs -> their named shapes above: planning and compile-only checks need no download
HUB_SHAPES = {
    "Qwen/Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b",
    "Qwen/Qwen2.5-1.5B-Instruct": "qwen2.5-1.5b",
    "meta-llama/Llama-3.2-1B-Instruct": "llama-3.2-1b",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "google/gemma-3-1b-it": "gemma-3-1b",
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b",
    "google/gemma-3-4b-it": "gemma-3-4b",
}


def vision_language_shape(path: str) -> VisionLanguageConfig | None:
    """The `VisionLanguageConfig` of a vision-language model named by `path` (a named shape, a Hub id of one, or a
    local checkpoint directory; no weights read); None for a text model or anything else."""
    name = HUB_SHAPES.get(path, path)
    if name in NAMED_VISION_CONFIGS:
        return NAMED_VISION_CONFIGS[name]
    directory = Path(path).expanduser()
    if directory.is_dir() and is_vision_language_checkpoint(directory):
        return vision_lm_config(directory)
    return None
