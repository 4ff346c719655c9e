"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers, the expert-parallel layout against one
device, and the capacity limit against a hand-written dispatch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from flax import nnx
from support.checkpoints import left_padded_batch, relative_error, save_hf_model, torch_logits
from support.devices import needs_devices
from support.rl_setup import build_run_inputs, rl_config, with_moe_policy
from support.tiny_models import compiled_forward
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from hfjax.config.rl import load_rl_config
from hfjax.config.roles import ActorConfig
from hfjax.models import load_hf, save_hf
from hfjax.models.config import UnsupportedModelError, config_from_hf
from hfjax.models.hf import abstract_model
from hfjax.models.lora import LoraConfig, LoraParam, add_lora, lora_parameter_count
from hfjax.models.moe import (
    SparseMoE,
    buffer_slots,
    collect_router_stats,
    record_routes,
    route_dtype,
    router_summary,
    set_expert_capacity,
    stacked_routes,
    top_k_routing,
)
from hfjax.models.presets import named_config
from hfjax.models.transformer import set_remat
from hfjax.parallel import Layout
from hfjax.rollout import JaxEngine, OfflineGenerator, SamplingParams
from hfjax.trainer.launch import run_rl
from hfjax.workers.actor import response_logprobs
from hfjax.workers.model_role import load_trained
from hfjax.workers.sequences import ROUTED_EXPERTS, assemble

LENGTHS = [12, 7, 3, 10]
ONE_LAYER = dict(  # a one-layer Qwen3-MoE config.json, without its experts
    architectures=["Qwen3MoeForCausalLM"],
    vocab_size=32,
    hidden_size=16,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
)
CASES = {
    "qwen3_moe": ("qwen3_moe", {}),  # 8 experts, top-2, layer 1 dense (support/checkpoints.py)
    "qwen3_moe-norm-top3-bias": ("qwen3_moe", dict(num_experts_per_tok=3, norm_topk_prob=True, attention_bias=True)),
    "qwen3_moe-sliding-4": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=4, mlp_only_layers=[])),
    "mixtral": ("mixtral", {}),
    "mixtral-top1-sliding-4": ("mixtral", dict(num_experts_per_tok=1, sliding_window=4)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_and_save_round_trips(tmp_path, case):
    family, overrides = CASES[case]
    reference, path = save_hf_model(tmp_path, family, **overrides)
    ids, mask, positions = left_padded_batch(reference.config.vocab_size, LENGTHS, seed=1)
    expected = torch_logits(reference, ids, mask, positions)
    model = load_hf(path)
    got = np.asarray(compiled_forward(model, ids, mask))
    valid = mask.astype(bool)
    assert relative_error(got[valid], expected[valid]) <= 1e-5
    assert model.config.num_params == sum(p.numel() for p in reference.parameters())
    # ours -> HF: transformers reads back every tensor bit for bit; HF -> ours again: every parameter bit for bit
    saved = save_hf(model, tmp_path / "saved")
    reloaded = tf.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    want = reference.state_dict()
    assert reloaded.state_dict().keys() == want.keys()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, want[name]), name
    again = dict(nnx.to_flat_state(nnx.state(load_hf(saved), nnx.Param)))
    for key, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        np.testing.assert_array_equal(np.asarray(again[key][...]), np.asarray(param[...]), err_msg=str(key))


def test_critic_of_a_mixture_of_experts_matches_token_classification(tmp_path):
    reference, path = save_hf_model(tmp_path, "qwen3_moe", head="TokenClassification", num_labels=1)
    ids, mask, _ = left_padded_batch(reference.config.vocab_size, LENGTHS, seed=4)
    with torch.no_grad():
        expected = reference(input_ids=torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask))
    got = np.asarray(compiled_forward(load_hf(path), ids, mask))
    valid = mask.astype(bool)
    assert relative_error(got[valid], expected.logits[..., 0].numpy()[valid]) <= 1e-5


