"""A tiny hfjax model config and random-weight models of it, built without any checkpoint or initialiser compile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hfjax.models import CausalLM, ModelConfig
from hfjax.models.hf import abstract_model
from hfjax.models.moe import record_routes, stacked_routes

TINY = ModelConfig(
    family="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
)


def random_model(cfg: ModelConfig = TINY, seed: int = 0) -> CausalLM:
    """A causal LM of `cfg` with random numpy weights (norm weights near 1): no per-shape initialiser compiles."""
    graphdef, abstract = nnx.split(abstract_model(cfg, "causal_lm"))
    rng = np.random.default_rng(seed)

    def draw(leaf):
        values = 1 + 0.1 * rng.standard_normal(leaf.shape) if len(leaf.shape) == 1 else rng.normal(0, 0.05, leaf.shape)
        return values.astype(leaf.dtype)

    return nnx.merge(graphdef, jax.tree.map(draw, abstract))


@nnx.jit
def compiled_forward(model: nnx.Module, *inputs: jax.Array) -> jax.Array:
    """`model(*inputs)` as one compiled program per model structure and input shapes. A plain (eager) call runs and
    compiles each operation on its own: hundreds of small compiles per new shape, most of a test's time."""
    return model(*inputs)


def full_forward_routes(model: nnx.Module, sequence: np.ndarray) -> np.ndarray:
    """The experts every mixture-of-experts layer of `model` chooses for each token of one unpadded `sequence`
    [length] in a full forward: [length, moe layers, k] (`hfjax.models.moe.record_routes`)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state: nnx.State, ids: jax.Array) -> jax.Array:
        with record_routes() as tape:
            nnx.merge(graphdef, state).model(ids, jnp.ones_like(ids))
        return stacked_routes(tape, model.config.num_experts)

    return np.asarray(forward(state, np.asarray(sequence, np.int32)[None]))[0]
