#!/usr/bin/env bash
# Creates (or reuses) the TRL peer's own virtualenv, runs/peers/trl-venv (Python 3.11), with TRL's GRPOTrainer on a
# CPU build of PyTorch. It downloads from PyPI once (setup only; the peer run itself needs no network). hfjax's .venv
# is not touched. Usage: bash scripts/bench/peers/setup_trl.sh   (prints the venv's python path on success);
# `--where` prints where the virtualenv is (or would be) and exits, installing nothing.
#
# Pins: trl 1.16.0 (requires transformers >= 4.56, works with 5.x), transformers 5.23.0 (hfjax's pin, so both sides
# read the checkpoint and tokenizer with the same code), torch 2.13.0 (the CPU wheel on this machine's disk; a plain
# `torch` requirement would pull a multi-GB CUDA build).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"  # scripts/bench/peers/ -> the repository
VENV="$ROOT/runs/peers/trl-venv"
if [ "${1:-}" = --where ]; then
  echo "$VENV"
  exit 0
fi
PY="${PYTHON:-$(command -v python3.11)}"
PINS=(torch==2.13.0 trl==1.16.0 transformers==5.23.0 tokenizers==0.23.3 safetensors==0.8.0 pyarrow rich)
STAMP="$VENV/.pins"
if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "${PINS[*]}" ]; then
  echo "installing ${PINS[*]} into $VENV (first run: a few minutes)" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0 >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${PINS[@]}" >&2
  echo "${PINS[*]}" > "$STAMP"
fi
"$VENV/bin/python" -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'trl', trl.__version__)" >&2
echo "$VENV/bin/python"
