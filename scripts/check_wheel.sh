#!/usr/bin/env bash
# CI's packaging check: builds the wheel, installs it with its declared dependencies (at the pinned versions) into a
# clean virtualenv, runs `pip check`, and runs hfjax from a directory outside the checkout: --version, the shipped
# quickstart config's --help, the packaged GPU target files, the layout presets, and `hfjax plot` of a finished run's metrics.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$WORK/dist" "$ROOT" >&2
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check -c "$ROOT/requirements.txt" "$WORK"/dist/hfjax-*.whl
"$WORK/venv/bin/python" -m pip check
mkdir "$WORK/outside" && cd "$WORK/outside"
export JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1
"$WORK/venv/bin/hfjax" --version
"$WORK/venv/bin/hfjax" quickstart --help > /dev/null
"$WORK/venv/bin/python" -c "from hfjax.cli.packaged import config_path; assert config_path('quickstart.yaml').is_file()"
# the GPU targets' compiler descriptions that `hfjax compile --target h100` reads (package data: a move drops them)
"$WORK/venv/bin/python" -c "
from importlib import resources
from hfjax.automap.compiled.targets import GPU_TARGETS
for target in GPU_TARGETS.values():
    assert resources.files('hfjax.automap.compiled').joinpath('gpu_targets', target.config_file).is_file(), target
"
"$WORK/venv/bin/hfjax" layouts > /dev/null
# the quickstart's tokenizer with its chat template: the runtime dependencies a first run needs, without PyTorch
"$WORK/venv/bin/python" -c "
from hfjax.data.synthetic import build_addition_tokenizer
text = build_addition_tokenizer().apply_chat_template([{'role': 'user', 'content': '1+2='}], tokenize=False)
assert '1+2=' in text, text
"
# hfjax serve's HTTP face imports with the wheel's dependencies alone (no tinker SDK, no protobuf package)
"$WORK/venv/bin/python" -c "import hfjax.serve.app, hfjax.serve.worker_backend"
"$WORK/venv/bin/hfjax" serve --help > /dev/null
mkdir run
for step in 1 2 3; do
  echo "{\"step\": $step, \"critic/score/mean\": 0.$step, \"actor/pg_loss\": -0.0$step}" >> run/metrics.jsonl
done
"$WORK/venv/bin/hfjax" plot run > /dev/null
ls run/plots/*.png > /dev/null
echo "wheel check passed: $(basename "$WORK"/dist/hfjax-*.whl) installs with its dependencies and runs outside the checkout"
