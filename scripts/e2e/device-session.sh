#!/usr/bin/env bash
# On the GPU machine: one session's whole run. The kernel benchmarks run first, while the later device
# calls carry the pieces of scripts/e2e/stage.sh into /tmp/stage and, once the last call has written
# /tmp/stage/complete, vLLM installs (scripts/e2e/device-run.sh with no phase); then device-run.sh runs
# the end-to-end phases given as arguments. Results land in /tmp/e2e/out for device-wait.sh.
#
# Usage (the first call carries piece.00 and starts it; the others carry a piece each):
#   (setsid nohup bash scripts/e2e/device-session.sh --phases offline,chunk > /tmp/e2e/run.log 2>&1 &)
#   bash scripts/e2e/device-wait.sh 560        (again as needed)
# Settings (each optional):
#   BENCH_RUNS     ';'-separated argument lists of scripts/bench_kernels.py, run N writing
#                  /tmp/e2e/out/bench-N.json (default: 32 / 8 heads at d=128, then SmolLM2's 9 / 3 at d=64);
#                  a list may start with NAME=VALUE words, that run's environment (PYTHONPATH=DIR for a
#                  Triton installed there, PREFILL_ACCEL_AUTOTUNE=0)
#   BENCH_TIMEOUT  seconds each benchmark run may take (default 600); the lengths it finished stay in its JSON
#   STAGE_WAIT     seconds to wait for /tmp/stage/complete (default 900)
#   ACCURACY_RUNS  ';'-separated argument lists of the accuracy harness, run on the staged GGUF models
#                  before the engine phases (scripts/e2e/harness-runs.sh)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p /tmp/e2e/out
rm -f /tmp/e2e/done
trap 'echo "exit $?" > /tmp/e2e/done' EXIT
(
  deadline=$(( $(date +%s) + ${STAGE_WAIT:-900} ))
  until [[ -f /tmp/stage/complete ]]; do
    (( $(date +%s) < deadline )) || { echo "no /tmp/stage/complete after ${STAGE_WAIT:-900} s"; exit 1; }
    sleep 3
  done
  E2E_DONE=/tmp/e2e/install.done bash "$root/scripts/e2e/device-run.sh" --phases none
) > /tmp/e2e/install.log 2>&1 &
install=$!

repo=/tmp/e2e/bench-repo  # a private copy: a later device call refreshes the checkout
rm -rf "$repo" && cp -a "$root" "$repo" && rm -rf "$repo/.device"
cd "$repo"
export PYTHONUNBUFFERED=1
default_runs="--lengths 8192,32768,131072 --densities 0.02,0.05 --repeats 5;"
default_runs+="--skip-check --heads 9 --kv-heads 3 --head-dim 64 --lengths 32768,131072 --densities 0.02 --repeats 5"
IFS=';' read -ra runs <<< "${BENCH_RUNS-$default_runs}"
n=0
for run_args in "${runs[@]}"; do
  [[ -n "${run_args// }" ]] || continue
  n=$((n + 1))
  echo "== bench_kernels.py $run_args"
  read -ra words <<< "$run_args"
  assignments=()
  while (( ${#words[@]} )) && [[ "${words[0]}" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do
    assignments+=("${words[0]}")
    words=("${words[@]:1}")
  done
  timeout "${BENCH_TIMEOUT:-600}" env "${assignments[@]}" python3 scripts/bench_kernels.py "${words[@]}" \
    --out "/tmp/e2e/out/bench-$n.json" || echo "== bench_kernels.py run $n: exit $?"
done

wait "$install"
echo "== install: $(cat /tmp/e2e/install.done 2>/dev/null)"
cat /tmp/e2e/install.log
[[ -f /tmp/site/.installed ]] || exit 1

bash scripts/e2e/harness-runs.sh
rm -f /tmp/e2e/out/results-none.json /tmp/e2e/out/report-none.md
cd "$root"
bash scripts/e2e/device-run.sh "$@"
