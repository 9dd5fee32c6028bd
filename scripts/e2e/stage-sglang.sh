#!/usr/bin/env bash
# Pack SGLang 0.5.16 for the GPU machine, whose image already holds what SGLang pins underneath it (torch
# 2.11.0 with CUDA 13, Triton 3.6, transformers): pieces of at most 56 MiB, one per device call.
#
# Usage (project root): bash scripts/e2e/stage-sglang.sh [OUTDIR]      (default .device/sglang, git-ignored)
# Pieces: OUTDIR/piece.NNN of one tar stream holding
#   wheels/*.whl         SGLang's wheel for the device's Python (the target's pinned cp312 wheel, checksum
#                        checked), sglang-kernel 0.4.5 (built for CUDA 13: its libraries link libcudart.so.13),
#                        flashinfer-python, and the Python packages SGLang imports that the image lacks
#                        (SGLang's CPU import set, docker/requirements/sglang-0.5.16-cpu.txt, less the image's
#                        packages in scripts/e2e/gpu-image-packages.txt, plus SERVER_EXTRA below), all --no-deps;
#                        SGLang's own transformers and tokenizers pins, which differ from the image's
#   sglang-patched.tar   the files of sglang/ that the prefill-accel series and overlay change or add, applied
#                        here to the very wheel by `prefill-accel apply`
#   SHA256SUMS
# The model travels separately: STAGE_VLLM=0 STAGE_MODELS="qwen2.5-coder-1.5b smollm2" scripts/e2e/stage.sh.
# On the device: scripts/e2e/device-sglang.sh installs, probes the imports and runs the sglang phase.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="$(realpath -m "${1:-$root/.device/sglang}")"
source "$root/scripts/e2e/stage-lib.sh"
target=sglang-0.5.16
requirements="$root/docker/requirements/$target-cpu.txt"
image="$root/scripts/e2e/gpu-image-packages.txt"
# Imported by the server or what it loads, not by the CPU tests' modules (at SGLang's pins where it has one):
# HTTP form parsing, grammar backends, the memory saver its model runner imports, and what those import.
SERVER_EXTRA="${SERVER_EXTRA-python-multipart interegular llguidance>=1.7.6,<2 openai-harmony==0.0.4 blobfile==3.0.0
  pycryptodomex easydict torch_memory_saver>=0.0.9.post1 zstandard watchfiles soundfile==0.13.1 cffi pycparser jiter
  jsonschema jsonschema-specifications referencing rpds-py}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bundle/wheels"

engine_wheel="$(target_file "$target" wheel:cp312)"
cp "$engine_wheel" "$work/bundle/wheels/"

device_platform 3.12
# The CPU import set less the image's packages (and the torch stack, which the image provides for CUDA 13).
mapfile -t imports < <("$py" - "$requirements" "$image" <<'EOF'
import re
import sys

def name(text):
    return re.sub(r"[-_.]+", "-", text.strip().lower())

image = {name(line) for line in open(sys.argv[2]) if line.strip() and not line.startswith("#")}
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if not line:
        continue
    package = name(re.split(r"[=<>!~\[; ]", line)[0])
    if package not in image and not package.startswith("nvidia-") and package not in ("torch", "triton", "torchvision"):
        print(line)
EOF
)
pins=(transformers tokenizers)
for pin in "${pins[@]}"; do
  imports+=("$(grep -i "^$pin==" "$requirements")")
done
"$py" -m pip download -q --no-deps "${platform[@]}" -d "$work/bundle/wheels" "${imports[@]}" $SERVER_EXTRA \
  sglang-kernel==0.4.5 flashinfer-python==0.6.14

patched_files "$target" "$engine_wheel" sglang "$work/bundle/sglang-patched.tar" "$work/patch"

(cd "$work/bundle" && find . -type f ! -name SHA256SUMS -print0 | sort -z | xargs -0 sha256sum > SHA256SUMS)
rm -rf "$out" && mkdir -p "$out"
tar cf - -C "$work/bundle" . | split -b 56M -d -a 3 - "$out/piece."
echo "$(ls "$work"/bundle/wheels/*.whl | wc -l) wheels, $(du -sh "$work/bundle" | cut -f1), $(ls "$out"/piece.* | wc -l) pieces in $out" >&2
