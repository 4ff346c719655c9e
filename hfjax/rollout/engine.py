"""`Engine`, the generation interface shaped after JetStream's, and `JaxEngine`, its implementation for hfjax causal LMs
over a generation `Layout`.

The decode state (`CacheLayout`) holds `max_concurrent_decodes` slots, sharded with slots over the layout's batch axes
and kv heads over its tensor axis: each slot's own blocks of positions (the response) and a shared prompt pool.
`prefill` runs a batch of right-padded prompts (lengths bucketed to powers of two and 1.5x powers of two, so compiles
stay few; rows split over the layout's batch axes, so each data shard prefills its own), or appends them to an
`existing_prefix`; `insert` writes each prefilled prompt once per data shard into pool blocks that the host's
`PromptPool` allocates, points its samples' slots at them (the samples of a prompt share its keys and values; a
sample's own tokens go to its own blocks) and samples each sample's first token (the token `prefill` returns is
sample 0's: both draw it with the same key). Inserting into a slot releases the prompt it read; `release` does so for
finished slots, and `init_decode_state` starts a new, empty pool. `extend` appends tokens to running slots (a
multi-turn observation) without re-prefilling their history, at shapes bucketed and capped by `ExtendShapes` (a
bounded number of compiled programs, `max_extend_programs`); `generate` advances every slot by one token, attending
over the prompt blocks of the longest prompt held and the own blocks that the longest response has reached when told
its length (one compiled step per pair of block counts). The jitted steps donate the decode state, trace attention
under the layout (`program_layout`: Pallas kernels run per shard). An engine of the same settings as a recent one in
this process (the next run's rollout worker) reuses its jitted steps and their traces; `compiles` counts, per step,
the programs an engine called (traced by it or by an earlier engine) plus any retrace. Parameters are
passed on every call (JetStream's convention), so new weights of the same shapes and shardings never recompile.
`prefill_insert` fuses `prefill` and `insert` into one compiled call (what `OfflineGenerator` runs); it gives the
tokens of the two calls made one after the other.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from hfjax.models.attention import configured_implementation
from hfjax.models.moe import set_expert_capacity
from hfjax.models.program import program_layout, setting_key
from hfjax.models.transformer import CausalLM
from hfjax.models.vision_lm import VisionLanguageLM, language_model
from hfjax.parallel.layout import Layout
from hfjax.rollout.cache_layout import CacheLayout, batch_sharded
from hfjax.rollout.engine_steps import EngineSteps
from hfjax.rollout.extend_shapes import ExtendShapes, pad_extend
from hfjax.rollout.interface import (
    ALL_FILTERS,
    DecodeState,
    PrefillResult,
    ResultTokens,
    prefill_buckets,
)
from hfjax.rollout.prompt_pool import Placement, PromptPool
from hfjax.rollout.sampling import SamplerKind, SamplingError, SamplingParams
from hfjax.xla_settings import FORWARD_COMPILER_OPTIONS

# The jitted steps of recent engines by their settings (model structure and config, dtype, layout, slots, lengths,
# the attention setting): an engine of equal settings (the next run's rollout worker in this process) reuses them.
_SHARED_ENGINES = 8
_PROGRAMS: dict[tuple[Any, ...], tuple[Any, ...]] = {}
# how many traces the engine call in progress caused (`JaxEngine._counting`), in a one-element list
_TRACES: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("hfjax_engine_traces", default=None)


class JaxEngine(EngineSteps):
    """Generation for an hfjax `CausalLM` or `VisionLanguageLM` (concrete or abstract: only its structure is used;
    images enter through `prefill` and `prefill_insert`) over `layout`. Past
    `max_extend_programs` compiled `extend` shapes, an extend pads up to a compiled shape that holds it, and compiles
    only where none does (`hfjax.rollout.extend_shapes`). With `record_experts`, a mixture of experts' routes come
    back with the tokens of `prefill_insert`, `generate` and `extend` (`ResultTokens.experts`)."""

    def __init__(
        self,
        model: CausalLM | VisionLanguageLM,
        layout: Layout | None = None,
        *,
        max_concurrent_decodes: int = 64,
        max_prefill_length: int = 512,
        max_new_tokens: int = 512,
        max_extend_programs: int = 16,
        prompt_cache_tokens: int | None = None,
        record_experts: bool = False,
    ):
        for name, value in (
            ("max_concurrent_decodes", max_concurrent_decodes),
            ("max_prefill_length", max_prefill_length),
            ("max_new_tokens", max_new_tokens),
        ):
            if not isinstance(value, int) or value < 1:
                raise SamplingError(f"engine.{name}: expected an integer >= 1, got {value!r}")
        lm = language_model(model)  # a vision-language model's images enter only through its prefill
        cfg = lm.config
        self.config = cfg
        self.layout = layout or Layout.from_config({"mesh": {"data": 1}, "rules": "dp_tp_gen", "devices": [0]})
        self._slots = max_concurrent_decodes
        # a mixture of experts' routes, recorded by `prefill_insert`, `generate` and `extend` (routing replay)
        self.record_experts = record_experts and any(cfg.moe_layers)
        self._max_prefill = max_prefill_length
        self.capacity = max_prefill_length + max_new_tokens  # the longest sequence: a prompt and its response
        self.cache = CacheLayout(
            cfg,
            self.layout,
            lm.dtype,
            slots=max_concurrent_decodes,
            max_prefill_length=max_prefill_length,
            max_new_tokens=max_new_tokens,
            prompt_cache_tokens=prompt_cache_tokens,
        )
        self.block, self.blocks, self.prompt_blocks = self.cache.block, self.cache.blocks, self.cache.prompt_blocks
        self.pool = PromptPool(
            parts=self.cache.pool_parts, blocks_per_part=self.cache.pool_blocks, slots=self._slots, block=self.block
        )
        if any(cfg.moe_layers):  # generation never drops a token: a new module over the same arrays, dropless
            model = set_expert_capacity(nnx.merge(*nnx.split(model)), None)
        self.graphdef, _, self._rest = nnx.split(model, nnx.Param, ...)
        self.compiles: collections.Counter[str] = collections.Counter()
        self._used: set[tuple[Any, ...]] = set()  # the programs this engine has called (`_counting`)
        self.extend_shapes = ExtendShapes(
            slots=self._slots, capacity=self.cache.own_capacity, blocks=self.blocks, max_programs=max_extend_programs
        )
        self.state_sharding = self.cache.sharding
        key = None
        if not jax.tree.leaves(self._rest):
            settings = (
                max_concurrent_decodes,
                max_prefill_length,
                max_new_tokens,
                prompt_cache_tokens,
                self.record_experts,
            )
            key = (
                self.graphdef,
                setting_key(cfg),
                str(lm.dtype),
                self.layout,
                self.layout.platform,  # the cache blocks and the attention kernel follow it
                (self.block, self.prompt_blocks),
                settings,
                configured_implementation(),
            )
        programs = (key is not None and _PROGRAMS.pop(key, None)) or self._programs()
        if key is not None:  # the most recently used last; the oldest go past `_SHARED_ENGINES`
            _PROGRAMS[key] = programs
            while len(_PROGRAMS) > _SHARED_ENGINES:
                _PROGRAMS.pop(next(iter(_PROGRAMS)))
        self._prefill, self._prefill_extend, self._extend, self._insert, self._generate, self._prefill_insert = programs

    def _programs(self) -> tuple[Any, ...]:
        """The jitted steps over this engine's model structure, layout and cache, shared with every later engine of
        equal settings (`_PROGRAMS`): the traced methods read only what those settings fix (graph definition,
        layout, slots, cache blocks), never parameters or decode state, which are arguments."""
        state_out = {"donate_argnums": 1, "out_shardings": (self.state_sharding, None)}
        return (
            self._jit(self._prefill_fn),
            self._jit(self._prefill_extend_fn),
            self._jit(self._extend_fn, ("kind", "live"), **state_out),
            self._jit(self._insert_fn, **state_out),
            self._jit(self._generate_fn, ("kind", "live", "prompt_live", "prompt_readers"), **state_out),
            self._jit(self._prefill_insert_fn, **state_out),
        )

    def _jit(self, fn: Any, static: tuple[str, ...] = ("kind",), **jit_kwargs: Any) -> Any:
        """`jax.jit` of fn (with `static` argument names) that counts its traces for the engine that calls it
        (`_counting`) and traces its attention under the engine's layout (`program_layout`)."""
        layout = self.layout

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            traces = _TRACES.get()
            if traces is not None:
                traces[0] += 1
            with program_layout(layout):
                return fn(*args, **kwargs)

        return jax.jit(counted, static_argnames=static, compiler_options=FORWARD_COMPILER_OPTIONS, **jit_kwargs)

    @contextlib.contextmanager
    def _counting(self, name: str, *program: Any) -> Iterator[None]:
        """A call of program `name` at `program` (its static arguments and shapes): counts in `compiles[name]` the
        traces it causes, or one when it is this engine's first call of a program that another engine traced."""
        traces = [0]
        token = _TRACES.set(traces)
        try:
            yield
        finally:
            _TRACES.reset(token)
            first_use = (name, *program) not in self._used
            self._used.add((name, *program))
            self.compiles[name] += max(traces[0], int(first_use))

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
        return batch_sharded(self.layout, (self.batch_parts,), ("batch",))

    def init_decode_state(self) -> DecodeState:
        """Empty slots: zero caches and lengths (an empty slot computes harmlessly until something is inserted), and
        an empty prompt pool: the engine's `pool` allocates for this state from now on."""
        self.pool.reset()
        return jax.device_put(self.cache.empty(), self.state_sharding)

    def abstract_decode_state(self) -> DecodeState:
        """`init_decode_state` as `jax.ShapeDtypeStruct`s with its shardings: allocates nothing (to lower and compile
        the engine's programs for devices this process does not run on)."""
        shapes = jax.eval_shape(self.cache.empty)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, self.state_sharding
        )

    def abstract_placement(self, rows: int, length: int, samples: int) -> Placement:
        """The placement arrays of a `prefill_insert` of `rows` prefill rows padded to `length` into `samples` slots,
        as `jax.ShapeDtypeStruct`s."""
        parts, blocks = self.cache.pool_parts, -(-length // self.block)
        pool = self.cache.readers_shape
        shapes = ((parts, rows), (parts, rows, blocks), (samples, self.prompt_blocks), pool, pool[:2], (self._slots,))
        return Placement(*(jax.ShapeDtypeStruct(shape, jnp.int32) for shape in shapes))

    def kv_cache_bytes_per_device(self) -> int:
        """Bytes of the decode state's KV caches (own blocks and prompt pool) on each device."""
        return self.cache.bytes_per_device()

    def release(self, slots: Any) -> None:
        """Finished slots let go of their prompts (a prompt's pool blocks are free once no slot reads them)."""
        self.pool.release(np.atleast_1d(np.asarray(slots, np.int32)))

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
        images: Any = None,
    ) -> tuple[PrefillResult, ResultTokens]:
        """Prefills one prompt ([P]) or a batch ([B, P], right-padded) of `true_length` real tokens each; with an
        `existing_prefix` (of as many rows), appends them to it instead: the result is the prefix of the joined
        prompts, computed without re-running the existing part. Returns the prefix and each prompt's first token (the
        token `insert` gives its sample 0) with its logprob, drawn with `sampler` (default greedy) and the keys of
        `request_id` (default the row index). A vision-language model reads each row's `images` [rows, images per
        row, channels, height, width] in place of its image placeholders (`prefill_forward`; not with
        `existing_prefix`)."""
        sampler = sampler or SamplingParams(temperature=0.0)
        tokens = np.atleast_2d(np.asarray(padded_tokens, np.int32))
        lengths = np.atleast_1d(np.asarray(true_length, np.int32))
        rows = len(lengths)
        requests = np.arange(rows, dtype=np.int32) if request_id is None else np.atleast_1d(request_id)
        arrays = self._sampling_arrays(sampler, np.asarray(requests, np.int32))
        if existing_prefix is None:
            for n in lengths:
                self.bucket(int(n))
            shapes = (tokens.shape, None if images is None else np.shape(images))
            with self._counting("prefill", shapes, SamplerKind.of(sampler)):
                prefix, first = self._prefill(params, tokens, lengths, *arrays, images, kind=SamplerKind.of(sampler))
        elif images is not None:
            raise SamplingError("prefill: images with an existing_prefix; images enter only a prompt's first prefill")
        else:
            total = np.asarray(existing_prefix.cache.lengths) + lengths
            for n in total:
                self.bucket(int(n))
            width = existing_prefix.cache.keys[0].shape[1]
            if width + tokens.shape[1] > self._max_prefill:  # keep the joined prefix within the prefill limit
                tokens = tokens[:, : max(int(lengths.max()), self._max_prefill - width)]
            with self._counting("prefill", "extend", width, tokens.shape, SamplerKind.of(sampler)):
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
        the rows past R are padding. A row's tokens go to its slot's own blocks, so `starts[i]` must be at least the
        slot's prompt length, and the positions past the prompt must fit the slot's own blocks."""
        tokens = np.atleast_2d(np.asarray(padded_tokens, np.int32))
        lengths = np.atleast_1d(np.asarray(true_length, np.int32))
        starts = np.atleast_1d(np.asarray(starts, np.int32))
        slot_ids = np.atleast_1d(np.asarray(slots, np.int32))
        real = (slot_ids >= 0) & (slot_ids < self._slots)
        prompts = np.where(real, self.pool.prompt_lengths[np.clip(slot_ids, 0, self._slots - 1)], 0)
        own_end = np.where(real, starts + lengths - prompts, 1)
        if lengths.min() < 1 or (starts < prompts).any() or own_end.max() > self.cache.own_capacity:
            rows = np.stack([slot_ids, starts, lengths, prompts], axis=1).tolist()
            raise SamplingError(
                f"extend: rows [slot, start, tokens, prompt length] {rows}; expected at least one token per row, a"
                f" start at or past the slot's prompt and at most {self.cache.own_capacity} positions past it (the"
                " slot's own blocks)"
            )
        steps = np.full(len(slot_ids), -1, np.int32) if steps is None else np.atleast_1d(np.asarray(steps, np.int32))
        reach = -(-int(own_end.max()) // self.block)  # own blocks the rows reach
        shape = self.extend_shapes.choose(len(slot_ids), int(lengths.max()), reach, kind)
        arrays = pad_extend(shape, self._slots, slot_ids, tokens, lengths, starts, steps)
        with self._counting("extend", shape):
            return self._extend(params, decode_state, *arrays, kind=kind, live=shape.live)

    def insert(
        self, prefix: PrefillResult, decode_state: DecodeState, slot: Any, rows: Any = None, sample_ids: Any = None
    ) -> DecodeState:
        """Inserts prefix rows (default: row i into slot[i]) into slots, sample `sample_ids` of each (default 0): the
        slots read the rows' prompts from the pool (one copy per row and data shard, shared by its slots)."""
        state, _ = self.insert_samples(prefix, decode_state, slot, rows, sample_ids)
        return state

    def insert_samples(
        self, prefix: PrefillResult, decode_state: DecodeState, slot: Any, rows: Any = None, sample_ids: Any = None
    ) -> tuple[DecodeState, ResultTokens]:
        """`insert` that also returns each inserted sample's first token and its logprob."""
        slots = np.atleast_1d(np.asarray(slot, np.int32))
        rows = np.arange(len(slots), dtype=np.int32) if rows is None else np.asarray(rows, np.int32)
        samples = np.zeros(len(slots), np.int32) if sample_ids is None else np.asarray(sample_ids, np.int32)
        width = prefix.cache.keys[0].shape[1]
        placement = self._placement(np.asarray(prefix.cache.lengths), slots, rows, width)
        with self._counting("insert", prefix.cache.keys[0].shape, len(slots)):
            return self._insert(prefix, decode_state, slots, rows, samples, placement, kind=ALL_FILTERS)

    def generate(
        self, params: Any, decode_state: DecodeState, kind: SamplerKind = ALL_FILTERS, context: int | None = None
    ) -> tuple[DecodeState, ResultTokens]:
        """One token for every slot (`kind` leaves filters that no slot uses out of the compiled step). `context`, when
        given, bounds every active slot's positions past its prompt after this step (its whole length bounds them
        too): only the own blocks up to it are attended over, and only the prompt blocks of the longest prompt that
        a slot holds (empty and released slots may compute garbage)."""
        live = self.blocks if context is None else min(self.blocks, max(1, -(-context // self.block)))
        prompt_live = min(self.prompt_blocks, -(-int(self.pool.prompt_lengths.max()) // self.block))
        readers = self.pool.reader_width()
        with self._counting("generate", kind, live, prompt_live, readers):
            return self._generate(
                params, decode_state, kind=kind, live=live, prompt_live=prompt_live, prompt_readers=readers
            )

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
        images: np.ndarray | None = None,
    ) -> tuple[DecodeState, ResultTokens]:
        """`prefill` (with `images`, as there) then `insert` in one compiled call (what `OfflineGenerator` uses)."""
        arrays = self._sampling_arrays(sampling, request_ids)
        placement = self._placement(lengths, slots, rows, tokens.shape[1])
        shapes = (tokens.shape, None if images is None else images.shape)
        with self._counting("prefill_insert", shapes, len(slots), SamplerKind.of(sampling)):
            return self._prefill_insert(
                params, decode_state, tokens, lengths, *arrays, slots, rows, sample_ids, placement, images,
                kind=SamplerKind.of(sampling),
            )  # fmt: skip

    def _placement(self, lengths: np.ndarray, slots: np.ndarray, rows: np.ndarray, width: int) -> Placement:
        """The pool blocks of an insert of prefill rows padded to `width` (`PromptPool.placement`)."""
        return self.pool.placement(lengths, slots, rows, -(-width // self.block), self.prompt_blocks)

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
