#!/usr/bin/env bash
# The README's test command: set up .venv, lint, then run the test suite (8 fake CPU devices). Extra args go to pytest.
export HFJAX_VENV=dev
source "$(dirname "$0")/venv.sh"
ruff check .
ruff format --check .
python -m pytest -q "$@"
