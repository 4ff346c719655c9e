"""Programs shared across workers of equal settings in one process: `bind` compares settings by value, training
steps of an equal loss and model structure reuse one trace, and an engine of equal settings reuses the jitted steps
of an earlier one (its `compiles` counts only the traces its own calls caused)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.tiny_models import TINY, random_model

from hfjax.models.program import bind
from hfjax.optim.train_state import TrainState, compile_counts
from hfjax.parallel import Layout
from hfjax.rollout import JaxEngine, OfflineGenerator, SamplingParams


@dataclasses.dataclass
class LossSettings:
    scale: float
    targets: list[int] = dataclasses.field(default_factory=lambda: [1, 2])


def scaled_logit_loss(settings: LossSettings, model, batch):
    logits = model(batch["input_ids"], batch["attention_mask"])
    loss = settings.scale * jnp.mean(logits[..., jnp.asarray(settings.targets)])
    return loss, {"loss_share": loss}


def test_bindings_of_equal_settings_are_equal_and_call_with_the_settings_first():
    a, b = bind(scaled_logit_loss, LossSettings(2.0), 3), bind(scaled_logit_loss, LossSettings(2.0), 3)
    assert a == b and hash(a) == hash(b) and a is not b
    assert a != bind(scaled_logit_loss, LossSettings(2.0, [1, 3]), 3)  # a field inside a list differs
    assert a != bind(scaled_logit_loss, LossSettings(2.0), 4)
    assert bind(divmod, 7)(2) == (3, 1)
    with pytest.raises(TypeError, match="unhashable"):
        bind(scaled_logit_loss, {"scale": 2.0})


def _update(seed: int, settings: LossSettings) -> float:
    layout = Layout.from_config({"mesh": {"data": 2}, "rules": "fsdp", "devices": [0, 1]})
    state = TrainState(random_model(TINY, seed), layout, optax.sgd(0.1), grad_clip=1.0)
    batch = {"input_ids": np.arange(16, dtype=np.int32).reshape(2, 8) % TINY.vocab_size}
    batch["attention_mask"] = np.ones_like(batch["input_ids"])
    return state.update(bind(scaled_logit_loss, settings), [batch])["loss"]


def test_training_steps_of_equal_settings_and_model_structure_share_one_trace():
    before = compile_counts()["grad"]
    first = _update(0, LossSettings(0.5))
    assert compile_counts()["grad"] == before + 1
    second = _update(1, LossSettings(0.5))  # another model's weights, another settings object of equal value
    assert compile_counts()["grad"] == before + 1
    assert second != first  # the shared program computed with the second model's weights
    _update(1, LossSettings(0.25))
    assert compile_counts()["grad"] == before + 2


def _generate(seed: int, slots: int) -> tuple[JaxEngine, list[list[int]]]:
    model = random_model(TINY, seed)
    engine = JaxEngine(
        model, max_concurrent_decodes=slots, max_prefill_length=24, max_new_tokens=6
    )  # settings no other test uses
    generator = OfflineGenerator(engine, nnx.split(model, nnx.Param, ...)[1], progress=False)
    outs = generator.generate([[3, 4, 5], [6, 7, 8, 9, 10]], SamplingParams(max_new_tokens=6, temperature=0.0))
    return engine, [out.tokens.tolist() for out in outs]


def _traces(engine: JaxEngine) -> list[int]:
    """How many programs each of the engine's jitted steps holds (traced and compiled)."""
    return [program._cache_size() for program in (engine._prefill_insert, engine._generate)]


def test_an_engine_of_equal_settings_reuses_the_jitted_steps_of_an_earlier_one():
    first, tokens = _generate(0, slots=4)
    assert first.compiles["generate"] >= 1 and first.compiles["prefill_insert"] >= 1
    traces = _traces(first)
    again, same_tokens = _generate(0, slots=4)
    assert again._generate is first._generate and _traces(first) == traces  # nothing traced again
    assert same_tokens == tokens and again.compiles == first.compiles  # the programs it called
    _, other_tokens = _generate(1, slots=4)  # same programs, the other model's parameters
    assert _traces(first) == traces and other_tokens != tokens
    more_slots, _ = _generate(0, slots=8)  # another decode state: programs of its own
    assert more_slots._generate is not first._generate
    assert more_slots.compiles["generate"] == first.compiles["generate"]
