"""The LM head's collectives under fsdp: its chunked log-prob loops (`hfjax.models.lm_head`) gather the head once and
reduce its gradient once per micro-batch, outside the loops, never per chunk; and its values and gradients under
sharded layouts equal a plain unchunked computation."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hfjax.models.lm_head as lm_head
from hfjax.automap.compiled.programs import actor_programs
from hfjax.config.rl import load_rl_config
from hfjax.models.config import ModelConfig
from hfjax.models.program import program_layout
from hfjax.parallel import Layout

# a head of 32,000 x 512 (its fsdp shard of 2.0M elements) larger than any activation or layer weight (a chunk's
# logits on a device: 32 x 32,000 = 1.0M elements)
SHAPE = ModelConfig(
    family="llama",
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1024,
    num_layers=1,
    num_heads=8,
    num_kv_heads=8,
    head_dim=64,
    rms_norm_eps=1e-5,
)
HEAD = SHAPE.padded_vocab_size * SHAPE.hidden_size
FSDP = 8
CHUNKS = 4  # 128 response positions, 32 a chunk

HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$")
COLLECTIVE = re.compile(r"= (\([^=]*\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(")
ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
CALLED = re.compile(r"%([\w.\-]+)")
TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@functools.cache
def _update_hlo() -> str:
    """The actor's loss-and-gradient of one micro-batch (8 rows, bfloat16 compute, float32 master) under fsdp=8,
    compiled for the 8 fake CPU devices, as HLO text."""
    cfg = load_rl_config(
        {
            "actor": {
                "model_path": "unused",
                "micro_batch_size": 8,
                "ppo_mini_batch_size": 8,
                "dtype": "bfloat16",
                "param_dtype": "float32",
            },
            "data": {"max_prompt_length": 32},
            "rollout": {"response_length": 32 * CHUNKS, "slots": 8, "n": 2},
        }
    )
    train = Layout.from_config({"mesh": {"fsdp": FSDP}, "rules": "fsdp"})
    gen = Layout.from_config({"mesh": {"data": FSDP}, "rules": "dp_tp_gen"})
    tokens, budget = lm_head.LOGITS_CHUNK_TOKENS, lm_head.LOGITS_BUDGET_BYTES
    lm_head.LOGITS_CHUNK_TOKENS = 32  # one row a device: chunks of 32 positions
    lm_head.LOGITS_BUDGET_BYTES = 0  # chunked, as the shipped configs' large vocabularies are (not kept whole)
    try:
        trace = next(actor_programs(cfg, SHAPE, train, gen))
    finally:
        lm_head.LOGITS_CHUNK_TOKENS, lm_head.LOGITS_BUDGET_BYTES = tokens, budget
    assert trace.program == "loss+grad"
    return trace.traced.lower().compile().as_text()


def _collectives(hlo: str) -> list[tuple[str, list[tuple[str, int]], int, bool]]:
    """(kind, (dtype, elements) of each result array, times run, inside a loop) of every collective that the entry
    computation runs, through the computations it calls (fusions, reductions, while conditions and bodies); a
    while body's collectives run its trip count times."""
    computations: dict[str, list[str]] = {}
    entry = name = None
    for line in hlo.splitlines():
        if header := HEADER.match(line):
            name = header.group(1)
            computations[name] = []
            entry = name if line.startswith("ENTRY") else entry
        elif line == "}":
            name = None
        elif name is not None:
            computations[name].append(line)
    found: list[tuple[str, list[tuple[str, int]], int, bool]] = []

    def visit(computation: str, times: int, in_loop: bool) -> None:
        for line in computations[computation]:
            if collective := COLLECTIVE.search(line):
                arrays = ARRAY.findall(collective.group(1))
                sizes = [(dtype, math.prod(int(n) for n in dims.split(",") if n)) for dtype, dims in arrays]
                found.append((collective.group(2), sizes, times, in_loop))
            loop = " while(" in line
            trips = int(TRIP_COUNT.search(line).group(1)) if loop else 1
            for called in CALLED.findall(line.split("=", 1)[-1]):
                if called in computations and called != computation:
                    visit(called, times * trips, in_loop or loop)

    visit(entry, 1, False)
    return found


