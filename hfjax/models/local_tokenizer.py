"""Builds a byte-level BPE tokenizer from a text corpus locally (no hub), wrapped as a transformers fast tokenizer
with `<pad>`, `<s>`, `</s>` (ids 0, 1, 2) and a plain chat template, and a Gemma 3 processor (images and text) over
one. For quickstarts, tests and synthetic tasks."""

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


GEMMA3_IMAGE_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
GEMMA3_CHAT_TEMPLATE = (  # SIMPLE_CHAT_TEMPLATE with a message's image parts as Gemma 3's start-of-image token
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}" + GEMMA3_IMAGE_TOKENS["boi_token"] + "{% else %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}assistant:"
)


def build_gemma3_processor(corpus: Iterable[str], vocab_size: int, image_size: int, tokens_per_image: int) -> Any:
    """A transformers `Gemma3Processor` over `build_bpe_tokenizer(corpus, vocab_size)` with Gemma 3's image tokens
    added: images resized to `image_size` pixels a side, `tokens_per_image` soft tokens each."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor, PreTrainedTokenizerFast

    bpe = build_bpe_tokenizer(corpus, vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe.backend_tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens=GEMMA3_IMAGE_TOKENS,
    )
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    images = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size})
    return Gemma3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        image_seq_length=tokens_per_image,
        chat_template=GEMMA3_CHAT_TEMPLATE,
    )
