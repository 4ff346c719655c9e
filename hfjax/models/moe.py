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
its residual, and `RoutedTokens.dropped` counts it. Padding takes no slot and counts in no capacity: the buffers
keep the padded width's slots (a static shape), but each row places at most its own `row_capacities`, those of
its real tokens unpadded, and places them in the order of its real tokens, so a sequence drops the same choices
(and gets the same outputs) whatever padding its micro-batch gives it.

Routing replay: a forward given `expert_choices` [rows, length, moe layers, k] (the experts a generation engine
chose for each token, -1 where it chose none) routes each recorded token to exactly those experts, weighted by this
forward's own router probabilities of them (renormalised as usual), so the router still learns how to weigh the
chosen experts but not which to choose; unrecorded tokens route themselves. Generation never drops a choice, so
neither does a replaying forward: it ignores the capacity factor (every row gets the dropless capacity, its length)
and every token reaches all the experts generation used. `record_routes()` collects the experts every layer chose
while a forward is traced (the engine's prefill and decode steps).

Router statistics: `collect_router_stats()` collects each layer's sums over the real tokens of a forward (choices
per expert, router probabilities per expert, router entropy, dropped choices), from which `router_summary` gives
transformers' load-balancing loss (`load_balancing_loss_func`) and the router metrics. Both tapes are filled at
trace time; `checkpointed` carries them out of a layer under `jax.checkpoint` as outputs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hfjax.models.config import ModelConfig
from hfjax.models.dense import dense
from hfjax.models.primitives import ACTIVATION_FUNCTIONS, logical_param, normal_init
from hfjax.models.program import constrain


@dataclasses.dataclass(frozen=True)
class RoutedTokens:
    """The routing of a batch [rows, length]: each token's chosen `experts` [rows, length, k] (int32) and their
    float32 `weights` [rows, length, k]; `slots` [rows, length * k], each choice's slot in its row's buffers of
    `num_experts * capacity` slots (expert * capacity + position, or `num_experts * capacity` when dropped or of
    padding), choices k-major, in buffers of `capacity` slots per expert (a row may fill fewer: `row_capacities`);
    `valid` [rows, length]: the real tokens (None: all)."""

    experts: jax.Array
    weights: jax.Array
    slots: jax.Array
    num_experts: int
    capacity: int
    valid: jax.Array | None = None

    @property
    def dropped(self) -> jax.Array:
        """Real tokens' choices past their expert's capacity, per row and token [rows, length] (int32)."""
        rows, length, k = self.experts.shape
        unplaced = jnp.sum(self.slots.reshape(rows, k, length) == self.num_experts * self.capacity, axis=1)
        return unplaced if self.valid is None else unplaced * self.valid


RouterStats = dict[str, jax.Array]  # one layer's sums: tokens, load [experts], probs [experts], entropy, dropped


@dataclasses.dataclass
class RouterTape:
    """What the mixture-of-experts layers traced inside a `record_routes` or `collect_router_stats` block write,
    by moe layer index: the experts [rows, length, k] each token was routed to, and the layer's `RouterStats`."""

    routes: dict[int, jax.Array] | None = None
    stats: dict[int, RouterStats] | None = None

    def contents(self) -> tuple[dict[int, jax.Array] | None, dict[int, RouterStats] | None]:
        return self.routes, self.stats

    def add(self, contents: tuple[dict[int, jax.Array] | None, dict[int, RouterStats] | None]) -> None:
        for mine, theirs in zip(self.contents(), contents, strict=True):
            if mine is not None:
                mine.update(theirs)


_TAPE: contextvars.ContextVar[RouterTape | None] = contextvars.ContextVar("hfjax_router_tape", default=None)


@contextlib.contextmanager
def _taping(tape: RouterTape) -> Iterator[RouterTape]:
    token = _TAPE.set(tape)
    try:
        yield tape
    finally:
        _TAPE.reset(token)


@contextlib.contextmanager
def record_routes() -> Iterator[dict[int, jax.Array]]:
    """A dict that the mixture-of-experts layers traced inside the block fill: moe layer index -> the experts
    [rows, length, k] each token was routed to (read at trace time, like `hfjax.models.lora.adapters_off`)."""
    outer = _TAPE.get() or RouterTape()
    with _taping(dataclasses.replace(outer, routes={})) as tape:
        yield tape.routes


