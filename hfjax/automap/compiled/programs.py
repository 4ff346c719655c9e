"""The compiled programs of an RL run at its config's shapes, lowered with abstract weights over any devices (a
target's compile-only devices, or this machine's), with what each needs per device.

Each program is the one the workers run, built by the same functions (`actor_loss`, `critic_loss`, the train state's
gradient and optimizer programs, the row programs of log probs and values, the engine's prefill and decode), at the
largest shapes a run of the config reaches: a micro-batch of `micro_batch_size` rows of `max_prompt_length +
response_length` tokens (with `packed_row_tokens`: one packed row of that many tokens per batch part), the engine's
`rollout.slots` and its longest prefill bucket. The weights are
`jax.ShapeDtypeStruct`s: nothing is allocated, so a 70B model compiles on a laptop.

Each program comes as a `ProgramTrace` (the traced program, or what tracing it raised: one program's failure to
trace is its own, the programs after it are still traced): `measure` compiles it for its devices, and
`traced.lower(lowering_platforms=(...))` lowers it for a platform without its compiler (`jax.export`'s path).
`ProgramMemory` holds what the compiler says (arguments, outputs, aliased outputs, temporaries: bytes per device) and
what the run keeps on the device outside the program while it runs (`resident`: the optimizer state during a
gradient program, the reference weights, the master copy during generation, ...). `peak` adds them up.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hfjax.automap.compiled.batches import image_shape, micro_batch, sequence_batch, with_seed_column
from hfjax.config.rl import RLConfig
from hfjax.models.config import ModelConfig
from hfjax.models.lora import LoraConfig, LoraParam, add_lora
from hfjax.models.model_io import ALL_BUT_THE_TOWER, abstract_policy
from hfjax.models.moe import set_expert_capacity
from hfjax.models.transformer import set_remat
from hfjax.models.vision_lm import (
    VisionLanguageConfig,
    language_model,
)
from hfjax.optim.optimizer import make_optimizer
from hfjax.optim.train_state import abstract_optimizer_state, apply_program, frozen, grad_program, split_trained
from hfjax.parallel.layout import Layout
from hfjax.rollout import JaxEngine
from hfjax.rollout.interface import prefill_buckets
from hfjax.rollout.sampling import SamplerKind
from hfjax.workers.actor import actor_loss, logprob_rows, ref_logprob_rows
from hfjax.workers.critic import critic_loss, response_values
from hfjax.workers.generation import sampling_params
from hfjax.workers.model_role import rows_program
from hfjax.workers.reward_model import sequence_scores
from hfjax.workers.sequences import ROUTED_EXPERTS


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """One compiled program's bytes per device (from `compiled.memory_analysis()`), the bytes its group keeps on the
    device outside it while it runs, its FLOPs per device and its compile time."""

    group: str
    program: str
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    resident: int
    flops: float
    compile_seconds: float

    @property
    def peak(self) -> int:
        """Bytes per device while the program runs: its buffers (donated outputs counted once) plus the residents."""
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.resident


def bytes_per_device(tree: Any) -> int:
    """The bytes one device holds of a tree of arrays or `ShapeDtypeStruct`s with shardings (its largest shard)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


