"""Dataflow programs: the supervised trainers (`sft`, `rm`, sharing `supervised`) and the RL trainer (`rl`); their
configs are `hfjax.config`'s. Names load lazily, so importing one trainer module does not import the others."""

from __future__ import annotations

from hfjax.lazy_names import lazy_names

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

__getattr__ = lazy_names(__name__, _EXPORTS)