def _loss_and_grads(model, ids, mask):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logp = jax.nn.log_softmax(nnx.merge(graphdef, params, rest)(ids, mask), axis=-1)
        picked = jnp.take_along_axis(logp[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(picked * mask[:, 1:])

    step = jax.jit(jax.value_and_grad(loss))
    return step, params


@needs_devices(8)
@pytest.mark.parametrize("mesh", [{"expert": 4, "fsdp": 2}, {"data": 2, "expert": 2, "tensor": 2}])
def test_expert_parallel_layout_equals_one_device(tmp_path, mesh):
    """The loss and every parameter's gradient under a layout whose `expert` axis splits the experts equal one
    device's; each device holds its share of the experts, and the tokens reach them by all-to-all, with no expert
    weight gathered."""
    _, path = save_hf_model(tmp_path, "qwen3_moe", vocab_size=96)
    ids, mask, _ = left_padded_batch(96, [12, 7, 3, 10, 12, 5, 9, 11], seed=2)
    step, params = _loss_and_grads(load_hf(path), ids, mask)
    loss, grads = step(params)
    split = load_hf(path, layout={"mesh": mesh, "rules": "fsdp_tp"})
    experts = split.model.layers[0].mlp.gate_kernel[...]
    assert experts.sharding.spec[0] == "expert"
    assert experts.addressable_shards[0].data.shape[0] == 8 // mesh["expert"]
    split_step, split_params = _loss_and_grads(split, ids, mask)
    split_loss, split_grads = split_step(split_params)
    assert float(split_loss) == pytest.approx(float(loss), rel=1e-6)
    want = dict(nnx.to_flat_state(grads))
    for key, grad in nnx.to_flat_state(split_grads):  # each up to summation order (relative to its norm)
        assert relative_error(np.asarray(grad[...]), np.asarray(want[key][...])) <= 1e-5, key
    hlo = split_step.lower(split_params).compile().as_text()
    assert "all-to-all" in hlo
    stacked = {f"[8,{a},{b}]" for a, b in ((32, 64), (64, 32))}  # a whole expert stack [experts, out, in]
    gathers = [line for line in hlo.splitlines() if "all-gather(" in line]
    assert not [line for line in gathers if any(s in line.split("=")[1].split("all-gather")[0] for s in stacked)]


def _dispatch_reference(x, weights, experts, num_experts, capacities, expert_fn, valid):
    """Per row: `capacities[row]` slots per expert taken first choices before second choices, each in token order,
    by real tokens only (a padding token adds nothing); a choice finding its expert full adds nothing."""
    out = np.zeros_like(x)
    dropped = np.zeros(x.shape[0], np.int64)
    for row in range(x.shape[0]):
        used = [0] * num_experts
        for choice in range(experts.shape[-1]):
            for token in range(x.shape[1]):
                if not valid[row, token]:
                    continue
                e = int(experts[row, token, choice])
                if used[e] == capacities[row]:
                    dropped[row] += 1
                    continue
                used[e] += 1
                out[row, token] += weights[row, token, choice] * expert_fn(e, x[row, token])
    return out, dropped


@pytest.mark.parametrize("factor", [None, 1.0, 0.5])
@pytest.mark.parametrize("padded", [False, True])
def test_capacity_drops_late_choices_as_the_reference_does(factor, padded):
    """Also with left padding, which takes no slot (else a padded row's padding would crowd out its tokens) and
    counts in no capacity: a padded row has the capacity of its real tokens unpadded (`expert_capacity`)."""
    cfg, _ = config_from_hf({**ONE_LAYER, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8})
    layer = SparseMoE(cfg, jnp.float32, jnp.float32, nnx.Rngs(0), std=0.5)
    set_expert_capacity(layer, factor)
    x = jax.random.normal(jax.random.key(1), (3, 10, 16))
    valid = np.arange(10)[None, :] >= np.array([[0], [4], [7]]) if padded else np.ones((3, 10), bool)
    routed = layer.route(x, valid=jnp.asarray(valid) if padded else None)
    got = np.asarray(layer.apply_experts(x, routed))
    gate, up, down = (np.asarray(k[...], np.float64) for k in (layer.gate_kernel, layer.up_kernel, layer.down_kernel))

    def expert_fn(e, v):
        h = gate[e] @ v
        return down[e] @ (h / (1 + np.exp(-h)) * (up[e] @ v))

    capacity = {None: 10, 1.0: 5, 0.5: 3}[factor]  # ceil(factor * 10 * 2 / 4): the buffers' slots per expert
    assert routed.capacity == capacity
    # the rows' 10, 6 and 3 real tokens: ceil(factor * real * 2 / 4) (None: dropless, any capacity >= real)
    capacities = {None: [10] * 3, 1.0: [5, 3, 2], 0.5: [3, 2, 1]}[factor] if padded else [capacity] * 3
    routes = np.asarray(routed.weights), np.asarray(routed.experts)
    want, dropped = _dispatch_reference(np.asarray(x, np.float64), *routes, 4, capacities, expert_fn, valid)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(routed.dropped).sum(-1), dropped)
    if factor is None:
        assert dropped.sum() == 0
    if factor == 0.5 and not padded:  # 20 choices per row, 4 x 3 slots
        assert (dropped >= 8).all()
    if factor == 0.5 and padded:  # the 3-token row's 6 choices, 4 x 1 slots
        assert dropped[2] >= 2 and dropped[0] >= 8


def test_routing_is_the_top_k_of_the_softmax():
    logits = jnp.array([[2.0, 0.5, 1.0, -1.0]])
    weights, experts = top_k_routing(logits, 2, normalize=False)
    probs = np.exp([2.0, 0.5, 1.0, -1.0]) / np.exp([2.0, 0.5, 1.0, -1.0]).sum()
    np.testing.assert_array_equal(np.asarray(experts), [[0, 2]])
    np.testing.assert_allclose(np.asarray(weights), [[probs[0], probs[2]]], rtol=1e-6)
    normalized, _ = top_k_routing(logits, 2, normalize=True)
    np.testing.assert_allclose(np.asarray(normalized), [[probs[0], probs[2]]] / (probs[0] + probs[2]), rtol=1e-6)
    # slots: first choices of tokens 0 and 1 (experts 1, 1), then their second choices (experts 0, 1); capacity 2
    slots = buffer_slots(jnp.array([[[1, 0], [1, 1]]]), num_experts=2, capacity=2)
    np.testing.assert_array_equal(np.asarray(slots), [[2, 3, 0, 4]])  # the last finds expert 1 full: slot 2 * 2


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_experts_per_tok=9), r"experts_per_token must be in \[1, num_experts=8\]"),
        (dict(router_jitter_noise=0.1, architectures=["MixtralForCausalLM"]), "router_jitter_noise=0.1"),
    ],
)
def test_bad_expert_settings_are_named(change, message):
    with pytest.raises((ValueError, UnsupportedModelError), match=message):
        config_from_hf({**ONE_LAYER, "num_experts": 8, **change})


