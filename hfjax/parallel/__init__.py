"""Meshes, layouts and resharding."""

from hfjax.parallel.hybrid_engine import HybridEngine
from hfjax.parallel.layout import RULE_PRESETS, Layout, LayoutError, layout_or_default

__all__ = ["RULE_PRESETS", "HybridEngine", "Layout", "LayoutError", "layout_or_default"]
