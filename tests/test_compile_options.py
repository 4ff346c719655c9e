"""hfjax's model programs compile with its XLA:CPU options (`hfjax.xla_settings`): XLA hands only dot products
to its YNNPACK library, no reductions (slower there than XLA's own loops); in forward programs each library call is a
single dot. Checked on the compiled HLO of the engine's decode step and of the training gradient step; the same
programs compiled with library reductions allowed do contain them, and the decode step compiled with the gradient
step's options has a library call of several operations (one over the slots' own blocks only), so each check can
fail."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.tiny_models import TINY, random_model

from hfjax.optim.train_state import _Frozen, _loss_and_grad
from hfjax.rollout import JaxEngine, SamplingParams
from hfjax.rollout.sampling import SamplerKind
from hfjax.xla_settings import GRADIENT_COMPILER_OPTIONS

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU library fusions")

CONFIG = dataclasses.replace(TINY, vocab_size=512)  # sampler reductions large enough for the library
WITH_REDUCTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_REDUCE"}


def library_ops(hlo: str) -> list[list[str]]:
    """The operations inside each fusion that XLA:CPU hands to YNNPACK (sorted, with repeats)."""
    bodies = dict(re.findall(r"\n(%[\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S))
    called = re.findall(r"calls=(%[\w.\-]+)[^\n]*\"kind\":\"__ynn_fusion\"", hlo)
    ignored = {"parameter", "bitcast", "constant"}
    return [
        sorted(op for op in re.findall(r"= \S+ ([a-z][\w-]*)\(", bodies[name]) if op not in ignored) for name in called
    ]


def _check_no_library_reductions(lowered) -> list[list[str]]:
    ours = library_ops(lowered.compile().as_text())
    assert ours and all("dot" in ops and "reduce" not in ops for ops in ours), ours
    allowed = library_ops(lowered.compile(compiler_options=WITH_REDUCTIONS).as_text())
    assert any("reduce" in ops for ops in allowed), allowed
    return ours


def test_decode_step_gives_the_library_single_dots():
    model = random_model(CONFIG)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    engine = JaxEngine(model, max_concurrent_decodes=8, max_prefill_length=16, max_new_tokens=16)
    kind = SamplerKind.of(SamplingParams(max_new_tokens=4))
    state = engine.init_decode_state()
    lowered = engine._generate.lower(params, state, kind=kind, live=engine.blocks)
    ours = _check_no_library_reductions(lowered)
    assert all(ops == ["dot"] for ops in ours), ours
    # the control: a step over the slots' own block only (no prompt blocks; its two attention products then meet
    # with nothing between them) is single dots too, and fuses several operations under the gradient options
    own_only = engine._generate.lower(params, state, kind=kind, live=engine.blocks, prompt_live=0)
    assert all(ops == ["dot"] for ops in library_ops(own_only.compile().as_text()))
    fused = library_ops(own_only.compile(compiler_options=GRADIENT_COMPILER_OPTIONS).as_text())
    assert any(len(ops) > 1 for ops in fused), fused


def test_gradient_step_gives_the_library_dots_only():
    graphdef, params, rest = nnx.split(random_model(CONFIG), nnx.Param, ...)
    params = jax.tree.map(jnp.asarray, params)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, CONFIG.vocab_size, (8, 16)), jnp.int32)

    def loss(model, batch):
        logits = model(batch["tokens"][:, :-1])
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["tokens"][:, 1:, None], axis=-1)
        return -picked.mean(), {}

    shardings = _Frozen.of(jax.tree.map(lambda x: x.sharding, params))
    _check_no_library_reductions(
        _loss_and_grad.lower(
            params,
            rest,
            {"tokens": tokens},
            graphdef=graphdef,
            loss_fn=loss,
            static=(),
            shardings=shardings,
            layout=None,
        )
    )
