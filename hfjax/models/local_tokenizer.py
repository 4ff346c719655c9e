"""Builds a byte-level BPE tokenizer from a text corpus locally (no hub), wrapped as a transformers fast tokenizer
with `<pad>`, `<s>`, `</s>` (ids 0, 1, 2) and a plain chat template. For quickstarts, tests and synthetic tasks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

SIMPLE_CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def build_bpe_tokenizer(corpus: Iterable[str], vocab_size: int, chat_template: str = SIMPLE_CHAT_TEMPLATE) -> Any:
    """Trains a byte-level BPE of at most `vocab_size` tokens on `corpus`; returns a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = chat_template
    return fast
