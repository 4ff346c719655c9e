# Sourced by the README commands: creates or reuses .venv (Python 3.11) and installs hfjax with its pinned runtime
# dependencies (requirements.txt as constraints), plus the test tools when HFJAX_VENV=dev (scripts/test.sh), each
# again only when its requirement files changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
KIND="${HFJAX_VENV:-runtime}"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  "$PY" -m venv "$ROOT/.venv"
fi
# pip byte-compiles every installed file (the dev environment: about 100 of its 182 CPU-s on a 2-core VM). Keep it:
# where PYTHONDONTWRITEBYTECODE is set (it is on the VM measured), `--no-compile` leaves every test process and Ray
# worker compiling its imports from source: the default suite took 992 s in a clean clone against 802 s in-tree.
pip_install() { "$ROOT/.venv/bin/python" -m pip install -q --disable-pip-version-check "$@" >&2; }
STAMP="$ROOT/.venv/.requirements-$KIND.sha256"
FILES=("$ROOT/requirements.txt" "$ROOT/pyproject.toml")
[ "$KIND" = dev ] && FILES+=("$ROOT/requirements-dev.txt")
WANT="$(cat "${FILES[@]}" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "installing $KIND dependencies into .venv (first run: about 2 minutes)" >&2
  pip_install --upgrade pip
  # hfjax with the dependencies its package declares, at the tested versions
  pip_install -c "$ROOT/requirements.txt" -e "$ROOT"
  if [ "$KIND" = dev ]; then
    pip_install -r "$ROOT/requirements-dev.txt"
  fi
  "$ROOT/.venv/bin/python" -m pip check >&2
  echo "$WANT" > "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$ROOT"
