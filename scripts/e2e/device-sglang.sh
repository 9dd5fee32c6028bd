#!/usr/bin/env bash
# On the GPU machine: SGLang 0.5.16 end to end (scripts/e2e/vllm_e2e.py --phases sglang). Installs the
# pieces of scripts/e2e/stage-sglang.sh from $SGL_STAGE (default /tmp/sglang-stage, awaited until a call
# writes its complete-marker) into $E2E_SGL_SITE (default /tmp/sglang-site, upstream) on the image's torch,
# puts the patched files in $E2E_SGL_PATCHED (default /tmp/sglang-patched, ahead of it on the patched
# side), converts the staged models (device-staging.sh), then probes, on both sides, every module the
# server and the offline Engine import (all failures listed at once) before the GPU phase.
# Everything goes to /tmp/e2e-sglang (run.log, out/, logs/, done) for `device-wait.sh SECONDS /tmp/e2e-sglang`.
#
# Usage (project root): mkdir -p /tmp/stage /tmp/sglang-stage /tmp/e2e-sglang && \
#   setsid nohup bash scripts/e2e/device-sglang.sh [vllm_e2e.py ARGS...] > /tmp/e2e-sglang/run.log 2>&1 &
#   (PROBE_ONLY=1: stop after the import probe)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
stage="${SGL_STAGE:-/tmp/sglang-stage}"
site="${E2E_SGL_SITE:-/tmp/sglang-site}"
patched="${E2E_SGL_PATCHED:-/tmp/sglang-patched}"
run=/tmp/e2e-sglang
source "$root/scripts/e2e/device-staging.sh"
start_run "$run" "$root"

staged_model qwen2.5-coder-1.5b smollm2
if [[ ! -f "$site/.installed" ]]; then
  staged_bundle "$stage" SGLang
  rm -rf "$site" && python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$stage"/bundle/wheels/*.whl
  rm -rf "$patched" && mkdir -p "$patched" && cp -a "$site/sglang" "$patched/sglang"
  tar xf "$stage/bundle/sglang-patched.tar" -C "$patched"
  touch "$site/.installed"
fi

# What the server and the offline Engine import, and the kernels they call: every failure, then the verdict.
probe='
import importlib
import sys
failed = []
for name in ("sglang", "sglang.srt.entrypoints.engine", "sglang.srt.entrypoints.http_server",
             "sglang.srt.managers.scheduler", "sglang.srt.managers.tokenizer_manager",
             "sglang.srt.managers.detokenizer_manager", "sglang.srt.model_executor.model_runner",
             "sglang.srt.models.qwen2", "sglang.srt.layers.attention.flashattention_backend",
             "sglang.srt.layers.attention.flashinfer_backend", "sglang.srt.layers.attention.attention_registry",
             "sglang.srt.managers.tp_worker", "sglang.srt.managers.data_parallel_controller",
             "sglang.srt.model_loader.loader", "sglang.srt.layers.sampler", "sglang.srt.constrained.xgrammar_backend",
             "sglang.srt.entrypoints.openai.serving_completions", "sglang.bench_serving", "sgl_kernel", "flashinfer"):
    try:
        importlib.import_module(name)
    except Exception as error:
        failed.append(name)
        print(f"  {name}: {type(error).__name__}: {error}")
from importlib import metadata
print("sglang", metadata.version("sglang"), "transformers", metadata.version("transformers"),
      "torch", metadata.version("torch"), "sparse flags:",
      hasattr(importlib.import_module("sglang.srt.server_args").ServerArgs, "sparse_prefill_threshold"))
sys.exit(1 if failed else 0)
'
status=0
for side in "$site" "$patched:$site:$PWD/kernels"; do
  echo "== import probe, PYTHONPATH=$side"
  PYTHONPATH="$side" python3 -c "$probe" || status=1
done
(( status == 0 )) || { echo "== the import probe failed (above)"; exit 1; }
[[ "${PROBE_ONLY:-0}" == 1 ]] && exit 0

wait_for_gpu_run
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
echo "== vllm_e2e.py --phases sglang $*"
E2E_SGL_SITE="$site" E2E_SGL_PATCHED="$patched" E2E_LOGS="$run/logs" PYTHONUNBUFFERED=1 \
  python3 scripts/e2e/vllm_e2e.py --phases sglang --out "$run/out" "$@"
