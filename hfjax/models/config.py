"""`ModelConfig`: the typed, validated view of a Hugging Face decoder `config.json`.

Owns the translation between HF config dicts (transformers 4 and 5 spellings) and the fields the Flax model reads.
Every HF option that changes the numbers is either honoured here or rejected with an error that names it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# HF model type (our family) -> the prefix of its architecture classes.
FAMILY_CLASS_PREFIX = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mistral": "Mistral",
    "gemma2": "Gemma2",
    "gemma3_text": "Gemma3",
    "qwen3_moe": "Qwen3Moe",
    "mixtral": "Mixtral",
}
HEAD_CLASS_SUFFIX = {"causal_lm": "CausalLM", "seq_cls": "SequenceClassification", "token_cls": "TokenClassification"}
# Where a family's class is not prefix + "For" + suffix. transformers has no Gemma 3 token classifier: an hfjax critic
# of Gemma 3 is saved under this name, which hfjax reads back (transformers does not).
ARCHITECTURE_EXCEPTIONS = {("gemma3_text", "seq_cls"): "Gemma3TextForSequenceClassification"}
GEMMA_FAMILIES = ("gemma2", "gemma3_text")
MOE_FAMILIES = ("qwen3_moe", "mixtral")


def architecture_name(family: str, head: str) -> str:
    """The HF architecture string of a family (HF `model_type`) and head kind (`causal_lm`, `seq_cls`, `token_cls`)."""
    default = f"{FAMILY_CLASS_PREFIX[family]}For{HEAD_CLASS_SUFFIX[head]}"
    return ARCHITECTURE_EXCEPTIONS.get((family, head), default)


# HF architecture name -> (family, head kind). Head kinds: causal_lm, seq_cls, token_cls (our critic).
ARCHITECTURES: dict[str, tuple[str, str]] = {
    architecture_name(family, head): (family, head) for family in FAMILY_CLASS_PREFIX for head in HEAD_CLASS_SUFFIX
}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}  # HF name -> ours
ROPE_TYPES = ("default", "linear", "llama3")
# Stored vocabulary rows are a multiple of this (whatever the layout, so one checkpoint shape serves every layout):
# it divides by every power-of-two tensor-parallel size up to 128; real vocabularies such as 32000 or 151936 already
# are multiples.
VOCAB_MULTIPLE = 128
MASKED_SCORE = -1e30  # a masked attention score or logit: finite, so fully masked rows stay NaN-free


class UnsupportedModelError(ValueError):
    """A checkpoint uses an architecture or option that hfjax does not implement."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base `theta`, `rope_type` and the scaling parameters that type reads."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder: Llama 2/3.x, Qwen2, Qwen3, Mistral, Gemma 2 and 3 (text), whose
    differences are the options below `sliding_windows`, and the mixture-of-experts Qwen3-MoE and Mixtral (the
    options from `num_experts` on)."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Per layer: None for full attention, else the sliding-window width (keys with q_idx - k_idx < window).
    sliding_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)
    norm_offset: bool = False  # RMSNorm scales by (1 + weight), in float32 (Gemma)
    sandwich_norms: bool = False  # norms on the attention and MLP outputs too (Gemma: post_attention_layernorm is
    # the attention output's norm, pre_feedforward_layernorm the MLP input's)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), rounded to the compute dtype (Gemma)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power, not head_dim's (Gemma)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
    final_softcap: float | None = None  # the same on the LM head's logits (Gemma 2)
    local_rope: RopeConfig | None = None  # rotary embedding of the sliding-window layers when it differs (Gemma 3)
    num_experts: int = 0  # experts of a mixture-of-experts layer (0: every layer has the dense MLP)
    experts_per_token: int = 0  # experts each token is routed to (top-k of the router's softmax)
    expert_intermediate_size: int = 0  # each expert's gated-MLP width
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1 (Mixtral always)
    # Per layer: whether its MLP is the mixture of experts (Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step`)
    moe_layers: tuple[bool, ...] = ()
    num_labels: int = 1
    pad_token_id: int | None = None
    hf_config: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILY_CLASS_PREFIX:
            raise UnsupportedModelError(
                f"model family {self.family!r} is not supported; expected one of {sorted(FAMILY_CLASS_PREFIX)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "num_labels",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.rope.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {self.rope.rope_type!r} is not supported; expected one of {ROPE_TYPES}"
            )
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise UnsupportedModelError(f"hidden_act {self.hidden_act!r} is not supported; expected silu or gelu_tanh")
        for name in ("query_pre_attn_scalar", "attn_softcap", "final_softcap"):
            value = getattr(self, name)
            if value is not None and not float(value) > 0:
                raise ValueError(f"ModelConfig.{name} must be > 0 or None, got {value!r}")
        self._check_experts()
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(
                f"ModelConfig.sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers"
            )

    def _check_experts(self) -> None:
        if not self.moe_layers or not self.num_experts:  # a dense model's, also after `dataclasses.replace`
            object.__setattr__(self, "moe_layers", (self.num_experts > 0,) * self.num_layers)
        if len(self.moe_layers) != self.num_layers:
            raise ValueError(f"ModelConfig.moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if not any(self.moe_layers):
            return
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"ModelConfig.experts_per_token must be in [1, num_experts={self.num_experts}], "
                f"got {self.experts_per_token!r}"
            )
        if self.expert_intermediate_size < 1:
            raise ValueError(f"ModelConfig.expert_intermediate_size must be >= 1, got {self.expert_intermediate_size}")

    @property
    def layer_ropes(self) -> tuple[RopeConfig, ...]:
        """Each layer's rotary embedding: `local_rope` for sliding-window layers when set, else `rope`."""
        local = self.local_rope or self.rope
        return tuple(self.rope if window is None else local for window in self.sliding_windows)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids from the HF config (`eos_token_id`, an int or a list); empty when absent."""
        eos = self.hf_config.get("eos_token_id")
        if eos is None:
            return ()
        return tuple(int(i) for i in eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the stored embedding and LM head: `vocab_size` rounded up to a multiple of `VOCAB_MULTIPLE`. The
        rows from `vocab_size` on are zero, never looked up, and their logits are masked."""
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    @property
    def num_params(self) -> int:
        """Parameter count of the HF causal LM (embedding, layers, final norm, LM head unless tied), as transformers
        counts it: the vocabulary padding rows are not counted."""
        d, q, kv, m = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, 0
        attn = d * q + 2 * d * kv + q * d
        attn += (q + 2 * kv) * self.qkv_bias + d * self.o_bias + 2 * self.head_dim * self.qk_norm
        m = 3 * d * self.intermediate_size + (2 * self.intermediate_size + d) * self.mlp_bias
        experts = self.num_experts * (3 * d * self.expert_intermediate_size + d)  # + the router
        moe = sum(self.moe_layers)
        per_layer = attn + (4 if self.sandwich_norms else 2) * d
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        mlps = (self.num_layers - moe) * m + moe * experts
        return self.vocab_size * d + self.num_layers * per_layer + mlps + d + head

    def architecture(self, head: str) -> str:
        """The HF architecture string for this family and head kind (`causal_lm`, `seq_cls`, `token_cls`)."""
        return architecture_name(self.family, head)

    def to_hf_dict(self, head: str, dtype: str) -> dict[str, Any]:
        """A transformers `config.json` dict for this config, keeping unrelated keys of the original."""
        out = dict(self.hf_config)
        for stale in ("rope_scaling", "rope_parameters", "rope_theta", "torch_dtype", "id2label", "label2id"):
            out.pop(stale, None)
        out.update(
            architectures=[self.architecture(head)],
            model_type=self.family,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_parameters=_rope_to_hf(self.rope),
            dtype=dtype,
            pad_token_id=self.pad_token_id,
        )
        if self.family in GEMMA_FAMILIES:
            out.update(self._gemma_hf_keys())
        else:
            out["hidden_act"] = "silu"
        if self.family in MOE_FAMILIES:
            out.update(self._moe_hf_keys())
        if self.family == "llama":
            out.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        if head != "causal_lm":
            out["id2label"] = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
            out["label2id"] = {f"LABEL_{i}": i for i in range(self.num_labels)}
        return out

    def _gemma_hf_keys(self) -> dict[str, Any]:
        windows = sorted({w for w in self.sliding_windows if w is not None})
        keys: dict[str, Any] = {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "attn_logit_softcapping": self.attn_softcap,
            "final_logit_softcapping": self.final_softcap,
            "sliding_window": windows[0] if windows else None,
            "layer_types": ["full_attention" if w is None else "sliding_attention" for w in self.sliding_windows],
            "attention_bias": self.qkv_bias,
        }
        if self.family == "gemma3_text":
            keys["rope_parameters"] = {
                "full_attention": _rope_to_hf(self.rope),
                "sliding_attention": _rope_to_hf(self.local_rope or self.rope),
            }
        return keys

    def _moe_hf_keys(self) -> dict[str, Any]:
        keys: dict[str, Any] = {"num_experts_per_tok": self.experts_per_token, "num_local_experts": self.num_experts}
        if self.family == "mixtral":
            return {**keys, "intermediate_size": self.expert_intermediate_size, "router_jitter_noise": 0.0}
        return {
            **keys,
            "num_experts": self.num_experts,
            "moe_intermediate_size": self.expert_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, moe in enumerate(self.moe_layers) if not moe],
        }


