#!/usr/bin/env bash
# On the GPU machine: wait up to SECONDS for the run started by device-run.sh to finish, printing its log
# as it grows, then copy the results (and the engine logs, packed) into $OUT.
# Usage: bash scripts/e2e/device-wait.sh SECONDS
set -uo pipefail
deadline=$(( $(date +%s) + ${1:-500} ))
seen=0
while [[ ! -f /tmp/e2e/done && $(date +%s) -lt $deadline ]]; do
  sleep 10
  lines=$(wc -l < /tmp/e2e/run.log 2>/dev/null || echo 0)
  if (( lines > seen )); then sed -n "$((seen + 1)),${lines}p" /tmp/e2e/run.log | grep -v -E '^\s*$' | cut -c1-300; seen=$lines; fi
done
[[ -f /tmp/e2e/done ]] && echo "== finished: $(cat /tmp/e2e/done)" || echo "== still running"
sed -n "$((seen + 1)),\$p" /tmp/e2e/run.log 2>/dev/null | cut -c1-300
if [[ -n "${OUT:-}" ]]; then
  cp /tmp/e2e/out/* "$OUT"/ 2>/dev/null
  cp /tmp/e2e/run.log "$OUT"/run.log 2>/dev/null
  tar czf "$OUT"/engine-logs.tgz -C /tmp/e2e logs 2>/dev/null
fi
exit 0
