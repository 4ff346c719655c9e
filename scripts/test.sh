#!/usr/bin/env bash
# The README's test command: set up .venv, lint, then run the test suite (8 fake CPU devices) on two pytest-xdist
# workers (HFJAX_TEST_WORKERS overrides; 0 runs in this process), printing the 15 slowest tests. Each test is a unit of
# work of its own (`--dist loadgroup` with no groups: pytest-xdist's `xdist_group` markers group nothing under pytest
# 9), handed to whichever worker is free in the order conftest.py sorts them (the longest files, by SCHEDULE_FIRST,
# first), not by test count. Extra args go to pytest.
export HFJAX_VENV=dev
source "$(dirname "$0")/venv.sh"
ruff check .
ruff format --check .
WORKERS="${HFJAX_TEST_WORKERS:-$(( $(nproc) >= 2 ? 2 : 0 ))}"
python -m pytest -q -n "$WORKERS" --dist loadgroup --no-loadscope-reorder --durations=15 "$@"
