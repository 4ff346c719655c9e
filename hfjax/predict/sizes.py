"""The layouts the cost model prices: mesh sizes (`Sizes`), the rule presets of training and generation layouts,
and the activation width a token's decoder layer keeps."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from hfjax.models.config import ModelConfig
from hfjax.parallel.layout import Layout

TRAIN_RULES = "fsdp_tp"
GEN_RULES = "dp_tp_gen"


@dataclasses.dataclass(frozen=True, order=True)
class Sizes:
    """Mesh sizes of one layout: data x fsdp x expert x sequence x tensor devices (the searches keep `expert` and
    `sequence` at 1). `sequence` splits the positions of every row in the training and log-prob passes (and, under
    the rule presets the cost model prices, the weights with `fsdp`); a generation layout has none."""

    data: int
    fsdp: int
    tensor: int
    expert: int = 1
    sequence: int = 1

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.expert * self.sequence * self.tensor

    @property
    def batch_parts(self) -> int:
        """The parts the batch splits into: every rule preset spreads rows over data, fsdp and expert (`sequence`
        splits each row's positions instead)."""
        return self.data * self.fsdp * self.expert

    def config(self, rules: str) -> dict[str, Any]:
        """The layout config `Layout.from_config` accepts (tensor innermost; `expert` and `sequence` where above 1)."""
        mesh = {"data": self.data, "fsdp": self.fsdp}
        mesh.update({axis: n for axis, n in (("expert", self.expert), ("sequence", self.sequence)) if n > 1})
        return {"mesh": {**mesh, "tensor": self.tensor}, "rules": rules}

    def describe(self) -> str:
        optional = "".join(f".{axis}{n}" for axis, n in (("e", self.expert), ("s", self.sequence)) if n > 1)
        return f"d{self.data}.f{self.fsdp}{optional}.t{self.tensor}"


@functools.lru_cache(maxsize=8192)
def layout_of(sizes: Sizes, rules: str) -> Layout:
    return Layout.from_config(sizes.config(rules))


def gen_sizes(devices: int, tensor: int) -> Sizes:
    """The generation layout: `tensor`-way model parallel replicas over `devices` (no FSDP)."""
    return Sizes(devices // tensor, 1, tensor)


def mlp_width(cfg: ModelConfig, capacity_factor: float | None) -> float:
    """The MLP width one token's activations span: the dense MLP's, or, in a mixture of experts, the expert width
    times the buffer slots per token (every expert's without a capacity factor, `factor x k` with one; the most of
    any layer)."""
    if not any(cfg.moe_layers):
        return cfg.intermediate_size
    slots = cfg.num_experts if capacity_factor is None else capacity_factor * cfg.experts_per_token
    experts = slots * cfg.expert_intermediate_size
    return experts if all(cfg.moe_layers) else max(experts, cfg.intermediate_size)


# MLP-width tensors a decoder layer keeps for its backward, by platform, measured as the compiled update's
# temporaries per token and layer between two micro-batch sizes (Qwen2.5 shapes, bf16, no recomputation): the GPU
# compiler keeps the gate and up projections and recomputes the activation and product in the backward's fusions
# (41.1 / 76.4 / 42.8 KB a token and layer at 0.5B fsdp 1, 1.5B fsdp 8, 1.5B fsdp 4 x tensor 2 against 41.0 / 72.7 /
# 47.1 with two); libtpu at its leanest schedule about three (47.6 KB at 0.5B fsdp 8 against 50.1); XLA:CPU all four
MLP_TENSORS_KEPT = {"gpu": 2, "tpu": 3, "cpu": 4}


def layer_activation_bytes(
    width: int, mlp_width: float, tensor: int, mlp_tensors: int = MLP_TENSORS_KEPT["cpu"]
) -> float:
    """Bytes per token that one decoder layer keeps for its backward (bf16 compute): the two norms' inputs and their
    float32 copies (12 d), the residual (2 d), and split over `tensor`: normed input, q/k/v, rotated q/k and the
    attention output (10 d), and `mlp_tensors` of the MLP's gate, up, activation and product (2 m each; what the
    platform's compiler keeps: `MLP_TENSORS_KEPT`)."""
    return 14 * width + (10 * width + 2 * mlp_tensors * mlp_width) / tensor


def layer_inference_bytes(width: int, mlp_width: float, tensor: int) -> float:
    """Bytes per token alive at once in one decoder layer of a forward that keeps nothing for a backward (bf16
    compute): the residual, the normed input and their float32 norm temporaries (8 d), and split over `tensor` the
    MLP's gate, up and product (6 m)."""
    return 8 * width + 6 * mlp_width / tensor
