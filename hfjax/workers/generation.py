"""Generation requests as the workers run them: sampling settings from a request's `meta_info` and the rollout
config, and one `generate` of a batch of prompts through an `OfflineGenerator` into the rollout batch (prompts,
responses, masks, the rollout's own log probs) with its timing metrics. Shared by the policy worker (generation on
its own devices through the HybridEngine) and the rollout worker of a disaggregated placement. With `rollout.agent`
each sample is a multi-turn trajectory of an environment (`hfjax.envs.AgentGenerator`), built here once per worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from hfjax.config.roles import RolloutConfig
from hfjax.envs.agent_loop import AgentGenerator
from hfjax.envs.base import load_environment
from hfjax.protocol import ROW_OFFSET, DataProto
from hfjax.rollout import OfflineGenerator, SamplingParams
from hfjax.rollout.generator import SampleOutput
from hfjax.workers.sequences import IMAGES, assemble, prompt_token_lists


def agent_generator(generator: OfflineGenerator, rollout: RolloutConfig) -> AgentGenerator | None:
    """The multi-turn generator of `rollout.agent` over `generator` (None when rollouts are single-turn)."""
    agent = rollout.agent
    if not agent.enabled:
        return None
    from hfjax.models import load_tokenizer

    return AgentGenerator(
        generator,
        load_environment(agent.env),
        load_tokenizer(agent.tokenizer_path),
        max_turns=agent.max_turns,
        max_tokens=agent.max_tokens_per_trajectory or rollout.response_length,
        max_tokens_per_turn=agent.max_tokens_per_turn or None,
        env_kwargs=agent.env_kwargs,
        env_workers=agent.env_workers,
        env_step_timeout_s=agent.env_step_timeout_s,
    )


def dataset_rows(columns: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """The prompts' dataset rows in verl's schema (what an environment's `reset` gets) from the batch's columns."""
    rows = len(next(iter(columns.values()))) if columns else 0

    def get(key: str, i: int) -> Any:
        return columns[key][i] if key in columns else None

    return [
        {
            "prompt": get("raw_prompt", i),
            "data_source": get("data_source", i),
            "ability": get("ability", i),
            "reward_model": {"ground_truth": get("ground_truth", i)},
            "extra_info": get("extra_info", i),
            "index": get("index", i),
        }
        for i in range(rows)
    ]


def sampling_params(rollout: RolloutConfig, meta: dict[str, Any]) -> SamplingParams:
    """The request's sampling: `meta_info` may set `n`, `do_sample` (False = greedy, one sample), `seed`,
    `temperature`, `response_length`; the rest comes from `rollout`."""
    greedy = not meta.get("do_sample", True)
    return SamplingParams(
        max_new_tokens=int(meta.get("response_length", rollout.response_length)),
        temperature=0.0 if greedy else float(meta.get("temperature", rollout.temperature)),
        top_k=rollout.top_k,
        top_p=rollout.top_p,
        n=1 if greedy else int(meta.get("n", rollout.n)),
        seed=int(meta.get("seed", rollout.seed)),
        stop_token_ids=() if rollout.ignore_eos else None,
    )


def program_counts(compiles: Mapping[str, int]) -> dict[str, float]:
    """The rollout metrics of an engine's traces by program (`JaxEngine.compiles`)."""
    return {
        "rollout/prefill_programs": float(compiles["prefill"] + compiles["prefill_insert"]),
        "rollout/decode_programs": float(compiles["generate"]),
        "rollout/extend_programs": float(compiles["extend"]),
    }


def generate_batch(
    generator: OfflineGenerator,
    prompts: DataProto,
    sampling: SamplingParams,
    pad_id: int,
    run: Callable[[list[np.ndarray], SamplingParams, int], list[SampleOutput]] | None = None,
    agent: AgentGenerator | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Runs `generator` (its parameters already set) over the left-padded prompts; returns the rollout batch's arrays
    and the timing metrics (`gen_tokens`, `gen_seconds`, `gen_decode_steps`, `gen_kv_cache_bytes`, and the wall
    clock `gen_started_at` / `gen_ended_at` for timelines) with the programs its engine has compiled so far
    (`rollout/prefill_programs`, `rollout/decode_programs`, `rollout/extend_programs`: a count that keeps growing
    means shapes that were not bucketed). `run(prompts, sampling, first_request)` replaces
    `generator.generate` (e.g. generation across weight versions). Sample keys follow each prompt's index in the
    whole batch (`ROW_OFFSET`), so samples do not depend on placement. A prompt the generator rejects is an error
    naming it. With `agent`, each sample is a trajectory of its environment (the batch then also has `env_rewards` and
    the metrics `agent/*`). Prompts with `IMAGES` (a vision-language policy) prefill with them, and each sample's row
    carries its prompt's images to the passes after generation."""
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    first = int(prompts.meta_info.get(ROW_OFFSET, 0))
    images = prompts.batch.get(IMAGES)
    if images is not None and (agent is not None or run is not None):
        raise ValueError("generate_sequences: prompts with images run without an agent loop or partial rollouts")
    started = time.time()
    if images is not None:
        outputs = generator.generate(prompt_token_lists(ids, mask), sampling, first, images=list(images))
    elif agent is not None:
        rows = dataset_rows(prompts.non_tensor_batch)
        outputs = agent.generate(prompt_token_lists(ids, mask), rows, sampling, first)
    else:
        outputs = (run or generator.generate)(prompt_token_lists(ids, mask), sampling, first)
    rejected = [o for o in outputs if o.finish_reason == "rejected"]
    if rejected:
        raise ValueError(f"generate_sequences: prompt {rejected[0].request}: {rejected[0].error}")
    batch = assemble(ids, mask, outputs, sampling.n, sampling.max_new_tokens, pad_id)
    if images is not None:  # samples are prompt-major: prompt i's n samples are rows i*n .. i*n+n-1
        batch[IMAGES] = np.repeat(images, sampling.n, axis=0)
    stats = (agent or generator).last_stats
    timing = {
        "gen_tokens": stats["response_tokens"],
        "gen_seconds": stats["seconds"],
        "gen_decode_steps": stats["decode_steps"],
        "gen_kv_cache_bytes": stats["kv_cache_bytes_per_device"],
        "gen_started_at": started,
        "gen_ended_at": time.time(),
        **program_counts(generator.engine.compiles),
    }
    if agent is not None:  # the turn metrics come from the batch's agent columns, on the controller
        timing["agent/env_wait_share"] = stats["env_wait_share"]
    return batch, timing
