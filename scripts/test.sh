#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the test suite. Fails if no test ran.
# Two pytest workers (pytest-xdist, a test file per worker) where the machine has two cores or
# more: much of the suite waits on servers and worker processes, so one process leaves a core
# idle (on CI's 2 cores: 10.4 min against 14.9). Each worker's torch gets one thread unless
# OMP_NUM_THREADS says otherwise; PAGEDLLM_TEST_WORKERS=0 runs everything in one process.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
# the dashboard's browser test drives Debian's chromium (it skips, saying so, without one)
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get install -y -q chromium >/dev/null 2>&1 || echo "chromium not installed" >&2
fi
VENV=${PAGEDLLM_VENV:-.venv}
workers=${PAGEDLLM_TEST_WORKERS:-$(( $(nproc) >= 2 ? 2 : 0 ))}
args=()
if [ "$workers" -gt 0 ]; then
  args=(-n "$workers" --dist loadfile)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
"$VENV/bin/python" -m pytest -q -x --durations=15 "${args[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "no tests ran: failing" >&2
  exit 1
fi
exit "$rc"