@dataclasses.dataclass(frozen=True)
class ProgramTrace:
    """A traced program of a run (`traced`: a `jax.stages.Traced`), its group, and the bytes its group keeps resident
    beside it; or, where tracing it raised, `error` (which `traced` raises again)."""

    group: str
    program: str
    result: Any = dataclasses.field(repr=False)
    resident: int
    error: Exception | None = None

    @classmethod
    def of(cls, group: str, program: str, trace: Callable[[], Any], resident: int) -> ProgramTrace:
        """The program that `trace()` traces, traced now; what it raises is kept as the program's `error`."""
        try:
            return cls(group, program, trace(), resident)
        except Exception as error:
            return cls(group, program, None, resident, error)

    @property
    def traced(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


def measure(trace: ProgramTrace) -> ProgramMemory:
    """Compiles a traced program for its devices (raising what tracing it raised) and reads its memory and cost."""
    group, program, resident, traced = trace.group, trace.program, trace.resident, trace.traced
    started = time.perf_counter()
    compiled = traced.lower().compile()
    seconds = time.perf_counter() - started
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    return ProgramMemory(
        group,
        program,
        int(memory.argument_size_in_bytes),
        int(memory.output_size_in_bytes),
        int(memory.alias_size_in_bytes),
        int(memory.temp_size_in_bytes),
        int(resident),
        float(cost.get("flops", 0.0)),
        seconds,
    )


@dataclasses.dataclass
class AbstractModel:
    """A model's graph, its parameters as `ShapeDtypeStruct`s sharded by `layout`, the rest of its state, and the
    type of the parameters it trains (`LoraParam` with adapters: the base frozen in `dtype`)."""

    graphdef: Any
    params: Any
    rest: Any
    layout: Layout
    trainable: nnx.filterlib.Filter = nnx.Param

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        head: str,
        layout: Layout,
        dtype: str,
        param_dtype: str | None,
        remat: str = "none",
        lora: LoraConfig | None = None,
        expert_capacity_factor: float | None = None,
        base_layout: Layout | None = None,
        vision: VisionLanguageConfig | None = None,
        freeze_vision_tower: bool = False,
        images_per_step: int = 0,
    ) -> AbstractModel:
        """`base_layout`: where a LoRA model's frozen base lives, when not in `layout` (`rollout.lora_base_layout`);
        `vision`: a vision-language policy's config (`config` its language model's), its tower kept as loaded with
        `freeze_vision_tower`."""
        with_lora = lora is not None and lora.enabled
        model = abstract_policy(config, head, dtype, dtype if with_lora else param_dtype, vision, images_per_step)
        set_remat(language_model(model), remat)
        set_expert_capacity(model, expert_capacity_factor)
        if with_lora:
            add_lora(model, lora)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        if with_lora and base_layout is not None:
            adapters, base = nnx.split_state(params, LoraParam, ...)
            abstract = nnx.merge_state(_sharded(adapters, layout), _sharded(base, base_layout))
        else:
            abstract = _sharded(params, layout)
        trainable = LoraParam if with_lora else ALL_BUT_THE_TOWER if freeze_vision_tower else nnx.Param
        return cls(graphdef, abstract, rest, layout, trainable)

    def trained_and_rest(self) -> tuple[Any, Any]:
        """(the trained parameters, the rest of the model's state), as the gradient program takes them."""
        return split_trained(self.params, self.rest, self.trainable)

    @property
    def shardings(self) -> Any:
        return jax.tree.map(lambda x: x.sharding, self.params)

    def cast(self, dtype: str | None, layout: Layout | None = None) -> Any:
        """The parameters in `dtype` (the generation copy; None: each in its own), sharded by `layout` (default:
        this model's)."""
        layout = layout or self.layout
        if layout is self.layout:
            shardings = self.shardings
        else:
            per_param = layout.shardings(self.params)
            shardings = jax.tree.map(lambda s, p: jax.tree.map(lambda _: s, p), per_param, self.params)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype or x.dtype), sharding=s), self.params, shardings
        )


def _sharded(params: Any, layout: Layout) -> Any:
    """`params` as `ShapeDtypeStruct`s sharded by `layout`."""
    per_param = layout.shardings(params)
    shardings = jax.tree.map(lambda s, p: jax.tree.map(lambda _: s, p), per_param, params)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings)


def base_layout(cfg: RLConfig, gen_layout: Layout) -> Layout | None:
    """Where the actor's frozen LoRA base lives when not in its training layout: the generation layout, where a
    colocated rollout keeps it (`RLConfig.keeps_lora_base_in_gen`); None otherwise."""
    return gen_layout if cfg.keeps_lora_base_in_gen else None


def _train_programs(
    group: str,
    model: AbstractModel,
    optimizer: Any,
    grad_clip: float,
    loss_fn: Callable[..., Any],
    batch: dict[str, Any],
    resident: int,
) -> Iterator[ProgramTrace]:
    """The loss-and-gradient program of one micro-batch (the optimizer state and the gradient accumulator resident)
    and the optimizer step (donating parameters and state)."""
    trained, rest = model.trained_and_rest()
    opt_state = abstract_optimizer_state(optimizer, trained, model.layout)
    grads = bytes_per_device(trained)
    frozen_bytes = bytes_per_device(model.params) - grads  # a LoRA base: resident beside the trained parameters
    trained_shardings = jax.tree.map(lambda x: x.sharding, trained)
    trace = functools.partial(
        grad_program().trace,
        trained,
        rest,
        batch,
        graphdef=model.graphdef,
        loss_fn=loss_fn,
        static=(),
        shardings=frozen(trained_shardings),
        layout=model.layout,
    )
    yield ProgramTrace.of(group, "loss+grad", trace, resident + bytes_per_device(opt_state) + grads)
    state_shardings = frozen((trained_shardings, jax.tree.map(lambda x: x.sharding, opt_state)))
    trace = functools.partial(
        apply_program().trace, trained, opt_state, trained, optimizer=optimizer, grad_clip=grad_clip,
        shardings=state_shardings,
    )  # fmt: skip
    yield ProgramTrace.of(group, "optimizer step", trace, resident + frozen_bytes)


def _rows_program(
    group: str, name: str, model: AbstractModel, params: Any, fn: Callable[..., Any], batch: dict, resident: int
) -> ProgramTrace:
    def trace() -> Any:
        return rows_program(model.graphdef, model.rest, model.layout, fn).trace(params, batch)

    return ProgramTrace.of(group, name, trace, resident)


