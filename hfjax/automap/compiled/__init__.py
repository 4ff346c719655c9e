"""Compiling for hardware this machine does not have: compile-only devices of a named TPU or GPU target."""

from hfjax.automap.compiled.targets import (
    GPU_TARGETS,
    INSTALL_HINT,
    TPU_GENERATIONS,
    Target,
    TargetError,
    accepted_targets,
    parse_target,
    target_devices,
)

__all__ = [
    "GPU_TARGETS",
    "INSTALL_HINT",
    "TPU_GENERATIONS",
    "Target",
    "TargetError",
    "accepted_targets",
    "parse_target",
    "target_devices",
]
