#!/usr/bin/env bash
# Compile-only checks for real targets (CI runs this after the test suites): sets up .venv-compile, hfjax with the
# `compile` extra (libtpu and the CUDA compiler plugin, about 1.1 GB; no accelerator needed), then runs the tests
# marked compile_target and, beside them, compiles one shipped config at small shapes for its TPU target
# (scripts/compile_configs.py --tiny) and then, at full size, the update and largest prefill of the shipped configs with
# the least room (--guard: fails when one stops fitting or the cost model is more than 15% off; without either flag it
# compiles every shipped config at full size, about 10 minutes each on 2 cores), each side compiling on about one core.
# `--prepare-only` sets up .venv-compile and stops (CI does it early).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
VENV="$ROOT/.venv-compile"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
STAMP="$VENV/.requirements.sha256"
WANT="$(cat "$ROOT/requirements.txt" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "installing the compile extra into .venv-compile (first run: a few minutes)" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$ROOT/requirements.txt" -e "$ROOT[compile]" \
    "pytest==9.2.0" >&2
  echo "$WANT" > "$STAMP"
fi
[ "${1:-}" = --prepare-only ] && exit 0
cd "$ROOT"
export JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1
OUT="$(mktemp -d -t hfjax-compile-configs-XXXX)"
(
  failed=0
  "$VENV/bin/python" scripts/compile_configs.py --tiny --out "$OUT/tiny" --markdown "$OUT/tiny/table.md" || failed=1
  grep -q "^Compiled at commit .* jax " "$OUT/tiny/table.md" || { echo "compile_configs.py --markdown: no provenance line" >&2; failed=1; }
  "$VENV/bin/python" scripts/compile_configs.py --guard --out "$OUT/guard" || failed=1
  exit "$failed"
) > "$OUT/table.txt" 2>&1 &
CONFIGS=$!
"$VENV/bin/python" -m pytest -q -m compile_target tests/test_targets.py tests/test_remat.py tests/test_sweep.py tests/test_scaling.py "$@"  # no PyTorch here
status=0
wait "$CONFIGS" || status=$?
cat "$OUT/table.txt"
exit "$status"
