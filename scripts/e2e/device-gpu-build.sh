#!/usr/bin/env bash
# On a machine without a package index: reassemble the pieces of scripts/e2e/stage-gpu-build.sh from
# STAGE_DIR (default /tmp/gpu-build), then run the front door itself, `scripts/build.sh TARGET --venv VENV
# --gpu`, with pip reading only the staged wheels (PIP_NO_INDEX, PIP_FIND_LINKS) and the engine wheel in
# the tooling cache, and print what the environment imports.
#
# Usage (project root): bash scripts/e2e/device-gpu-build.sh TARGET [VENV]   (default VENV /tmp/venv-TARGET)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
target="${1:?usage: device-gpu-build.sh TARGET [VENV]}"
venv="${2:-/tmp/venv-$target}"
stage="${STAGE_DIR:-/tmp/gpu-build}"
wheels="$stage/wheels"

if [[ ! -f "$wheels/ENGINE_WHEEL" ]]; then
  compgen -G "$stage/piece.*" > /dev/null || { echo "no pieces in $stage" >&2; exit 2; }
  echo "== assembling $(ls "$stage"/piece.* | wc -l) pieces"
  cat "$stage"/piece.* | tar xf - -C "$stage"
fi
(cd "$wheels" && sha256sum --quiet -c SHA256SUMS) || { echo "staged wheels fail their checksums" >&2; exit 1; }
export PREFILL_ACCEL_CACHE="${PREFILL_ACCEL_CACHE:-$stage/cache}"
mkdir -p "$PREFILL_ACCEL_CACHE/dist"
cp "$wheels/$(cat "$wheels/ENGINE_WHEEL")" "$PREFILL_ACCEL_CACHE/dist/"
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$wheels" PIP_DISABLE_PIP_VERSION_CHECK=1
rm -rf "$venv"
echo "== scripts/build.sh $target --venv $venv --gpu (offline)"
start=$(date +%s)
"$root/scripts/build.sh" "$target" --venv "$venv" --gpu
echo "== built in $(( $(date +%s) - start )) s"
"$venv/bin/python" - <<'EOF'
import importlib.metadata as metadata

import torch
import triton

names = ("vllm", "torch", "triton", "xformers", "transformers", "prefill-accel")
print(", ".join(f"{name} {metadata.version(name)}" for name in names))
print(f"CUDA {torch.version.cuda}, GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}, "
      f"triton {triton.__version__}")
EOF
