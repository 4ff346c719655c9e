"""The traced bodies of `JaxEngine`'s jitted steps (prefill, insert, generate, extend, and prefill with insert), as
`EngineSteps`, the class `JaxEngine` builds on: what runs on the devices, apart from the host's bookkeeping (slots,
the prompt pool's placement, compile counting) in `hfjax.rollout.engine`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hfjax.models.moe import record_routes, stacked_routes
from hfjax.models.program import constrain
from hfjax.models.transformer import CausalLM
from hfjax.models.vision_lm import VisionLanguageLM
from hfjax.rollout.cached_forward import (
    Prefix,
    PromptBlocks,
    decode_forward,
    extend_forward,
    extend_slots_forward,
    prefill_forward,
)
from hfjax.rollout.interface import DecodeState, PrefillResult, ResultTokens
from hfjax.rollout.pooled_attention import PoolReaders
from hfjax.rollout.prompt_pool import Placement, write_prompts
from hfjax.rollout.sampling import sample_key, sample_tokens


def _split_rows(*arrays: jax.Array) -> list[jax.Array]:
    """The arrays (traced under the engine's layout) with their rows, dimension 0, split over the batch mesh axes
    where they divide: each part of the batch axes then computes its own rows of a prefill, whatever the inputs'
    placement (host arrays arrive replicated)."""
    return [constrain(x, ("batch",) + (None,) * (x.ndim - 1)) for x in arrays]


def _sample_rng(keys: jax.Array, samples: jax.Array) -> jax.Array:
    """The random key of sample `samples[i]` of a prompt whose base key is `keys[i]` (raw key data)."""
    return jax.vmap(lambda k, i: jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(k), i)))(keys, samples)


def _set_slots(slots: jax.Array, current: jax.Array, value: jax.Array) -> jax.Array:
    """`current` with rows `slots` set to `value` (slots out of range, padding rows, write nothing)."""
    return current.at[slots].set(value, mode="drop")


class EngineSteps:
    """The traced step bodies. The engine provides `graphdef` and `_rest` (its model's structure and non-parameter
    state), `config`, `block` and `prompt_blocks` (its cache's block size and prompt blocks per slot), `_slots` and
    `record_experts`."""

    graphdef: Any
    _rest: Any
    config: Any
    block: int
    prompt_blocks: int
    _slots: int
    record_experts: bool

    def _model(self, params: Any) -> CausalLM | VisionLanguageLM:
        return nnx.merge(self.graphdef, params, self._rest)

    def _prefill_fn(self, params, tokens, lengths, seeds, requests, temperature, top_k, top_p, images=None, *, kind):
        tokens, lengths, *sampling = _split_rows(tokens, lengths, seeds, requests, temperature, top_k, top_p)
        cache = prefill_forward(self._model(params), tokens, lengths, images)
        return self._prefix_and_first(cache, *sampling, kind)

    def _prefill_extend_fn(self, params, existing: Prefix, tokens, lengths, seeds, requests, temp, top_k, top_p, *,
                           kind):  # fmt: skip
        tokens, lengths, starts, *sampling = _split_rows(
            tokens, lengths, existing.lengths, seeds, requests, temp, top_k, top_p
        )
        pad = ((0, 0), (0, tokens.shape[1]), (0, 0), (0, 0))
        keys = tuple(_split_rows(*(jnp.pad(k, pad) for k in existing.keys)))
        values = tuple(_split_rows(*(jnp.pad(v, pad) for v in existing.values)))
        cache = extend_forward(self._model(params), tokens, starts, lengths, keys, values)
        return self._prefix_and_first(cache, *sampling, kind)

    @staticmethod
    def _prefix_and_first(cache: Prefix, seeds, requests, temperature, top_k, top_p, kind):
        """The prefix of `cache` with each row's base key, and sample 0's first token (drawn as `insert` draws it)."""
        keys = sample_key(seeds, requests, jnp.zeros_like(requests))
        prefix = PrefillResult(cache, keys, temperature, top_k, top_p)
        zeros = jnp.zeros_like(requests)
        first = sample_tokens(cache.last_logits, _sample_rng(keys, zeros), zeros, temperature, top_k, top_p, kind)
        return prefix, ResultTokens(*first)

    def _insert_fn(self, prefix: PrefillResult, state: DecodeState, slots, rows, samples, placement: Placement, *,
                   kind):  # fmt: skip
        rng = _sample_rng(prefix.keys[rows], samples)
        zeros = jnp.zeros_like(slots)
        temperature, top_k, top_p = prefix.temperature[rows], prefix.top_k[rows], prefix.top_p[rows]
        first = sample_tokens(prefix.cache.last_logits[rows], rng, zeros, temperature, top_k, top_p, kind)
        pool_keys, pool_values = write_prompts(
            state.pool_keys, state.pool_values, prefix.cache.keys, prefix.cache.values, placement, self.block
        )

        state = state._replace(
            pool_keys=tuple(pool_keys),
            pool_values=tuple(pool_values),
            prompt_table=_set_slots(slots, state.prompt_table, placement.tables),
            prompt_lengths=_set_slots(slots, state.prompt_lengths, prefix.cache.lengths[rows]),
            pool_readers=placement.readers,
            pool_columns=placement.columns,
            prompt_ranks=placement.ranks,
            lengths=_set_slots(slots, state.lengths, prefix.cache.lengths[rows]),
            tokens=_set_slots(slots, state.tokens, first[0]),
            rng=_set_slots(slots, state.rng, rng),
            steps=_set_slots(slots, state.steps, jnp.ones_like(slots)),
            temperature=_set_slots(slots, state.temperature, temperature),
            top_k=_set_slots(slots, state.top_k, top_k),
            top_p=_set_slots(slots, state.top_p, top_p),
        )
        return state, ResultTokens(*first)

    @staticmethod
    def _prompt(state: DecodeState, blocks: int) -> PromptBlocks:
        """The state's prompt pool with each slot's first `blocks` prompt blocks."""
        table = state.prompt_table[:, :blocks]
        return PromptBlocks(state.pool_keys, state.pool_values, table, state.prompt_lengths)

    def _generate_fn(self, params, state: DecodeState, *, kind, live, prompt_live=None, prompt_readers=1):
        model = self._model(params)
        live_keys, live_values = tuple(k[:live] for k in state.keys), tuple(v[:live] for v in state.values)
        readers = PoolReaders(state.pool_readers[..., :prompt_readers], state.pool_columns, state.prompt_ranks)
        prompt = self._prompt(state, self.prompt_blocks if prompt_live is None else prompt_live)._replace(
            readers=readers
        )
        with record_routes() as routes:
            logits, keys, values = decode_forward(model, state.tokens, state.lengths, live_keys, live_values, prompt)
        keys = tuple(new + old[live:] for new, old in zip(keys, state.keys, strict=True))
        values = tuple(new + old[live:] for new, old in zip(values, state.values, strict=True))
        tokens, logprobs = sample_tokens(
            logits, state.rng, state.steps, state.temperature, state.top_k, state.top_p, kind
        )
        state = state._replace(
            keys=keys, values=values, lengths=state.lengths + 1, tokens=tokens, steps=state.steps + 1
        )
        experts = stacked_routes(routes, self.config.num_experts)[:, 0] if self.record_experts else None
        return state, ResultTokens(tokens, logprobs, experts)

    def _extend_fn(self, params, state: DecodeState, slots, tokens, counts, starts, steps, *, kind, live):
        rows = jnp.minimum(slots, self._slots - 1)  # padding rows (slot out of range) read the last slot, write none
        with record_routes() as routes:
            logits, keys, values = extend_slots_forward(
                self._model(params), tokens, starts, counts, slots, state.keys, state.values, live,
                self._prompt(state, self.prompt_blocks),
            )  # fmt: skip
        steps = jnp.where(steps < 0, state.steps[rows], steps)
        first = sample_tokens(
            logits, state.rng[rows], steps, state.temperature[rows], state.top_k[rows], state.top_p[rows], kind
        )

        state = state._replace(
            keys=keys,
            values=values,
            lengths=_set_slots(slots, state.lengths, starts + counts),
            tokens=_set_slots(slots, state.tokens, first[0]),
            steps=_set_slots(slots, state.steps, steps + 1),
        )
        experts = stacked_routes(routes, self.config.num_experts) if self.record_experts else None
        return state, ResultTokens(*first, experts)

    def _prefill_insert_fn(self, params, state, tokens, lengths, seeds, requests, temp, top_k, top_p, slots, rows,
                           samples, placement, images=None, *, kind):  # fmt: skip
        with record_routes() as routes:
            prefix, _ = self._prefill_fn(
                params, tokens, lengths, seeds, requests, temp, top_k, top_p, images, kind=kind
            )
        state, first = self._insert_fn(prefix, state, slots, rows, samples, placement, kind=kind)
        if not self.record_experts:
            return state, first
        return state, first._replace(experts=stacked_routes(routes, self.config.num_experts)[rows])
