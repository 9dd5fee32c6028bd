#!/usr/bin/env bash
# On the GPU machine: vLLM 0.6.3.post1 end to end (scripts/e2e/vllm_e2e.py --phases v0). The patched side is
# the environment the front door builds (scripts/e2e/device-gpu-build.sh vllm-0.6.x, from the wheels
# stage-gpu-build.sh staged in /tmp/gpu-build), built here unless $E2E_V0_VENV already has it; the upstream
# side is the same engine wheel unpacked into $E2E_V0_UPSTREAM, ahead of the venv's patched copy on the path.
# The models are those device-run.sh converted into /tmp/hf. The build needs no GPU: started while a
# device-run.sh / device-session.sh run is under way, the GPU phase waits for that run's /tmp/e2e/done.
# Everything goes to /tmp/e2e-v0 (run.log, out/, logs/, done) for `device-wait.sh SECONDS /tmp/e2e-v0`.
#
# Usage (project root): mkdir -p /tmp/e2e-v0 && setsid nohup bash scripts/e2e/device-v0.sh [vllm_e2e.py ARGS...] \
#   > /tmp/e2e-v0/run.log 2>&1 &
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${E2E_V0_VENV:-/tmp/venv-vllm-0.6.x}"
upstream="${E2E_V0_UPSTREAM:-/tmp/site-0.6}"
stage="${STAGE_DIR:-/tmp/gpu-build}"
run=/tmp/e2e-v0
mkdir -p "$run/out" "$run/logs"
rm -f "$run/done"
trap 'echo "exit $?" > "$run/done"' EXIT
rm -rf "$run/repo" && cp -a "$root" "$run/repo" && rm -rf "$run/repo/.device"  # later calls refresh the checkout
cd "$run/repo"

[[ -f "$venv/.built" ]] || { bash scripts/e2e/device-gpu-build.sh vllm-0.6.x "$venv" && touch "$venv/.built"; }
if [[ ! -d "$upstream/vllm" ]]; then
  "$venv/bin/python" -m pip install -q --no-index --no-deps --no-compile --target "$upstream" \
    "$stage/wheels/$(cat "$stage/wheels/ENGINE_WHEEL")"
fi
for path in "$upstream" ""; do
  PYTHONPATH="$path" "$venv/bin/python" -c "import vllm, vllm.engine.arg_utils as a; print('vllm', vllm.__version__, \
vllm.__file__, 'sparse flags:', hasattr(a.EngineArgs, 'sparse_prefill_threshold'))"
done
if [[ -d /tmp/e2e && ! -f /tmp/e2e/done ]]; then
  echo "== waiting for the run in /tmp/e2e to finish"
  until [[ -f /tmp/e2e/done ]]; do sleep 5; done
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
echo "== vllm_e2e.py --phases v0 $*"
E2E_V0_VENV="$venv" E2E_V0_UPSTREAM="$upstream" E2E_LOGS="$run/logs" PYTHONUNBUFFERED=1 \
  python3 scripts/e2e/vllm_e2e.py --phases v0 --out "$run/out" "$@"
