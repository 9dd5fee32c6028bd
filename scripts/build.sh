#!/usr/bin/env bash
# Build a patched engine for TARGET: an image with docker where a Docker engine answers, else with
# buildah (no daemon), else (or with --venv DIR) a virtualenv made by the same install step.
# Usage: scripts/build.sh TARGET [--builder docker|buildah] [--stand-in-base] [--venv DIR [--gpu|--cpu]]
#   e.g. scripts/build.sh vllm-0.6.x --venv /tmp/pa-venv; scripts/build.sh sglang-0.5.16 --builder buildah
# --stand-in-base: FROM a stand-in for the official image, made here (needs root). --gpu: the venv gets the engine's
# CUDA dependencies, as the official image has them (the default where nvidia-smi lists a GPU). Exit codes: prefill-accel --help.
set -euo pipefail
if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,7s/^# \{0,1\}//p' "$0"
  exit $(( $# < 1 ? 2 : 0 ))
fi
exec "$(dirname "${BASH_SOURCE[0]}")/prefill-accel" build "$@"