def test_the_named_mixture_of_experts_shape_counts_as_transformers_does():
    """Qwen3-30B-A3B's shape (`hfjax.models.presets`): hfjax's parameter count and its abstract model's parameters
    equal transformers' model of the same config.json, built on the meta device (no memory)."""
    cfg = named_config("qwen3-30b-a3b")
    with torch.device("meta"):
        reference = tf.AutoModelForCausalLM.from_config(tf.Qwen3MoeConfig(**cfg.to_hf_dict("causal_lm", "bfloat16")))
    count = sum(p.numel() for p in reference.parameters())
    assert cfg.num_params == count == 30_532_122_624
    params = nnx.state(abstract_model(cfg, "causal_lm", "bfloat16"), nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(params)) == count  # the vocabulary is a multiple of 128: no padding


def test_lora_adapts_attention_and_dense_mlps_but_not_experts(tmp_path):
    _, path = save_hf_model(tmp_path, "qwen3_moe")  # layer 0 experts, layer 1 a dense MLP
    model = add_lora(load_hf(path), LoraConfig(rank=4))
    adapted = {str(p[:-2]) for p, _ in nnx.to_flat_state(nnx.state(model, LoraParam))}
    assert any("'layers', 0, 'self_attn'" in p for p in adapted) and any("'layers', 1, 'mlp'" in p for p in adapted)
    assert not any("'layers', 0, 'mlp'" in p for p in adapted)
    built = sum(x.size for x in jax.tree.leaves(nnx.state(model, LoraParam)))
    assert lora_parameter_count(model.config, LoraConfig(rank=4)) == built


