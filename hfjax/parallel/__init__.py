"""Meshes, layouts and resharding."""

from hfjax.parallel.layout import RULE_PRESETS, Layout, LayoutError

__all__ = ["RULE_PRESETS", "Layout", "LayoutError"]