def _rope_to_hf(rope: RopeConfig) -> dict[str, Any]:
    """A `RopeConfig` as transformers 5 `rope_parameters`."""
    out: dict[str, Any] = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
    if rope.rope_type in ("linear", "llama3"):
        out["factor"] = rope.factor
    if rope.rope_type == "llama3":
        out.update(
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    return out


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    """Reads rope settings from v5 `rope_parameters` or v4 `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    merged = {**legacy, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.json: rope type {rope_type!r} is not supported; expected one of {ROPE_TYPES}"
        )
    kwargs: dict[str, Any] = {"theta": float(theta), "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        if "factor" not in merged:
            raise ValueError(f"config.json: rope type {rope_type!r} needs 'factor' in rope_parameters/rope_scaling")
        kwargs["factor"] = float(merged["factor"])
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in merged:
                raise ValueError(f"config.json: rope type 'llama3' needs {key!r} in rope_parameters/rope_scaling")
            kwargs[key] = merged[key]
        kwargs["original_max_position_embeddings"] = int(kwargs["original_max_position_embeddings"])
    return RopeConfig(**kwargs)


def _sliding_windows_from_hf(cfg: dict[str, Any], family: str, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding windows from `layer_types` / `use_sliding_window` / `sliding_window` (Gemma: `layer_types`,
    else its fixed pattern: every 2nd layer global in Gemma 2, every `sliding_window_pattern`-th (6) in Gemma 3)."""
    window = cfg.get("sliding_window")
    if family in ("mistral", "mixtral") or (family == "qwen3_moe" and cfg.get("use_sliding_window")):
        return (window,) * num_layers if window else (None,) * num_layers
    gemma = family in GEMMA_FAMILIES
    if family == "llama" or not window or not (gemma or cfg.get("use_sliding_window", False)):
        return (None,) * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types is None and gemma:
        period = 2 if family == "gemma2" else int(cfg.get("sliding_window_pattern", 6))
        layer_types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(num_layers)]
    if layer_types is None:
        first_sliding = cfg.get("max_window_layers", num_layers)
        layer_types = ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]
    bad = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if bad:
        raise UnsupportedModelError(f"config.json: layer_types {bad} are not supported")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def _gemma_options(cfg: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """The `ModelConfig` fields of a Gemma 2 or Gemma 3 (text) config, with transformers' defaults where absent."""
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{source}: use_bidirectional_attention=true is not supported (causal LMs only)")
    gemma2 = family == "gemma2"
    bias = bool(cfg.get("attention_bias", False))
    options: dict[str, Any] = {
        "norm_offset": True,
        "sandwich_norms": True,
        "embed_scale": True,
        "qk_norm": not gemma2,
        "qkv_bias": bias,
        "o_bias": bias,
        "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar", 256),  # as written: transformers wants an int
        "attn_softcap": cfg.get("attn_logit_softcapping", 50.0 if gemma2 else None),
        "final_softcap": cfg.get("final_logit_softcapping", 30.0 if gemma2 else None),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
    }
    params = cfg.get("rope_parameters") or {}
    if not gemma2 and "full_attention" in params:
        options["rope"] = _rope_from_hf({"rope_parameters": params["full_attention"]})
        options["local_rope"] = _rope_from_hf({"rope_parameters": params.get("sliding_attention") or {}})
    elif not gemma2:
        options["rope"] = _rope_from_hf({"rope_theta": 1_000_000.0, **cfg})
        options["local_rope"] = RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10_000.0)))
    return options


