#!/usr/bin/env bash
# Creates (or reuses) the Tunix peer's own virtualenv, runs/peers/tunix-venv (Python 3.11), with Tunix's GRPOLearner on
# CPU JAX. It downloads from PyPI once (setup only; the peer run itself needs no network). hfjax's .venv is not
# touched. Usage: bash scripts/bench/peers/setup_tunix.sh   (prints the venv's python path on success);
# `--where` prints where the virtualenv is (or would be) and exits, installing nothing.
#
# Pins: google-tunix 0.1.7 with jax/jaxlib 0.10.2 and flax 0.12.8 (hfjax's JAX versions; Tunix itself asks only for
# flax >= 0.11.1), optax 0.2.8 (the optimizer tunix_grpo.py builds), transformers 5.12.1 and tokenizers 0.22.2 (the
# versions tunix_grpo.py was checked with: the workload's prompt token ids equal those of hfjax's transformers
# 5.23.0), safetensors 0.7.0 (Tunix requires < 0.8), pyarrow and rich (the workload's parquet and the shared scripts),
# psutil (the summary's child-process check).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"  # scripts/bench/peers/ -> the repository
VENV="$ROOT/runs/peers/tunix-venv"
if [ "${1:-}" = --where ]; then
  echo "$VENV"
  exit 0
fi
PY="${PYTHON:-$(command -v python3.11)}"
PINS=(google-tunix==0.1.7 jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 optax==0.2.8 transformers==5.12.1 tokenizers==0.22.2
  safetensors==0.7.0 pyarrow==26.0.1 rich==15.0.0 psutil==7.2.2)
STAMP="$VENV/.pins"
if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "${PINS[*]}" ]; then
  echo "installing ${PINS[*]} into $VENV (first run: a few minutes)" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${PINS[@]}" >&2
  echo "${PINS[*]}" > "$STAMP"
fi
"$VENV/bin/python" -c "import importlib.metadata as m; print(*(f'{p} {m.version(p)}' for p in ('google-tunix', 'jax', \
'flax', 'optax', 'transformers')), sep=', ')" >&2
echo "$VENV/bin/python"
