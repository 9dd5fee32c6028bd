#!/usr/bin/env bash
# Pack what `scripts/build.sh TARGET --venv DIR --gpu` installs, for a GPU machine that reaches no package
# index: the target's engine wheel and every wheel pip resolves for it under the target's gpu_constraints
# (for vllm-0.6.3.post1: torch 2.4.0 with its CUDA 12 libraries, Triton 3.0.0, xformers, about 3.2 GB), built
# for the device's Python, plus setuptools and pip (the build installs the runtime package from source).
# Dependencies published only as a source archive (SDIST_ONLY) are built into wheels here.
#
# Usage (project root): [STAGE_PYTHON=3.12] [SDIST_ONLY="pyairports"] bash scripts/e2e/stage-gpu-build.sh TARGET [OUTDIR]
#   (default OUTDIR .device/gpu-build, git-ignored): OUTDIR/wheels/ and OUTDIR/piece.NNN of at most 56 MiB.
# On the device, one `run` call per piece (carry=[".device/gpu-build/piece.NNN"], `cp` it to /tmp/gpu-build/),
# then: bash scripts/e2e/device-gpu-build.sh TARGET [VENV]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
target="${1:?usage: stage-gpu-build.sh TARGET [OUTDIR]}"
out="$(realpath -m "${2:-$root/.device/gpu-build}")"
source "$root/scripts/e2e/stage-lib.sh"
version="${STAGE_PYTHON:-3.12}"

# The target's engine wheel for the device's Python and its gpu_constraints.
rm -rf "$out" && mkdir -p "$out/wheels" "$out/local"
engine_wheel="$(target_file "$target" "wheel:cp${version/./}")"
wheel="$(basename "$engine_wheel")"
cp "$engine_wheel" "$out/local/"
PYTHONPATH="$root/kernels" "$py" -c 'import sys; from pathlib import Path; from prefill_accel.tooling.targets import Targets
print("".join(line + "\n" for line in Targets.load(Path(sys.argv[1])).resolve(sys.argv[2]).gpu_constraints), end="")' \
  "$root" "$target" > "$out/constraints.txt"

device_platform "$version"
for name in ${SDIST_ONLY-pyairports}; do
  "$py" -m pip wheel -q --no-deps -w "$out/local" "$name"
done
"$py" -m pip download -q "${platform[@]}" --find-links "$out/local" -d "$out/wheels" -c "$out/constraints.txt" \
  "$out/local/$wheel" setuptools pip
# pip evaluates environment markers for the Python that runs it, not --python-version's: add what the
# target Python needs beyond that (scripts/e2e/unmet_requirements.py) until the set is closed.
for round in 1 2 3 4 5; do
  mapfile -t unmet < <("$py" "$root/scripts/e2e/unmet_requirements.py" "$out/wheels" "$version")
  (( ${#unmet[@]} )) || break
  (( round < 5 )) || { echo "still unmet for Python $version: ${unmet[*]}" >&2; exit 1; }
  echo "for Python $version also: ${unmet[*]}" >&2
  "$py" -m pip download -q "${platform[@]}" --find-links "$out/local" -d "$out/wheels" -c "$out/constraints.txt" \
    "${unmet[@]}"
done
cp "$out/constraints.txt" "$out/wheels/prefill-accel-constraints.txt"
echo "$wheel" > "$out/wheels/ENGINE_WHEEL"
(cd "$out/wheels" && sha256sum -- * > ../SHA256SUMS && mv ../SHA256SUMS .)
tar cf - -C "$out" wheels | split -b 56M -d -a 3 - "$out/piece."
echo "$(ls "$out"/wheels/*.whl | wc -l) wheels, $(du -sh "$out/wheels" | cut -f1), $(ls "$out"/piece.* | wc -l) pieces in $out" >&2