@contextlib.contextmanager
def collect_router_stats() -> Iterator[dict[int, RouterStats]]:
    """A dict that the mixture-of-experts layers traced inside the block fill: moe layer index -> its
    `RouterStats` over the forward's real tokens (`router_summary` reads it). Empty for a dense model."""
    outer = _TAPE.get() or RouterTape()
    with _taping(dataclasses.replace(outer, stats={})) as tape:
        yield tape.stats


def checkpointed(fn: Callable[..., jax.Array], policy: Callable[..., bool]) -> Callable[..., jax.Array]:
    """`jax.checkpoint(fn, policy=policy)` that also carries what `fn`'s mixture-of-experts layers write to the
    active tape out of the checkpoint, as outputs (a tape filled inside would hold the checkpoint's own tracers)."""
    outer = _TAPE.get()
    if outer is None:
        return jax.checkpoint(fn, policy=policy)

    def taped(*args: Any) -> tuple[jax.Array, tuple[Any, Any]]:
        inner = RouterTape(*({} if part is not None else None for part in outer.contents()))
        with _taping(inner):
            return fn(*args), inner.contents()

    def call(*args: Any) -> jax.Array:
        out, contents = jax.checkpoint(taped, policy=policy)(*args)
        outer.add(contents)
        return out

    return call


def route_dtype(num_experts: int) -> jnp.dtype:
    """The integer type of recorded expert ids (-1: none): int8 up to 128 experts, else int16."""
    return jnp.dtype(jnp.int8 if num_experts <= 128 else jnp.int16)


def stacked_routes(tape: dict[int, jax.Array], num_experts: int) -> jax.Array:
    """The recorded routes as one array [rows, length, moe layers, k] of `route_dtype`, layers in order."""
    return jnp.stack([tape[i] for i in sorted(tape)], axis=2).astype(route_dtype(num_experts))


def router_stats(logits: jax.Array, routed: RoutedTokens, valid: jax.Array | None) -> RouterStats:
    """One layer's sums over the tokens where `valid` [rows, length] (all when None) from its router `logits`
    [rows, length, experts] and routing: `tokens`, `load` (choices per expert), `probs` (router probabilities per
    expert), `entropy` (of the router's distribution) and `dropped` (choices past capacity), float32."""
    weight = jnp.ones(routed.experts.shape[:2], jnp.float32) if valid is None else valid.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    probs = jnp.exp(logp)
    per_choice = jnp.broadcast_to(weight[..., None], routed.experts.shape)
    return {
        "tokens": jnp.sum(weight),
        "load": jnp.zeros(routed.num_experts, jnp.float32).at[routed.experts.reshape(-1)].add(per_choice.reshape(-1)),
        "probs": jnp.einsum("rte,rt->e", probs, weight),
        "entropy": -jnp.sum(jnp.sum(probs * logp, axis=-1) * weight),
        "dropped": jnp.sum(routed.dropped * weight),
    }


def router_summary(stats: dict[int, RouterStats], k: int) -> dict[str, jax.Array]:
    """The router's figures from the layers' `RouterStats`: `aux_loss`, transformers' load-balancing loss
    (experts x sum over experts of the share of choices times the mean router probability, both over every layer's
    real tokens; differentiable through the probabilities only); `max_load` and `min_load`, the busiest and idlest
    expert's share of a layer's choices times the number of experts (1 when balanced), averaged over layers;
    `entropy`, the router's mean entropy per token (nats); `dropped`, the share of choices past capacity."""
    layers = [stats[i] for i in sorted(stats)]
    tokens = jnp.maximum(sum(layer["tokens"] for layer in layers), 1.0)
    experts = layers[0]["load"].shape[0]
    load = jax.lax.stop_gradient(sum(layer["load"] for layer in layers)) / tokens
    probs = sum(layer["probs"] for layer in layers) / tokens
    shares = [layer["load"] * experts / (k * jnp.maximum(layer["tokens"], 1.0)) for layer in layers]
    return {
        "aux_loss": experts * jnp.sum(load * probs),
        "max_load": sum(jnp.max(share) for share in shares) / len(layers),
        "min_load": sum(jnp.min(share) for share in shares) / len(layers),
        "entropy": sum(layer["entropy"] for layer in layers) / tokens,
        "dropped": sum(layer["dropped"] for layer in layers) / (k * tokens),
    }


