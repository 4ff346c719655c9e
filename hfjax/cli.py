"""The `hfjax` command. `hfjax inspect` shows how a checkpoint's parameters shard under a layout (no weights are
loaded); `hfjax layouts` lists the rule presets or compares layout pairs; `hfjax generate` samples responses;
`hfjax train` runs an RL config; `hfjax sft` / `hfjax rm` train supervised; `hfjax quickstart` runs the CPU demo;
`hfjax export`, `hfjax plot` and `hfjax automap` work on runs and placements."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from hfjax.cli_support import configure_logging, debugging, run_command, version
from hfjax.compile_cache import enable_compilation_cache
from hfjax.packaged import config_path

QUICKSTART_CONFIG = "quickstart.yaml"


def _parse_mesh(text: str) -> dict[str, int]:
    mesh = {}
    for item in text.split(","):
        name, _, size = item.partition("=")
        if not size.isdigit():
            raise SystemExit(f"--mesh: expected AXIS=SIZE[,AXIS=SIZE...], e.g. fsdp=4,tensor=2; got {text!r}")
        mesh[name.strip()] = int(size)
    return mesh


def _layout_config(args: argparse.Namespace) -> dict[str, Any]:
    rules: Any = args.rules
    if rules.startswith("["):
        rules = json.loads(rules)
    return {"mesh": _parse_mesh(args.mesh), "rules": rules}


def cmd_inspect(args: argparse.Namespace) -> int:
    import math

    import jax
    import numpy as np
    from flax import nnx
    from rich.console import Console
    from rich.table import Table

    from hfjax.models.hf import abstract_model, read_config
    from hfjax.parallel import Layout

    cfg, head = read_config(args.model)
    model = abstract_model(cfg, args.head or head, args.dtype)
    layout = Layout.from_config(_layout_config(args))
    shardings = dict(nnx.to_flat_state(layout.shardings(nnx.state(model, nnx.Param))))
    table = Table(
        title=f"{args.model}: {cfg.num_params / 1e6:.1f}M parameters under {layout.describe()}, rules {args.rules}"
    )
    for col in ("parameter", "shape", "logical axes", "partition", "bytes / device"):
        table.add_column(col)
    total, per_device = 0, 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        sharding = shardings[path]
        nbytes = math.prod(var.shape) * np.dtype(var.dtype).itemsize
        local = math.prod(sharding.shard_shape(var.shape)) * np.dtype(var.dtype).itemsize
        total, per_device = total + nbytes, per_device + local
        if args.all or not any(isinstance(k, int) and k > 0 for k in path):
            table.add_row(
                "/".join(map(str, path)),
                str(var.shape),
                str(var.get_metadata()["logical_axes"]),
                str(tuple(sharding.spec)),
                f"{local:,}",
            )
    Console(width=160).print(table)
    print(
        f"parameters: {total / 2**20:.1f} MiB in all, {per_device / 2**20:.1f} MiB per device on "
        f"{jax.device_count()} devices{' (layer 0 shown; --all for every layer)' if not args.all else ''}"
    )
    return 0


def abstract_params_for(model: str, dtype: str) -> Any:
    """Abstract parameters (no memory) of a Hugging Face directory or a named size such as `llama-200m`."""
    from pathlib import Path

    from flax import nnx

    from hfjax.models.hf import abstract_model, read_config
    from hfjax.models.presets import named_config

    if Path(model).is_dir():
        cfg, head = read_config(model)
    else:
        cfg, head = named_config(model), "causal_lm"
    return nnx.state(abstract_model(cfg, head, dtype), nnx.Param)


def cmd_layouts(args: argparse.Namespace) -> int:
    from hfjax.parallel import RULE_PRESETS

    if not args.pairs:
        for name, rules in RULE_PRESETS.items():
            print(f"{name:10s} " + ", ".join(f"{logical}->{'x'.join(axes)}" for logical, axes in rules))
        return 0
    if not args.model:
        raise SystemExit("hfjax layouts --pairs needs --model (a Hugging Face directory or a named size)")
    import yaml

    from hfjax.layout_table import print_layout_rows, write_rows
    from hfjax.parallel.layout_compare import compare_layouts

    with open(args.pairs) as f:
        pairs = (yaml.safe_load(f) or {}).get("pairs")
    if not isinstance(pairs, list) or not all(isinstance(p, dict) and {"train", "gen"} <= set(p) for p in pairs):
        raise SystemExit(f"{args.pairs}: expected 'pairs:' as a list of {{name, train, gen}} layout entries")
    rows = compare_layouts(abstract_params_for(args.model, args.dtype), pairs, repeats=args.repeats)
    print_layout_rows(rows, f"{args.model} ({args.dtype}) on {args.devices or 'all'} devices")
    if args.out:
        write_rows(rows, args.out)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
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
        layout = Layout.from_config(_layout_config(args)) if args.mesh else None
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


def cmd_train(args: argparse.Namespace) -> int:
    from hfjax.config.rl import load_rl_config
    from hfjax.trainer.launch import run_rl

    cfg = load_rl_config(args.config, args.overrides)
    if args.dry_run:
        from hfjax.trainer.dry_run import describe_run

        print(describe_run(cfg))
        return 0
    history = run_rl(cfg)
    last = history[-1] if history else {}
    keys = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "timing_s/step")
    print("final step: " + ", ".join(f"{k}={last[k]:.4g}" for k in keys if k in last))
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from hfjax.compiled import parse_target

    target = parse_target(args.target)  # before any config work: a bad name is the first error
    from hfjax.compiled.report import compile_run, fits, format_report, predicted_peak
    from hfjax.config.rl import load_rl_config

    cfg = load_rl_config(args.config, args.overrides)
    programs = compile_run(cfg, target)
    predicted = predicted_peak(cfg, target)
    print(format_report(programs, target, predicted))
    problems = fits(programs, target)
    for line in problems:
        print(line)
    if args.json:
        rows = [{**dataclasses.asdict(p), "peak": p.peak} for p in programs]
        Path(args.json).write_text(
            json.dumps(
                {"target": target.name, "programs": rows, "fits": not problems, "cost_model_peak": predicted}, indent=1
            )
        )
    return 1 if problems else 0


def cmd_export(args: argparse.Namespace) -> int:
    from hfjax.trainer.launch import export_run

    step = export_run(args.run_dir, args.step, args.out)
    print(f"exported step {step} of {args.run_dir} to {args.out}")
    return 0


def cmd_automap(args: argparse.Namespace) -> int:
    from hfjax.trainer.automap_run import automap_run

    return automap_run(args.cluster, args.config, args.out, args.top)


def cmd_supervised(args: argparse.Namespace) -> int:
    from hfjax.trainer import rm_main, sft_main

    return (sft_main if args.command == "sft" else rm_main)(args.config, args.overrides)


def cmd_quickstart(args: argparse.Namespace) -> int:
    from hfjax.quickstart import quickstart_main

    return quickstart_main(args.config, args.overrides)


def cmd_data(args: argparse.Namespace) -> int:
    from hfjax.data.records import read_rows
    from hfjax.data.tasks import prepare_task

    for name, path in prepare_task(args.task, args.out, args.source).items():
        print(f"{name}: {len(read_rows(path))} rows -> {path}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from hfjax.plot import plot_main

    return plot_main(args.plot_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hfjax", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hfjax {version()}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of hfjax's errors (or HFJAX_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="show parameter shardings of a checkpoint under a layout")
    inspect.add_argument("model", help="Hugging Face model directory")
    inspect.add_argument("--mesh", default="fsdp=1", help="mesh axes and sizes, e.g. fsdp=4,tensor=2")
    inspect.add_argument("--rules", default="fsdp_tp", help="rule preset name or a JSON list of [logical, mesh]")
    inspect.add_argument("--devices", type=int, help="on CPU: number of fake devices to create")
    inspect.add_argument("--head", choices=["causal_lm", "seq_cls", "token_cls"], help="override the head kind")
    inspect.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    inspect.add_argument("--all", action="store_true", help="list every layer, not only layer 0")
    inspect.set_defaults(run=cmd_inspect)
    layouts = sub.add_parser("layouts", help="list rule presets, or compare (train, gen) layout pairs for a model")
    layouts.add_argument("--model", help="Hugging Face model directory or a named size (e.g. llama-200m)")
    layouts.add_argument("--pairs", help="YAML file with 'pairs: [{name, train, gen}, ...]'")
    layouts.add_argument("--devices", type=int, help="on CPU: number of fake devices to create")
    layouts.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    layouts.add_argument("--repeats", type=int, default=0, help="also time to_gen/to_train this many times")
    layouts.add_argument("--out", help="write the rows as JSON here")
    layouts.set_defaults(run=cmd_layouts)
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
    generate.set_defaults(run=cmd_generate)
    train = sub.add_parser("train", help="run an RL config (PPO, GRPO, RLOO, REINFORCE++, ReMax, Safe-RLHF)")
    train.add_argument("config", help="YAML config (see configs/)")
    train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. actor.optim.lr=1e-5")
    train.add_argument("--devices", type=int, help="on CPU: number of fake devices of this process")
    train.add_argument(
        "--dry-run",
        "--print-config",
        action="store_true",
        help="print the resolved config, worker groups, layouts and the cost model's memory per device; start nothing",
    )
    train.set_defaults(run=cmd_train)
    compile_ = sub.add_parser(
        "compile", help="compile a run's programs for a TPU or GPU target on this machine; print memory per device"
    )
    compile_.add_argument("config", help="YAML config (see configs/)")
    compile_.add_argument("overrides", nargs="*", help="key=value overrides, e.g. actor.micro_batch_size=8")
    compile_.add_argument("--target", required=True, help="v5e:2x4, v5p:2x2x1, v6e:2x4, h100, h100x8, a100-80gbx8, ...")
    compile_.add_argument("--json", help="also write the table as JSON to this file")
    compile_.set_defaults(run=cmd_compile)
    export = sub.add_parser("export", help="write a run's actor checkpoint as a Hugging Face model")
    export.add_argument("run_dir")
    export.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    export.add_argument("--out", required=True)
    export.set_defaults(run=cmd_export)
    automap = sub.add_parser("automap", help="choose placement and layouts for an RL run from a cost model")
    automap.add_argument("--cluster", required=True, help="cluster YAML (hosts, devices, memory, profile)")
    automap.add_argument("--config", required=True, help="the RL run config (the YAML `hfjax train` reads)")
    automap.add_argument("--out", help="write the best mapping here, as that run config with it filled in")
    automap.add_argument("--top", type=int, default=10)
    automap.set_defaults(run=cmd_automap)
    for name, text in (("sft", "supervised fine-tuning"), ("rm", "Bradley-Terry reward-model training")):
        supervised = sub.add_parser(name, help=f"{text} from a YAML config")
        supervised.add_argument("config")
        supervised.add_argument("overrides", nargs="*", help="key=value overrides")
        supervised.add_argument("--devices", type=int, help="on CPU: number of fake devices of this process")
        supervised.set_defaults(run=cmd_supervised)
    quickstart = sub.add_parser("quickstart", help="SFT then RL on a synthetic addition task, built locally")
    quickstart.add_argument(
        "config",
        nargs="?",
        default=QUICKSTART_CONFIG,
        help="YAML config (default: the shipped one); an argument with '=' is an override, not a config",
    )
    quickstart.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rl.algorithm.name=ppo")
    quickstart.set_defaults(run=cmd_quickstart, default_config=QUICKSTART_CONFIG)
    data = sub.add_parser("data", help="write a built-in task's prompts (and SFT rows) in the prompt schema")
    data.add_argument("task", choices=["gsm8k", "addition"])
    data.add_argument("--out", required=True, help="folder to write the parquet files to")
    data.add_argument(
        "--from",
        dest="source",
        help="a local copy of the raw files (default: the Hub dataset, from the local cache or downloaded when online)",
    )
    data.set_defaults(run=cmd_data)
    plot = sub.add_parser("plot", help="PNG curves of a run's metrics.jsonl")
    plot.add_argument("plot_args", nargs=argparse.REMAINDER, metavar="RUN_DIR [--out DIR]")
    plot.set_defaults(run=cmd_plot)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's arguments. A command whose config is optional (`quickstart`) takes its default config when
    the first positional is a `key=value` override (argparse gives that positional to the config first): e.g.
    `hfjax quickstart rl.algorithm.name=ppo`."""
    args = build_parser().parse_args(argv)
    default = getattr(args, "default_config", None)
    if default is not None and "=" in args.config:
        args.overrides, args.config = [args.config, *args.overrides], default
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if getattr(args, "devices", None):
        if "jax" in sys.modules:
            raise SystemExit("--devices must be set before JAX is imported")
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
        ).strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.command == "compile":  # compile-only devices: JAX itself runs on the CPU, never on the plugins' hardware
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    enable_compilation_cache()
    configure_logging()

    def run() -> int:
        if isinstance(getattr(args, "config", None), str):  # a file, or the name of a config shipped with hfjax
            args.config = str(config_path(args.config))
        return args.run(args)

    return run_command(args.command, run, debugging(args.debug))


if __name__ == "__main__":
    sys.exit(main())