def test_a_role_capacity_factor_reaches_its_passes_and_generation_stays_dropless(tmp_path):
    """`actor.expert_capacity_factor` sets the factor of the role's model (its update, log-prob and reference
    passes); an engine built over that model generates with a dropless copy of its structure."""
    _, path = save_hf_model(tmp_path, "qwen3_moe", vocab_size=96)
    actor = ActorConfig(model_path=str(path), expert_capacity_factor=1.5)
    loaded, _ = load_trained(actor, Layout.from_config({"mesh": {"data": 1}, "devices": [0]}), "causal_lm")
    engine = JaxEngine(loaded.model, max_concurrent_decodes=2, max_prefill_length=8, max_new_tokens=4)

    def factors(model):
        return [m.capacity_factor for _, m in nnx.iter_modules(model) if isinstance(m, SparseMoE)]

    assert factors(loaded.model) == [1.5]  # layer 1 is dense
    assert factors(nnx.merge(engine.graphdef, loaded.params, loaded.rest)) == [None]
    with pytest.raises(ValueError, match=r"expert_capacity_factor: expected > 0 or null, got 0"):
        ActorConfig(expert_capacity_factor=0)


def _routed_forward(model, ids, mask, replay=None):
    """(logits, the experts every mixture-of-experts layer chose [rows, length, moe layers, k]) of one jitted
    forward, replaying `replay` when given."""
    graphdef, state = nnx.split(model)

    def forward(state, replay):
        net = nnx.merge(graphdef, state)
        with record_routes() as tape:
            hidden = net.model(ids, mask, None, replay)
        return net.logits(hidden), stacked_routes(tape, 8)

    return jax.jit(forward)(state, replay)


def test_replayed_routes_are_the_recorded_ones_and_the_router_still_learns(tmp_path):
    """A forward replaying its own recorded routes is the same forward (recorded without remat, replayed and
    recorded again under remat: the checkpointed layers hand their routes out); after the router moves (a
    perturbed router, as training moves it), the free forward routes some tokens elsewhere, while the replaying one
    routes every token as recorded, and its loss still has a gradient on the router."""
    remat = "full"
    _, path = save_hf_model(tmp_path, "qwen3_moe", mlp_only_layers=[], num_hidden_layers=2)
    model = load_hf(path)
    ids, mask, _ = left_padded_batch(97, LENGTHS, seed=3)
    logits, routes = _routed_forward(model, ids, mask)
    assert routes.shape == (4, 12, 2, 2) and routes.dtype == jnp.int8  # 8 experts: ids fit int8
    assert route_dtype(128) == jnp.int8 and route_dtype(129) == jnp.int16
    set_remat(model, remat)
    replayed, remat_routes = _routed_forward(model, ids, mask, routes)
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(logits))
    np.testing.assert_array_equal(np.asarray(remat_routes), np.asarray(routes))
    unrecorded, _ = _routed_forward(model, ids, mask, jnp.full_like(routes, -1))  # -1: a token routes itself
    np.testing.assert_array_equal(np.asarray(unrecorded), np.asarray(logits))
    for layer in model.model.layers:  # the router moves
        kernel = layer.mlp.router_kernel
        kernel[...] = kernel[...] + 0.5 * jax.random.normal(jax.random.key(7), kernel.shape)
    free, _ = _routed_forward(model, ids, mask)
    moved, _ = _routed_forward(model, ids, mask, routes)
    valid = mask.astype(bool)
    assert np.abs(np.asarray(moved) - np.asarray(free))[valid][:, :97].max() > 1e-3  # replay changed the forward
    set_remat(model, "none")
    _, free_routes = _routed_forward(model, ids, mask)
    assert (np.asarray(free_routes) != np.asarray(routes))[valid].any()
    _, replay_routes = _routed_forward(model, ids, mask, routes)
    np.testing.assert_array_equal(np.asarray(replay_routes), np.asarray(routes))
    set_remat(model, remat)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        net = nnx.merge(graphdef, params, rest)
        return jnp.sum(net.logits(net.model(ids, mask, None, routes))[..., :97] ** 2 * mask[..., None])

    grads = jax.jit(jax.grad(loss))(params)
    for layer in range(2):
        assert np.abs(np.asarray(grads["model"]["layers"][layer]["mlp"]["router_kernel"][...])).sum() > 0


