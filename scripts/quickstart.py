"""Quickstart (until the RL trainer lands): build small Llama, Qwen2, Qwen3 and Mistral checkpoints and a tokenizer
locally, load each with hfjax on one device and sharded over 8 CPU devices, and print logit parity with
transformers (PyTorch, the reference), then round-trip one through `save_hf`. Nothing is downloaded.
Usage: python scripts/quickstart.py [--out runs/quickstart]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np
import torch
import transformers as tf
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from hfjax.models import load_hf, load_tokenizer, save_hf
from hfjax.models.local_tokenizer import build_bpe_tokenizer

SMALL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
)
FAMILIES = {
    "Llama 3 (llama3 rope)": (
        tf.LlamaConfig,
        tf.LlamaForCausalLM,
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            )
        ),
    ),
    "Qwen2 (qkv bias, tied)": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "Qwen3 (qk norm)": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=16)),
    "Mistral (sliding window 8)": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=8, head_dim=16)),
}
LAYOUT = {"mesh": {"fsdp": 4, "tensor": 2}, "rules": "fsdp_tp"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/quickstart"))
    args = parser.parse_args()
    corpus = [f"{a}+{b}={a + b}" for a in range(100) for b in range(100)] + ["what is sort hello world this a"]
    build_bpe_tokenizer(corpus, vocab_size=512).save_pretrained(args.out / "tokenizer")
    tokenizer = load_tokenizer(args.out / "tokenizer")
    prompts = ["12+7=", "what is 3+4?", "sort: c a b", "hello world, this is a longer prompt about 15+27="]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False) for p in prompts]
    batch = tokenizer(texts, return_tensors="np", padding=True, padding_side="left")
    ids, mask = batch["input_ids"].astype(np.int32), batch["attention_mask"].astype(np.int32)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    valid = mask.astype(bool)

    table = Table(
        title=f"hfjax vs transformers, fp32 logits on {len(prompts)} left-padded chat prompts "
        f"({jax.device_count()} {jax.default_backend()} devices)"
    )
    for col in ("family", "params", "rel err (1 device)", f"rel err ({LAYOUT['mesh']})", "next tokens agree"):
        table.add_column(col)
    results = {}
    for name, (config_cls, model_cls, extra) in tqdm(FAMILIES.items(), desc="families"):
        torch.manual_seed(0)
        config = config_cls(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **SMALL, **extra)
        reference = model_cls(config).eval()
        path = args.out / name.split()[0].lower()
        reference.save_pretrained(path)
        with torch.no_grad():
            want = reference(
                input_ids=torch.as_tensor(ids, dtype=torch.long),
                attention_mask=torch.as_tensor(mask),
                position_ids=torch.as_tensor(positions),
            ).logits.numpy()
        errors = []
        for layout in (None, LAYOUT):
            got = np.asarray(load_hf(path, layout=layout)(ids, mask))
            errors.append(float(np.linalg.norm(got[valid] - want[valid]) / np.linalg.norm(want[valid])))
        agree = float(np.mean(got[:, -1].argmax(-1) == want[:, -1].argmax(-1)))
        n = sum(p.numel() for p in reference.parameters())
        table.add_row(name, f"{n / 1e6:.2f}M", f"{errors[0]:.1e}", f"{errors[1]:.1e}", f"{agree:.0%}")
        results[name] = {"params": n, "rel_err_one_device": errors[0], "rel_err_sharded": errors[1]}
    Console(width=140).print(table)

    saved = save_hf(load_hf(args.out / "llama"), args.out / "llama-resaved", tokenizer=tokenizer, overwrite=True)
    again = tf.AutoModelForCausalLM.from_pretrained(saved).eval()
    original = tf.AutoModelForCausalLM.from_pretrained(args.out / "llama").eval()
    same = all(
        torch.equal(a, b) for a, b in zip(original.state_dict().values(), again.state_dict().values(), strict=True)
    )
    print(f"save_hf -> transformers reload: weights {'bitwise equal' if same else 'DIFFER'} ({saved})")
    worst = max(max(r["rel_err_one_device"], r["rel_err_sharded"]) for r in results.values())
    (args.out / "parity.json").write_text(json.dumps({"results": results, "save_round_trip_bitwise": same}, indent=2))
    print(f"worst relative error {worst:.1e} (target <= 1e-5): {'PASS' if worst <= 1e-5 and same else 'FAIL'}")
    sys.exit(0 if worst <= 1e-5 and same else 1)


if __name__ == "__main__":
    main()
