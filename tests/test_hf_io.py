"""Checkpoint I/O: save_hf round trips through transformers and back bitwise; bad checkpoints give clear errors."""

import json
import re

import jax
import numpy as np
import pytest
import torch
import transformers as tf
from flax import nnx
from safetensors.torch import load_file, save_file
from support.checkpoints import left_padded_batch, relative_error, save_hf_model, torch_logits

from hfjax.models import CheckpointError, UnsupportedModelError, load_hf, load_tokenizer, save_hf
from hfjax.models.local_tokenizer import build_bpe_tokenizer
from hfjax.models.safetensors_io import read_header, read_tensor


def _params(model):
    return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _assert_bitwise(a, b):
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for path in pa:
        assert pa[path].dtype == pb[path].dtype and np.array_equal(pa[path].view(np.uint8), pb[path].view(np.uint8)), (
            path
        )


@pytest.mark.parametrize(
    "family,kw",
    [
        ("llama", {}),
        ("qwen3", dict(tie_word_embeddings=True)),
        ("qwen2", dict(num_key_value_heads=1)),
        ("gemma2", dict(sliding_window=4)),
        ("gemma3", dict(sliding_window=4, tie_word_embeddings=False)),
    ],
)
def test_save_round_trip_through_transformers(tmp_path, family, kw):
    reference, path = save_hf_model(tmp_path, family, **kw)
    model = load_hf(path)
    out = save_hf(model, tmp_path / "saved")
    reloaded_hf = tf.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids, mask, positions = left_padded_batch(reference.config.vocab_size, [8, 5, 2], seed=0)
    v = mask.astype(bool)
    assert (
        relative_error(
            torch_logits(reloaded_hf, ids, mask, positions)[v], torch_logits(reference, ids, mask, positions)[v]
        )
        <= 1e-6
    )
    _assert_bitwise(model, load_hf(out))


def test_sharded_save_writes_an_index_that_transformers_loads(tmp_path):
    reference, path = save_hf_model(tmp_path, "llama")
    model = load_hf(path)
    out = save_hf(model, tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all(p.name in files for p in out.glob("*.safetensors"))
    reloaded_hf = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(tensor, reloaded_hf.state_dict()[name]), name
    _assert_bitwise(model, load_hf(out))


def test_bfloat16_save_is_bitwise(tmp_path):
    reference, path = save_hf_model(tmp_path, "qwen2")
    model = load_hf(path, dtype="bfloat16")
    out = save_hf(model, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf16 = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    want = reference.state_dict()["model.layers.0.self_attn.q_proj.weight"].to(torch.bfloat16)
    assert torch.equal(hf16.state_dict()["model.layers.0.self_attn.q_proj.weight"], want)
    _assert_bitwise(model, load_hf(out, dtype="bfloat16"))


def test_sequence_classifier_and_critic_round_trip(tmp_path):
    _reference, path = save_hf_model(tmp_path, "llama", head="SequenceClassification", num_labels=1)
    rm = load_hf(path)
    out = save_hf(rm, tmp_path / "rm")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    _assert_bitwise(rm, load_hf(out))
    _, lm_path = save_hf_model(tmp_path, "qwen2")
    critic = load_hf(lm_path, head="token_cls")
    out = save_hf(critic, tmp_path / "critic")
    hf_critic = tf.AutoModelForTokenClassification.from_pretrained(out, attn_implementation="eager").eval()
    ids, mask, positions = left_padded_batch(97, [6, 3], seed=1)
    v = mask.astype(bool)
    expected = torch_logits(hf_critic, ids, mask, positions)[..., 0]
    assert relative_error(np.asarray(critic(ids, mask))[v], expected[v]) <= 1e-5


def test_save_never_clobbers_without_overwrite(tmp_path):
    _, path = save_hf_model(tmp_path, "llama")
    model = load_hf(path)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_hf(model, path)
    assert (path / "model.safetensors").is_file()
    save_hf(model, path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no partial or replaced dirs left behind
    _assert_bitwise(model, load_hf(path))


def test_reader_agrees_with_safetensors_library(tmp_path):
    _, path = save_hf_model(tmp_path, "qwen3")
    expected = load_file(str(path / "model.safetensors"))
    entries = read_header(str(path / "model.safetensors"))
    assert entries.keys() == expected.keys()
    for name, entry in entries.items():
        assert np.array_equal(read_tensor(entry), expected[name].numpy()), name


def _rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_unexpected_and_misshaped_tensors_are_listed(tmp_path):
    _, path = save_hf_model(tmp_path, "llama")

    def edit(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.extra.weight"] = torch.zeros(3)
        t["model.norm.weight"] = torch.zeros(5)

    _rewrite(path, edit)
    with pytest.raises(CheckpointError) as info:
        load_hf(path)
    message = str(info.value)
    assert "missing tensors: model.layers.1.mlp.up_proj.weight (96, 64)" in message
    assert "unexpected tensors: model.extra.weight (3,)" in message
    assert "model.norm.weight: checkpoint (5,), model expects (64,)" in message


def test_corrupt_and_unsupported_checkpoints(tmp_path):
    _, path = save_hf_model(tmp_path, "llama")
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=re.escape("model.safetensors: corrupt safetensors entry")):
        load_hf(path)
    file.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="header length"):
        load_hf(path)
    file.write_bytes((12).to_bytes(8, "little") + b"{not json!!}")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_hf(path)
    file.unlink()
    with pytest.raises(CheckpointError, match=re.escape("no model.safetensors")):
        load_hf(path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="FalconForCausalLM"):
        load_hf(path)
    with pytest.raises(CheckpointError, match=re.escape("no config.json")):
        load_hf(tmp_path / "nowhere")


def test_bad_dtype_is_named(tmp_path):
    _, path = save_hf_model(tmp_path, "llama")
    with pytest.raises(ValueError, match=r"load_hf\(param_dtype\).*int8"):
        load_hf(path, param_dtype="int8")


def test_tokenizer_with_chat_template(tmp_path):
    fast = build_bpe_tokenizer([f"{a}+{b}={a + b}" for a in range(30) for b in range(30)], vocab_size=300)
    _, path = save_hf_model(tmp_path, "llama")
    save_hf(load_hf(path), tmp_path / "with-tok", tokenizer=fast)
    loaded = load_tokenizer(tmp_path / "with-tok")
    text = loaded.apply_chat_template([{"role": "user", "content": "12+7="}], tokenize=False)
    assert text == "user: 12+7=\nassistant:"
    assert loaded.decode(loaded.encode("12+7=19")) == "12+7=19" and loaded.pad_token_id == 0
    with pytest.raises(CheckpointError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path / "missing")


def test_params_land_on_one_device_without_layout(tmp_path):
    _, path = save_hf_model(tmp_path, "llama")
    model = load_hf(path)
    leaf = model.model.layers[0].mlp.up_kernel[...]
    assert leaf.sharding.device_set == {jax.devices()[0]}
