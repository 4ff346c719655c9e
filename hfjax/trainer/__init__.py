"""Dataflow programs: the supervised trainers (`sft`, `rm`, sharing `supervised`) and the RL trainer (`rl`); their
configs are `hfjax.config`'s. Names load lazily, so importing one trainer module does not import the others."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PROGRAMS": "programs",
    "RLTrainer": "rl",
    "export_run": "launch",
    "run_rl": "launch",
    "rm_main": "rm",
    "run_rm": "rm",
    "run_sft": "sft",
    "sft_main": "sft",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hfjax.trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hfjax.trainer.{_EXPORTS[name]}"), name)
