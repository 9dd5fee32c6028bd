#!/usr/bin/env bash
# On the GPU machine, without an engine: check and time the kernels (bench_kernels.py), then run the
# accuracy harness on the GGUF models of `STAGE_VLLM=0 scripts/e2e/stage.sh` and time the kernels on
# q/k/v captured from them. The first device call starts it in the background and carries the first
# piece; the benchmark runs while later calls carry the others into /tmp/stage; the last of those
# writes /tmp/stage/complete, for which the accuracy part waits (at most STAGE_WAIT seconds, 900).
#
# Usage: mkdir -p /tmp/e2e && (setsid nohup bash scripts/e2e/device-kernels.sh > /tmp/e2e/run.log 2>&1 &)
#        bash scripts/e2e/device-wait.sh SECONDS        (again as needed; results in /tmp/e2e/out)
# Settings (each optional):
#   CHECK=1        first the correctness check alone, without autotuning (bench_kernels.py --lengths "")
#   BENCH_ARGS     arguments of scripts/bench_kernels.py (none: no random-input run; add --search-launches
#                  for the search at each launch shape)
#   ACCURACY_RUNS  ';'-separated argument lists of `python -m prefill_accel.accuracy`
#   CAPTURES       ';'-separated argument lists of the harness run with --capture; the captured layers
#                  are then timed by bench_kernels.py --real with REAL_ESTIMATORS (default pooled)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p /tmp/e2e/out
rm -f /tmp/e2e/done
trap 'echo "exit $?" > /tmp/e2e/done' EXIT
repo=/tmp/e2e/kernels-repo  # a private copy: a later device call refreshes the checkout
rm -rf "$repo" && cp -a "$root" "$repo" && rm -rf "$repo/.device"
cd "$repo"
export PYTHONUNBUFFERED=1

if [[ "${CHECK:-0}" == 1 ]]; then
  echo "== bench_kernels.py correctness check"
  PREFILL_ACCEL_AUTOTUNE=0 python3 scripts/bench_kernels.py --lengths "" --out /tmp/e2e/out/check.json
fi
if [[ -n "${BENCH_ARGS:-}" ]]; then
  echo "== bench_kernels.py $BENCH_ARGS"
  # shellcheck disable=SC2086  # the arguments are split on purpose
  python3 scripts/bench_kernels.py $BENCH_ARGS --out /tmp/e2e/out/bench.json
fi
[[ -n "${ACCURACY_RUNS:-}${CAPTURES:-}" ]] || exit 0

echo "== waiting for the staged models"
deadline=$(( $(date +%s) + ${STAGE_WAIT:-900} ))
until [[ -f /tmp/stage/complete ]]; do
  (( $(date +%s) < deadline )) || { echo "no /tmp/stage/complete after ${STAGE_WAIT:-900} s" >&2; exit 1; }
  sleep 5
done
bash scripts/e2e/unpack-stage.sh || exit 1
bash scripts/e2e/harness-runs.sh
if compgen -G "/tmp/e2e/captures/*.pt" > /dev/null; then
  echo "== bench_kernels.py on the captured layers"
  python3 scripts/bench_kernels.py --skip-check --lengths "" --estimators "${REAL_ESTIMATORS:-pooled}" \
    --real /tmp/e2e/captures/*.pt --out /tmp/e2e/out/bench-real.json
fi
