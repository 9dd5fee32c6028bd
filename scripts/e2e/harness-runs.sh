#!/usr/bin/env bash
# On the GPU machine: the accuracy harness (`python -m prefill_accel.accuracy`, the package of the
# checkout this script lies in) on the staged GGUF models of /tmp/bundle (scripts/e2e/unpack-stage.sh).
#   ACCURACY_RUNS  ';'-separated argument lists; run N writes /tmp/e2e/out/accuracy-N.json
#   CAPTURES       ';'-separated argument lists run with --capture /tmp/e2e/captures
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="/tmp/bundle/gguf-only:$root/kernels"
harness() {
  python3 -m prefill_accel.accuracy --device cuda --cache-dir /tmp/bundle/cache/models "$@" 2>&1 \
    | grep -v "Converting\|Loading weights"
}

IFS=';' read -ra runs <<< "${ACCURACY_RUNS:-}"
n=0
for run_args in "${runs[@]}"; do
  [[ -n "${run_args// }" ]] || continue
  n=$((n + 1))
  echo "== accuracy $n: $run_args"
  # shellcheck disable=SC2086  # the run's arguments are split on purpose
  harness --out "/tmp/e2e/out/accuracy-$n.json" $run_args
done

IFS=';' read -ra captures <<< "${CAPTURES:-}"
for run_args in "${captures[@]}"; do
  [[ -n "${run_args// }" ]] || continue
  echo "== capture: $run_args"
  # shellcheck disable=SC2086
  harness --capture /tmp/e2e/captures $run_args
done
