#!/usr/bin/env bash
# On the GPU machine: reassemble the pieces of scripts/e2e/stage.sh from /tmp/stage, install upstream
# vLLM into /tmp/site and the patched copy into /tmp/site-patched, convert the models into /tmp/hf, then
# run scripts/e2e/vllm_e2e.py with the given arguments. Runs from a private copy of the checkout, so a
# later device call that refreshes the checkout cannot change it mid-run.
#
# Usage: bash scripts/e2e/device-run.sh [vllm_e2e.py ARGS...]        (one run at a time)
#   setsid nohup bash scripts/e2e/device-run.sh --phases offline,serve,tp >/tmp/e2e/run.log 2>&1 &
# then, in later calls: bash scripts/e2e/device-wait.sh SECONDS   (copies results into $OUT)
# Results: /tmp/e2e/out (results-*.json, report-*.md), engine logs in /tmp/e2e/logs, done-marker /tmp/e2e/done.
set -euo pipefail
mkdir -p /tmp/e2e/out /tmp/e2e/logs
done_marker="${E2E_DONE:-/tmp/e2e/done}"  # device-session.sh installs with its own marker
rm -f "$done_marker"
trap 'echo "exit $?" > "$done_marker"' EXIT
rm -rf /tmp/e2e/repo && cp -a "$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)" /tmp/e2e/repo
cd /tmp/e2e/repo
rm -rf .device  # the carried piece, if any, is already in /tmp/stage

if [[ ! -f /tmp/site/.installed ]]; then
  bash scripts/e2e/unpack-stage.sh
  echo "== installing vLLM and its missing imports into /tmp/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/bundle/wheels/*.whl &
  install=$!
  echo "== converting the GGUF models into /tmp/hf"
  # E2E_CONVERT="smollm2" converts only the models a short run needs (default: those the bundle holds; the
  # converter's own default, SmolLM2 and Gemma 3, failed a Qwen-only bundle on a missing GGUF, run 15).
  PYTHONPATH=/tmp/bundle/gguf-only PREFILL_ACCEL_CACHE=/tmp/bundle/cache python3 scripts/e2e/convert_models.py /tmp/hf \
    ${E2E_CONVERT:-$(ls /tmp/bundle/cache/models)}
  wait $install
  rm -rf /tmp/site-patched && mkdir -p /tmp/site-patched
  cp -a /tmp/site/vllm /tmp/site-patched/vllm
  tar xf /tmp/bundle/vllm-patched.tar -C /tmp/site-patched
  touch /tmp/site/.installed
fi
for side in /tmp/site "/tmp/site-patched:/tmp/site:$PWD/kernels"; do
  PYTHONPATH=$side python3 -c "import vllm, vllm.config.attention as a; print('vllm', vllm.__version__, vllm.__file__, 'sparse flags:', hasattr(a.AttentionConfig, 'sparse_prefill_threshold'))"
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
echo "== vllm_e2e.py $*"
E2E_LOGS=/tmp/e2e/logs PYTHONUNBUFFERED=1 python3 scripts/e2e/vllm_e2e.py --out /tmp/e2e/out "$@"
