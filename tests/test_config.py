"""HF config parsing: both rope spellings, llama3 frequencies by hand, and unsupported options named in errors."""

import math

import numpy as np
import pytest
from support.checkpoints import hf_config

from hfjax.models import ModelConfig, RopeConfig, UnsupportedModelError, config_from_hf
from hfjax.models.layers import rope_inv_freq


def _dict(family, **overrides):
    cfg = hf_config(family, **overrides).to_dict()
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "gemma2": "Gemma2"}
    cfg["architectures"] = [prefix.get(family, "Gemma3") + "ForCausalLM"]
    return cfg


def test_llama3_inverse_frequencies_by_hand():
    rope = RopeConfig(
        theta=500000.0,
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    got = rope_inv_freq(rope, 128)
    for i, f in enumerate(got):
        base = 500000.0 ** (-(2 * i) / 128)
        wavelen = 2 * math.pi / base
        if wavelen < 8192 / 4:
            want = base
        elif wavelen > 8192 / 1:
            want = base / 8
        else:
            s = (8192 / wavelen - 1) / (4 - 1)
            want = (1 - s) * base / 8 + s * base
        assert f == pytest.approx(want, rel=1e-6), i
    assert got[0] == pytest.approx(1.0) and got[-1] < 500000.0 ** (-126 / 128) / 7.9  # both ends of the band


def test_rope_read_from_v4_and_v5_spellings():
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    v5 = _dict("llama")
    v5["rope_parameters"] = dict(rope_type="llama3", rope_theta=123.0, **scaling)
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4.update(rope_theta=123.0, rope_scaling=dict(type="llama3", **scaling))
    a, b = config_from_hf(v5)[0], config_from_hf(v4)[0]
    assert a.rope == b.rope == RopeConfig(theta=123.0, rope_type="llama3", **scaling)


def test_family_options():
    qwen2, head = config_from_hf(_dict("qwen2"))
    assert head == "causal_lm" and qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    qwen3 = config_from_hf(_dict("qwen3", head_dim=32))[0]
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.qkv_bias
    mistral = config_from_hf(_dict("mistral", sliding_window=16))[0]
    assert mistral.sliding_windows == (16, 16)
    sliding_qwen = config_from_hf(_dict("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1))[0]
    assert sliding_qwen.sliding_windows == (None, 8)


def test_gemma_options_and_their_defaults():
    """Gemma configs as the Hub ships them: Gemma 2 with no layer_types alternates sliding and global layers and has
    both soft caps; Gemma 3 in the older spelling (rope_theta, rope_local_base_freq, sliding_window_pattern) has a
    global layer every 6th, its local rotary base on the sliding layers, q/k norms and no caps."""
    gemma2 = _dict("gemma2", sliding_window=4096, num_hidden_layers=4, layer_types=None)
    for key in ("layer_types", "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        gemma2.pop(key)
    cfg = config_from_hf(gemma2)[0]
    assert cfg.sliding_windows == (4096, None, 4096, None)
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.query_pre_attn_scalar) == (50.0, 30.0, 256.0)
    assert cfg.norm_offset and cfg.sandwich_norms and cfg.embed_scale and not cfg.qk_norm
    assert cfg.hidden_act == "gelu_tanh" and cfg.tie_word_embeddings
    gemma3 = _dict("gemma3", num_hidden_layers=7, sliding_window=512, layer_types=None)
    for key in ("layer_types", "rope_parameters"):
        gemma3.pop(key)
    gemma3.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6)
    cfg = config_from_hf(gemma3)[0]
    assert cfg.sliding_windows == (512,) * 5 + (None, 512)
    assert [r.theta for r in cfg.layer_ropes] == [1e4] * 5 + [1e6, 1e4]
    assert cfg.qk_norm and cfg.attn_softcap is None and cfg.final_softcap is None
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        config_from_hf({**gemma3, "use_bidirectional_attention": True})


def test_param_count_matches_transformers():
    from support.checkpoints import build_hf_model

    cases = (
        ("llama", dict(tie_word_embeddings=True)),
        ("qwen2", {}),
        ("qwen3", dict(head_dim=32)),
        ("gemma2", {}),
        ("gemma3", dict(tie_word_embeddings=False)),
    )
    for family, kw in cases:
        model = build_hf_model(family, **kw)
        cfg = config_from_hf(_dict(family, **kw))[0]
        assert cfg.num_params == sum(p.numel() for p in model.parameters()), family


@pytest.mark.parametrize(
    "edit,needle",
    [
        (dict(architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
        (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)), "'yarn'"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(attention_dropout=0.1), "attention_dropout"),
        (dict(rope_parameters=dict(rope_type="llama3", rope_theta=1e4, factor=4.0)), "low_freq_factor"),
    ],
)
def test_unsupported_options_are_named(edit, needle):
    cfg = _dict("llama")
    cfg.update(edit)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        config_from_hf(cfg)


def test_missing_keys_and_bad_shapes():
    cfg = _dict("llama")
    del cfg["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        config_from_hf(cfg)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(
            family="llama",
            vocab_size=8,
            hidden_size=8,
            intermediate_size=8,
            num_layers=1,
            num_heads=3,
            num_kv_heads=2,
            head_dim=4,
        )
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelConfig(
            family="gpt2",
            vocab_size=8,
            hidden_size=8,
            intermediate_size=8,
            num_layers=1,
            num_heads=2,
            num_kv_heads=2,
            head_dim=4,
        )
    assert np.isfinite(rope_inv_freq(RopeConfig(), 8)).all()
