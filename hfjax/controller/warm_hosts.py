"""Warm worker processes, opt-in with `HFJAX_WARM_WORKERS=N`: a driver that runs several runs in turn (a layout
sweep, a test session) keeps up to N idle single-process worker hosts alive between runs, each with the
placement-group bundle it runs in, and hands one to the next group whose pool has the same shape and environment.

A reused process has imported JAX and keeps JAX's in-memory caches of traced and lowered programs, so the next run's
programs skip tracing and lowering, which the persistent compilation cache cannot skip. Groups of several processes
(they join a jax.distributed runtime of their own) and processes that do not answer a reset are never kept. Each kept
process holds its bundle's reservation (0.1 CPU by default; its accelerators on GPU or TPU), so keep N small beside
other Ray work. Unset or 0: every group's processes end with it, as without this module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

SETTING = "HFJAX_WARM_WORKERS"
RESET_TIMEOUT_S = 10.0


def capacity() -> int:
    """How many idle worker processes a driver keeps (`HFJAX_WARM_WORKERS`; 0 when unset)."""
    raw = os.environ.get(SETTING, "").strip()
    try:
        count = int(raw or 0)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"{SETTING}: expected how many idle worker processes to keep (an int >= 0), got {raw!r}")
    return count


@dataclass
class _Parked:
    key: tuple[Any, ...]
    session: str
    placement_group: Any
    host: Any


_parked: list[_Parked] = []  # oldest first


def _session() -> str:
    """The Ray session this driver is connected to: parked processes belong to it and end with it."""
    import ray

    context = ray.get_runtime_context()
    return f"{context.gcs_address}/{context.get_job_id()}"


def take(key: tuple[Any, ...]) -> tuple[Any, Any] | None:
    """(placement group, idle host) parked under `key` in this Ray session, removed from the parked ones; None when
    there is none."""
    if not _parked:
        return None
    session = _session()
    _parked[:] = [p for p in _parked if p.session == session]  # the processes of an ended session are gone
    for i, parked in enumerate(_parked):
        if parked.key == key:
            del _parked[i]
            return parked.placement_group, parked.host
    return None


def park(key: tuple[Any, ...], placement_group: Any, host: Any) -> bool:
    """Keeps `host` (reset, idle) and its `placement_group` for a later pool with `key`; the oldest parked ones
    beyond `capacity()` end. False, keeping nothing, when warm workers are off."""
    limit = capacity()
    if limit == 0:
        return False
    _parked.append(_Parked(key, _session(), placement_group, host))
    while len(_parked) > limit:
        oldest = _parked.pop(0)
        end(oldest.placement_group, [oldest.host])
    return True


def end(placement_group: Any | None, hosts: list[Any]) -> None:
    """Kills `hosts` and returns `placement_group`'s bundles (if any) to Ray."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for host in hosts:
        ray.kill(host, no_restart=True)
    if placement_group is not None:
        remove_placement_group(placement_group)


def reset(host: Any) -> bool:
    """Drops the worker `host` holds, keeping the process; False when it does not answer in time (dead, stopped or
    busy), so the caller kills it instead."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    try:
        ray.get(host.reset.remote(), timeout=RESET_TIMEOUT_S)
    except (GetTimeoutError, RayError):
        return False
    return True
