#!/usr/bin/env bash
# On the GPU machine: one session's whole run. The kernel benchmarks run first, while vLLM installs
# from the staged pieces (scripts/e2e/device-run.sh with no phase), then device-run.sh runs the
# end-to-end phases given as arguments. Results land in /tmp/e2e/out for device-wait.sh.
#
# Usage (after the pieces of scripts/e2e/stage.sh are in /tmp/stage):
#   (setsid nohup bash scripts/e2e/device-session.sh --phases offline,chunk > /tmp/e2e/run.log 2>&1 &)
#   bash scripts/e2e/device-wait.sh 560        (again as needed)
# Bench settings: BENCH_LENGTHS, BENCH_DENSITIES, BENCH_SMALL_LENGTHS (SmolLM2's shape: 9/3 heads, d=64);
# BENCH_TILES=1 adds the tile sweep; ACCURACY_RUNS (below) adds accuracy-harness runs after the install.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p /tmp/e2e/out
rm -f /tmp/e2e/done
E2E_DONE=/tmp/e2e/install.done bash "$root/scripts/e2e/device-run.sh" --phases none > /tmp/e2e/install.log 2>&1 &
install=$!

repo=/tmp/e2e/bench-repo  # a private copy: a later device call may refresh the checkout
rm -rf "$repo" && cp -a "$root" "$repo" && rm -rf "$repo/.device"
cd "$repo"
export PYTHONUNBUFFERED=1
echo "== bench_kernels.py: 32 / 8 heads, head_dim 128, tile sweep"
python3 scripts/bench_kernels.py --lengths "${BENCH_LENGTHS:-8192,32768,131072}" \
  --densities "${BENCH_DENSITIES:-0.02,0.05}" --repeats 5 ${BENCH_TILES:+--tiles} --out /tmp/e2e/out/bench-d128.json
echo "== bench_kernels.py: SmolLM2's shape, 9 / 3 heads, head_dim 64, tile sweep"
python3 scripts/bench_kernels.py --skip-check --heads 9 --kv-heads 3 --head-dim 64 \
  --lengths "${BENCH_SMALL_LENGTHS:-32768,131072}" --densities 0.02 --repeats 5 ${BENCH_TILES:+--tiles} --out /tmp/e2e/out/bench-d64.json

wait "$install"
echo "== install: $(cat /tmp/e2e/install.done 2>/dev/null)"
cat /tmp/e2e/install.log

# ACCURACY_RUNS: ';'-separated argument lists of the accuracy harness, run on the staged GGUF models
# before the engine phases (scripts/e2e/harness-runs.sh).
bash scripts/e2e/harness-runs.sh
rm -f /tmp/e2e/out/results-none.json /tmp/e2e/out/report-none.md
cd "$root"
bash scripts/e2e/device-run.sh "$@"
