#!/usr/bin/env bash
# On a GPU machine without a package index: `prefill-accel verify TARGET --gpu` with the interpreter of the
# environment device-gpu-build.sh built (VENV), from the piece of stage-verify-gpu.sh in $VERIFY_STAGE
# (default /tmp/verify-gpu, awaited until a call writes its complete-marker). Upstream's gpu_tests run on the
# unpatched and the patched engine (patches/targets.toml); pytest is installed beside the environment, not
# into it. The trees and junit reports go to WORK (default /tmp/verify-gpu/work), the report to stdout.
#
# Usage (project root): bash scripts/e2e/device-verify-gpu.sh TARGET VENV [WORK]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
target="${1:?usage: device-verify-gpu.sh TARGET VENV [WORK]}"
venv="${2:?usage: device-verify-gpu.sh TARGET VENV [WORK]}"
stage="${VERIFY_STAGE:-/tmp/verify-gpu}"
work="${3:-$stage/work}"
source "$root/scripts/e2e/device-staging.sh"

staged_bundle "$stage" "upstream sources and pytest"
# The engine wheel is in the cache device-gpu-build.sh filled; the source archive joins it.
export PREFILL_ACCEL_CACHE="${PREFILL_ACCEL_CACHE:-${STAGE_DIR:-/tmp/gpu-build}/cache}" PREFILL_ACCEL_FETCH=artifact
mkdir -p "$PREFILL_ACCEL_CACHE/dist"
cp "$stage"/bundle/dist/* "$PREFILL_ACCEL_CACHE/dist/"
pytest_site="$stage/pytest-site"
[[ -d "$pytest_site" ]] || "$venv/bin/python" -m pip install -q --no-index --find-links "$stage/bundle/wheels" \
  --target "$pytest_site" pytest
rm -rf "$work"
echo "== prefill-accel verify $target --gpu --python $venv/bin/python"
PYTHONPATH="$root/kernels:$pytest_site" "$venv/bin/python" -m prefill_accel.cli verify "$target" --gpu \
  --python "$venv/bin/python" --work "$work"
