#!/usr/bin/env bash
# The README's main command: set up .venv, then run the quickstart on CPU. Extra args go to the quickstart.
source "$(dirname "$0")/venv.sh"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
python scripts/quickstart.py "$@"
