"""Helpers shared by the tests and the scripts' tiny runs: tiny models and checkpoints, RL run inputs, the
session's Ray cluster, independent references of the RL math, the compile report."""