def actor_resident(
    cfg: RLConfig, shape: ModelConfig, layout: Layout, gen_layout: Layout, vision: VisionLanguageConfig | None = None
) -> int:
    """What the policy keeps on each device between its programs: master weights (with LoRA: the base, in its
    `base_layout`, and the adapters), optimizer state, reference (with LoRA: none, the base serves)."""
    actor = cfg.actor
    policy = AbstractModel.build(
        shape, "causal_lm", layout, actor.dtype, actor.param_dtype, lora=actor.lora,
        base_layout=base_layout(cfg, gen_layout), vision=vision, freeze_vision_tower=actor.freeze_vision_tower,
    )  # fmt: skip
    opt_state = abstract_optimizer_state(make_optimizer(actor.optim, None), policy.trained_and_rest()[0], layout)
    ref = _reference(cfg, policy)
    return bytes_per_device((policy.params, opt_state)) + (bytes_per_device(ref) if ref is not None else 0)


def _reference(cfg: RLConfig, policy: AbstractModel) -> Any:
    """The reference copy of the policy's weights, or None: no reference, or a LoRA policy (its base serves)."""
    if not cfg.uses_ref or cfg.actor.lora.enabled:
        return None
    return policy.cast(cfg.actor.dtype)


def critic_resident(cfg: RLConfig, shape: ModelConfig, layout: Layout) -> int:
    """What the critic keeps on each device between its programs: weights and optimizer state."""
    model = AbstractModel.build(shape, "token_cls", layout, cfg.critic.dtype, cfg.critic.param_dtype)
    return bytes_per_device(
        (model.params, abstract_optimizer_state(make_optimizer(cfg.critic.optim, None), model.params, layout))
    )


def actor_programs(
    cfg: RLConfig,
    shape: ModelConfig,
    layout: Layout,
    gen_layout: Layout,
    others: int = 0,
    vision: VisionLanguageConfig | None = None,
) -> Iterator[ProgramTrace]:
    """The policy group's programs: the actor's update, its log-prob pass, the reference's, and generation;
    `others`: bytes per device that colocated roles keep meanwhile; `vision`: a vision-language policy's config
    (every pass reads the rows' images, `images_per_row` each)."""
    actor, rollout = cfg.actor, cfg.rollout
    response = rollout.response_length
    lora = actor.lora.enabled
    policy = AbstractModel.build(
        shape,
        "causal_lm",
        layout,
        actor.dtype,
        actor.param_dtype,
        actor.remat,
        actor.lora,
        expert_capacity_factor=actor.expert_capacity_factor,
        base_layout=base_layout(cfg, gen_layout),
        vision=vision,
        freeze_vision_tower=actor.freeze_vision_tower,
        images_per_step=actor.images_per_step,
    )
    optimizer = make_optimizer(actor.optim, None)
    opt_bytes = bytes_per_device(abstract_optimizer_state(optimizer, policy.trained_and_rest()[0], layout))
    ref = _reference(cfg, policy)
    ref_bytes = (bytes_per_device(ref) if ref is not None else 0) + others
    extra = ["advantages", "old_log_probs", "response_mask"] + (["ref_log_prob"] if actor.use_kl_loss else [])
    routes = shape if actor.router_replay else None
    images = None if vision is None else image_shape(cfg, vision)
    batch = with_seed_column(micro_batch(cfg, actor, layout, extra, routes, images), actor, layout)
    loss_fn = functools.partial(actor_loss, actor, rollout.temperature, response)
    yield from _train_programs("actor", policy, optimizer, actor.optim.grad_clip, loss_fn, batch, ref_bytes)
    rows = micro_batch(cfg, actor, layout, (), routes, images)
    logprob = functools.partial(logprob_rows, rollout.temperature)
    yield _rows_program("actor", "log probs", policy, policy.params, logprob, rows, opt_bytes + ref_bytes)
    if cfg.uses_ref:  # the reference copy, or a LoRA policy's base (the adapters off)
        ref_logprob = functools.partial(ref_logprob_rows, rollout.temperature)
        params, resident = (policy.params, opt_bytes) if lora else (ref, bytes_per_device(policy.params) + opt_bytes)
        own_routes = {k: v for k, v in rows.items() if k != ROUTED_EXPERTS}  # the reference routes itself
        yield _rows_program("actor", "ref log probs", policy, params, ref_logprob, own_routes, resident)
    # generation: the cast copy in the generation layout; the master stays where it is kept in another dtype (a LoRA
    # base is in the compute dtype already and its adapters are cast where they are used: nothing stays behind)
    gen_params = policy.cast(None if lora else actor.dtype, gen_layout)
    cast = not lora and jnp.dtype(actor.param_dtype) != jnp.dtype(actor.dtype)
    # `rollout.offload_optimizer` parks the optimizer state, and a master that generation casts, in host memory
    master = bytes_per_device(policy.params) if cast and not rollout.offload_optimizer else 0
    optimizer_resident = 0 if rollout.offload_optimizer else opt_bytes
    yield from engine_programs(cfg, shape, gen_layout, gen_params, master + optimizer_resident + ref_bytes, vision)


