"""Memory per device in the cost model (`hfjax.predict.cost`): its precision and memory assumptions (`CostOptions`)
and the terms (`MemoryTerms`, which `CostModel` extends), as hfjax's trainers hold them.

A trained role keeps its master copy (`master_bytes`, float32 by default), Adam's two moments in float32 and
gradients in the master's dtype (twice from a step's second micro-batch on: the accumulator and the micro-batch's
own); a frozen role (reference, reward) keeps its parameters in the compute dtype (`param_bytes`); a LoRA actor
(`CostOptions.actor_lora`) keeps its base in the compute dtype and float32 adapters with their moments and gradients,
and its reference is that base (no copy), kept in its generation layout all iteration (`CostOptions.lora_base_in_gen`,
then only the adapters move); the actor's generation copy in the compute dtype is extra while it generates (the
whole copy when it is a cast of the master, else what the generation shard adds to the training shard), and so is
its KV cache. Parameter shards come from the layout's rules (`ModelShape.shard_elements`), so a `sequence` axis
splits the weights with `fsdp`.
Activations of a pass over micro-batches of m rows per data-parallel rank (`activation_bytes`), with a `sequence`
axis of N (N = 1 without one) splitting each row's S positions, so that a device holds T = m S / N tokens:
- per decoder layer, T tokens of what hfjax's layer keeps for its backward in bf16 (`layer_activation_bytes`: 14 d +
  (10 d + 2 k m_w) / t bytes a token, d the width, m_w the MLP width, t the tensor size: the float32 norms, q/k/v,
  rotary, attention and k of the four SwiGLU tensors, as the platform's compiler keeps them,
  `CostOptions.mlp_tensors`: 2 on a GPU, 3 on a TPU, 4 on CPU, measured in `sizes.MLP_TENSORS_KEPT`);
- with N > 1, per layer also what the split attention holds (`split_attention_bytes`): the keys and values of the
  whole rows gathered over the axis, 2 m S (k / t) e c bytes for k kv heads of size e and c the compute dtype's size,
  and then by the path it runs (`CostOptions.split_attention`): the splash kernels per position shard (TPU) nothing
  more; cuDNN per position shard (GPU, in a 2-byte dtype, heads up to 128 wide) the mask of the device's queries against
  all S keys that jax hands it as a bias in the compute dtype, c m (S / N) S bytes, twice in the layer a training pass
  back-propagates (its gradient); xla (`split_positions_attention`: CPU, any other case, and any model with score
  soft-capping) the float32 probabilities of the device's queries against all S keys and their copy in the compute
  dtype, (4 + c) m (h / t) (S / N) S bytes for h query heads. Without the axis no scores are counted: the kernels of
  whole rows (cuDNN, splash) hold none (the xla attention of XLA:CPU does);
- a training pass keeps every layer's activations, or with recomputation only each layer's input (T d c bytes a
  layer), beside the one layer it computes; a log-prob pass holds one layer;
- one chunk of the LM head's float32 logits, LOGITS_CHUNK_TOKENS response tokens a device, or all m R / N of them
  (R of a row) where they take at most LOGITS_BUDGET_BYTES (kept from the forward for the backward), twice in a
  training pass (the logits and their gradient), and the head's whole-vocabulary buffers
  (`hfjax.models.lm_head`): its kernel gathered in the compute dtype, c V E / t bytes for V the padded vocabulary
  and E the width, and in a training pass also the float32 kernel-gradient each device accumulates, 4 V E / t.
A mixture of experts' buffers (its MLP FLOPs and activations: `ModelShape.matmul_params_at`, `mlp_width`) hold
`factor x k / experts` of a row per expert under a capacity factor in the passes that route themselves (the
reference's, and the actor's without routing replay), and the whole row per expert in the dropless ones: generation,
and the actor's update and log-prob passes when they replay generation's routes (`router_replay`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Literal

from hfjax.models.lm_head import LOGITS_BUDGET_BYTES, LOGITS_CHUNK_TOKENS
from hfjax.models.lora import LoraConfig
from hfjax.predict.dataflow import Dataflow, ModelShape, Workload
from hfjax.predict.sizes import (
    GEN_RULES,
    MLP_TENSORS_KEPT,
    TRAIN_RULES,
    Sizes,
    layer_activation_bytes,
    layer_inference_bytes,
    layout_of,
    mlp_width,
)


@dataclasses.dataclass(frozen=True)
class CostOptions:
    """Precision and memory assumptions: `param_bytes` of the compute dtype (activations, frozen roles, the
    generation copy, the KV cache, collectives of parameters), `master_bytes` of a trained role's stored parameters
    and gradients, `optimizer_bytes` of its optimizer state per parameter (Adam's two float32 moments)."""

    param_bytes: int = 2
    master_bytes: int = 4
    optimizer_bytes: int = 8
    # each layer keeps only its input for the backward (the paper's setting, for searches; a run's config says what
    # its code does: `run_cost_options` sets it from `actor.remat`)
    remat: bool = True
    usable_memory_fraction: float = 0.9
    # the actor's LoRA adapters (`actor.lora`; None: full fine-tuning): the base in `param_bytes`, float32 adapters
    # with their gradients and optimizer state, and no reference copy (the base serves)
    actor_lora: LoraConfig | None = None
    # a LoRA actor's base stays in the generation layout (`rollout.lora_base_layout: gen`): its generation shard is
    # resident while it trains too, and the train -> gen transition moves the adapters alone (memory and the
    # transition only: the training and log-prob passes are still priced with the training layout's gathers)
    lora_base_in_gen: bool = True
    critic_lora: LoraConfig | None = None  # the critic's (`critic.lora`), counted as the actor's
    freeze_vision_tower: bool = False  # a vision-language actor's tower kept as loaded (`actor.freeze_vision_tower`)
    # a mixture of experts' capacity factor in the training and log-prob passes that route themselves
    # (`actor.expert_capacity_factor`; None: no token dropped, every expert's buffer spans the row); generation never
    # drops a token
    expert_capacity_factor: float | None = None
    # the actor's update and log-prob passes replay generation's routes (`actor.router_replay`): dropless whatever
    # the capacity factor (every expert generation used is kept), which then caps the reference's pass alone
    router_replay: bool = False
    # the actor's optimizer state (and a master that generation casts) waits in host memory while it generates
    # (`rollout.offload_optimizer`)
    offload_optimizer: bool = False
    # how attention runs under a sequence axis (`run_cost_options` sets it from `trainer.device`): "splash", the
    # Pallas kernels per position shard (TPU): no score block, each device's kernel skips the keys past its queries;
    # "cudnn", per position shard (GPU): products over every key and a bias of the queries against every key; "xla"
    # (CPU): products over every key and a float32 score block per layer
    split_attention: Literal["xla", "splash", "cudnn"] = "xla"
    # MLP-width tensors a decoder layer keeps for its backward (`sizes.MLP_TENSORS_KEPT` by platform; CPU's by
    # default)
    mlp_tensors: int = MLP_TENSORS_KEPT["cpu"]


class MemoryTerms:
    """The memory terms of a cost model of `flow` for `workload` under `options` (the attributes its subclass,
    `CostModel`, sets)."""

    flow: Dataflow
    workload: Workload
    options: CostOptions

    def _passes(self, seqs: int, sizes: Sizes) -> tuple[int, int]:
        """(micro-batches, sequences per micro-batch) one data-parallel rank runs for `seqs` sequences."""
        local = math.ceil(seqs / sizes.batch_parts)
        micro = math.ceil(local / self.workload.micro_batch_seqs)
        return micro, math.ceil(local / micro)

    def capacity_factor(self, role: str) -> float | None:
        """The experts' capacity factor that `role`'s update and log-prob passes are priced with:
        `expert_capacity_factor`, except the actor's under `router_replay` (they replay generation's routes, dropless:
        None, each expert's buffer spans the row). The reference routes itself, so the factor still caps it."""
        opt = self.options
        return None if role == "actor" and opt.router_replay else opt.expert_capacity_factor

    def split_attention(self, shape: ModelShape) -> Literal["xla", "splash", "cudnn"]:
        """How attention under a sequence axis runs for `shape` (`CostOptions.split_attention`): as xla with score
        soft-capping, which only xla does, and on the cuDNN path where cuDNN does not take the model (a 4-byte
        compute dtype, heads wider than 128 or not a multiple of 8, as `hfjax.models.attention.cudnn_supported`)."""
        path, cfg = self.options.split_attention, shape.config
        if cfg.attn_softcap is not None:
            return "xla"
        if path == "cudnn" and (self.options.param_bytes != 2 or cfg.head_dim > 128 or cfg.head_dim % 8):
            return "xla"
        return path

    def split_attention_bytes(self, shape: ModelShape, sizes: Sizes, rows: int, backward: bool = False) -> float:
        """Bytes per device that one layer's attention holds for `rows` rows per rank whose positions a `sequence`
        axis splits (0 without the axis): the keys and values gathered over the axis and what its path holds of the
        device's queries against every key, with `backward` also their gradients in the layer's backward (the
        module docstring gives the terms)."""
        n = sizes.sequence
        if n == 1:
            return 0.0
        cfg, c, S, t = shape.config, self.options.param_bytes, self.workload.seq_len, sizes.tensor
        keys_values = 2 * rows * S * cfg.num_kv_heads / t * cfg.head_dim * c
        queries_keys = rows * (S / n) * S
        path = self.split_attention(shape)
        if path == "splash":
            return keys_values
        if path == "cudnn":
            return keys_values + (2 if backward else 1) * c * queries_keys
        return keys_values + (4 + c) * queries_keys * cfg.num_heads / t

    def activation_bytes(self, shape: ModelShape, sizes: Sizes, seqs: int, training: bool, role: str) -> float:
        """Activation bytes per device of a training or log-prob pass over `seqs` sequences (the module docstring
        gives the terms)."""
        cfg, opt, w = shape.config, self.options, self.workload
        _, m = self._passes(seqs, sizes)
        tokens = m * w.seq_len / sizes.sequence  # the device's positions of its rows
        width = mlp_width(cfg, self.capacity_factor(role))
        layer = tokens * layer_activation_bytes(cfg.hidden_size, width, sizes.tensor, opt.mlp_tensors)
        layer += self.split_attention_bytes(shape, sizes, m)  # what a layer holds for its backward
        # the LM head's log probs run a chunk of LOGITS_CHUNK_TOKENS response tokens at a time (float32 logits), or all
        # of them at once where they fit LOGITS_BUDGET_BYTES, beside its kernel gathered whole along the width and,
        # in training, its float32 kernel-gradient accumulator
        head, vocab_width = shape.head == "causal_lm", cfg.padded_vocab_size * cfg.hidden_size / sizes.tensor
        responses = m * w.response_len / sizes.sequence
        whole = responses * cfg.padded_vocab_size * 4 / sizes.tensor
        chunked = whole * min(1.0, LOGITS_CHUNK_TOKENS / max(responses, 1.0))
        logits = 0.0 if not head else whole if whole <= LOGITS_BUDGET_BYTES else chunked
        if not training:
            return layer + logits + (opt.param_bytes * vocab_width if head else 0.0)
        stash = tokens * cfg.hidden_size * opt.param_bytes * cfg.num_layers if opt.remat else layer * cfg.num_layers
        # the one layer in its backward also holds its attention's gradients (cuDNN's bias gradient)
        active = layer + self.split_attention_bytes(shape, sizes, m, True) - self.split_attention_bytes(shape, sizes, m)
        return stash + active + 2 * logits + ((4 + opt.param_bytes) * vocab_width if head else 0.0)

    def gen_extra_bytes(self, shape: ModelShape, train: Sizes, gen: Sizes) -> float:
        """Parameter bytes per device that generation adds: the whole generation shard when it is a cast copy of
        the master (which stays), else what it adds over the training shard (the HybridEngine reuses that)."""
        opt = self.options
        gen_elems = shape.shard_elements(layout_of(gen, GEN_RULES))
        if opt.master_bytes != opt.param_bytes:
            return gen_elems * opt.param_bytes
        return (gen_elems - shape.shard_elements(layout_of(train, TRAIN_RULES))) * opt.param_bytes

    def generation_extra(self, shape: ModelShape, train: Sizes, gen: Sizes) -> float:
        """The parameter bytes per device that generation adds to what is resident: none for a LoRA base kept in
        the generation layout (`with_base_in_gen` counts it resident), else `gen_extra_bytes`."""
        return 0.0 if self.stationary_base() else self.gen_extra_bytes(shape, train, gen)

    def stationary_base(self) -> bool:
        """Whether the actor is LoRA with its base kept in the generation layout (`CostOptions.lora_base_in_gen`)."""
        lora = self.options.actor_lora
        return lora is not None and lora.enabled and self.options.lora_base_in_gen

    def offloaded_bytes(self, memory: Mapping[str, float]) -> float:
        """What the generating role of `memory` (its terms) parks in host memory while it generates
        (`offload_optimizer`): its optimizer state, and its master weights where generation reads a cast copy of
        them."""
        opt = self.options
        if not opt.offload_optimizer:
            return 0.0
        casts = opt.master_bytes != opt.param_bytes and not (opt.actor_lora and opt.actor_lora.enabled)
        return memory.get("optimizer", 0.0) + (memory["params"] if casts else 0.0)

    def prefill_bytes(self, shape: ModelShape, gen: Sizes) -> float:
        """Bytes per device that the engine's largest prefill call adds to the KV cache (the generator prefills at
        most the largest power of two of `kv_slots` rows at once): one layer's keys and values of its prompts (the
        pools are written one layer after another) and what one layer's forward holds at once over them
        (`layer_inference_bytes`). The cache is written in place, donated: no second copy of it counts. Compiled
        for v5e:2x4 with the scheduler at its leanest (`hfjax compile --lean`), the Llama-3.2-1B config's prefill of
        256 x 512 holds 0.89 GiB of temporaries; this gives 1.0 GiB."""
        w, cfg, opt = self.workload, shape.config, self.options
        rows = math.ceil((1 << (w.kv_slots.bit_length() - 1)) / gen.batch_parts)
        kv_layer = shape.kv_elements_per_token() * opt.param_bytes / gen.tensor / cfg.num_layers
        width = mlp_width(cfg, None)  # generation drops no token
        layer = layer_inference_bytes(cfg.hidden_size, width, gen.tensor) * opt.param_bytes / 2
        return rows * w.prompt_len * (kv_layer + layer)
