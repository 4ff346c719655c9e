"""Mixture-of-experts capacity per row: sized from the row's real tokens, so a sequence's dropped choices and log
probs do not depend on its padding (so on its micro-batch); routing replay keeps every expert generation used."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from support.checkpoints import left_padded_batch
from support.tiny_models import TINY, random_model

from hfjax.models.moe import (
    collect_router_stats,
    expert_capacity,
    record_routes,
    row_capacities,
    set_expert_capacity,
    stacked_routes,
)

# Two mixture-of-experts layers of 8 experts, top-2. A one-token attention window: full attention's reductions over a
# padded key axis round differently with its width (CPU, ~5e-7, in dense models too), while attending to the token
# itself is exact at any width, which leaves the experts' capacity the only coupling between a row's tokens.
MOE = dataclasses.replace(
    TINY,
    family="qwen3_moe",
    num_layers=2,
    sliding_windows=(1, 1),
    num_experts=8,
    experts_per_token=2,
    expert_intermediate_size=16,
    moe_layers=(),
)


def _forward(model, ids, mask, replay=None):
    """(log probs of each next token [rows, length - 1], dropped choices per moe layer, the experts chosen
    [rows, length, moe layers, k]) of one jitted forward, replaying `replay` when given."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids, mask, replay):
        net = nnx.merge(graphdef, state)
        with record_routes() as routes, collect_router_stats() as stats:
            logits = net.logits(net.model(ids, mask, None, replay))
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), ids[:, 1:, None], axis=-1)[..., 0]
        return logp, jnp.stack([stats[i]["dropped"] for i in sorted(stats)]), stacked_routes(routes, 8)

    return jax.device_get(forward(state, jnp.asarray(ids), jnp.asarray(mask), replay))


def test_a_rows_capacity_is_an_unpadded_rows_of_its_real_tokens():
    """By hand: ceil(factor * real tokens * k / experts), at least 1, at most the real tokens."""
    valid = jnp.asarray(np.arange(48)[None, :] >= np.array([[0], [16], [45], [48]]))  # 48, 32, 3 and 0 real tokens
    # 1.25 x 2 / 8: ceil(15) = 15, ceil(10) = 10, ceil(0.9375) = 1, and 1 for an empty row
    np.testing.assert_array_equal(np.asarray(row_capacities(valid, 2, 8, 1.25)), [15, 10, 1, 1])
    # 4 x 2 / 4: twice the real tokens, capped at them
    np.testing.assert_array_equal(np.asarray(row_capacities(valid, 2, 4, 4.0)), [48, 32, 3, 1])
    assert [expert_capacity(n, 2, 8, 1.25) for n in (48, 32, 3, 0)] == [15, 10, 1, 1]  # the rows unpadded
    # 0.15 x 50 x 2 / 3 = 5 exactly (float64 too, as `expert_capacity` computes it; float32 would round to 6)
    assert np.asarray(row_capacities(jnp.asarray(np.arange(64)[None] >= 14), 2, 3, 0.15)).tolist() == [5]


def test_a_sequences_log_probs_do_not_depend_on_its_left_padding():
    """Capacity factor 1.25, which drops choices: a 48-token sequence left-padded by 0, 16 or 48 tokens (as the
    longest row of its micro-batch sets its width) has bit-for-bit the same log probs and drops as many choices."""
    model = set_expert_capacity(random_model(MOE, seed=3), 1.25)
    sequence = np.random.default_rng(0).integers(1, 64, 48)
    logps, drops = [], []
    for pad in (0, 16, 48):
        ids = np.concatenate([np.zeros(pad, int), sequence])[None]
        logp, dropped, _ = _forward(model, ids, (np.arange(pad + 48) >= pad)[None])
        logps.append(logp[0, pad:])
        drops.append(dropped)
    assert (drops[0] > 0).all()  # every layer drops choices
    for pad, logp, dropped in zip((16, 48), logps[1:], drops[1:], strict=True):
        np.testing.assert_array_equal(logp, logps[0], err_msg=f"left padding {pad}")
        np.testing.assert_array_equal(dropped, drops[0], err_msg=f"left padding {pad}")


def test_routing_replay_keeps_every_expert_generation_chose_under_a_capacity_factor():
    """Generation never drops a choice; a pass that replays its routes under a capacity factor sends every token to
    all of them (nothing dropped) and so has the dropless pass's log probs bit for bit, while a pass that routes
    itself (the reference's) still drops choices."""
    model = random_model(MOE, seed=4)
    ids, mask, _ = left_padded_batch(64, [48, 30, 12, 40], seed=5)
    real = mask.astype(bool)
    dropless, _, routes = _forward(model, ids, mask)
    routes = np.where(real[..., None, None], routes, -1)  # padding: no route recorded
    set_expert_capacity(model, 1.25)
    _, free_dropped, _ = _forward(model, ids, mask)
    assert free_dropped.sum() > 0
    replayed, replay_dropped, _ = _forward(model, ids, mask, jnp.asarray(routes))
    np.testing.assert_array_equal(replay_dropped, 0)
    np.testing.assert_array_equal(replayed[real[:, :-1]], dropless[real[:, :-1]])
