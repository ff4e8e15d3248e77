#!/usr/bin/env bash
# Build the kvpress peer's own venv (kvpress pins transformers<5.3; it is a peer, never a
# dependency of this repository).
#
#   bash benchmarks/peers/kvpress_setup.sh [VENV]        # default /tmp/kvpress_venv
#
# torch 2.13.0 (the local CPU wheel) goes in FIRST: an unpinned torch would pull a multi-GB CUDA
# build. kvpress's other dependencies then resolve around it; the CUDA-linked torchvision /
# torchaudio / torchcodec builds, if something drags them in, break `import transformers` and
# are removed. Re-running on an existing venv is a no-op apart from pip's checks.
# Resolved here (2026-11): kvpress 0.5.5, transformers 5.2.0, tokenizers 0.22.2, torch 2.13.0+cpu.
# A machine without a registry (the GPU one) layers carried wheels over its own torch instead:
# benchmarks/peers/kvpress_gpu_setup.sh.
set -euo pipefail

VENV="${1:-/tmp/kvpress_venv}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/pip" install --upgrade pip >/dev/null
"$VENV/bin/pip" install "torch==2.13.0"
"$VENV/bin/pip" install "kvpress==0.5.5" "torch==2.13.0"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md

import torch
import transformers

import kvpress

for pkg in ("kvpress", "transformers", "torch"):
    print(pkg, md.version(pkg))
assert torch.__version__.startswith("2.13.0"), torch.__version__
print("kvpress presses:", ", ".join(sorted(n for n in dir(kvpress) if n.endswith("Press"))))
PY
