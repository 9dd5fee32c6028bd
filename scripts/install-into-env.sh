#!/usr/bin/env bash
# The install step of every build: patch the engine installed in a Python environment with TARGET's
# series and overlay, write the build stamp, and install the prefill-accel runtime package (--no-deps).
# The Dockerfiles run it inside the official image; `build.sh --venv` runs it on a fresh virtualenv.
# Usage: scripts/install-into-env.sh TARGET [--python PYTHON] [--no-runtime]
set -euo pipefail
if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,5s/^# \{0,1\}//p' "$0"
  exit $(( $# < 1 ? 2 : 0 ))
fi
exec "$(dirname "${BASH_SOURCE[0]}")/prefill-accel" install "$@"
