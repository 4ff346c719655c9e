"""Shared prompt KV: the samples of a prompt read one copy of its keys and values from the engine's prompt pool.

Decode attention over a slot's prompt blocks (gathered through its table) and its own blocks equals a dense softmax
over the sequence's positions (xla and the Pallas kernel, with a window); greedy generation equals a teacher-forced
forward's argmax and sampled tokens' log probs its log-softmax; the allocator holds one copy of a prompt for its 8
samples and frees it with the last; a group that does not fit the pool waits; at data=2 the pool is sharded with the
slots and gives the tokens of data=1."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from support.tiny_models import TINY, compiled_forward, random_model

from hfjax.config.roles import AgentConfig, RolloutConfig
from hfjax.envs.examples import calculator
from hfjax.models import attention_pallas
from hfjax.models.decode_attention import decode_attention
from hfjax.parallel import Layout
from hfjax.rollout import JaxEngine, OfflineGenerator, SamplingParams
from hfjax.rollout.prompt_pool import PromptPool, PromptPoolFull
from hfjax.rollout.sampling import SamplerKind

VOCAB = TINY.vocab_size


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny():
    model = random_model(TINY)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    return model, params


def _generator(model, params, layout=None, **engine_kwargs) -> OfflineGenerator:
    kwargs = {"max_concurrent_decodes": 8, "max_prefill_length": 64, "max_new_tokens": 40, **engine_kwargs}
    engine = JaxEngine(model, layout, **kwargs)
    if layout is not None:
        params = jax.device_put(params, NamedSharding(layout.mesh, PartitionSpec()))
    return OfflineGenerator(engine, params, eos_token_ids=(), progress=False)


def _log_softmax(model, sequence: list[int], temperature: float = 1.0) -> np.ndarray:
    """Log probs [len(sequence), vocab] of the model's plain forward (next token after each position)."""
    logits = np.asarray(compiled_forward(model, jnp.asarray([sequence], jnp.int32))[0], np.float64) / temperature
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


# ----------------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_over_prompt_and_own_blocks_equals_dense_softmax(implementation, window):
    """Slots with prompts of 3..16 positions in two 8-position prompt blocks and 0..13 positions of their own in two
    own blocks: each query sees its prompt's real positions and its own up to its length, one softmax over both."""
    rng = np.random.default_rng(0)
    slots, kv_heads, heads, d, block = 5, 2, 4, 8, 8
    prompt_lengths = np.array([3, 8, 9, 16, 11], np.int32)
    own_lengths = np.array([1, 8, 13, 4, 9], np.int32)  # positions written past the prompt, the query's included
    lengths = prompt_lengths + own_lengths - 1  # the query's position
    keys = [rng.standard_normal((slots, kv_heads, d, block)).astype(np.float32) for _ in range(4)]
    values = [rng.standard_normal((slots, kv_heads, block, d)).astype(np.float32) for _ in range(4)]
    q = rng.standard_normal((slots, 1, heads, d)).astype(np.float32)
    got = decode_attention(
        jnp.asarray(q), [jnp.asarray(k) for k in keys], [jnp.asarray(v) for v in values], jnp.asarray(lengths),
        window, prompt_lengths=jnp.asarray(prompt_lengths), prompt_blocks=2, implementation=implementation,
    )  # fmt: skip
    all_keys = np.concatenate(keys, axis=-1)  # [S, kv, d, 32]: prompt positions 0..15, then own positions
    all_values = np.concatenate(values, axis=2)
    for s in range(slots):
        columns = [*range(prompt_lengths[s]), *range(16, 16 + own_lengths[s])]  # the sequence in position order
        positions = np.arange(len(columns))
        if window is not None:
            columns = [c for c, p in zip(columns, positions, strict=True) if lengths[s] - p < window]
        for h in range(heads):
            kv = h // (heads // kv_heads)
            scores = q[s, 0, h] @ all_keys[s, kv][:, columns] / np.sqrt(d)
            probs = np.exp(scores - scores.max())
            want = (probs / probs.sum()) @ all_values[s, kv][columns]
            np.testing.assert_allclose(np.asarray(got)[s, 0, h], want, rtol=1e-5, atol=1e-5)


