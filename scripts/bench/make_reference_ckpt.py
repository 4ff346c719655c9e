"""Builds the benchmark reference checkpoint locally (no downloads): a random Llama of 25.8M parameters with a
byte-level BPE tokenizer trained on a fixed synthetic corpus, saved as a Hugging Face directory.

The spec is fixed so that benchmark figures stay comparable across runs and over time:
- tokenizer: byte-level BPE, vocabulary 8192 (tiny: 512) with `<pad>`, `<s>`, `</s>` as ids 0-2, trained on 10,000
  additions `a+b=c` (a < 200, b < 50) and 20,000 lines of 12 random lower-case "words" (seed 0), and the chat
  template `role: content` per message followed by `assistant:`;
- model: hidden 512, 6 layers, 8 heads / 4 kv heads, MLP 1376, 1024 positions, untied embeddings (tiny: hidden 64,
  2 layers, 4 / 2 heads, MLP 128, 512 positions), weights from `torch.manual_seed(0)`.

Usage: `python scripts/bench/make_reference_ckpt.py OUT_DIR [--tiny]`. Needs torch, transformers and tokenizers (the
benchmark references, not runtime dependencies of hfjax).
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SEED = 0
NUM_WORDS = 20_000
NUM_SENTENCES = 20_000
WORDS_PER_SENTENCE = 12
ADDITION_OPERANDS = (200, 50)

# LlamaConfig arguments of the two sizes (the bos/eos/pad ids come from the tokenizer)
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
    },
}
VOCAB_SIZES = {"full": 8192, "tiny": 512}


def tokenizer_corpus(seed: int = SEED) -> list[str]:
    """The training text of the tokenizer: every addition `a+b=c`, then sentences of random words. The draws of
    `random.Random(seed)` follow a fixed order (a word's length, then its letters; then each sentence's words)."""
    rng = random.Random(seed)
    words = []
    for _ in range(NUM_WORDS):
        length = rng.randint(2, 9)
        words.append("".join(rng.choice(string.ascii_lowercase) for _ in range(length)))
    first, second = ADDITION_OPERANDS
    lines = [f"{a}+{b}={a + b}" for a in range(first) for b in range(second)]
    lines += [" ".join(rng.choice(words) for _ in range(WORDS_PER_SENTENCE)) for _ in range(NUM_SENTENCES)]
    return lines


def build_tokenizer(vocab_size: int) -> Any:
    """A `PreTrainedTokenizerFast` (byte-level BPE, no unknown token) trained on `tokenizer_corpus()`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(tokenizer_corpus(), trainer)
    pad, bos, eos = SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token=eos, pad_token=pad)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build(out_dir: str | Path, tiny: bool = False) -> Path:
    """Writes the tokenizer, `config.json`, the weights and `peer_ckpt_info.json` (parameters, vocabulary) to
    `out_dir`; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    size = "tiny" if tiny else "full"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    tokenizer = build_tokenizer(VOCAB_SIZES[size])
    tokenizer.save_pretrained(out)
    config = LlamaConfig(vocab_size=len(tokenizer), **MODEL_SIZES[size])
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    (out / "peer_ckpt_info.json").write_text(json.dumps({"params": params, "vocab": len(tokenizer)}))
    print(f"checkpoint at {out}: {params / 1e6:.1f}M params, vocab {len(tokenizer)}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="directory to write the checkpoint to")
    parser.add_argument("--tiny", action="store_true", help="the 2-layer, 64-wide variant for fast tests")
    args = parser.parse_args()
    build(args.out_dir, tiny=args.tiny)


if __name__ == "__main__":
    main()