def _router_summary(model, ids, mask):
    """(`router_summary` of one jitted forward, the gradient of its `aux_loss` on the parameters)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def summary(params):
        net = nnx.merge(graphdef, params, rest)
        with collect_router_stats() as stats:
            net.model(ids, mask)
        figures = router_summary(stats, net.config.experts_per_token)
        return figures["aux_loss"], figures

    (_, figures), grads = jax.jit(jax.value_and_grad(summary, has_aux=True))(params)
    return figures, grads


def test_router_figures_and_balancing_loss_match_transformers(tmp_path):
    """The load-balancing loss equals transformers' `load_balancing_loss_func` over its own router logits (left
    padding masked out); entropy and the busiest and idlest experts' loads equal numpy's from those logits; under
    remat the figures and the loss's gradient are the same (the checkpointed layers hand their statistics out)."""
    reference, path = save_hf_model(tmp_path, "qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])
    ids, mask, positions = left_padded_batch(97, LENGTHS, seed=2)
    with torch.no_grad():
        out = reference(
            input_ids=torch.as_tensor(ids, dtype=torch.long),
            attention_mask=torch.as_tensor(mask),
            position_ids=torch.as_tensor(positions, dtype=torch.long),
            output_router_logits=True,
        )
    assert len(out.router_logits) == 2  # layer 1 is dense
    want_aux = float(load_balancing_loss_func(out.router_logits, 8, 2, torch.as_tensor(mask)))
    valid = mask.reshape(-1).astype(bool)
    entropies, peaks, lows = [], [], []
    for layer_logits in out.router_logits:
        logits = layer_logits.double().numpy()[valid]
        logp = (
            logits
            - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - logits.max(-1, keepdims=True)
        )
        entropies.append(-(np.exp(logp) * logp).sum(-1))
        top2 = np.argsort(-logits, axis=-1)[:, :2]
        share = np.bincount(top2.reshape(-1), minlength=8) / top2.size * 8
        peaks.append(share.max())
        lows.append(share.min())
    model = load_hf(path)
    figures, grads = _router_summary(model, ids, mask)
    assert abs(float(figures["aux_loss"]) - want_aux) <= 1e-5 * want_aux
    np.testing.assert_allclose(float(figures["entropy"]), np.concatenate(entropies).mean(), rtol=1e-5)
    np.testing.assert_allclose(float(figures["max_load"]), np.mean(peaks), rtol=1e-6)
    np.testing.assert_allclose(float(figures["min_load"]), np.mean(lows), rtol=1e-6)
    assert float(figures["dropped"]) == 0.0
    set_remat(model, "full")
    remat_figures, remat_grads = _router_summary(model, ids, mask)
    for key, value in figures.items():
        np.testing.assert_allclose(float(remat_figures[key]), float(value), rtol=1e-6, err_msg=key)
    router = grads["model"]["layers"][0]["mlp"]["router_kernel"][...]
    assert np.abs(np.asarray(router)).sum() > 0
    for (key, got), (_, want) in zip(nnx.to_flat_state(remat_grads), nnx.to_flat_state(grads), strict=True):
        if not np.any(want[...]):  # the LM head and last norm are not in the loss
            assert not np.any(got[...]), key
            continue
        assert relative_error(got[...], want[...]) <= 1e-5, key


def test_the_engine_records_each_tokens_routes_where_a_full_forward_routes_it(tmp_path):
    """Generation with `record_experts`: each sample's recorded experts (its prompt's from the prefill, then one
    token per decode step) are those a full forward over the prompt and response chooses, position by position
    (float32, routers far from ties), for samples that share prompts and finish at different steps."""
    _, path = save_hf_model(tmp_path, "qwen3_moe", vocab_size=96, eos_token_id=7)
    model = load_hf(path)
    engine = JaxEngine(model, max_concurrent_decodes=4, max_prefill_length=16, max_new_tokens=8, record_experts=True)
    generator = OfflineGenerator(engine, nnx.state(model, nnx.Param), progress=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(8, 96, n).tolist() for n in (5, 11, 3)]
    outputs = generator.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=1))
    for out in outputs:
        sequence = np.array([*prompts[out.request], *out.tokens[:-1]], np.int32)[None]
        assert out.experts.shape == (sequence.shape[1], 1, 2) and out.experts.dtype == np.int8
        _, routes = _routed_forward(model, sequence, np.ones_like(sequence))
        np.testing.assert_array_equal(out.experts, np.asarray(routes)[0])


