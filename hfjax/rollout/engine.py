"""`Engine`, the generation interface shaped after JetStream's, and `JaxEngine`, its implementation for hfjax causal LMs
over a generation `Layout`.

The decode state holds a KV cache of `max_concurrent_decodes` slots, sharded with slots over the layout's batch axes
and kv heads over its tensor axis, in at most `MAX_KV_BLOCKS` blocks of positions per layer. `prefill` runs a batch of
right-padded prompts (lengths bucketed to powers of two and 1.5x powers of two, so compiles stay few; rows split over
the layout's batch axes, so each data shard prefills its own), or appends them to an `existing_prefix`; `insert` copies
prefilled prompts into slots (gathering their keys and values to the slots' shards) and samples each sample's first
token (the token `prefill` returns is sample 0's: both draw it with the same key); `extend` appends
tokens to running slots (a multi-turn observation) without re-prefilling their history, at shapes bucketed and capped
by `ExtendShapes` (a bounded number of compiled programs, `max_extend_programs`); `generate` advances every slot
by one token, attending only over the blocks that the longest slot has reached when told its length (one compiled step
per block count). The jitted steps donate the decode state, trace attention under the layout (`program_layout`: Pallas
kernels run per shard), and `compiles` counts traces. Parameters are passed on every call (JetStream's convention), so
new weights of the same shapes and shardings never recompile. `prefill_insert` fuses `prefill` and `insert` into one
compiled call (what `OfflineGenerator` runs); it gives the tokens of the two calls made one after the other.
Imports `hfjax.models`, `hfjax.parallel` and this package's interface, sampling, extend shapes and cached forwards.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hfjax.compile_options import FORWARD_COMPILER_OPTIONS
from hfjax.models.program import constrain, program_layout
from hfjax.models.transformer import CausalLM
from hfjax.parallel.layout import Layout
from hfjax.rollout.cached_forward import (
    Prefix,
    decode_forward,
    extend_forward,
    extend_slots_forward,
    prefill_forward,
    to_decode_layout,
)
from hfjax.rollout.extend_shapes import ExtendShapes, pad_extend
from hfjax.rollout.interface import (
    ALL_FILTERS,
    DecodeState,
    PrefillResult,
    ResultTokens,
    kv_block_size,
    prefill_buckets,
)
from hfjax.rollout.sampling import SamplerKind, SamplingError, SamplingParams, sample_key, sample_tokens


def _batch_sharded(layout: Layout, shape: tuple[int, ...], logical: tuple[str | None, ...]) -> NamedSharding:
    """Sharding by `layout` of each dimension that divides evenly; a dimension that does not is replicated."""
    entries = []
    used: set[str] = set()
    for size, axis in zip(shape, logical, strict=True):
        mesh_axes = tuple(a for a in dict(layout.rules).get(axis, ()) if a not in used and layout.axis_size(a) > 1)
        parts = int(np.prod([layout.axis_size(a) for a in mesh_axes])) if mesh_axes else 1
        if not mesh_axes or size % parts:
            entries.append(None)
            continue
        used.update(mesh_axes)
        entries.append(mesh_axes if len(mesh_axes) > 1 else mesh_axes[0])
    return NamedSharding(layout.mesh, PartitionSpec(*entries))


def _split_rows(*arrays: jax.Array) -> list[jax.Array]:
    """The arrays (traced under the engine's layout) with their rows, dimension 0, split over the batch mesh axes
    where they divide: each part of the batch axes then computes its own rows of a prefill, whatever the inputs'
    placement (host arrays arrive replicated)."""
    return [constrain(x, ("batch",) + (None,) * (x.ndim - 1)) for x in arrays]


def _sample_rng(keys: jax.Array, samples: jax.Array) -> jax.Array:
    """The random key of sample `samples[i]` of a prompt whose base key is `keys[i]` (raw key data)."""
    return jax.vmap(lambda k, i: jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(k), i)))(keys, samples)


class JaxEngine:
    """Generation for an hfjax `CausalLM` (concrete or abstract: only its structure is used) over `layout`. Past
    `max_extend_programs` compiled `extend` shapes, an extend pads up to a compiled shape that holds it, and compiles
    only where none does (`hfjax.rollout.extend_shapes`)."""

    def __init__(
        self,
        model: CausalLM,
        layout: Layout | None = None,
        *,
        max_concurrent_decodes: int = 64,
        max_prefill_length: int = 512,
        max_new_tokens: int = 512,
        max_extend_programs: int = 16,
    ):
        for name, value in (
            ("max_concurrent_decodes", max_concurrent_decodes),
            ("max_prefill_length", max_prefill_length),
            ("max_new_tokens", max_new_tokens),
        ):
            if not isinstance(value, int) or value < 1:
                raise SamplingError(f"engine.{name}: expected an integer >= 1, got {value!r}")
        cfg = model.config
        self.config = cfg
        self.layout = layout or Layout.from_config({"mesh": {"data": 1}, "rules": "dp_tp_gen", "devices": [0]})
        self._slots = max_concurrent_decodes
        self._max_prefill = max_prefill_length
        self.capacity = max_prefill_length + max_new_tokens
        self.block = kv_block_size(self.capacity, self.layout.platform)
        self.blocks = -(-self.capacity // self.block)
        self.graphdef, _, self._rest = nnx.split(model, nnx.Param, ...)
        self.compiles: collections.Counter[str] = collections.Counter()
        self.extend_shapes = ExtendShapes(
            slots=self._slots, capacity=self.capacity, blocks=self.blocks, max_programs=max_extend_programs
        )
        self._key_shape = (self._slots, cfg.num_kv_heads, cfg.head_dim, self.block)
        self._value_shape = (self._slots, cfg.num_kv_heads, self.block, cfg.head_dim)
        self._cache_dtype = jnp.dtype(model.dtype)
        key_cache = _batch_sharded(self.layout, self._key_shape, ("batch", "kv_heads", "head_dim", "length"))
        value_cache = _batch_sharded(self.layout, self._value_shape, ("batch", "kv_heads", "length", "head_dim"))
        per_slot = _batch_sharded(self.layout, (self._slots,), ("batch",))
        rng = _batch_sharded(self.layout, (self._slots, 2), ("batch", None))
        layers = cfg.num_layers
        self.state_sharding = DecodeState(
            ((key_cache,) * self.blocks,) * layers,
            ((value_cache,) * self.blocks,) * layers,
            per_slot,
            per_slot,
            rng,
            per_slot,
            per_slot,
            per_slot,
            per_slot,
        )
        self._prefill = self._jit("prefill", self._prefill_fn)
        self._prefill_extend = self._jit("prefill", self._prefill_extend_fn)
        self._extend = self._jit(
            "extend", self._extend_fn, ("kind", "live"), donate_argnums=1, out_shardings=(self.state_sharding, None)
        )
        self._insert = self._jit("insert", self._insert_fn, donate_argnums=1, out_shardings=(self.state_sharding, None))
        self._generate = self._jit(
            "generate",
            self._generate_fn,
            ("kind", "live"),
            donate_argnums=1,
            out_shardings=(self.state_sharding, None),
        )
        self._prefill_insert = self._jit(
            "prefill_insert", self._prefill_insert_fn, donate_argnums=1, out_shardings=(self.state_sharding, None)
        )

    def _jit(self, name: str, fn: Any, static: tuple[str, ...] = ("kind",), **jit_kwargs: Any) -> Any:
        """`jax.jit` of fn (with `static` argument names) that counts its traces in `compiles[name]` and traces its
        attention under the engine's layout (`program_layout`)."""

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.compiles[name] += 1
            with program_layout(self.layout):
                return fn(*args, **kwargs)

        return jax.jit(counted, static_argnames=static, compiler_options=FORWARD_COMPILER_OPTIONS, **jit_kwargs)

    # ----------------------------------------------------------------------------------------------- interface
    @property
    def max_concurrent_decodes(self) -> int:
        return self._slots

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill

    @property
    def mesh(self) -> Mesh:
        return self.layout.mesh

    @property
    def batch_parts(self) -> int:
        """How many parts the layout's batch mesh axes split rows into: a prefill of a multiple of this many rows
        computes each row on one part only (fewer rows, or rows that do not divide, are computed on every part)."""
        return self.layout.batch_parts

    def get_prefix_destination_sharding(self) -> NamedSharding:
        """Where a prefix's rows live: split over the layout's batch mesh axes (each part prefills its own rows; a
        prefill whose rows do not divide them keeps the rows that don't on every part)."""
        return _batch_sharded(self.layout, (self.batch_parts,), ("batch",))

    def init_decode_state(self) -> DecodeState:
        """Empty slots: zero caches and lengths (an empty slot computes harmlessly until something is inserted)."""
        return jax.device_put(self._empty_state(), self.state_sharding)

    def abstract_decode_state(self) -> DecodeState:
        """`init_decode_state` as `jax.ShapeDtypeStruct`s with its shardings: allocates nothing (to lower and compile
        the engine's programs for devices this process does not run on)."""
        shapes = jax.eval_shape(self._empty_state)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, self.state_sharding
        )

    def _empty_state(self) -> DecodeState:
        layers, blocks = self.config.num_layers, range(self.blocks)
        return DecodeState(
            tuple(tuple(jnp.zeros(self._key_shape, self._cache_dtype) for _ in blocks) for _ in range(layers)),
            tuple(tuple(jnp.zeros(self._value_shape, self._cache_dtype) for _ in blocks) for _ in range(layers)),
            jnp.zeros(self._slots, jnp.int32),
            jnp.zeros(self._slots, jnp.int32),
            jnp.zeros((self._slots, 2), jnp.uint32),
            jnp.zeros(self._slots, jnp.int32),
            jnp.zeros(self._slots, jnp.float32),
            jnp.zeros(self._slots, jnp.int32),
            jnp.ones(self._slots, jnp.float32),
        )

    def kv_cache_bytes_per_device(self) -> int:
        """Bytes of the decode state's KV cache on each device (its largest shard per block, summed)."""
        layers = self.config.num_layers * self.blocks
        per_block = sum(
            math.prod(sharding.shard_shape(shape)) * self._cache_dtype.itemsize
            for sharding, shape in (
                (self.state_sharding.keys[0][0], self._key_shape),
                (self.state_sharding.values[0][0], self._value_shape),
            )
        )
        return layers * per_block

    def bucket(self, length: int) -> int:
        """The padded prefill length for a prompt of `length` tokens."""
        if length < 1:
            raise SamplingError("prompt: empty prompt; expected at least one token")
        if length > self._max_prefill:
            raise SamplingError(
                f"prompt: {length} tokens, longer than the engine's max_prefill_length {self._max_prefill}"
            )
        return next(b for b in prefill_buckets(self._max_prefill) if b >= length)

    def prefill(
        self,
        *,
        params: Any,
        existing_prefix: PrefillResult | None = None,
        padded_tokens: Any,
        true_length: Any,
        sampler: SamplingParams | None = None,
        request_id: Any = None,
    ) -> tuple[PrefillResult, ResultTokens]:
        """Prefills one prompt ([P]) or a batch ([B, P], right-padded) of `true_length` real tokens each; with an
        `existing_prefix` (of as many rows), appends them to it instead: the result is the prefix of the joined
        prompts, computed without re-running the existing part. Returns the prefix and each prompt's first token (the
        token `insert` gives its sample 0) with its logprob, drawn with `sampler` (default greedy) and the keys of
        `request_id` (default the row index)."""
        sampler = sampler or SamplingParams(temperature=0.0)
        tokens = np.atleast_2d(np.asarray(padded_tokens, np.int32))
        lengths = np.atleast_1d(np.asarray(true_length, np.int32))
        rows = len(lengths)
        requests = np.arange(rows, dtype=np.int32) if request_id is None else np.atleast_1d(request_id)
        arrays = self._sampling_arrays(sampler, np.asarray(requests, np.int32))
        if existing_prefix is None:
            for n in lengths:
                self.bucket(int(n))
            prefix, first = self._prefill(params, tokens, lengths, *arrays, kind=SamplerKind.of(sampler))
        else:
            total = np.asarray(existing_prefix.cache.lengths) + lengths
            for n in total:
                self.bucket(int(n))
            width = existing_prefix.cache.keys[0].shape[1]
            if width + tokens.shape[1] > self._max_prefill:  # keep the joined prefix within the prefill limit
                tokens = tokens[:, : max(int(lengths.max()), self._max_prefill - width)]
            prefix, first = self._prefill_extend(
                params, existing_prefix.cache, tokens, lengths, *arrays, kind=SamplerKind.of(sampler)
            )
        if np.ndim(padded_tokens) == 1:
            return prefix, ResultTokens(first.tokens[0], first.logprobs[0])
        return prefix, first

    def extend(
        self,
        params: Any,
        decode_state: DecodeState,
        *,
        slots: Any,
        padded_tokens: Any,
        true_length: Any,
        starts: Any,
        steps: Any = None,
        kind: SamplerKind = ALL_FILTERS,
    ) -> tuple[DecodeState, ResultTokens]:
        """Appends tokens to running slots: row i ([R, T] right-padded, `true_length[i]` real) goes to slot
        `slots[i]` (out of range: ignored) at positions `starts[i]`.. (the slot's cached length: what the caller
        knows, not the decode state's, which advances while a slot waits). Their history is read from the cache, not
        recomputed. Samples each slot's next token with its own key at step `steps[i]` (default: the slot's own count,
        which also advances while it waits; a caller that knows each sample's token count passes it, so the draws do
        not depend on what else ran); returns the state (lengths `starts + true_length`) and those tokens. The call
        runs padded to a shape of `extend_shapes` (rows, width, cache blocks): row i of the result is row i's token,
        the rows past R are padding."""
        tokens = np.atleast_2d(np.asarray(padded_tokens, np.int32))
        lengths = np.atleast_1d(np.asarray(true_length, np.int32))
        starts = np.atleast_1d(np.asarray(starts, np.int32))
        if lengths.min() < 1 or (starts + lengths).max() > self.capacity:
            raise SamplingError(
                f"extend: tokens at positions {int(starts.min())}..{int((starts + lengths).max())}, expected at least"
                f" one token per row within the engine's capacity of {self.capacity} positions"
            )
        slot_ids = np.atleast_1d(np.asarray(slots, np.int32))
        steps = np.full(len(slot_ids), -1, np.int32) if steps is None else np.atleast_1d(np.asarray(steps, np.int32))
        reach = -(-int((starts + lengths).max()) // self.block)  # blocks the rows reach
        shape = self.extend_shapes.choose(len(slot_ids), int(lengths.max()), reach, kind)
        arrays = pad_extend(shape, self._slots, slot_ids, tokens, lengths, starts, steps)
        return self._extend(params, decode_state, *arrays, kind=kind, live=shape.live)

    def insert(
        self, prefix: PrefillResult, decode_state: DecodeState, slot: Any, rows: Any = None, sample_ids: Any = None
    ) -> DecodeState:
        """Copies prefix rows (default: row i to slot[i]) into slots, sample `sample_ids` of each (default 0)."""
        state, _ = self.insert_samples(prefix, decode_state, slot, rows, sample_ids)
        return state

    def insert_samples(
        self, prefix: PrefillResult, decode_state: DecodeState, slot: Any, rows: Any = None, sample_ids: Any = None
    ) -> tuple[DecodeState, ResultTokens]:
        """`insert` that also returns each inserted sample's first token and its logprob."""
        slots = np.atleast_1d(np.asarray(slot, np.int32))
        rows = np.arange(len(slots), dtype=np.int32) if rows is None else np.asarray(rows, np.int32)
        samples = np.zeros(len(slots), np.int32) if sample_ids is None else np.asarray(sample_ids, np.int32)
        return self._insert(prefix, decode_state, slots, rows, samples, kind=ALL_FILTERS)

    def generate(
        self, params: Any, decode_state: DecodeState, kind: SamplerKind = ALL_FILTERS, context: int | None = None
    ) -> tuple[DecodeState, ResultTokens]:
        """One token for every slot (`kind` leaves filters that no slot uses out of the compiled step). `context`, when
        given, bounds every active slot's cache length after this step: only the blocks up to it are attended over
        (empty slots may compute garbage)."""
        live = self.blocks if context is None else min(self.blocks, max(1, -(-context // self.block)))
        return self._generate(params, decode_state, kind=kind, live=live)

    def prefill_insert(
        self,
        params: Any,
        decode_state: DecodeState,
        tokens: np.ndarray,
        lengths: np.ndarray,
        sampling: SamplingParams,
        request_ids: np.ndarray,
        slots: np.ndarray,
        rows: np.ndarray,
        sample_ids: np.ndarray,
    ) -> tuple[DecodeState, ResultTokens]:
        """`prefill` then `insert` in one compiled call (what `OfflineGenerator` uses)."""
        arrays = self._sampling_arrays(sampling, request_ids)
        return self._prefill_insert(
            params, decode_state, tokens, lengths, *arrays, slots, rows, sample_ids, kind=SamplerKind.of(sampling)
        )

    # ----------------------------------------------------------------------------------------------- traced
    def _model(self, params: Any) -> CausalLM:
        return nnx.merge(self.graphdef, params, self._rest)

    @staticmethod
    def _sampling_arrays(sampling: SamplingParams, requests: np.ndarray) -> tuple[np.ndarray, ...]:
        rows = len(requests)
        return (
            np.full(rows, sampling.seed, np.int32),
            requests.astype(np.int32),
            np.full(rows, sampling.temperature, np.float32),
            np.full(rows, sampling.top_k, np.int32),
            np.full(rows, sampling.top_p, np.float32),
        )

    def _prefill_fn(self, params, tokens, lengths, seeds, requests, temperature, top_k, top_p, *, kind):
        tokens, lengths, *sampling = _split_rows(tokens, lengths, seeds, requests, temperature, top_k, top_p)
        cache = prefill_forward(self._model(params), tokens, lengths)
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

    def _insert_fn(self, prefix: PrefillResult, state: DecodeState, slots, rows, samples, *, kind):
        rng = _sample_rng(prefix.keys[rows], samples)
        zeros = jnp.zeros_like(slots)
        temperature, top_k, top_p = prefix.temperature[rows], prefix.top_k[rows], prefix.top_p[rows]
        first = sample_tokens(prefix.cache.last_logits[rows], rng, zeros, temperature, top_k, top_p, kind)
        width, block = prefix.cache.keys[0].shape[1], self.block
        layers = [
            to_decode_layout(k[rows], v[rows]) for k, v in zip(prefix.cache.keys, prefix.cache.values, strict=True)
        ]

        def put_blocks(blocks: tuple[jax.Array, ...], rows: jax.Array, axis: int) -> tuple[jax.Array, ...]:
            """`blocks` with the prefix `rows` (positions along `axis`) written into the slots' first positions."""
            out = []
            for i, cache in enumerate(blocks):
                part = jax.lax.slice_in_dim(rows, min(width, i * block), min(width, (i + 1) * block), axis=axis)
                index = (slots,) + (slice(None),) * (axis - 1) + (slice(0, part.shape[axis]),)
                out.append(cache.at[index].set(part.astype(cache.dtype), mode="drop") if part.size else cache)
            return tuple(out)

        def set_slots(current: jax.Array, value: jax.Array) -> jax.Array:
            return current.at[slots].set(value, mode="drop")

        state = DecodeState(
            tuple(put_blocks(c, k, 3) for c, (k, _) in zip(state.keys, layers, strict=True)),
            tuple(put_blocks(c, v, 2) for c, (_, v) in zip(state.values, layers, strict=True)),
            set_slots(state.lengths, prefix.cache.lengths[rows]),
            set_slots(state.tokens, first[0]),
            set_slots(state.rng, rng),
            set_slots(state.steps, jnp.ones_like(slots)),
            set_slots(state.temperature, temperature),
            set_slots(state.top_k, top_k),
            set_slots(state.top_p, top_p),
        )
        return state, ResultTokens(*first)

    def _generate_fn(self, params, state: DecodeState, *, kind, live):
        model = self._model(params)
        live_keys, live_values = tuple(k[:live] for k in state.keys), tuple(v[:live] for v in state.values)
        logits, keys, values = decode_forward(model, state.tokens, state.lengths, live_keys, live_values)
        keys = tuple(new + old[live:] for new, old in zip(keys, state.keys, strict=True))
        values = tuple(new + old[live:] for new, old in zip(values, state.values, strict=True))
        tokens, logprobs = sample_tokens(
            logits, state.rng, state.steps, state.temperature, state.top_k, state.top_p, kind
        )
        state = state._replace(
            keys=keys, values=values, lengths=state.lengths + 1, tokens=tokens, steps=state.steps + 1
        )
        return state, ResultTokens(tokens, logprobs)

    def _extend_fn(self, params, state: DecodeState, slots, tokens, counts, starts, steps, *, kind, live):
        rows = jnp.minimum(slots, self._slots - 1)  # padding rows (slot out of range) read the last slot, write none
        logits, keys, values = extend_slots_forward(
            self._model(params), tokens, starts, counts, slots, state.keys, state.values, live
        )
        steps = jnp.where(steps < 0, state.steps[rows], steps)
        first = sample_tokens(
            logits, state.rng[rows], steps, state.temperature[rows], state.top_k[rows], state.top_p[rows], kind
        )

        def set_slots(current: jax.Array, value: jax.Array) -> jax.Array:
            return current.at[slots].set(value, mode="drop")

        state = state._replace(
            keys=keys,
            values=values,
            lengths=set_slots(state.lengths, starts + counts),
            tokens=set_slots(state.tokens, first[0]),
            steps=set_slots(state.steps, steps + 1),
        )
        return state, ResultTokens(*first)

    def _prefill_insert_fn(self, params, state, tokens, lengths, seeds, requests, temp, top_k, top_p, slots, rows,
                           samples, *, kind):  # fmt: skip
        prefix, _ = self._prefill_fn(params, tokens, lengths, seeds, requests, temp, top_k, top_p, kind=kind)
        return self._insert_fn(prefix, state, slots, rows, samples, kind=kind)
