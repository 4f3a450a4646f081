#!/usr/bin/env bash
# The suite under load: `.ci/run` (or the command given) while one busy process per core competes for every
# core, so that a test that depends on how fast a thread gets scheduled fails here rather than on CI.
#   bash tests/stress.sh                      # CI=true bash .ci/run, every core kept busy
#   bash tests/stress.sh python -m pytest -q  # any command, e.g. the README's test command in a venv
set -euo pipefail
cd "$(dirname "$0")/.."

hogs=()
stop_hogs() { kill "${hogs[@]}" 2>/dev/null || true; }
trap stop_hogs EXIT
for _ in $(seq "$(nproc)"); do
    yes >/dev/null &
    hogs+=($!)
done
echo "stress: ${#hogs[@]} busy processes on $(nproc) cores"
if [ $# -eq 0 ]; then
    set -- bash .ci/run
fi
CI=true "$@"
