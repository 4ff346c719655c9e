"""`hfjax serve CONFIG [key=value ...]`: a Tinker-compatible training and sampling service (`hfjax.serve`) for the
base model the config names, every value checked before the model loads."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

SERVE_CONFIG = "serve.yaml"  # the shipped defaults (hfjax/configs/serve.yaml)


def add_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="serve a base model's LoRA training and sampling over the Tinker API")
    serve.add_argument(
        "config", nargs="?", default=SERVE_CONFIG, help=f"serve config YAML (default: the shipped {SERVE_CONFIG})"
    )
    serve.add_argument("overrides", nargs="*", help="key=value overrides (or every value), e.g. model_path=DIR")
    serve.add_argument("--host", help="address to listen on (default: the config's host, 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default: the config's port, 8000)")
    serve.set_defaults(run=run, default_config=SERVE_CONFIG)


def run(args: argparse.Namespace) -> int:
    from hfjax.serve.config import ServeConfig
    from hfjax.trainer.preflight import model_config
    from hfjax.typed_config import load_config

    overrides = [*args.overrides, *(f"{k}={v}" for k, v in (("host", args.host), ("port", args.port)) if v)]
    try:
        config = load_config(ServeConfig, args.config, overrides)
        model_config(config.model_path, "model_path")
    except ValueError as exc:
        raise SystemExit(f"hfjax serve: {exc}") from None
    import uvicorn

    from hfjax.serve.app import create_app
    from hfjax.serve.worker_backend import start_backend

    Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    logging.getLogger("hfjax.serve").setLevel(logging.INFO)
    backend = start_backend(config)
    app = create_app(backend, run_dir=config.run_dir, tokenizer_id=config.tokenizer)
    print(f"serving {config.base_model} at http://{config.host}:{config.port} (run directory {config.run_dir})")
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level="info", access_log=False)  # polls: noise
    finally:
        backend.shutdown()
    return 0
