# Sourced by the README commands: creates or reuses .venv (Python 3.11) and installs requirements-dev.txt when it
# changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  "$PY" -m venv "$ROOT/.venv"
fi
STAMP="$ROOT/.venv/.requirements.sha256"
WANT="$(cat "$ROOT/requirements.txt" "$ROOT/requirements-dev.txt" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "installing dependencies into .venv (first run: about 2 minutes)" >&2
  "$ROOT/.venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >&2
  "$ROOT/.venv/bin/python" -m pip install -q --disable-pip-version-check -r "$ROOT/requirements-dev.txt" >&2
  "$ROOT/.venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$ROOT" >&2
  echo "$WANT" > "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$ROOT"