def test_decode_kernel_with_prompt_blocks_lowers_for_tpu():
    """The Pallas decode kernel over a prompt block and an own block (placed by the prompt length, read in SMEM)
    lowers to Mosaic for a TPU from this machine (jax.export; no TPU compiler runs here)."""
    bf16 = jnp.bfloat16
    q = jax.ShapeDtypeStruct((8, 1, 8, 128), bf16)
    keys = [jax.ShapeDtypeStruct((8, 2, 128, 128), bf16)] * 2
    values = [jax.ShapeDtypeStruct((8, 2, 128, 128), bf16)] * 2
    lengths = jax.ShapeDtypeStruct((8,), jnp.int32)

    def decode(q, keys, values, lengths, prompt_lengths):
        return attention_pallas.decode_attention(
            q, keys, values, lengths, 64, prompt_lengths, prompt_blocks=1, interpret=False
        )

    jax.export.export(jax.jit(decode), platforms=["tpu"])(q, keys, values, lengths, lengths)


# ----------------------------------------------------------------------------------------------- allocator
def test_eight_samples_of_a_1000_token_prompt_hold_one_copy():
    """8 samples of a 1,000-token prompt in 144-position blocks hold ceil(1000/144) = 7 pool blocks, not 56; the copy
    is freed with the last sample, and samples in two data shards hold one copy in each."""
    pool = PromptPool(parts=1, blocks_per_part=16, slots=8, block=144)
    (copies,) = pool.place([1000], [list(range(8))])
    assert len(copies[0]) == 7 and pool.used_blocks == 7
    pool.release(range(7))
    assert pool.used_blocks == 7
    pool.release([7])
    assert pool.used_blocks == 0
    sharded = PromptPool(parts=2, blocks_per_part=8, slots=8, block=144)
    sharded.place([1000], [[0, 1, 6]])  # slots 0-3 in part 0, 4-7 in part 1
    assert (sharded.free_blocks(0), sharded.free_blocks(1)) == (1, 1)
    with pytest.raises(PromptPoolFull, match="prompt_cache_tokens"):
        sharded.place([200], [[2]])  # 2 blocks, 1 free in part 0
    sharded.place([144], [[2]])  # one block: fits; slot 2 reads it
    assert sharded.free_blocks(0) == 0 and list(sharded.prompt_lengths) == [1000, 1000, 144, 0, 0, 0, 1000, 0]


def test_engine_pool_and_bytes_for_8_samples_of_a_1000_token_prompt(tiny):
    """Through the generator, 128-position blocks: the pool's peak use is the prompt's ceil(1000/128) = 8 blocks, all
    free afterwards; the KV cache is that pool plus 8 slots' own block, against 8 copies of 1,016 positions (8 blocks
    each) in the copied layout."""
    model, params = tiny
    generator = _generator(model, params, max_prefill_length=1000, max_new_tokens=16, prompt_cache_tokens=8 * 128)
    engine = generator.engine
    assert (engine.block, engine.prompt_blocks, engine.blocks) == (128, 8, 1)
    outs = generator.generate(_prompts(1, (1000,)), SamplingParams(n=8, temperature=1.0, max_new_tokens=4, seed=2))
    assert len(outs) == 8 and len({tuple(o.tokens) for o in outs}) > 1  # 8 different samples of one prompt
    assert generator.last_stats["prompt_pool_blocks_peak"] == 8
    assert engine.pool.used_blocks == 0
    per_position = 2 * TINY.num_layers * TINY.num_kv_heads * TINY.head_dim * 4  # keys and values, float32
    assert engine.kv_cache_bytes_per_device() == (8 + 8) * 128 * per_position
    assert engine.cache.copied_bytes() == 8 * 8 * 128 * per_position


def test_a_group_that_does_not_fit_the_pool_waits(tiny):
    """A pool of one 64-position prompt: two prompts' groups of 2 samples fit the 8 slots but not the pool, so the
    second is inserted only when the first has finished (two inserts, peak one prompt); tokens as with a large pool."""
    model, params = tiny
    prompts, sampling = _prompts(2, (40, 50)), SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=4)
    small = _generator(model, params, prompt_cache_tokens=64)
    calls = []
    insert = small.engine.prefill_insert
    small.engine.prefill_insert = lambda *a: calls.append(small.engine.pool.used_blocks) or insert(*a)
    outs = small.generate(prompts, sampling)
    assert calls == [0, 0]  # each group inserted into an empty pool: the second waited for the first's release
    assert small.last_stats["prompt_pool_blocks_peak"] == 2 and small.engine.pool.used_blocks == 0
    reference = _generator(model, params).generate(prompts, sampling)
    assert [o.tokens.tolist() for o in outs] == [o.tokens.tolist() for o in reference]
    with pytest.raises(ValueError, match="prompt_cache_tokens"):
        JaxEngine(model, max_concurrent_decodes=8, max_prefill_length=64, max_new_tokens=40, prompt_cache_tokens=32)


