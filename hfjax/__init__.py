"""hfjax: HybridFlow-style RLHF in JAX (single controller over pjit-sharded Flax NNX worker groups)."""

__version__ = "0.1.0"
