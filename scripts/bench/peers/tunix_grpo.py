"""Tunix's `GRPOLearner` on CPU with the workload of hfjax's GRPO benchmark: the Tunix side of the side-by-side.

Workload (the same as `trl_grpo.py`'s): the reference checkpoint (fp32) loaded into Tunix's own Llama
(`tunix.models.llama3`) as the policy and, separately, the reference model; the 64 prompts of `workload.py` rendered
with the chat template and its generation prompt (no BOS added, as TRL does), 4 samples per prompt, responses of
exactly `--max-new-tokens` (the sampler never draws EOS, nor the pad token, which Tunix would mask out as padding),
temperature 1.0 with no top-k/top-p, the rule reward of `reward.py` on the decoded text (special tokens skipped),
group-normalized advantages, clip 0.2, k3 ("low_var_kl") KL loss `--beta`, token-mean loss, one AdamW update per step
over all samples (gradient accumulation over `--micro-batch` samples), one iteration, constant learning rate, grad clip
1.0, a one-device mesh.
Tunix 0.1.7's Llama ignores `ModelConfig.rope_theta` (its attention calls `apply_rope` with the default, 1e6); this
script passes the checkpoint's value (1e4) in (without it, logits differ from transformers' on the same weights by up
to 0.17 over 40 tokens; with it, by 3e-6).

Timing: wall time of each global step (`RLLearner._run_global_step`: generation, reward, reference log-probs, the
policy's forward/backward per micro-batch and the update), split into verl's `timing_s/{gen,reward,ref,update_actor}`
by timing the `RLCluster` methods the learner calls (`generate`, `get_ref_per_token_logps` until its result is ready,
`update_actor`) and the reward function. `seconds_per_step` and `tokens_per_s` as in `trl_grpo.py`.
Writes the summary JSON (`--out`) and per-step metrics with verl's names (`--metrics`). Run in the Tunix virtualenv
(`bash scripts/bench/peers/setup_tunix.sh` makes it):
    runs/peers/tunix-venv/bin/python scripts/bench/peers/tunix_grpo.py [--ckpt DIR] [--steps 2] [--tiny]
With `--tiny` and no Tunix installed, only the workload is built and the summary says why training was skipped.
Imports tunix, jax, optax and transformers inside functions, and `workload.py`, `reward.py`, `peer_run.py` (the
summary both peers write) and `bench_common.py` beside it; never hfjax's JAX code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from bench_common import parse_args as parse_with_tiny  # noqa: E402
from peer_run import TINY, prepare, workload_parser, write_summary  # noqa: E402
from reward import compute_score  # noqa: E402
from workload import DATA_SOURCE, checkpoint  # noqa: E402

PHASES = ("gen", "reward", "ref", "update_actor")
AUX_TO_VERL = {"pg_loss": "actor/pg_loss", "kl_loss": "actor/kl_loss", "entropy": "actor/entropy",
               "pg_clipfrac": "actor/pg_clipfrac"}  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = workload_parser(__doc__, "tunix")
    args = parse_with_tiny(parser, tiny=TINY)
    args.min_new_tokens = args.max_new_tokens  # the sampler never stops early
    samples = args.prompts * args.group
    bad = min(args.steps, args.group - 1) < 1 or args.beta <= 0
    if bad or samples % args.micro_batch or args.micro_batch % args.group:
        parser.error(
            f"expected --steps >= 1, --beta > 0, --group >= 2, and --micro-batch ({args.micro_batch}) a multiple of "
            f"--group dividing prompts x group ({samples})"
        )
    return args


def load_prompts(path: Path, n: int, tokenizer: Any, max_tokens: int) -> tuple[list[str], list[int]]:
    """The first `n` prompts of a verl-schema parquet rendered with the chat template (generation prompt included),
    and their token counts (no special tokens added, as `workload.prompt_length` counts them)."""
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    if len(rows) < n:
        raise SystemExit(f"{path}: {len(rows)} prompts, expected at least --prompts {n}")
    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows[:n]]
    lengths = [len(tokenizer.encode(text, add_special_tokens=False)) for text in texts]
    if max(lengths) > max_tokens:
        raise SystemExit(f"{path}: a prompt of {max(lengths)} tokens, over --max-prompt-tokens {max_tokens}")
    return texts, lengths


def model_config(ckpt: Path) -> Any:
    """Tunix's `llama3.ModelConfig` for the HF config.json, field by field; exits if Tunix's Llama cannot
    represent the checkpoint (biases, another activation, RoPE scaling)."""
    from tunix.models.llama3 import model as llama

    c = json.loads((ckpt / "config.json").read_text())
    rope = c.get("rope_parameters") or {"rope_theta": c.get("rope_theta", 10000.0), "rope_type": "default"}
    unsupported = {
        "model_type": c.get("model_type") != "llama",
        "hidden_act": c.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(c.get("attention_bias")),
        "mlp_bias": bool(c.get("mlp_bias")),
        "rope_parameters": rope.get("rope_type", "default") != "default" or c.get("rope_scaling") is not None,
    }
    if any(unsupported.values()):
        raise SystemExit(f"{ckpt}: Tunix's Llama cannot represent {[k for k, bad in unsupported.items() if bad]}")
    return llama.ModelConfig(
        num_layers=c["num_hidden_layers"],
        vocab_size=c["vocab_size"],
        embed_dim=c["hidden_size"],
        hidden_dim=c["intermediate_size"],
        num_heads=c["num_attention_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        num_kv_heads=c["num_key_value_heads"],
        rope_theta=rope["rope_theta"],
        norm_eps=c["rms_norm_eps"],
        weight_tying=bool(c.get("tie_word_embeddings", False)),
    )


def use_config_rope_theta(theta: float) -> None:
    """Makes Tunix's Llama attention rotate with `theta` (Tunix 0.1.7 calls `apply_rope` without `rope_theta`, so its
    default, 1e6, applies whatever the config says)."""
    from tunix.models.llama3 import model as llama

    shipped = llama.apply_rope

    def apply_rope(inputs: Any, positions: Any, head_dim: int, rope_theta: float = theta) -> Any:
        return shipped(inputs, positions, head_dim=head_dim, rope_theta=theta)

    llama.apply_rope = apply_rope


def fixed_length_rollout(forbidden: tuple[int, ...], seed: int) -> type:
    """A `VanillaRollout` whose sampler takes the rendered prompts' tokens as they are (Tunix's `Sampler.tokenize`
    prepends BOS), never samples `forbidden` (EOS and pad: every response runs to the maximum length), decodes
    without special tokens (as TRL's reward input) and draws fresh randomness each call (the sampler's default seed
    is the same key every call)."""
    import jax
    import numpy as np
    from tunix.generate import sampler as sampler_lib
    from tunix.generate import tokenizer_adapter
    from tunix.rl.rollout import base_rollout, vanilla_rollout

    class PlainTokenizer(tokenizer_adapter.TokenizerAdapter):
        def encode(self, text: str, **kwargs: Any) -> list[int]:
            return self.tokenizer.encode(str(text), add_special_tokens=False)  # Tunix hands numpy strings

        def decode(self, ids: list[int], **kwargs: Any) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    class PromptAsIsSampler(sampler_lib.Sampler):
        def tokenize(self, input_string: str) -> np.ndarray:
            return np.asarray(self.tokenizer.encode(input_string), dtype=np.int32)

    class FixedLengthRollout(vanilla_rollout.VanillaRollout):
        def __init__(self, rollout_actor: Any, tokenizer: Any, mesh: Any, rollout_config: Any) -> None:
            cfg = rollout_actor.config
            cache = sampler_lib.CacheConfig(
                rollout_config.kv_cache_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
            )
            self._sampler = PromptAsIsSampler(rollout_actor, PlainTokenizer(tokenizer.tokenizer), cache)
            self._calls = 0

        def generate(self, prompts: list[str], rollout_config: Any, **kwargs: Any) -> Any:
            out = self._sampler(
                input_strings=prompts,
                max_generation_steps=rollout_config.max_tokens_to_generate,
                max_prompt_length=rollout_config.max_prompt_length,
                temperature=rollout_config.temperature,
                top_p=rollout_config.top_p,
                top_k=rollout_config.top_k,
                seed=jax.random.fold_in(jax.random.PRNGKey(seed), self._calls),
                forbidden_tokens=forbidden,
                return_logprobs=rollout_config.return_logprobs,
            )
            self._calls += 1
            return base_rollout.RolloutOutput(out.text, out.logits, out.tokens, out.padded_prompt_tokens, out.logprobs)

    return FixedLengthRollout


class StepRecorder:
    """Times each global step and its phases, keeps the step's rewards, tokens and loss terms, and appends the
    step's metrics with verl's names to `metrics_path`."""

    def __init__(self, metrics_path: Path) -> None:
        self.metrics_path = metrics_path
        self.seconds: list[float] = []
        self.tokens: list[int] = []
        self.response_tokens: list[int] = []
        self.phases: list[dict[str, float]] = []
        self._phase: dict[str, float] = {}
        self._rewards: list[float] = []
        self._aux: list[dict[str, Any]] = []
        self._tokens = (0, 0)
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
        metrics_path.write_text("")

    def timed(self, phase: str, fn: Callable[..., Any], block: bool = False) -> Callable[..., Any]:
        """`fn`, adding its wall time (until its result is ready, with `block`) to the step's `phase`."""
        import jax

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            out = fn(*args, **kwargs)
            if block:
                out = jax.block_until_ready(out)
            self._phase[phase] = self._phase.get(phase, 0.0) + time.perf_counter() - started
            return out

        return wrapper

    def generated(self, out: Any, pad_id: int) -> Any:
        """Counts a rollout's prompt (non-pad) and response tokens."""
        prompt = int((out.left_padded_prompt_tokens != pad_id).sum())
        self._tokens = (prompt, sum(len(t) for t in out.tokens))
        print(f"  generated {len(out.tokens)} responses", flush=True)
        return out

    def reward(self, prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        """The digits reward (`reward.compute_score`) of each completion, timed and kept for the step's metrics."""
        started = time.perf_counter()
        rewards = [compute_score(DATA_SOURCE, text, None) for text in completions]
        self._rewards.extend(rewards)
        self._phase["reward"] = self._phase.get("reward", 0.0) + time.perf_counter() - started
        return rewards

    def end_step(self, step: int, seconds: float) -> None:
        prompt, response = self._tokens
        phases = {f"timing_s/{p}": self._phase.get(p, 0.0) for p in PHASES} | {"timing_s/step": seconds}
        self.seconds.append(seconds)
        self.tokens.append(prompt + response)
        self.response_tokens.append(response)
        self.phases.append(phases)
        rewards, samples = self._rewards or [0.0], max(len(self._rewards), 1)
        row: dict[str, Any] = {"step": step, "critic/score/mean": sum(rewards) / samples}
        row |= {
            "critic/score/max": max(rewards),
            "critic/score/min": min(rewards),
            "response_length/mean": response / samples,
        }
        for name, verl in AUX_TO_VERL.items():  # micro-batches of equal token counts: their mean is the token mean
            if values := [float(aux[name]) for aux in self._aux if name in aux]:
                row[verl] = sum(values) / len(values)
        row.update({"perf/throughput": (prompt + response) / seconds, **phases})
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        shown = ", ".join(f"{k.split('/')[1]} {v:.1f} s" for k, v in phases.items())
        print(f"step {step}: {row['perf/throughput']:,.0f} tokens/s, reward {row['critic/score/mean']:.4f}, "
              f"kl {row.get('actor/kl_loss', float('nan')):.3g}; {shown}", flush=True)  # fmt: skip
        self._phase, self._rewards, self._aux, self._tokens = {}, [], [], (0, 0)


def instrument(learner: Any, recorder: StepRecorder) -> None:
    """Wraps the learner's and cluster's per-step calls with the recorder's timers (instance attributes only)."""
    cluster, trainer = learner.rl_cluster, learner.rl_cluster.actor_trainer
    pad_id = cluster.rollout.pad_id()
    generate = recorder.timed("gen", cluster.generate)
    cluster.generate = lambda *a, **k: recorder.generated(generate(*a, **k), pad_id)
    cluster.get_ref_per_token_logps = recorder.timed("ref", cluster.get_ref_per_token_logps, block=True)
    cluster.update_actor = recorder.timed("update_actor", cluster.update_actor)
    post_process = trainer._post_process_train_step

    def keep_aux(aux: Any) -> None:
        recorder._aux.append(aux)
        post_process(aux)

    trainer._post_process_train_step = keep_aux
    run_global_step = learner._run_global_step

    def timed_step(*args: Any, **kwargs: Any) -> None:
        print(f"step {len(recorder.seconds) + 1}: generating, scoring, reference log-probs, update ...", flush=True)
        started = time.perf_counter()
        run_global_step(*args, **kwargs)
        recorder.end_step(len(recorder.seconds) + 1, time.perf_counter() - started)

    learner._run_global_step = timed_step


def build_learner(args: argparse.Namespace, ckpt: Path, recorder: StepRecorder) -> tuple[Any, Any]:
    """Policy and reference (Tunix Llama from the safetensors), the RL cluster on a one-device mesh; returns the
    GRPO learner, instrumented for `recorder`, and the tokenizer."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import transformers
    from tunix.models.llama3 import params as llama_params
    from tunix.rl import rl_cluster as rl
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    config = model_config(ckpt)
    use_config_rope_theta(config.rope_theta)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    policy, reference = (
        llama_params.create_model_from_safe_tensors(str(ckpt), config, mesh=mesh, dtype=jnp.float32) for _ in range(2)
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt)
    micro_prompts = args.micro_batch // args.group  # Tunix counts its batch sizes in prompts
    training = rl.RLTrainingConfig(
        actor_optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, weight_decay=0.0)),
        eval_every_n_steps=1,
        max_steps=args.steps,
        mini_batch_size=args.prompts,
        train_micro_batch_size=micro_prompts,
        rollout_micro_batch_size=args.prompts,
        compute_logps_micro_batch_size=micro_prompts,
    )
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=args.max_new_tokens,
        max_prompt_length=args.max_prompt_tokens,
        kv_cache_size=args.max_prompt_tokens + args.max_new_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=None,
    )
    cluster = rl.RLCluster(
        actor=policy,
        reference=reference,
        tokenizer=tokenizer,
        cluster_config=rl.ClusterConfig(
            role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh},
            rollout_engine=fixed_length_rollout((tokenizer.eos_token_id, tokenizer.pad_token_id), seed=0),
            training_config=training,
            rollout_config=rollout,
        ),
    )
    algo = grpo_learner.GRPOConfig(
        num_generations=args.group,
        num_iterations=1,
        beta=args.beta,
        kl_loss_mode="low_var_kl",
        epsilon=0.2,
        loss_agg_mode="token-mean",
    )
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=recorder.reward)
    instrument(learner, recorder)
    return learner, tokenizer


def main() -> None:
    args = parse_args()
    ckpt = checkpoint(args.ckpt, args.tiny)
    workload = prepare(args, ckpt, "Tunix", "tunix")
    if workload is None:
        return
    import numpy as np
    import psutil

    recorder = StepRecorder(args.metrics)
    started = time.perf_counter()
    learner, tokenizer = build_learner(args, ckpt, recorder)
    prompts, lengths = load_prompts(workload, args.prompts, tokenizer, args.max_prompt_tokens)
    shape = (
        f"{args.prompts} prompts ({min(lengths)}..{max(lengths)} tokens) x {args.group} x {args.max_new_tokens} tokens"
    )
    print(f"Tunix GRPO: {shape}, {args.steps} steps (setup {time.perf_counter() - started:.1f} s)", flush=True)
    load_before = os.getloadavg()
    started = time.perf_counter()
    learner.train([{"prompts": np.array(prompts)}] * args.steps)  # one array: Tunix maps over the batch's leaves
    children = len(psutil.Process().children(recursive=True))
    packages = (("tunix", "google-tunix"), ("jax", "jax"), ("flax", "flax"), ("transformers", "transformers"))
    write_summary(
        args, "Tunix", recorder, ckpt, workload, started, load_before,
        peak_rss_note=f"VmHWM of this process: Tunix runs rollout, reference and training in its threads ({children} "
        "child processes at the end)",
        versions={name: metadata.version(dist) for name, dist in packages},
    )  # fmt: skip


if __name__ == "__main__":
    main()