def _head_sized(arrays: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The arrays of at least a device's shard of the head."""
    return [(dtype, n) for dtype, n in arrays if n >= HEAD // FSDP]


def test_no_head_sized_collective_in_a_loop():
    """Inside the chunk loops (and any loop of the update) no collective moves the head, its shard or its gradient:
    the head is gathered before the loops and each device accumulates its own rows' gradient. Before, every
    backward chunk all-reduced a float32 [vocab, embed] gradient (and on a TPU, both loops gathered the head)."""
    hlo = _update_hlo()
    assert hlo.count(" while(") >= 2, "expected the LM head's chunk loops in the program"
    in_loops = [(kind, _head_sized(arrays)) for kind, arrays, _, in_loop in _collectives(hlo) if in_loop]
    in_loops = [(kind, arrays) for kind, arrays in in_loops if arrays]
    assert not in_loops, f"head-sized collectives inside a loop: {in_loops}"


def test_head_gathered_once_and_its_gradient_reduced_once():
    """A micro-batch's collectives of head-sized arrays, in elements: one gather of the head (kept from the forward
    for the backward; in the compute dtype on a TPU, where XLA:CPU gathers the float32 master before the cast) and
    one reduction of its gradient (an all-reduce on XLA:CPU, which makes no reduce-scatters). Before: a gather for
    each loop and an all-reduce for each backward chunk."""
    moved = {"all-gather": 0, "reduction": 0}
    for kind, arrays, times, _ in _collectives(_update_hlo()):
        moved["all-gather" if kind == "all-gather" else "reduction"] += sum(n for _, n in _head_sized(arrays)) * times
    assert moved == {"all-gather": HEAD, "reduction": HEAD}, moved


def _reference(hidden: jax.Array, kernel: jax.Array, labels: jax.Array, vocab: int, temperature: float) -> tuple:
    """Unchunked float32 log probs and entropies of logits / temperature over the first `vocab` columns."""
    logits = jnp.einsum("rte,ve->rtv", hidden, kernel)[..., :vocab] / temperature
    logp = jax.nn.log_softmax(logits)
    return jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0], -jnp.sum(jnp.exp(logp) * logp, axis=-1)


@pytest.mark.parametrize(
    "layout",
    [
        {"mesh": {"fsdp": 8}, "rules": "fsdp"},
        {"mesh": {"data": 2, "fsdp": 2, "tensor": 2}, "rules": "fsdp_tp"},
    ],
)
def test_sharded_values_and_gradients_equal_unchunked(layout):
    """Under fsdp=8 and data=2,fsdp=2,tensor=2 (the head's gradient accumulated on each device's rows, then summed
    over the row parts to the head's sharding) the loss and its gradients in the hidden states and the head equal a
    plain unchunked float32 computation."""
    rows, length, embed, vocab, padded, temperature = 8, 37, 32, 50, 64, 0.7
    layout = Layout.from_config(layout)
    rng = np.random.default_rng(3)
    hidden = 0.3 * rng.standard_normal((rows, length, embed), np.float32)
    kernel = rng.standard_normal((padded, embed), np.float32)
    kernel[vocab:] = 0
    labels = rng.integers(0, vocab, (rows, length), np.int32)
    weights = rng.standard_normal((2, rows, length), np.float32)

    def loss(fn, hidden, kernel):
        logp, entropy = fn(hidden, kernel)
        return jnp.sum(weights[0] * logp) + jnp.sum(weights[1] * entropy)

    def chunked(hidden, kernel):
        return lm_head.token_logprobs(
            hidden, kernel, labels, vocab_size=vocab, temperature=temperature, chunk=8, with_entropy=True
        )

    def sharded(hidden, kernel):
        with program_layout(layout):
            return jax.value_and_grad(functools.partial(loss, chunked), argnums=(0, 1))(hidden, kernel)

    args = (
        jax.device_put(hidden, layout.sharding(("batch", None, None))),
        jax.device_put(kernel, layout.sharding(("vocab", "embed"))),
    )
    value, grads = jax.jit(sharded)(*args)
    plain = functools.partial(_reference, labels=labels, vocab=vocab, temperature=temperature)
    want, want_grads = jax.jit(jax.value_and_grad(functools.partial(loss, plain), argnums=(0, 1)))(hidden, kernel)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    for got, expected in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