def _moe_options(cfg: dict[str, Any], family: str, num_layers: int, source: str) -> dict[str, Any]:
    """The `ModelConfig` fields of a Qwen3-MoE or Mixtral config (transformers' spellings and defaults)."""
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or (8 if family == "mixtral" else 128))
    options: dict[str, Any] = {"num_experts": num_experts, "experts_per_token": int(cfg.get("num_experts_per_tok", 2))}
    if family == "mixtral":
        if float(cfg.get("router_jitter_noise", 0.0) or 0.0) != 0.0:
            raise UnsupportedModelError(f"{source}: router_jitter_noise={cfg['router_jitter_noise']} is not supported")
        return {**options, "expert_intermediate_size": int(cfg["intermediate_size"]), "norm_topk_prob": True}
    dense_only = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1))
    moe_layers = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(num_layers))
    return {
        **options,
        "expert_intermediate_size": int(cfg.get("moe_intermediate_size", 768)),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "moe_layers": moe_layers,
    }


def config_from_hf(cfg: dict[str, Any], source: str = "config.json") -> tuple[ModelConfig, str]:
    """Parses an HF config dict; returns the `ModelConfig` and the head kind of its architecture."""
    archs = cfg.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: architectures {archs!r} not supported; expected one of {sorted(ARCHITECTURES)}"
        )
    family, head = ARCHITECTURES[archs[0]]
    gemma = family in GEMMA_FAMILIES
    act_key = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
    act = cfg.get(act_key) or ("gelu_pytorch_tanh" if gemma else "silu")
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"{source}: {act_key} {act!r} is not supported; expected one of {sorted(ACTIVATIONS)}"
        )
    for key in ("attention_dropout", "hidden_dropout"):
        if float(cfg.get(key, 0.0) or 0.0) != 0.0:
            raise UnsupportedModelError(f"{source}: {key}={cfg[key]} is not supported; expected 0.0")
    missing = [
        k
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        if k not in cfg
    ]
    if missing:
        raise ValueError(f"{source}: missing required keys {missing}")
    num_heads = int(cfg["num_attention_heads"])
    num_layers = int(cfg["num_hidden_layers"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    attention_bias = bool(cfg.get("attention_bias", False))
    options = {
        "rope": _rope_from_hf(cfg),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "qkv_bias": family == "qwen2" or (family in ("llama", "qwen3", "qwen3_moe") and attention_bias),
        "o_bias": family in ("llama", "qwen3", "qwen3_moe") and attention_bias,
        "qk_norm": family in ("qwen3", "qwen3_moe"),
    }
    if gemma:
        options.update(_gemma_options(cfg, family, source))
    if family in MOE_FAMILIES:
        options.update(_moe_options(cfg, family, num_layers, source))
    model_cfg = ModelConfig(
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        mlp_bias=family == "llama" and bool(cfg.get("mlp_bias", False)),
        sliding_windows=_sliding_windows_from_hf(cfg, family, num_layers),
        hidden_act=ACTIVATIONS[act],
        num_labels=len(cfg["id2label"])
        if cfg.get("id2label")
        else int(cfg.get("num_labels", 1 if head == "token_cls" else 2)),
        pad_token_id=cfg.get("pad_token_id"),
        hf_config=dict(cfg),
        **options,
    )
    return model_cfg, head
