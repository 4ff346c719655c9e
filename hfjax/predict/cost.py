"""Cost model of one RL iteration (HybridFlow §6's simulators): seconds per role and stage, and memory per device.

A role's layout is `Sizes(data, fsdp, tensor, expert, sequence)` (`hfjax.predict.sizes`) on its group's devices (mesh
axes in the order data, fsdp, expert, sequence, tensor: tensor innermost, devices numbered host-major, so a group of
`span` consecutive devices talks over NVLink/ICI when it fits a host).
With P the matmul parameters, L layers, width d, S = prompt + response tokens, m sequences per micro-batch and
data-parallel rank, N the `sequence` size (1 without the axis: it splits each row's positions, so a device computes
m S / N tokens of a micro-batch), F achievable FLOP/s per device (at the width d/t each device's matmuls produce
under t-way tensor parallelism: `DeviceProfile.flops_at`):
- training, per token (6 + 2r) P + (3 + r) A FLOPs (r = 1 with full recomputation; A the attention's, over S/2 keys
  a query, the causal half; under a sequence axis over all S where it runs as xla or cuDNN, whose split products
  skip no key, or S (2N - 1) / 2N with the splash kernels per position shard, the last shard's: `attention_flops`),
  split over the group's devices; per micro-batch FSDP all-gathers the tensor-shard of the parameters twice and
  reduce-scatters gradients once over the fsdp x sequence devices that split the weights (overlapped with compute),
  data-parallel ranks all-reduce gradients once per optimizer step, and tensor parallelism all-reduces activations
  (m S d / N) 4 + 2r times per layer (on the critical path);
- inference: 2P + A per token, one FSDP gather and 2 tensor all-reduces per layer per micro-batch (the
  actor's old log-probs under its training layout, as the HybridEngine leaves it after generation);
- `sp`, under a sequence axis: each layer's attention all-gathers the keys and values of the micro-batch's rows over
  it (2 m S k e c / t bytes gathered, k kv heads of size e, c the compute dtype's bytes) once per forward, again in
  the recomputed forward, and reduce-scatters their gradients in the backward (2 + r per layer in training, 1 in
  inference; on the critical path);
- generation: prefill compute-bound; each decode step reads the actor's generation shard of the parameters
  plus the KV cache of its batch (memory-bound unless compute is slower), 2 tensor all-reduces per layer, and a
  fixed cost per layer (kernel launches, host work: `DeviceProfile.decode_layer_overhead_s`);
  the KV cache left over by resident state bounds the concurrent batch (more waves when it does not fit);
- train -> gen transition: the HybridEngine's bytes per device (`transition_bytes`: Table 2 where the training shard
  lies inside the generation shard, and gen -> train free; otherwise what no device order keeps in place, both ways);
- each role's call in a stage adds a fixed `DeviceProfile.call_overhead_s` (dispatch, host transfers, Python).
A ring collective over g devices costs (g-1)/g of the gathered bytes (twice for all-reduce) over the link's
bandwidth, plus a fixed latency per call. On a shared host (fake CPU devices: `DeviceProfile.shared_host`) a group
of g of the host's n devices runs at n/g times the per-device rates (measured with all n busy), collectives add
to compute instead of overlapping it, and the groups' stage seconds add up instead of taking their max.
Memory per device (`hfjax.predict.memory_terms`, whose docstring gives the terms): the parameters, gradients and
optimizer state of each role as its trainer holds them, the actor's generation copy and KV cache, and the
activations of the training and log-prob passes (a sequence axis divides them by N, and adds what its attention
holds).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from hfjax.models.lora import lora_parameter_count
from hfjax.predict.cluster import GIB, ClusterSpec
from hfjax.predict.dataflow import SCORING_ROLES, STAGES, Dataflow, ModelShape, Workload
from hfjax.predict.memory_terms import CostOptions, MemoryTerms
from hfjax.predict.sizes import GEN_RULES, TRAIN_RULES, Sizes, layout_of
from hfjax.predict.transition import transition_bytes

ROLLOUT = "rollout"  # the group of a disaggregated placement that only generates, with a copy of the actor's weights


@dataclasses.dataclass(frozen=True)
class RoleCost:
    """One role under one layout: seconds per stage, per-device bytes, and the terms behind them."""

    role: str
    sizes: Sizes
    seconds: dict[str, float]
    static_bytes: float  # resident all iteration: parameters (+ optimizer state when trained)
    transient_bytes: float  # peak extra while it trains or infers: gradients, activations, logits
    memory: dict[str, float]
    detail: dict[str, float]
    gen: Sizes | None = None

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


@dataclasses.dataclass(frozen=True)
class DeviceMapping:
    """Placement (groups of colocated roles with their device counts) and per-role layouts. A group of the single
    role `ROLLOUT` (a disaggregated placement) generates under `gen_layout` with its own copy of the actor's weights,
    and the actor's group does not generate."""

    groups: tuple[tuple[tuple[str, ...], int], ...]
    layouts: Mapping[str, Sizes]
    gen_layout: Sizes | None = None


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted seconds per stage and per iteration, with each role's cost and each group's peak bytes."""

    stage_seconds: dict[str, float]
    roles: dict[str, RoleCost]
    group_peak_bytes: tuple[float, ...]

    @property
    def iteration_seconds(self) -> float:
        return sum(self.stage_seconds.values())


def stage_seconds(groups: Sequence[Sequence[RoleCost]], concurrent: bool = True) -> dict[str, float]:
    """Per stage: the max over concurrently running groups of the sum of their roles' seconds (the sum over
    all groups when they are not `concurrent`)."""
    combine = max if concurrent else sum
    return {s: combine(sum(c.seconds[s] for c in costs) for costs in groups) for s in STAGES}


class InfeasibleError(ValueError):
    """A mapping that does not fit in device memory, or whose layouts do not match its groups."""


class CostModel(MemoryTerms):
    """Seconds and bytes of each role of `flow` on `cluster` for `workload`."""

    def __init__(self, cluster: ClusterSpec, flow: Dataflow, workload: Workload, options: CostOptions | None = None):
        self.cluster, self.flow, self.workload = cluster, flow, workload
        self.options = options or CostOptions()
        self.usable_bytes = cluster.device_memory_bytes * self.options.usable_memory_fraction
        self.shared = cluster.profile.shared_host
        self.concurrent_groups = not self.shared

    def share(self, devices: int) -> float:
        """Times its profile's rates a device of a group of `devices` runs at: n/g on a shared host of n, else 1."""
        per_host = self.cluster.devices_per_host
        return per_host / devices if self.shared and devices < per_host else 1.0

    def overlap(self, compute: float, communication: float) -> float:
        """Seconds of compute with communication that overlaps it (not on a shared host: the same cores)."""
        return compute + communication if self.shared else max(compute, communication)

    def shard_flops(self, shape: ModelShape, tensor: int) -> float:
        """FLOP/s of the model's matmuls with `tensor`-way tensor parallelism: the width each device computes is
        the hidden size over `tensor`."""
        return self.cluster.profile.flops_at(shape.config.hidden_size / tensor)

    def collective(self, kind: str, nbytes: float, group: int, span: int, calls: int = 1, share: float = 1.0) -> float:
        """Seconds of `calls` ring collectives moving `nbytes` in all (the gathered size) over `group` devices
        spanning `span` consecutive devices at `share` times the link bandwidth; `kind` is `gather`
        (all-gather/reduce-scatter) or `reduce`."""
        if group == 1:
            return 0.0
        profile = self.cluster.profile
        factor = (group - 1) / group * (2 if kind == "reduce" else 1)
        bandwidth = share * profile.bandwidth(self.cluster.link(span))
        return calls * profile.collective_latency_s + factor * nbytes / bandwidth

    def sequences(self, stage: str, role: str = "") -> int:
        """Sequences `role` processes in `stage` per iteration: ReMax's baseline rollouts are generated and
        scored, never trained on."""
        w = self.workload
        baseline = stage == "generation" or (stage == "inference" and role in SCORING_ROLES)
        return w.global_batch_prompts * (w.n_samples + (self.flow.baseline_rollouts if baseline else 0))

    def attention_flops(self, shape: ModelShape, sizes: Sizes) -> float:
        """Forward attention FLOPs per token of the slowest device: over the causal half of a row's keys (S/2);
        under a sequence axis of N, over all S on the xla and cuDNN paths (their products skip no key), and with the
        splash kernels per position shard over S (2N - 1) / 2N (the last shard's queries, which see the most keys)."""
        S, n = self.workload.seq_len, sizes.sequence
        if n == 1:
            return shape.attention_flops(S / 2)
        return shape.attention_flops(S * (2 * n - 1) / (2 * n) if self.split_attention(shape) == "splash" else S)

    def weight_gathers(self, sizes: Sizes) -> tuple[int, int]:
        """(devices, span) of the FSDP collectives: the fsdp x sequence devices that split the weights, spanning
        every mesh axis under `data`."""
        return sizes.fsdp * sizes.sequence, sizes.size // sizes.data

    def key_value_gathers(self, shape: ModelShape, sizes: Sizes, rows: int, per_layer: int) -> float:
        """Seconds of a micro-batch's `sp` collectives under a sequence axis: `per_layer` collectives per layer (an
        all-gather per forward, a reduce-scatter of the gradients per backward) of the keys and values of `rows`
        rows (their tensor shard) over the sequence devices, which sit just above `tensor` in the mesh."""
        cfg, n, t = shape.config, sizes.sequence, sizes.tensor
        nbytes = 2 * rows * self.workload.seq_len * cfg.num_kv_heads * cfg.head_dim * self.options.param_bytes / t
        calls = per_layer * cfg.num_layers
        return self.collective("gather", calls * nbytes, n, n * t, calls, self.share(sizes.size))

    def train(self, shape: ModelShape, sizes: Sizes, role: str = "actor") -> dict[str, float]:
        w, opt, cfg = self.workload, self.options, shape.config
        r = int(opt.remat)
        seqs_step = math.ceil(self.sequences("training") / w.mini_batches)
        micro, m = self._passes(seqs_step, sizes)
        steps = w.ppo_epochs * w.mini_batches
        tokens = m * w.seq_len / sizes.sequence  # a device's positions of a micro-batch
        matmul = shape.matmul_params_at(self.capacity_factor(role))
        flops = tokens * ((6 + 2 * r) * matmul + (3 + r) * self.attention_flops(shape, sizes))
        shard = shape.shard_elements(layout_of(sizes, TRAIN_RULES))
        (f, span), t = self.weight_gathers(sizes), sizes.tensor
        L, share = cfg.num_layers, self.share(sizes.size)
        compute = micro * flops / t / (share * self.shard_flops(shape, t))
        fsdp = micro * (
            self.collective("gather", shard * f * opt.param_bytes, f, span, 2 * L, share)
            + self.collective("gather", shard * f * opt.master_bytes, f, span, L, share)
        )
        dp = self.collective("reduce", shard * opt.master_bytes, sizes.data, sizes.size, share=share)
        tp = micro * self.collective(
            "reduce", (4 + 2 * r) * L * tokens * cfg.hidden_size * opt.param_bytes, t, t, (4 + 2 * r) * L, share
        )
        sp = micro * self.key_value_gathers(shape, sizes, m, 2 + r)
        return {
            "compute": steps * compute,
            "fsdp_dp": steps * (fsdp + dp),
            "tp": steps * tp,
            "sp": steps * sp,
            "seconds": steps * (self.overlap(compute, fsdp + dp) + tp + sp),
        }

    def infer(self, role: str, shape: ModelShape, sizes: Sizes) -> dict[str, float]:
        w, cfg, opt = self.workload, shape.config, self.options
        micro, m = self._passes(self.sequences("inference", role), sizes)
        L, t, share = cfg.num_layers, sizes.tensor, self.share(sizes.size)
        tokens = m * w.seq_len / sizes.sequence  # a device's positions of a micro-batch
        factor = self.capacity_factor(role) if role in ("actor", "ref") else None  # the policy's passes
        flops = tokens * (2 * shape.matmul_params_at(factor) + self.attention_flops(shape, sizes))
        shard = shape.shard_elements(layout_of(sizes, TRAIN_RULES))
        f, span = self.weight_gathers(sizes)
        compute = micro * flops / t / (share * self.shard_flops(shape, t))
        fsdp = micro * self.collective("gather", shard * f * opt.param_bytes, f, span, L, share)
        tp = micro * self.collective("reduce", 2 * L * tokens * cfg.hidden_size * opt.param_bytes, t, t, 2 * L, share)
        sp = micro * self.key_value_gathers(shape, sizes, m, 1)
        seconds = self.overlap(compute, fsdp) + tp + sp
        return {"compute": compute, "fsdp_dp": fsdp, "tp": tp, "sp": sp, "seconds": seconds}

    def generate(
        self, shape: ModelShape, train: Sizes | None, gen: Sizes, kv_budget: float | None, sync_link: str = "intra"
    ) -> dict[str, float] | str:
        """Generation seconds (prefill, decode, train -> gen transition) with `kv_budget` bytes per device free
        for the KV cache (None: unlimited, one wave; a lower bound of any budget), or the reason it cannot run.
        `train` None: a rollout group of its own, whose transition is the weight sync, every weight once in the
        compute dtype over the `sync_link` between the groups."""
        w, cfg, opt, profile = self.workload, shape.config, self.options, self.cluster.profile
        t, L, d = gen.tensor, cfg.num_layers, cfg.hidden_size
        kv_token = shape.kv_elements_per_token() * opt.param_bytes / t
        kv_seq = kv_token * w.seq_len
        batch = math.ceil(self.sequences("generation") / gen.batch_parts)
        if w.kv_slots is not None:  # the engine allocates every slot's cache whatever the batch
            slots = math.ceil(w.kv_slots / gen.batch_parts)
            cache = slots * kv_seq
            prefill_peak = self.prefill_bytes(shape, gen)
            if kv_budget is not None and cache + prefill_peak > kv_budget:
                return (
                    f"actor generation {gen.describe()}: the KV cache of rollout.slots={w.kv_slots} "
                    f"({cache / GIB:.2f} GiB per device) and its largest prefill ({prefill_peak / GIB:.2f} GiB) "
                    f"exceed the {max(kv_budget, 0) / GIB:.2f} GiB left by resident state"
                )
            kv_budget = cache
        if kv_budget is None:
            kv_budget = batch * kv_seq
        if kv_budget < kv_seq:
            return (
                f"actor generation {gen.describe()}: the KV cache of one sequence ({kv_seq / GIB:.2f} GiB per device) "
                f"exceeds the {max(kv_budget, 0) / GIB:.2f} GiB left by resident state"
            )
        waves = math.ceil(batch / int(kv_budget // kv_seq))
        b = math.ceil(batch / waves)
        param_read = shape.shard_elements(layout_of(gen, GEN_RULES)) * opt.param_bytes
        P, mm, share = w.prompt_len, shape.matmul_params, self.share(gen.size)
        flops = share * self.shard_flops(shape, t)
        prefill = b * P * (2 * mm + shape.attention_flops(P / 2)) / t / flops
        prefill += self.collective("reduce", 2 * L * b * P * d * opt.param_bytes, t, t, 2 * L, share)
        ctx = P + w.response_len / 2
        step_read = (param_read + b * kv_token * ctx) / (share * profile.bandwidth("memory"))
        step_compute = b * (2 * mm + shape.attention_flops(ctx)) / t / flops
        all_reduce = self.collective("reduce", 2 * L * b * d * opt.param_bytes, t, t, 2 * L, share)
        step = max(step_read, step_compute) + all_reduce + L * profile.decode_layer_overhead_s
        if train is None:
            reshard = shape.params * opt.param_bytes / profile.bandwidth(sync_link)
        else:
            moving = shape.params * opt.param_bytes
            if self.stationary_base():  # float32 adapters alone
                moving = lora_parameter_count(cfg, opt.actor_lora) * 4
            # weights split over fsdp x sequence move as over one fsdp axis of that size (generation has no sequence)
            weights = dataclasses.replace(train, fsdp=train.fsdp * train.sequence, sequence=1)
            moved = sum(transition_bytes(moving, layout_of(weights, TRAIN_RULES), layout_of(gen, GEN_RULES)))
            reshard = moved / (share * profile.bandwidth(self.cluster.link(weights.fsdp * weights.tensor)))
        return {
            "prefill": waves * prefill,
            "decode": waves * w.response_len * step,
            "reshard": reshard,
            "waves": waves,
            "kv_bytes": kv_budget if w.kv_slots is not None else b * kv_seq,
            "prefill_bytes": prefill_peak if w.kv_slots is not None else 0.0,
            "seconds": waves * (prefill + w.response_len * step) + reshard,
        }

    def with_base_in_gen(self, cost: RoleCost, shape: ModelShape, gen: Sizes) -> RoleCost:
        """The generating actor's cost with its LoRA base in the generation layout all iteration (what the
        generation shard adds over the training one becomes resident), when it keeps it there; else `cost`."""
        if cost.role not in self.flow.generation or not self.stationary_base():
            return cost
        extra = self.gen_extra_bytes(shape, cost.sizes, gen)
        memory = {**cost.memory, "params": cost.memory["params"] + extra}
        return dataclasses.replace(cost, static_bytes=cost.static_bytes + extra, memory=memory)

    def role_cost(self, role: str, shape: ModelShape, sizes: Sizes) -> RoleCost:
        """Inference and training seconds and memory of `role` under `sizes` (generation is added by
        `with_generation`, once the group's free memory is known). Raises `LayoutError` if it does not divide."""
        opt = self.options
        shard = shape.shard_elements(layout_of(sizes, TRAIN_RULES))
        trained = role in self.flow.training
        lora = {"actor": opt.actor_lora, "ref": opt.actor_lora, "critic": opt.critic_lora}.get(role)
        lora = lora if lora is not None and lora.enabled else None
        trained_shard = shard * lora_parameter_count(shape.config, lora) / shape.params if lora else shard
        if not lora and role == "actor" and opt.freeze_vision_tower:  # the tower: no gradients, no optimizer state
            trained_shard = shard * (shape.params - shape.tower_params) / shape.params
        seconds = dict.fromkeys(STAGES, 0.0)
        detail: dict[str, float] = {}
        if lora:  # the actor: the base and float32 adapters; the reference: the actor's base, nothing of its own
            memory = {"params": shard * opt.param_bytes + trained_shard * 4 if trained else 0.0}
        else:
            memory = {"params": shard * (opt.master_bytes if trained else opt.param_bytes)}
        transient = 0.0
        if role in self.flow.inference:
            inf = self.infer(role, shape, sizes)
            seconds["inference"] = inf["seconds"] + self.cluster.profile.call_overhead_s
            detail.update({f"infer_{k}": v for k, v in inf.items() if k != "seconds"})
            memory["infer_activations"] = self.activation_bytes(
                shape, sizes, self.sequences("inference", role), False, role
            )
            transient = memory["infer_activations"]
        if trained:
            tr = self.train(shape, sizes, role)
            seconds["training"] = tr["seconds"] + self.cluster.profile.call_overhead_s
            detail.update({f"train_{k}": v for k, v in tr.items() if k != "seconds"})
            seqs_step = math.ceil(self.sequences("training") / self.workload.mini_batches)
            memory["optimizer"] = trained_shard * opt.optimizer_bytes
            # from a step's second micro-batch on, its gradients are alive beside the accumulator of the earlier ones
            copies = 2 if self._passes(seqs_step, sizes)[0] > 1 else 1
            memory["grads"] = copies * trained_shard * (4 if lora else opt.master_bytes)
            memory["train_activations"] = self.activation_bytes(shape, sizes, seqs_step, True, role)
            transient = max(transient, memory["grads"] + memory["train_activations"])
        static = memory["params"] + memory.get("optimizer", 0.0)
        return RoleCost(role, sizes, seconds, static, transient, memory, detail)

    def with_generation(self, cost: RoleCost, shape: ModelShape, gen: Sizes, kv_budget: float) -> RoleCost | str:
        """The actor's cost with its generation under `gen` added, or the reason it cannot generate."""
        out = self.generate(shape, cost.sizes, gen, kv_budget)
        if isinstance(out, str):
            return out
        seconds = {**cost.seconds, "generation": out["seconds"] + self.cluster.profile.call_overhead_s}
        detail = {**cost.detail, **{f"gen_{k}": v for k, v in out.items() if k != "seconds"}}
        memory = {**cost.memory, "gen_extra_params": self.generation_extra(shape, cost.sizes, gen)}
        memory["kv_cache"] = out["kv_bytes"]
        memory["prefill"] = out["prefill_bytes"]
        return dataclasses.replace(cost, seconds=seconds, detail=detail, memory=memory, gen=gen)

    def memory_reason(self, costs: Sequence[RoleCost], devices: int) -> str | None:
        """Why roles colocated on `devices` do not fit (resident state plus the largest transient), or None."""
        static = sum(c.static_bytes for c in costs)
        transient = max((c.transient_bytes for c in costs), default=0.0)
        if static + transient <= self.usable_bytes:
            return None
        parts = ", ".join(
            f"{c.role} {c.sizes.describe()}: " + " + ".join(f"{k} {v / GIB:.1f}" for k, v in c.memory.items())
            for c in costs
        )
        return (
            f"{'+'.join(c.role for c in costs)} on {devices} devices needs {(static + transient) / GIB:.1f} GiB per "
            f"device (resident {static / GIB:.1f} + largest transient {transient / GIB:.1f}; {parts}) > "
            f"{self.usable_bytes / GIB:.1f} GiB usable"
        )

    def rollout_group(self, shape: ModelShape, gen: Sizes, sync_link: str) -> tuple[RoleCost, float] | str:
        """The generation of a disaggregated placement's rollout group under `gen` (the actor's weights in the compute
        dtype, its KV cache and largest prefill beside them; the weight sync before each generation), and the group's
        peak bytes per device (the larger of generation and the sync's second copy of the weights, which
        `async.weight_swap: atomic` places beside the first); or the reason it does not fit."""
        params = shape.shard_elements(layout_of(gen, GEN_RULES)) * self.options.param_bytes
        out = self.generate(shape, None, gen, self.usable_bytes - params, sync_link)
        if isinstance(out, str):
            return out.replace("actor generation", "rollout generation", 1)
        seconds = dict.fromkeys(STAGES, 0.0)
        seconds["generation"] = out["seconds"] + self.cluster.profile.call_overhead_s
        memory = {"params": params, "kv_cache": out["kv_bytes"], "prefill": out["prefill_bytes"]}
        detail = {f"gen_{k}": v for k, v in out.items() if k != "seconds"}
        cost = RoleCost(ROLLOUT, gen, seconds, params, 0.0, memory, detail, gen)
        return cost, params + max(params, out["kv_bytes"] + out["prefill_bytes"])

    def finish_group(
        self, costs: Sequence[RoleCost], shapes: Mapping[str, ModelShape], devices: int, gen: Sizes | None
    ) -> tuple[list[RoleCost], float] | str:
        """Checks the memory of colocated roles and adds the actor's generation with the KV budget they leave (none
        when `gen` is None: a rollout group generates). Returns the costs and the peak bytes per device, or the
        reason they do not fit."""
        if gen is not None:
            costs = [self.with_base_in_gen(c, shapes[c.role], gen) for c in costs]
        reason = self.memory_reason(costs, devices)
        if reason:
            return reason
        static = sum(c.static_bytes for c in costs)
        peak = static + max((c.transient_bytes for c in costs), default=0.0)
        out = list(costs)
        for i, cost in enumerate(costs):
            if cost.role in self.flow.generation and gen is not None:
                extra = self.generation_extra(shapes[cost.role], cost.sizes, gen)
                resident = static - self.offloaded_bytes(cost.memory)
                with_gen = self.with_generation(cost, shapes[cost.role], gen, self.usable_bytes - resident - extra)
                if isinstance(with_gen, str):
                    return with_gen
                out[i] = with_gen
                generation = with_gen.memory["kv_cache"] + with_gen.memory["prefill"]
                peak = max(peak, resident + extra + generation)
        return out, peak

    def predict(self, shapes: Mapping[str, ModelShape], mapping: DeviceMapping) -> Prediction:
        """Predicted iteration of a whole mapping: stage cost = max over groups of the sum of their roles'
        seconds in that stage; iteration = sum over stages. Raises `InfeasibleError` with the reason."""
        missing = sorted(set(shapes) - {r for roles, _ in mapping.groups for r in roles})
        if missing:
            raise InfeasibleError(f"mapping places no devices for roles {missing}")
        gen = mapping.gen_layout
        disaggregated = any(group == (ROLLOUT,) for group, _ in mapping.groups)
        if gen is None:
            raise InfeasibleError("mapping has no generation layout")
        roles: dict[str, RoleCost] = {}
        peaks, placed = [], []
        for group, devices in mapping.groups:
            if group == (ROLLOUT,):
                if gen.size != devices:
                    raise InfeasibleError(
                        f"gen_layout {gen.describe()} has {gen.size} devices, the rollout's {devices}"
                    )
                link = self.cluster.link(sum(n for _, n in mapping.groups))
                done = self.rollout_group(shapes[self.flow.generation[0]], gen, link)
                if isinstance(done, str):
                    raise InfeasibleError(done)
                roles[ROLLOUT] = done[0]
                placed.append([done[0]])
                peaks.append(done[1])
                continue
            costs = []
            for role in group:
                sizes = mapping.layouts[role]
                if sizes.size != devices:
                    raise InfeasibleError(
                        f"{role}: layout {sizes.describe()} has {sizes.size} devices, group {devices}"
                    )
                costs.append(self.role_cost(role, shapes[role], sizes))
            generates = not disaggregated and any(r in self.flow.generation for r in group)
            if generates and gen.size != devices:
                raise InfeasibleError(f"gen_layout {gen.describe()} has {gen.size} devices, its group {devices}")
            done = self.finish_group(costs, shapes, devices, gen if generates else None)
            if isinstance(done, str):
                raise InfeasibleError(done)
            roles.update({c.role: c for c in done[0]})
            placed.append(done[0])
            peaks.append(done[1])
        return Prediction(stage_seconds(placed, self.concurrent_groups), roles, tuple(peaks))
