"""The decode step reads the KV cache where it lies: no copy of the cache on the hot path.

Compiled on CPU at a shape whose KV cache outweighs the weights (64 slots, 2 layers): the step's temporaries do not
grow with the prompt blocks it attends over (a per-layer copy of each slot's prompt blocks out of the shared pool
did: 51 MB of a 64-slot step of the reference model, against 4.3 MB without), and XLA's count of the bytes the step
accesses grows by at most 1.5x the pool's bytes when the prompt blocks are read (the gathered copy was read,
written and read again: 4.3x). XLA counts an in-place write of a cache block as a read and a write of the whole
block, so the own blocks are bounded by the temporaries only. A multi-turn append (`JaxEngine.extend`) of a few
rows copies those rows' prompt blocks, not every slot's: its temporaries do not grow with the slots.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx
from support.tiny_models import TINY, random_model

from hfjax.rollout import JaxEngine, SamplingParams
from hfjax.rollout.extend_shapes import pad_extend
from hfjax.rollout.sampling import SamplerKind

CONFIG = dataclasses.replace(
    TINY, num_layers=2, sliding_windows=(None, None), hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=32
)


def test_the_decode_step_reads_the_prompt_pool_in_place():
    model = random_model(CONFIG)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    engine = JaxEngine(model, max_concurrent_decodes=64, max_prefill_length=64, max_new_tokens=128)
    state = engine.init_decode_state()
    kind = SamplerKind.of(SamplingParams(max_new_tokens=4, temperature=1.0))

    def step(prompt_live: int) -> tuple[float, int]:
        """(bytes accessed, temporaries) of the decode step over `prompt_live` prompt blocks."""
        compiled = engine._generate.lower(params, state, kind=kind, live=engine.blocks, prompt_live=prompt_live)
        compiled = compiled.compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        return float(cost["bytes accessed"]), compiled.memory_analysis().temp_size_in_bytes

    pool = sum(x.nbytes for x in (*state.pool_keys, *state.pool_values))
    (without, temp_without), (with_prompt, temp_with) = step(0), step(engine.prompt_blocks)
    assert engine.prompt_blocks >= 2 and pool > sum(x.nbytes for x in jax.tree.leaves(params))
    assert temp_with <= temp_without + 0.05 * pool / CONFIG.num_layers, (temp_without, temp_with, pool)
    assert with_prompt - without <= 1.5 * pool, (without, with_prompt, pool)


def test_an_append_copies_only_the_prompt_blocks_of_its_rows():
    model = random_model(CONFIG)
    _, params, _ = nnx.split(model, nnx.Param, ...)

    def temporaries(slots: int) -> tuple[int, int]:
        """(temporaries of a 2-row, 8-token append, bytes of the prompt pool) with `slots` decode slots."""
        engine = JaxEngine(model, max_concurrent_decodes=slots, max_prefill_length=64, max_new_tokens=128)
        state = engine.init_decode_state()
        kind = SamplerKind.of(SamplingParams(max_new_tokens=4, temperature=1.0))
        shape = engine.extend_shapes.choose(2, 8, 1, kind)
        rows = np.array([0, 1], np.int32)
        arrays = pad_extend(shape, slots, rows, np.ones((2, 8), np.int32), np.full(2, 8, np.int32), rows * 0, rows)
        compiled = engine._extend.lower(params, state, *arrays, kind=kind, live=shape.live).compile()
        return compiled.memory_analysis().temp_size_in_bytes, sum(
            x.nbytes for x in (*state.pool_keys, *state.pool_values)
        )

    (few, few_pool), (many, many_pool) = temporaries(8), temporaries(64)
    assert many_pool >= 4 * few_pool
    # a copy of every slot's prompt blocks would grow by a layer's pool (an eighth of `many_pool` here) or more
    assert many - few <= 0.1 * many_pool, (few, many, many_pool)
