#!/usr/bin/env bash
# On the GPU machine: vLLM 0.6.3.post1 end to end (scripts/e2e/vllm_e2e.py --phases v0). The patched side is
# the environment the front door builds (scripts/e2e/device-gpu-build.sh vllm-0.6.x, from the wheels
# stage-gpu-build.sh staged in /tmp/gpu-build), built here unless $E2E_V0_VENV already has it; the upstream
# side is the same engine wheel unpacked into $E2E_V0_UPSTREAM, ahead of the venv's patched copy on the path.
# The models are those device-run.sh converted into /tmp/hf; where Qwen2.5-Coder-1.5B or SmolLM2 is not there, the
# pieces of `STAGE_VLLM=0 STAGE_MODELS="qwen2.5-coder-1.5b smollm2" scripts/e2e/stage.sh` are awaited in /tmp/stage
# (until a call writes /tmp/stage/complete) and converted here. The pieces of stage-gpu-build.sh are
# awaited the same way in $STAGE_DIR (until $STAGE_DIR/complete), and the build runs beside the models' wait
# (its log in logs/gpu-build.log), so staging the wheels first overlaps the build with the models' calls.
# Nothing before the GPU phase needs the GPU: started while a device-run.sh / device-session.sh run is under
# way, it waits for that run's /tmp/e2e/done. Everything goes to /tmp/e2e-v0 (run.log, out/, logs/, done) for
# `device-wait.sh SECONDS /tmp/e2e-v0`. With UPSTREAM_GPU_TESTS=1 (or =after), upstream 0.6.3's GPU tests run
# on the unpatched and the patched engine before (after) the phase (device-verify-gpu.sh, from
# stage-verify-gpu.sh's piece in /tmp/verify-gpu), their report in out/verify-gpu.txt; on an H100 they took
# more than 5 minutes a side when the sides ran one after the other (tests/kernels/test_flash_attn.py: 432
# cases; verify now runs them at once), so =after keeps them from delaying the phase's measurements.
#
# Usage (project root): mkdir -p /tmp/e2e-v0 && setsid nohup bash scripts/e2e/device-v0.sh [vllm_e2e.py ARGS...] \
#   > /tmp/e2e-v0/run.log 2>&1 &
#   (the first call carries the first piece; each later call one piece, the last of a stage also writing its
#   complete-marker; STAGE_WAIT seconds, default 1200, bound each wait)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${E2E_V0_VENV:-/tmp/venv-vllm-0.6.x}"
upstream="${E2E_V0_UPSTREAM:-/tmp/site-0.6}"
stage="${STAGE_DIR:-/tmp/gpu-build}"
run=/tmp/e2e-v0
source "$root/scripts/e2e/device-staging.sh"
start_run "$run" "$root"

build_sides() {  # the patched environment and the upstream engine beside it
  if [[ ! -f "$venv/.built" ]]; then
    [[ -f "$stage/wheels/ENGINE_WHEEL" ]] || { echo "== waiting for the staged wheels ($stage/complete)"; wait_for "$stage/complete"; }
    bash scripts/e2e/device-gpu-build.sh vllm-0.6.x "$venv" || return
    touch "$venv/.built"
  fi
  if [[ ! -d "$upstream/vllm" ]]; then
    "$venv/bin/python" -m pip install -q --no-index --no-deps --no-compile --target "$upstream" \
      "$stage/wheels/$(cat "$stage/wheels/ENGINE_WHEEL")"
  fi
}
# The build runs while the models' pieces arrive and convert (stage the wheels first: the build takes longer).
build_sides > "$run/logs/gpu-build.log" 2>&1 &
build=$!
staged_model qwen2.5-coder-1.5b smollm2
wait "$build" || { echo "the GPU environment's build failed:" >&2; tail -n 40 "$run/logs/gpu-build.log" >&2; exit 1; }
cat "$run/logs/gpu-build.log"
for path in "$upstream" ""; do
  PYTHONPATH="$path" "$venv/bin/python" -c "import vllm, vllm.engine.arg_utils as a; print('vllm', vllm.__version__, \
vllm.__file__, 'sparse flags:', hasattr(a.EngineArgs, 'sparse_prefill_threshold'))"
done
wait_for_gpu_run
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
upstream_gpu_tests() {
  bash scripts/e2e/device-verify-gpu.sh vllm-0.6.x "$venv" "$run/verify-gpu" 2>&1 | tee "$run/out/verify-gpu.txt" || true
  cp "$run"/verify-gpu/*.xml "$run/out/" 2>/dev/null || true  # each test's outcome (junit), for the record
}
[[ "${UPSTREAM_GPU_TESTS:-0}" == 1 ]] && upstream_gpu_tests
echo "== vllm_e2e.py --phases v0 $*"
status=0
E2E_V0_VENV="$venv" E2E_V0_UPSTREAM="$upstream" E2E_LOGS="$run/logs" PYTHONUNBUFFERED=1 \
  python3 scripts/e2e/vllm_e2e.py --phases v0 --out "$run/out" "$@" || status=$?
[[ "${UPSTREAM_GPU_TESTS:-0}" == after ]] && upstream_gpu_tests
exit "$status"
