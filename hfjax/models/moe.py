"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks `experts_per_token` of `num_experts` gated MLPs
per token, and the token's output is their outputs weighted by the router's probabilities.

Routing is HF's: router logits in the compute dtype, softmax in float32, top-k, renormalised when
`norm_topk_prob`. Dispatch is by index, never a dense one-hot product: each row of the batch is a group whose
tokens are written into per-expert buffers of `capacity` slots (first choices before second choices, then token
order), each expert runs on its buffer [experts, rows, capacity, embed], and each token gathers its choices' outputs
back. The buffers carry the logical axes (`expert`, `batch`): under a layout with an `expert` mesh axis the experts'
weights and their buffers split over it and XLA moves the tokens with an all-to-all, with no hand-written
collective. `capacity` is the row's length by default, so no token is ever dropped (an expert can take every
token of the row); `capacity_factor` (`set_expert_capacity`) caps it at `factor * length * k / num_experts`
slots, and a choice past its expert's capacity is dropped: it adds nothing, the token keeps its other choices and
its residual, and `RoutedTokens.dropped` counts it.

Routing replay: a forward given `expert_choices` [rows, length, moe layers, k] (the experts a generation engine
chose for each token, -1 where it chose none) routes each recorded token to exactly those experts, weighted by this
forward's own router probabilities of them (renormalised as usual), so the router still learns how to weigh the
chosen experts but not which to choose; unrecorded tokens route themselves. `record_routes()` collects the experts
every layer chose while a forward is traced (the engine's prefill and decode steps).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from hfjax.models.config import ModelConfig
from hfjax.models.dense import dense
from hfjax.models.primitives import ACTIVATION_FUNCTIONS, logical_param, normal_init
from hfjax.models.program import constrain


@dataclasses.dataclass(frozen=True)
class RoutedTokens:
    """The routing of a batch [rows, length]: each token's chosen `experts` [rows, length, k] (int32) and their
    float32 `weights` [rows, length, k]; `slots` [rows, length * k], each choice's slot in its row's buffers of
    `num_experts * capacity` slots (expert * capacity + position, or `num_experts * capacity` when dropped), choices
    k-major."""

    experts: jax.Array
    weights: jax.Array
    slots: jax.Array
    num_experts: int
    capacity: int

    @property
    def dropped(self) -> jax.Array:
        """Choices past their expert's capacity, per row [rows] (int32)."""
        return jnp.sum(self.slots == self.num_experts * self.capacity, axis=-1, dtype=jnp.int32)


_RECORDING: contextvars.ContextVar[dict[int, jax.Array] | None] = contextvars.ContextVar("hfjax_routes", default=None)
ROUTE_DTYPE = jnp.int16  # recorded expert ids: -1 (none) to 32767


@contextlib.contextmanager
def record_routes() -> Iterator[dict[int, jax.Array]]:
    """A dict that the mixture-of-experts layers traced inside the block fill: moe layer index -> the experts
    [rows, length, k] each token was routed to (read at trace time, like `hfjax.models.lora.adapters_off`)."""
    tape: dict[int, jax.Array] = {}
    token = _RECORDING.set(tape)
    try:
        yield tape
    finally:
        _RECORDING.reset(token)


def recording_routes() -> bool:
    """Whether a `record_routes` block is being traced."""
    return _RECORDING.get() is not None


def stacked_routes(tape: dict[int, jax.Array]) -> jax.Array:
    """The recorded routes as one array [rows, length, moe layers, k] of `ROUTE_DTYPE`, layers in order."""
    return jnp.stack([tape[i] for i in sorted(tape)], axis=2).astype(ROUTE_DTYPE)


def expert_capacity(length: int, k: int, num_experts: int, factor: float | None) -> int:
    """Slots per expert and row of `length` tokens: `length` (no token dropped) without a factor, else
    `ceil(factor * length * k / num_experts)`, at least 1 and at most `length`."""
    if factor is None:
        return length
    return max(1, min(length, math.ceil(factor * length * k / num_experts)))


def top_k_routing(
    logits: jax.Array, k: int, normalize: bool, replay: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """(weights float32, experts int32), each [..., k], from router `logits` [..., experts]: the top-k of the
    float32 softmax (ties to the lower index), or the experts of `replay` [..., k] where it holds them (>= 0), with
    their softmax probabilities; renormalised to sum to 1 when `normalize`."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    experts = experts.astype(jnp.int32)
    if replay is not None:
        recorded = replay[..., :1] >= 0
        experts = jnp.where(recorded, replay.astype(jnp.int32), experts)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def buffer_slots(experts: jax.Array, num_experts: int, capacity: int) -> jax.Array:
    """Each choice's slot [rows, length * k] in its row's buffers of `num_experts * capacity` slots, choices
    k-major (every token's first choice before any second choice), the dropped ones at `num_experts * capacity`."""
    rows, length, k = experts.shape
    choices = jnp.swapaxes(experts, 1, 2).reshape(rows, k * length)
    onehot = jax.nn.one_hot(choices, num_experts, dtype=jnp.int32)
    position = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)
    return jnp.where(position < capacity, choices * capacity + position, num_experts * capacity)


class SparseMoE(nnx.Module):
    """Router [experts, embed] and stacked expert weights: gate and up [experts, mlp, embed], down [experts,
    embed, mlp] (HF's per-expert `[out, in]` matrices, stacked)."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs | None,
        std: float,
        moe_index: int = 0,
    ):
        e, d, m = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size
        init = normal_init(std)
        self.router_kernel = logical_param(rngs, init, (e, d), ("expert", "embed"), param_dtype)
        self.gate_kernel = logical_param(rngs, init, (e, m, d), ("expert", "mlp", "embed"), param_dtype)
        self.up_kernel = logical_param(rngs, init, (e, m, d), ("expert", "mlp", "embed"), param_dtype)
        self.down_kernel = logical_param(rngs, init, (e, d, m), ("expert", "embed", "mlp"), param_dtype)
        self.experts_per_token = cfg.experts_per_token
        self.norm_topk_prob = cfg.norm_topk_prob
        self.hidden_act = cfg.hidden_act
        self.capacity_factor: float | None = None  # `set_expert_capacity`: static, so it keys the compiled programs
        self.moe_index = moe_index  # this layer's index among the model's mixture-of-experts layers
        self.dtype = dtype

    @property
    def num_experts(self) -> int:
        return self.router_kernel.shape[0]

    def route(self, x: jax.Array, replay: jax.Array | None = None) -> RoutedTokens:
        """The routing of hidden states x [rows, length, embed] (`replay` [rows, length, k]: `top_k_routing`)."""
        logits = constrain(dense(x, self.router_kernel[...].astype(self.dtype)), ("batch", "length", None))
        weights, experts = top_k_routing(logits, self.experts_per_token, self.norm_topk_prob, replay)
        tape = _RECORDING.get()
        if tape is not None:
            tape[self.moe_index] = experts
        capacity = expert_capacity(x.shape[1], self.experts_per_token, self.num_experts, self.capacity_factor)
        slots = buffer_slots(experts, self.num_experts, capacity)
        return RoutedTokens(experts, weights, slots, self.num_experts, capacity)

    def __call__(self, x: jax.Array, expert_choices: jax.Array | None = None) -> jax.Array:
        """The layer over x [rows, length, embed]; `expert_choices` [rows, length, moe layers, k] replays routes."""
        replay = None if expert_choices is None else expert_choices[:, :, self.moe_index]
        return self.apply_experts(x, self.route(x, replay))

    def apply_experts(self, x: jax.Array, routed: RoutedTokens) -> jax.Array:
        """The layer's output [rows, length, embed] for hidden states x routed by `routed`."""
        rows, length, embed = x.shape
        experts, capacity, k = self.num_experts, routed.capacity, self.experts_per_token
        token = jnp.tile(jnp.arange(length, dtype=jnp.int32), k)[None, :].repeat(rows, axis=0)
        token_of_slot = jnp.full((rows, experts * capacity + 1), length, jnp.int32)
        token_of_slot = token_of_slot.at[jnp.arange(rows)[:, None], routed.slots].set(token)[:, :-1]
        padded = jnp.concatenate([x, jnp.zeros((rows, 1, embed), x.dtype)], axis=1)  # row `length`: empty slots
        buffers = jnp.take_along_axis(padded, token_of_slot[..., None], axis=1).reshape(rows, experts, capacity, embed)
        buffers = constrain(jnp.swapaxes(buffers, 0, 1), ("expert", "batch", None, "embed"))
        outputs = constrain(self._experts(buffers), ("expert", "batch", None, "embed"))
        outputs = jnp.swapaxes(outputs, 0, 1).reshape(rows, experts * capacity, embed)
        outputs = jnp.concatenate([outputs, jnp.zeros((rows, 1, embed), outputs.dtype)], axis=1)  # dropped: 0
        outputs = constrain(outputs, ("batch", None, "embed"))
        chosen = jnp.take_along_axis(outputs, routed.slots[..., None], axis=1).reshape(rows, k, length, embed)
        weights = jnp.swapaxes(routed.weights, 1, 2)[..., None]  # [rows, k, length, 1]
        return jnp.sum(chosen.astype(jnp.float32) * weights, axis=1).astype(self.dtype)

    def _experts(self, buffers: jax.Array) -> jax.Array:
        """Each expert's gated MLP on its buffer [experts, rows, capacity, embed]."""
        act = ACTIVATION_FUNCTIONS[self.hidden_act]
        gate = jnp.einsum("ercd,emd->ercm", buffers, self.gate_kernel[...].astype(self.dtype))
        up = jnp.einsum("ercd,emd->ercm", buffers, self.up_kernel[...].astype(self.dtype))
        hidden = constrain(act(gate) * up, ("expert", "batch", None, "mlp"))
        return jnp.einsum("ercm,edm->ercd", hidden, self.down_kernel[...].astype(self.dtype))


def set_expert_capacity(model: nnx.Module, factor: float | None) -> nnx.Module:
    """Sets the capacity factor of every mixture-of-experts layer of `model` (None: no token dropped; see the
    module docstring). Returns `model`."""
    if factor is not None and not float(factor) > 0:
        raise ValueError(f"capacity_factor: expected a number > 0 or null, got {factor!r}")
    for _, module in nnx.iter_modules(model):
        if isinstance(module, SparseMoE):
            module.capacity_factor = None if factor is None else float(factor)
    return model
