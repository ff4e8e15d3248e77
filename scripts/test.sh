#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the test suite. Fails if no test ran.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
VENV=${PAGEDLLM_VENV:-.venv}
"$VENV/bin/python" -m pytest -q -x --durations=15 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "no tests ran: failing" >&2
  exit 1
fi
exit "$rc"