def test_config_key_is_validated():
    """`rollout.prompt_cache_tokens`: null or a positive count, and null with a multi-turn environment."""
    assert RolloutConfig(prompt_cache_tokens=64).prompt_cache_tokens == 64
    with pytest.raises(ValueError, match="prompt_cache_tokens: expected null or >= 1"):
        RolloutConfig(prompt_cache_tokens=0)
    env = str(Path(calculator.__file__)) + ":CalculatorEnv"
    with pytest.raises(ValueError, match="prompt_cache_tokens: expected null with agent"):
        RolloutConfig(agent=AgentConfig(env=env), prompt_cache_tokens=64)


# ------------------------------------------------------------------------------------------------ generation
def test_greedy_and_sampled_tokens_equal_a_teacher_forced_forward(tiny):
    """Prompts over one and two prompt blocks, responses over two own blocks, 3 samples each sharing the prompt: the
    greedy tokens are the plain forward's argmax after each prefix, and sampled tokens' log probs its log-softmax."""
    model, params = tiny
    generator = _generator(model, params)
    assert (generator.engine.block, generator.engine.prompt_blocks, generator.engine.blocks) == (32, 2, 2)
    prompts = _prompts(3, (5, 37, 50))
    greedy = generator.generate(prompts, SamplingParams(n=3, temperature=0.0, max_new_tokens=40))
    sampled = generator.generate(prompts, SamplingParams(n=3, temperature=0.8, max_new_tokens=40, seed=6))
    for out in greedy:
        prompt = prompts[out.request]
        logp = _log_softmax(model, prompt + out.tokens.tolist())
        assert out.tokens.tolist() == logp[len(prompt) - 1 : -1].argmax(-1).tolist()
    assert len({tuple(o.tokens) for o in sampled if o.request == 2}) == 3
    for out in sampled:
        prompt = prompts[out.request]
        logp = _log_softmax(model, prompt + out.tokens.tolist(), 0.8)[len(prompt) - 1 : -1]
        expected = logp[np.arange(len(out.tokens)), out.tokens]
        np.testing.assert_allclose(out.logprobs, expected, rtol=0, atol=1e-5)


def test_data_sharded_pool_equals_one_shard(tiny):
    """At data=2 the pool and the slots split over the data axis, each shard's slots read its own pool (the decode
    step compiles to no collective), and a run of groups that straddle both shards gives the tokens and log probs of
    data=1."""
    model, params = tiny
    layout = Layout.from_config({"mesh": {"data": 2}, "rules": "dp_tp_gen", "devices": [0, 1]})
    sharded = _generator(model, params, layout, max_concurrent_decodes=4)
    engine = sharded.engine
    assert engine.cache.pool_parts == 2
    assert engine.state_sharding.pool_keys[0].spec[0] == "data" and engine.state_sharding.prompt_table.spec[0] == "data"
    prompts, sampling = _prompts(5, (9, 33, 20)), SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=8)
    outs = sharded.generate(prompts, sampling)
    assert sharded.last_stats["prompt_pool_blocks_peak"] >= 2  # a group of 3 in 2-slot shards: a copy in each
    reference = _generator(model, params, max_concurrent_decodes=4).generate(prompts, sampling)
    assert [o.tokens.tolist() for o in outs] == [o.tokens.tolist() for o in reference]
    np.testing.assert_allclose([o.logprobs for o in outs], [o.logprobs for o in reference], rtol=0, atol=1e-5)
    step = engine._generate.lower(sharded.params, engine.abstract_decode_state(), kind=SamplerKind.of(sampling),
                                  live=engine.blocks, prompt_live=engine.prompt_blocks)  # fmt: skip
    assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute", step.compile().as_text())
