#!/usr/bin/env bash
# Pack what `prefill-accel verify TARGET --gpu` needs on a GPU machine that reaches no package index, beside
# the environment stage-gpu-build.sh stages: the target's upstream source archive (upstream's tests come from
# it) and pytest with its dependencies, built for the device's Python. One piece of at most 56 MiB.
#
# Usage (project root): [STAGE_PYTHON=3.12] bash scripts/e2e/stage-verify-gpu.sh TARGET [OUTDIR]
#   (default OUTDIR .device/verify-gpu, git-ignored). On the device, carry OUTDIR/piece.000 into
#   /tmp/verify-gpu/ (and write /tmp/verify-gpu/complete), then: bash scripts/e2e/device-verify-gpu.sh TARGET VENV
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
target="${1:?usage: stage-verify-gpu.sh TARGET [OUTDIR]}"
out="$(realpath -m "${2:-$root/.device/verify-gpu}")"
source "$root/scripts/e2e/stage-lib.sh"
version="${STAGE_PYTHON:-3.12}"

rm -rf "$out" && mkdir -p "$out/bundle/dist" "$out/bundle/wheels"
artifact="$(target_file "$target" artifact)"
cp "$artifact" "$out/bundle/dist/"

device_platform "$version"
"$py" -m pip download -q "${platform[@]}" -d "$out/bundle/wheels" pytest
(cd "$out/bundle" && find . -type f ! -name SHA256SUMS -print0 | sort -z | xargs -0 sha256sum > SHA256SUMS)
tar cf - -C "$out/bundle" . | split -b 56M -d -a 3 - "$out/piece."
[[ ! -e "$out/piece.001" ]] || { echo "more than one piece: the device flow carries one" >&2; exit 1; }
echo "$(basename "$artifact") and $(ls "$out"/bundle/wheels | wc -l) wheels in $out/piece.000 ($(du -h "$out/piece.000" | cut -f1))" >&2