def expert_capacity(length: int, k: int, num_experts: int, factor: float | None) -> int:
    """Slots per expert and row of `length` tokens: `length` (no token dropped) without a factor, else
    `ceil(factor * length * k / num_experts)`, at least 1 and at most `length`."""
    if factor is None:
        return length
    return max(1, min(length, math.ceil(factor * length * k / num_experts)))


@functools.lru_cache(maxsize=64)
def _capacity_table(length: int, k: int, num_experts: int, factor: float) -> np.ndarray:
    """`expert_capacity` of every real-token count 0..length [length + 1] (int32)."""
    return np.array([expert_capacity(n, k, num_experts, factor) for n in range(length + 1)], np.int32)


def row_capacities(valid: jax.Array, k: int, num_experts: int, factor: float) -> jax.Array:
    """Each row's slots per expert [rows] (int32): `expert_capacity` of its real tokens (`valid` [rows, length]), the
    capacity of the row unpadded (looked up, so with `expert_capacity`'s float64 rounding); at most the padded
    width's."""
    table = jnp.asarray(_capacity_table(valid.shape[1], k, num_experts, factor))
    return table[jnp.sum(valid.astype(jnp.int32), axis=1)]


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


def buffer_slots(
    experts: jax.Array,
    num_experts: int,
    capacity: int,
    valid: jax.Array | None = None,
    row_capacity: jax.Array | None = None,
) -> jax.Array:
    """Each choice's slot [rows, length * k] in its row's buffers of `num_experts * capacity` slots, choices
    k-major (every token's first choice before any second choice), the dropped ones (past `capacity`, or past the
    row's `row_capacity` [rows] <= `capacity` where given), and those of tokens not `valid` [rows, length] (padding
    takes no slot), at `num_experts * capacity`."""
    rows, length, k = experts.shape
    choices = jnp.swapaxes(experts, 1, 2).reshape(rows, k * length)
    placed = jnp.ones(choices.shape, bool) if valid is None else jnp.tile(valid.astype(bool), (1, k))
    onehot = jax.nn.one_hot(choices, num_experts, dtype=jnp.int32) * placed[..., None]
    position = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)
    limit = capacity if row_capacity is None else row_capacity[:, None]
    return jnp.where(placed & (position < limit), choices * capacity + position, num_experts * capacity)


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

    def route(self, x: jax.Array, replay: jax.Array | None = None, valid: jax.Array | None = None) -> RoutedTokens:
        """The routing of hidden states x [rows, length, embed] (`replay` [rows, length, k]: `top_k_routing`,
        dropless), written to the active tape (`valid` [rows, length]: the real tokens, which alone take slots, set
        each row's capacity and count in its statistics)."""
        logits = constrain(dense(x, self.router_kernel[...].astype(self.dtype)), ("batch", "length", None))
        k = self.experts_per_token
        weights, experts = top_k_routing(logits, k, self.norm_topk_prob, replay)
        factor = None if replay is not None else self.capacity_factor  # replay keeps every expert generation used
        capacity = expert_capacity(x.shape[1], k, self.num_experts, factor)
        per_row = None if factor is None or valid is None else row_capacities(valid, k, self.num_experts, factor)
        slots = buffer_slots(experts, self.num_experts, capacity, valid, per_row)
        routed = RoutedTokens(experts, weights, slots, self.num_experts, capacity, valid)
        tape = _TAPE.get()
        if tape is not None and tape.routes is not None:
            tape.routes[self.moe_index] = experts
        if tape is not None and tape.stats is not None:
            tape.stats[self.moe_index] = router_stats(logits, routed, valid)
        return routed

    def __call__(
        self, x: jax.Array, expert_choices: jax.Array | None = None, valid: jax.Array | None = None
    ) -> jax.Array:
        """The layer over x [rows, length, embed]; `expert_choices` [rows, length, moe layers, k] replays routes;
        `valid` [rows, length] marks the real tokens (for the router statistics)."""
        replay = None if expert_choices is None else expert_choices[:, :, self.moe_index]
        return self.apply_experts(x, self.route(x, replay, valid))

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
        weighted = chosen.astype(jnp.float32) * jnp.swapaxes(routed.weights, 1, 2)[..., None]  # [rows, k, length, d]
        # summed choice by choice, not by a reduce: XLA's CPU backend hands a reduce to YNNPACK at some widths only,
        # which rounds differently (fused multiply-adds), so a row's outputs would depend on its padding
        return sum((weighted[:, i] for i in range(1, k)), weighted[:, 0]).astype(self.dtype)

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
