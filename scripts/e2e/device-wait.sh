#!/usr/bin/env bash
# On the GPU machine: wait up to SECONDS for the run started by device-run.sh to finish, printing its log
# as it grows, then copy the log, the partial results and an archive of everything else into $OUT.
# Usage: bash scripts/e2e/device-wait.sh SECONDS [DIR]   (DIR: the run's folder, default /tmp/e2e;
#   device-v0.sh's is /tmp/e2e-v0, device-sglang.sh's /tmp/e2e-sglang)
# A machine with no run log there is a fresh one (the last was given back with its /tmp): it says so at
# once instead of waiting out SECONDS of device time.
set -uo pipefail
dir="${2:-/tmp/e2e}"
if [[ ! -f "$dir/run.log" ]]; then
  echo "== no run in $dir: nothing was started on this machine (a fresh one, if the last was given back)"
  exit 3
fi
deadline=$(( $(date +%s) + ${1:-500} ))
seen=0
while [[ ! -f "$dir/done" && $(date +%s) -lt $deadline ]]; do
  sleep 10
  lines=$(wc -l < "$dir/run.log" 2>/dev/null || echo 0)
  if (( lines > seen )); then sed -n "$((seen + 1)),${lines}p" "$dir/run.log" | grep -v -E '^\s*$' | cut -c1-300; seen=$lines; fi
done
[[ -f "$dir/done" ]] && echo "== finished: $(cat "$dir/done")" || echo "== still running"
sed -n "$((seen + 1)),\$p" "$dir/run.log" 2>/dev/null | cut -c1-300
if [[ -n "${OUT:-}" ]]; then
  # A call brings back at most 8 files: the log, the latest partial results, and one archive of the rest
  # (results, benchmark and accuracy JSON, the bench's folder, the engine logs).
  cp "$dir/run.log" "$OUT"/run.log 2>/dev/null
  cp "$dir/out"/results-partial.json "$OUT"/ 2>/dev/null
  tar czf "$OUT"/results.tgz -C "$dir" out logs 2>/dev/null
fi
exit 0
