"""JetStream's engine interface as hfjax implements it: the `Engine` protocol, the values that pass through it
(`PrefillResult`, `DecodeState`, `ResultTokens`) and the sizes of its buckets (prompt lengths, KV-cache blocks).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
from jax.sharding import Mesh

from hfjax.rollout.cached_forward import Prefix
from hfjax.rollout.sampling import SamplerKind, SamplingParams

MIN_PREFILL_BUCKET = 16
MAX_KV_BLOCKS = 8  # per layer: decode steps compile once per count of blocks in use
MIN_KV_BLOCK = 32  # positions
TPU_KV_MULTIPLE = 128  # a TPU's lane width: the block dimension of the keys' [.., head_dim, block] tiles
ALL_FILTERS = SamplerKind(top_k=True, top_p=True)


class PrefillResult(NamedTuple):
    """A prefilled batch (JetStream's "prefix"): the cache rows plus, per prompt, its base random key and sampling
    values, so that `insert` can sample any number of samples from it."""

    cache: Prefix
    keys: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array


class DecodeState(NamedTuple):
    """All slots: per layer, each slot's own cache blocks of consecutive positions from its prompt length on (keys
    [slots, kv_heads, head_dim, block], values [slots, kv_heads, block, head_dim]) and the shared prompt pool (keys
    [parts, pool blocks, kv_heads, head_dim, block], values [parts, pool blocks, kv_heads, block, head_dim]: each
    part of the batch mesh axes holds its own slots' prompts); each slot's prompt blocks (`prompt_table` [slots,
    prompt blocks], ids in its part's pool) and prompt length, which slots read each pool block (so that a decode
    step reads the pool in place); the tokens in each slot's cache (`lengths`, prompt
    included), the next input token, each sample's key and token count (`steps`), and its sampling values."""

    keys: tuple[tuple[jax.Array, ...], ...]
    values: tuple[tuple[jax.Array, ...], ...]
    pool_keys: tuple[jax.Array, ...]
    pool_values: tuple[jax.Array, ...]
    prompt_table: jax.Array
    prompt_lengths: jax.Array
    pool_readers: jax.Array  # [parts, pool blocks, slots per part]: `hfjax.rollout.pooled_attention.PoolReaders`
    pool_columns: jax.Array  # [parts, pool blocks]
    prompt_ranks: jax.Array  # [slots]
    lengths: jax.Array
    tokens: jax.Array
    rng: jax.Array
    steps: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array


class ResultTokens(NamedTuple):
    """Tokens and their logprobs, one per slot (or per inserted sample); with an engine that records routes, the
    experts each mixture-of-experts layer chose for the token the step ran on ([slots, moe layers, k]; an insert's:
    its prompt's [samples, prompt positions, moe layers, k]; an extend's: its rows' [rows, width, moe layers, k])."""

    tokens: jax.Array
    logprobs: jax.Array
    experts: jax.Array | None = None


class Engine(Protocol):
    """JetStream's engine interface (prefill / insert / generate over slots), with JetStream's signatures."""

    def prefill(
        self,
        *,
        params: Any,
        existing_prefix: PrefillResult | None = None,
        padded_tokens: Any,
        true_length: Any,
        sampler: SamplingParams | None = None,
        request_id: Any = None,
    ) -> tuple[PrefillResult, ResultTokens]: ...

    def insert(self, prefix: PrefillResult, decode_state: DecodeState, slot: Any) -> DecodeState: ...

    def generate(self, params: Any, decode_state: DecodeState) -> tuple[DecodeState, ResultTokens]: ...

    def init_decode_state(self) -> DecodeState: ...

    def get_prefix_destination_sharding(self) -> Any: ...

    @property
    def max_concurrent_decodes(self) -> int: ...

    @property
    def max_prefill_length(self) -> int: ...

    @property
    def mesh(self) -> Mesh: ...


def power_of_two_at_least(n: int) -> int:
    """The smallest power of two >= `n` (1 for n <= 1): rounded row counts, so few shapes compile."""
    return 1 << max(0, n - 1).bit_length()


def prefill_buckets(max_prefill_length: int) -> tuple[int, ...]:
    """Padded prompt lengths: 16, 24, 32, 48, 64, 96, ... (powers of two and 1.5x powers of two, so at most a third
    of a padded prompt longer than 16 is padding) up to the limit, and the limit itself."""
    out, size = [], MIN_PREFILL_BUCKET
    while size < max_prefill_length:
        out += [n for n in (size, size * 3 // 2) if n < max_prefill_length]
        size *= 2
    return (*out, max_prefill_length)


def kv_block_size(capacity: int, platform: str = "cpu") -> int:
    """Positions per decode-cache block for a cache of `capacity` positions on `platform`: at least `MIN_KV_BLOCK`,
    a multiple of 16 (of 128 on a TPU, whose 128-lane tiles would pad any other size: a block of 192 took 256), and
    at most `MAX_KV_BLOCKS` blocks."""
    multiple = TPU_KV_MULTIPLE if platform == "tpu" else 16
    return max(MIN_KV_BLOCK, -(-capacity // (multiple * MAX_KV_BLOCKS)) * multiple)