def engine_programs(
    cfg: RLConfig,
    shape: ModelConfig,
    layout: Layout,
    params: Any,
    resident: int,
    vision: VisionLanguageConfig | None = None,
) -> Iterator[ProgramTrace]:
    """The engine's fused prefill-and-insert at its longest bucket with every slot's row (the most the generator
    prefills in one call; with `vision`, the rows' images too) and its decode step over every cache block, with the
    decode state as an argument (the engine built by the first trace: an error building it is each one's)."""
    rollout = cfg.rollout

    @functools.cache
    def engine_and_state() -> tuple[JaxEngine, Any]:
        policy = abstract_policy(shape, "causal_lm", cfg.actor.dtype, None, vision, cfg.actor.images_per_step)
        model = add_lora(policy, cfg.actor.lora)
        engine = JaxEngine(
            model, layout, max_concurrent_decodes=rollout.slots, max_prefill_length=cfg.data.max_prompt_length,
            max_new_tokens=rollout.response_length, prompt_cache_tokens=rollout.prompt_cache_tokens,
            record_experts=cfg.actor.router_replay,
        )  # fmt: skip
        return engine, engine.abstract_decode_state()

    sampling = sampling_params(rollout, {})
    kind = SamplerKind.of(sampling)
    rows = 1 << (rollout.slots.bit_length() - 1)  # the generator's largest power-of-two prefill call
    length = prefill_buckets(cfg.data.max_prompt_length)[-1]

    def ints(*shape: int, dtype: Any = jnp.int32) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype)

    sampling_args = (ints(rows), ints(rows), ints(rows, dtype=jnp.float32), ints(rows), ints(rows, dtype=jnp.float32))

    def prefill() -> Any:
        engine, state = engine_and_state()
        placement = engine.abstract_placement(rows, length, rows)
        images = None if vision is None else ints(rows, *image_shape(cfg, vision), dtype=jnp.float32)
        return engine._prefill_insert.trace(
            params, state, ints(rows, length), ints(rows), *sampling_args, ints(rows), ints(rows), ints(rows),
            placement, images, kind=kind,
        )  # fmt: skip

    def decode() -> Any:
        engine, state = engine_and_state()
        return engine._generate.trace(params, state, kind=kind, live=engine.blocks)

    yield ProgramTrace.of("rollout", f"prefill {rows} x {length}", prefill, resident)
    yield ProgramTrace.of("rollout", f"decode {rollout.slots} slots", decode, resident)


def critic_programs(cfg: RLConfig, shape: ModelConfig, layout: Layout, others: int = 0) -> Iterator[ProgramTrace]:
    """The critic's update and its value pass; `others`: bytes per device that colocated roles keep meanwhile."""
    critic, response = cfg.critic, cfg.rollout.response_length
    model = AbstractModel.build(
        shape,
        "token_cls",
        layout,
        critic.dtype,
        critic.param_dtype,
        critic.remat,
        expert_capacity_factor=critic.expert_capacity_factor,
    )
    optimizer = make_optimizer(critic.optim, None)
    batch = with_seed_column(micro_batch(cfg, critic, layout, ("values", "returns", "response_mask")), critic, layout)
    loss_fn = functools.partial(critic_loss, critic, response)
    yield from _train_programs("critic", model, optimizer, critic.optim.grad_clip, loss_fn, batch, others)
    rows = micro_batch(cfg, critic, layout, ())
    opt_bytes = bytes_per_device(abstract_optimizer_state(optimizer, model.params, layout))

    def values(m: Any, b: dict) -> dict:
        return {"values": response_values(m, b)}

    yield _rows_program("critic", "values", model, model.params, values, rows, opt_bytes + others)


def scorer_resident(shape: ModelConfig, dtype: str, layout: Layout) -> int:
    """What a reward or cost model keeps on each device: its weights."""
    return bytes_per_device(AbstractModel.build(shape, "seq_cls", layout, dtype, None).params)


def scorer_programs(
    cfg: RLConfig, name: str, shape: ModelConfig, section: Any, layout: Layout, others: int = 0
) -> Iterator[ProgramTrace]:
    """A reward or cost model's scoring pass over a micro-batch of whole sequences."""
    model = AbstractModel.build(shape, "seq_cls", layout, section.dtype, None)
    rows = sequence_batch(layout, section.micro_batch_size, cfg.data.max_prompt_length, cfg.rollout.response_length, ())
    yield _rows_program(name.removesuffix("_model"), "scores", model, model.params, sequence_scores, rows, others)
