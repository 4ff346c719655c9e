#!/usr/bin/env bash
# The README's main command: set up .venv, then run the quickstart (SFT then RL on a synthetic task) on CPU.
# Extra args are config overrides, e.g. `bash scripts/quickstart.sh rl.algorithm.name=ppo`.
source "$(dirname "$0")/venv.sh"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
hfjax quickstart quickstart.yaml "$@"
