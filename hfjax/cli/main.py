"""The `hfjax` command: one module of `hfjax.cli` per command, each adding its parser (`add_parser`) and running
it (`run`); `DESCRIPTION` is what `hfjax --help` says."""

from __future__ import annotations

import argparse
import os
import sys

from hfjax.cli import (
    automap,
    compile_target,
    data,
    export,
    generate,
    inspect_checkpoint,
    layouts,
    plot,
    quickstart_command,
    serve,
    supervised,
    sweep,
    train,
)
from hfjax.cli.packaged import config_path
from hfjax.cli.runner import configure_logging, debugging, run_command, version
from hfjax.xla_settings import enable_compilation_cache

DESCRIPTION = """`hfjax inspect` shows how a checkpoint's parameters shard under a layout (no weights are loaded);
`hfjax layouts` lists the rule presets or compares layout pairs; `hfjax generate` samples responses; `hfjax train`
runs an RL config; `hfjax compile` compiles it for a TPU or GPU target; `hfjax sft` / `hfjax rm` train
supervised; `hfjax quickstart` runs the CPU demo; `hfjax export`, `hfjax plot`, `hfjax data` and `hfjax automap`
work on runs, data and placements; `hfjax sweep` measures candidate layouts beside the cost model; `hfjax serve`
serves LoRA training and sampling of a base model over the Tinker API."""

COMMANDS = (
    inspect_checkpoint,
    layouts,
    generate,
    train,
    compile_target,
    export,
    automap,
    sweep,
    supervised,
    quickstart_command,
    data,
    plot,
    serve,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hfjax", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"hfjax {version()}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of hfjax's errors (or HFJAX_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's arguments. A command whose config is optional (`quickstart`) takes its default config when
    the first positional is a `key=value` override (argparse gives that positional to the config first): e.g.
    `hfjax quickstart rl.algorithm.name=ppo`. Overrides may also follow the options (`hfjax compile CONFIG --target
    h100 actor.micro_batch_size=8`), which argparse alone leaves unrecognised."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        takes_overrides = isinstance(getattr(args, "overrides", None), list)
        if not takes_overrides or any("=" not in e or e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
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
    else:  # a compile-only device's executable cannot be loaded back from the cache (JAX warns on every read)
        enable_compilation_cache()
    configure_logging()

    def run() -> int:
        if isinstance(getattr(args, "config", None), str):  # a file, or the name of a config shipped with hfjax
            args.config = str(config_path(args.config))
        return args.run(args)

    return run_command(args.command, run, debugging(args.debug))


if __name__ == "__main__":
    sys.exit(main())
