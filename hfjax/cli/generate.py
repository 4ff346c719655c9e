"""`hfjax generate`: sample responses for a JSONL file of prompts (single-turn, or multi-turn with an
environment), every argument checked before the model loads."""

from __future__ import annotations

import argparse
import json
from typing import Any

from hfjax.cli.model_args import layout_config


def add_parser(sub: Any) -> None:
    generate = sub.add_parser("generate", help="sample responses for a JSONL file of prompts")
    generate.add_argument("--model", required=True, help="Hugging Face causal-LM directory (with its tokenizer)")
    generate.add_argument("--prompts", required=True, help='JSONL: {"prompt"|"messages"|"text"|"input_ids": ...}')
    generate.add_argument("--out", required=True, help="JSONL output, one line per sample")
    generate.add_argument("--max-new-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    generate.add_argument("--top-k", type=int, default=0, help="0 = off")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--n", type=int, default=1, help="samples per prompt")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--stop", help="comma-separated stop token ids (default: the model's eos)")
    generate.add_argument("--slots", type=int, default=64, help="concurrent sequences (KV cache slots)")
    generate.add_argument("--max-prefill-length", type=int, help="longest prompt (default: the longest given)")
    generate.add_argument("--dtype", default="float32")
    generate.add_argument("--mesh", help="generation mesh, e.g. data=4,tensor=2 (default: one device)")
    generate.add_argument("--rules", default="dp_tp_gen", help="rule preset name or a JSON list of [logical, mesh]")
    generate.add_argument("--devices", type=int, help="on CPU: number of fake devices to create")
    generate.add_argument("--agent", help="multi-turn: an environment path/to/file.py:ClassName (hfjax.envs)")
    generate.add_argument("--max-turns", type=int, default=4, help="with --agent: model turns per trajectory")
    generate.add_argument("--max-tokens-per-turn", type=int, help="with --agent: default no limit but the budget")
    generate.add_argument("--env-kwargs", default="{}", help="with --agent: JSON keyword arguments of the env")
    generate.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from flax import nnx

    from hfjax.envs.base import load_environment
    from hfjax.models import load_hf, load_tokenizer
    from hfjax.parallel import Layout
    from hfjax.rollout import JaxEngine, OfflineGenerator, SamplingParams
    from hfjax.rollout.prompt_file import read_prompts, write_results
    from hfjax.trainer.preflight import check_generation, model_config
    from hfjax.typed_config import ConfigError

    try:  # every argument checked before the model loads: one line each, no traceback
        stop = None if args.stop is None else tuple(int(t) for t in args.stop.split(",") if t)
        sampling = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            n=args.n,
            seed=args.seed,
            stop_token_ids=stop,
        )
        for flag, value in (
            ("--slots", args.slots),
            ("--max-prefill-length", args.max_prefill_length or 1),
            ("--max-turns", args.max_turns),
            ("--max-tokens-per-turn", args.max_tokens_per_turn or 1),
        ):
            if value < 1:
                raise ConfigError(f"{flag}: expected >= 1, got {value}")
        model_cfg = model_config(args.model, "--model")
        env_cls = load_environment(args.agent) if args.agent else None
        env_kwargs = json.loads(args.env_kwargs)
        if not isinstance(env_kwargs, dict):
            raise ConfigError(f"--env-kwargs: expected a JSON object, got {args.env_kwargs!r}")
        tokenizer = load_tokenizer(args.model)
        rows, prompts = read_prompts(args.prompts, tokenizer)
        layout = Layout.from_config(layout_config(args)) if args.mesh else None
        prefill = args.max_prefill_length or max([1, *map(len, prompts)])
        devices = layout.size if layout is not None else 1
        check_generation(model_cfg, prefill, args.max_new_tokens, args.slots, args.dtype, devices)
    except ValueError as exc:  # ConfigError, SamplingError, DataError, LayoutError, CheckpointError, EnvError, JSON
        raise SystemExit(f"hfjax generate: {exc}") from None
    model = load_hf(args.model, dtype=args.dtype, layout=layout)
    if model.head_kind != "causal_lm":
        raise SystemExit(f"--model: {args.model} is a {model.head_kind} checkpoint; generation needs a causal LM")
    _, params, _ = nnx.split(model, nnx.Param, ...)
    engine = JaxEngine(
        model, layout, max_concurrent_decodes=args.slots, max_prefill_length=prefill, max_new_tokens=args.max_new_tokens
    )
    generator = OfflineGenerator(engine, params, eos_token_ids=_eos_ids(args.model, model, tokenizer))
    if env_cls is None:
        outputs = generator.generate(prompts, sampling)
        stats = generator.last_stats
    else:  # multi-turn: the whole trajectory after the prompt within --max-new-tokens
        from hfjax.envs.agent_loop import AgentGenerator

        agent = AgentGenerator(
            generator,
            env_cls,
            tokenizer,
            max_turns=args.max_turns,
            max_tokens=args.max_new_tokens,
            max_tokens_per_turn=args.max_tokens_per_turn,
            env_kwargs=env_kwargs,
        )
        outputs = agent.generate(prompts, rows, sampling)
        stats = agent.last_stats
    write_results(args.out, rows, outputs, tokenizer)
    rejected = sum(o.finish_reason == "rejected" for o in outputs)
    print(
        f"wrote {len(outputs)} samples to {args.out} ({rejected} rejected); {stats['response_tokens']} tokens in "
        f"{stats['seconds']:.1f} s; compiles {dict(engine.compiles)}"
    )
    return 0


def _eos_ids(model_dir: str, model: Any, tokenizer: Any) -> tuple[int, ...]:
    """Stop ids: generation_config.json's eos, else config.json's, else the tokenizer's."""
    from pathlib import Path

    file = Path(model_dir) / "generation_config.json"
    if file.is_file():
        eos = json.loads(file.read_text()).get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    if model.config.eos_token_ids:
        return model.config.eos_token_ids
    eos_id = getattr(tokenizer, "eos_token_id", None)
    return () if eos_id is None else (int(eos_id),)
