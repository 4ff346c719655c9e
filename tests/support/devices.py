"""Device-count requirements of tests. On CPU the session has 8 fake devices (conftest.py), so every test runs; on
one GPU (`scripts/gpu_check.sh`) a test whose layout spans several devices is skipped with its reason instead of
failing on the layout check."""

from __future__ import annotations

import jax
import pytest


def needs_devices(n: int) -> pytest.MarkDecorator:
    """Skips a test when this process has fewer than `n` devices."""
    have = jax.device_count()
    return pytest.mark.skipif(have < n, reason=f"its layout spans {n} devices; this process has {have}")