def test_replaying_the_rollouts_routes_gives_the_training_pass_its_experts(tmp_path):
    """A rollout recorded by the engine, assembled into the batch, and the training pass's log probs under a moved
    router (as the policy moves, or as numerics differ between generation and training). Top-1 routing renormalised
    (each token's one expert weighs 1), so routing is the only difference the move makes: without replay the pass
    routes some tokens to other experts than the rollout did and its log probs drift from the rollout's; replaying
    `routed_experts`, every token goes to the rollout's expert and the log probs are the rollout's."""
    overrides = dict(vocab_size=96, eos_token_id=7, mlp_only_layers=[], num_experts_per_tok=1, norm_topk_prob=True)
    _, path = save_hf_model(tmp_path, "qwen3_moe", **overrides)
    model = load_hf(path)
    engine = JaxEngine(model, max_concurrent_decodes=4, max_prefill_length=16, max_new_tokens=6, record_experts=True)
    generator = OfflineGenerator(engine, nnx.state(model, nnx.Param), progress=False)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(8, 96, n).tolist() for n in (5, 9, 3, 12)]
    outputs = generator.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))
    width = 12
    ids = np.zeros((4, width), np.int32)
    mask = np.zeros((4, width), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    batch = {k: jnp.asarray(v) for k, v in assemble(ids, mask, outputs, 1, 6, 0).items()}
    routed = batch[ROUTED_EXPERTS]
    assert routed.shape == (4, 18, 2, 1)
    real = np.asarray(batch["attention_mask"]).astype(bool)
    last = real.sum(1) - 1 + (width - real[:, :width].sum(1))  # each row's last real position: no route recorded
    assert (np.asarray(routed)[~real] == -1).all() and (np.asarray(routed)[np.arange(4), last] == -1).all()
    rollout = np.asarray(batch["rollout_log_probs"])
    for layer in model.model.layers:  # the router moves
        kernel = layer.mlp.router_kernel
        kernel[...] = kernel[...] + 0.3 * jax.random.normal(jax.random.key(5), kernel.shape)
    graphdef, state = nnx.split(model)

    def training_pass(state, batch):
        with record_routes() as tape:
            logp, _ = response_logprobs(nnx.merge(graphdef, state), batch, 1.0, with_entropy=False)
        return logp, stacked_routes(tape, 8)

    free = {k: v for k, v in batch.items() if k != ROUTED_EXPERTS}
    free_logp, free_routes = jax.jit(training_pass)(state, free)
    replay_logp, replay_routes = jax.jit(training_pass)(state, batch)
    recorded = np.asarray(routed) >= 0
    assert (np.asarray(free_routes)[recorded] != np.asarray(routed)[recorded]).any()
    np.testing.assert_array_equal(np.asarray(replay_routes)[recorded], np.asarray(routed)[recorded])
    response = np.asarray(batch["response_mask"]).astype(bool)
    free_drift = np.abs(np.asarray(free_logp) - rollout)[response]
    replay_drift = np.abs(np.asarray(replay_logp) - rollout)[response]
    print(f"max |log prob - rollout's| under the moved router: {free_drift.max():.2e} free, {replay_drift.max():.2e}")
    assert free_drift.max() > 1e-2
    assert replay_drift.max() < 1e-5  # the engine's and the full forward's float32 numerics


def test_a_critic_of_experts_reports_its_router_metrics(tmp_path):
    """A PPO step whose critic is a mixture of experts (the policy's Qwen3-MoE checkpoint with a value head): the
    critic's update reports the router figures the actor does, in the same ranges (8 experts, no capacity)."""
    inputs = with_moe_policy(build_run_inputs(tmp_path), tmp_path)
    cfg = rl_config(inputs, tmp_path / "run", "ppo", trainer={"total_steps": 1})
    (step,) = run_rl(load_rl_config(cfg))
    for role in ("actor", "critic"):
        assert step[f"{role}/router_max_load"] >= 1 - 1e-5 >= step[f"{role}/router_min_load"] - 2e-5 >= 0, role
        assert 0 < step[f"{role}/router_entropy"] <= np.log(8) + 1e-5, role
        assert step[f"{role}/router_dropped"] == 0 and step[f"{role}/router_aux_loss"] > 0, role


@pytest.mark.parametrize("packed_row_tokens", [0, 64])
def test_a_grpo_run_replays_its_rollouts_routes(tmp_path, packed_row_tokens):
    """A GRPO step of a mixture-of-experts policy with `actor.router_replay` (trimmed or packed micro-batches, the
    KL loss against a reference that routes itself) and the load-balancing loss, its router metrics, and the
    settings it refuses."""
    inputs = with_moe_policy(build_run_inputs(tmp_path), tmp_path)
    actor = {"router_replay": True, "router_aux_loss_coef": 0.01, "packed_row_tokens": packed_row_tokens}
    cfg = rl_config(inputs, tmp_path / "run", "grpo", actor=actor, trainer={"total_steps": 1})
    history = run_rl(load_rl_config(cfg))  # 8 rows, mini-batches of 4: the old log probs are a pass of their own
    assert len(history) == 1
    for step in history:  # float32: the training pass replays the rollout's routes and matches its log probs
        assert step["rollout_corr/log_prob_abs_diff_max"] < 1e-4
        assert np.isfinite(step["actor/pg_loss"])
        # the busiest expert has at least, the idlest at most, the mean share; 8 experts; no capacity: none dropped
        assert step["actor/router_max_load"] >= 1 - 1e-5 >= step["actor/router_min_load"] - 2e-5 >= 0
        assert 0 < step["actor/router_entropy"] <= np.log(8) + 1e-5
        assert step["actor/router_dropped"] == 0 and step["actor/router_aux_loss"] > 0
    if packed_row_tokens:
        return
    dense = rl_config(build_run_inputs(tmp_path / "dense"), tmp_path / "d", "grpo", actor={"router_replay": True})
    with pytest.raises(ValueError, match=r"actor.router_replay: .* has no mixture-of-experts layers to replay"):
        run_rl(load_rl_config(dense))
    dense["actor"] = {**dense["actor"], "router_replay": False, "router_aux_loss_coef": 0.01}
    with pytest.raises(ValueError, match=r"actor.router_aux_loss_coef: .* has no mixture-of-experts router"):
        run_rl(load_rl_config(dense))
