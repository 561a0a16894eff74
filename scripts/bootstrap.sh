#!/usr/bin/env bash
# Make (or refresh) the project's virtual environment. Idempotent: does nothing when .venv already
# matches pyproject.toml + requirements.lock. CPU torch is installed first, by exact version, so that
# no dependency can pull the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.kiln-stamp
want=$(cat pyproject.toml requirements.lock | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "bootstrap: installing kiln into .venv (a few minutes the first time)" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  .venv/bin/python -m pip install -q --disable-pip-version-check -c requirements.lock -e '.[dev]'
  echo "$want" > "$stamp"
fi
