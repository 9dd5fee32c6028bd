#!/usr/bin/env bash
# Build a patched engine for TARGET: a Docker image where a Docker engine answers, else (or with
# --venv DIR) a virtualenv made by the same install step. Prints what it built and how to run it.
# Usage: scripts/build.sh TARGET [--venv DIR]      e.g. scripts/build.sh vllm-0.6.x --venv /tmp/pa-venv
# Exit codes: see `scripts/prefill-accel --help`.
set -euo pipefail
if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,5s/^# \{0,1\}//p' "$0"
  exit $(( $# < 1 ? 2 : 0 ))
fi
exec "$(dirname "${BASH_SOURCE[0]}")/prefill-accel" build "$@"
