"""LoRA adapters (low-rank updates of the decoder's projections): y = x W^T + (alpha / rank) (x A^T) B^T, with A
[rank, in] and B [out, rank] float32 `LoraParam`s beside a frozen base weight W.

`add_lora(model, cfg)` attaches adapters to the projections named by `cfg.targets` (PEFT's module names: attention
q/k/v/o_proj, MLP gate/up/down_proj). B starts at zero, so a fresh adapter leaves every output exactly as it was; A
starts as PEFT starts it (uniform in +-1/sqrt(in)). An adapter's matrices carry the logical axes of their base weight
on the side they share with it and `lora_rank` (never split) on the other, so a layout shards them as it shards the
base. Inside `adapters_off()` (read when a program is traced) the model computes its base alone: a LoRA actor's
reference policy is its own base, with no second copy. `merge_lora` folds the adapters into the base weights.

Adapter dropout (PEFT's `lora_dropout`): inside `adapter_dropout(row_keys)` each adapter with a `dropout` rate sees
its input with that share of elements zeroed and the rest scaled by 1 / (1 - rate), a mask drawn per batch row from
the row's key and the adapter's `site` (so a row's masks do not depend on the micro-batch it lands in); the base
term sees the whole input. Only the updates open it: log probs, references and generation use the whole adapter.
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

# PEFT's target name -> (the attribute of the projection's kernel, of its adapter, and how many leading kernel
# dimensions are its output: Attention's q/k/v kernels are [heads, head_dim, embed], its o kernel [embed, heads,
# head_dim]; the MLP's kernels [out, in])
LORA_SITES = {
    "q_proj": ("q_kernel", "q_lora", 2),
    "k_proj": ("k_kernel", "k_lora", 2),
    "v_proj": ("v_kernel", "v_lora", 2),
    "o_proj": ("o_kernel", "o_lora", 1),
    "gate_proj": ("gate_kernel", "gate_lora", 1),
    "up_proj": ("up_kernel", "up_lora", 1),
    "down_proj": ("down_kernel", "down_lora", 1),
}
_ADAPTERS_ON = contextvars.ContextVar("hfjax_lora_adapters_on", default=True)
_DROPOUT_KEYS: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("hfjax_lora_dropout", default=None)


@dataclasses.dataclass
class LoraConfig:
    """Low-rank adapters on a trained role: `rank` 0 trains every weight (no adapters); `rank` > 0 freezes the base
    (stored in the role's compute dtype) and trains float32 adapters of that rank, scaled by `alpha / rank`, on the
    projections named in `targets`."""

    rank: int = 0  # adapter rank; 0: no adapters (every weight trains)
    alpha: float = 16.0  # the adapters' term is scaled by alpha / rank
    # projections that get adapters, by PEFT's module names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    # down_proj (default: all seven)
    targets: list[str] = dataclasses.field(default_factory=lambda: list(LORA_SITES))
    # share of each adapter's input elements zeroed in the updates (PEFT's lora_dropout; a fresh mask per row and
    # update, the same over an update's PPO epochs); 0: none
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"lora.rank: expected an integer >= 0 (0: no adapters), got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha: expected > 0, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, int | float) or not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout: expected a number in [0, 1), got {self.dropout!r}")
        unknown = [t for t in self.targets if t not in LORA_SITES]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(
                f"lora.targets: expected distinct names out of {list(LORA_SITES)}, at least one, got {self.targets!r}"
            )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def drops_out(self) -> bool:
        """Whether the updates drop out adapter inputs (adapters with a dropout rate)."""
        return self.enabled and self.dropout > 0


ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def lora_modules(cfg: ModelConfig) -> list[str]:
    """The targets (PEFT's module names) that a model of `cfg` has a projection for: attention's in every layer, the
    MLP's only where a layer's MLP is dense (a mixture of experts' expert weights get no adapters)."""
    return [t for t in LORA_SITES if t in ATTENTION_TARGETS or not all(cfg.moe_layers)]


def check_lora_targets(cfg: ModelConfig, lora: LoraConfig, field: str, where: str) -> None:
    """Raises ValueError naming `field` (e.g. "actor.lora.targets") when `lora`'s targets match no projection of the
    model of `cfg` (at `where`): MLP targets on a model whose every layer's MLP is a mixture of experts."""
    modules = lora_modules(cfg)
    if lora.enabled and not set(lora.targets) & set(modules):
        raise ValueError(
            f"{field}: {lora.targets} match no module of the model at {where} (every layer's MLP is a mixture of "
            f"experts, whose experts get no adapters); expected at least one of its modules {modules}"
        )


def lora_parameter_count(cfg: ModelConfig, lora: LoraConfig) -> int:
    """The adapters' parameters of `lora` on a model of `cfg`: rank x (in + out) per adapted projection (the MLP
    targets adapt dense MLPs only: a mixture of experts' expert weights get no adapters)."""
    if not lora.enabled:
        return 0
    d, m, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    attention = {"q_proj": d + q, "k_proj": d + kv, "v_proj": d + kv, "o_proj": q + d}
    dense_layers = cfg.num_layers - sum(cfg.moe_layers)
    mlp = sum(d + m for t in lora.targets if t not in attention)
    return lora.rank * (cfg.num_layers * sum(attention.get(t, 0) for t in lora.targets) + dense_layers * mlp)


class LoraParam(nnx.Param):
    """An adapter matrix: what a LoRA role trains (its base `nnx.Param`s stay frozen)."""


class LoraAdapter(nnx.Module):
    """The adapter of one kernel [*out, *in] (`out_dims` output dimensions): A [rank, *in], B [*out, rank]; of an
    abstract kernel (`jax.ShapeDtypeStruct`, `hfjax.models.hf.abstract_model`), abstract too."""

    def __init__(
        self, kernel: nnx.Param, out_dims: int, rank: int, alpha: float, key: jax.Array, dropout: float, site: int
    ):
        axes = kernel.get_metadata()["logical_axes"]
        out_shape, in_shape = kernel.shape[:out_dims], kernel.shape[out_dims:]
        a_shape, b_shape = (rank, *in_shape), (*out_shape, rank)
        if isinstance(kernel.get_value(), jax.ShapeDtypeStruct):
            a, b = jax.ShapeDtypeStruct(a_shape, jnp.float32), jax.ShapeDtypeStruct(b_shape, jnp.float32)
        else:
            bound = 1.0 / math.sqrt(math.prod(in_shape))
            a = jax.random.uniform(key, a_shape, jnp.float32, -bound, bound)
            b = jnp.zeros(b_shape, jnp.float32)
        self.a = LoraParam(a, logical_axes=("lora_rank", *axes[out_dims:]))
        self.b = LoraParam(b, logical_axes=(*axes[:out_dims], "lora_rank"))
        self.scale = float(alpha) / rank
        self.dropout = float(dropout)
        self.site = site  # this adapter's index in the model: its dropout masks' stream

    def delta(self) -> jax.Array:
        """scale * B A as a [prod(out), prod(in)] matrix (float32)."""
        rank = self.a.shape[0]
        return self.scale * (self.b[...].reshape(-1, rank) @ self.a[...].reshape(rank, -1))


def with_adapter(y: jax.Array, x: jax.Array, adapter: LoraAdapter | None, dtype: jnp.dtype) -> jax.Array:
    """`y` (= x W^T, [..., prod(out)]) plus the adapter's low-rank term in `dtype`; `y` itself when there is no
    adapter or adapters are off."""
    if adapter is None or not _ADAPTERS_ON.get():
        return y
    row_keys = _DROPOUT_KEYS.get()
    if adapter.dropout and row_keys is not None:
        x = _dropped(x, row_keys, adapter)
    rank = adapter.a.shape[0]
    a = adapter.a[...].astype(dtype).reshape(rank, -1)
    b = (adapter.b[...] * adapter.scale).astype(dtype).reshape(-1, rank)
    return y + dense(dense(x, a), b)


def _dropped(x: jax.Array, row_keys: jax.Array, adapter: LoraAdapter) -> jax.Array:
    """`x` [rows, ...] with a share `adapter.dropout` of each row's elements zeroed (row r's mask from
    `row_keys[r]` and the adapter's site) and the rest scaled by 1 / (1 - dropout)."""
    keep = 1.0 - adapter.dropout

    def row_mask(key: jax.Array) -> jax.Array:
        return jax.random.bernoulli(jax.random.fold_in(key, adapter.site), keep, x.shape[1:])

    mask = jax.vmap(row_mask)(row_keys)
    return jnp.where(mask, x / jnp.asarray(keep, x.dtype), jnp.zeros((), x.dtype))


@contextlib.contextmanager
def adapter_dropout(row_seeds: jax.Array | None) -> Iterator[None]:
    """Programs traced inside drop out adapter inputs (the adapters' `dropout` rates), row r's masks drawn from
    `row_seeds[r]` (int); None: no dropout."""
    keys = None if row_seeds is None else jax.vmap(jax.random.key)(row_seeds)
    token = _DROPOUT_KEYS.set(keys)
    try:
        yield
    finally:
        _DROPOUT_KEYS.reset(token)


@contextlib.contextmanager
def adapters_off() -> Iterator[None]:
    """Programs traced inside compute the base model alone (every adapter skipped)."""
    token = _ADAPTERS_ON.set(False)
    try:
        yield
    finally:
        _ADAPTERS_ON.reset(token)


def _sites(model: nnx.Module, targets: list[str]) -> Iterator[tuple[nnx.Module, str, str, int]]:
    for _, module in nnx.iter_modules(model):
        for target in targets:
            kernel_attr, adapter_attr, out_dims = LORA_SITES[target]
            if hasattr(module, kernel_attr) and hasattr(module, adapter_attr):
                yield module, kernel_attr, adapter_attr, out_dims


def add_lora(model: nnx.Module, cfg: LoraConfig, seed: int = 0) -> nnx.Module:
    """`model` with adapters of `cfg` attached in place (their A initialised from `seed`); returns `model`."""
    if not cfg.enabled:
        return model
    key = jax.random.key(seed)
    for index, (module, kernel_attr, adapter_attr, out_dims) in enumerate(_sites(model, cfg.targets)):
        kernel = getattr(module, kernel_attr)
        adapter = LoraAdapter(kernel, out_dims, cfg.rank, cfg.alpha, jax.random.fold_in(key, index), cfg.dropout, index)
        setattr(module, adapter_attr, nnx.data(adapter))
    return model


def merge_lora(model: nnx.Module) -> nnx.Module:
    """A copy of `model` with every adapter folded into its base kernel (W + scale B A, in the kernel's dtype) and
    removed: the plain model that the adapted one computes."""
    merged = nnx.clone(model)
    for module, kernel_attr, adapter_attr, _ in _sites(merged, list(LORA_SITES)):
        adapter = getattr(module, adapter_attr)
        if adapter is None:
            continue
        kernel = getattr(module, kernel_attr)
        value = kernel[...]
        kernel[...] = (value.astype(jnp.float32) + adapter.delta().reshape(value.shape)).astype(value.dtype)
        setattr(module, adapter_attr, None)
    return merged
