# Sourced by the device-side run scripts (device-v0.sh, device-sglang.sh, device-verify-gpu.sh): the run's
# folder and private checkout, waiting for staged pieces and unpacking them, converting the staged models.

start_run() {  # DIR ROOT: DIR/out, DIR/logs and DIR/done (written on exit, with the status) for
  # device-wait.sh; the checkout ROOT copied to DIR/repo and entered, so a later device call that refreshes
  # the checkout cannot change the run
  run_dir="$1"
  mkdir -p "$run_dir/out" "$run_dir/logs"
  rm -f "$run_dir/done"
  trap 'echo "exit $?" > "$run_dir/done"' EXIT
  rm -rf "$run_dir/repo" && cp -a "$2" "$run_dir/repo" && rm -rf "$run_dir/repo/.device"
  cd "$run_dir/repo"
}

wait_for() {  # FILE: wait for a staging call's complete-marker, at most STAGE_WAIT seconds (default 1200)
  local deadline=$(( $(date +%s) + ${STAGE_WAIT:-1200} ))
  until [[ -f "$1" ]]; do
    (( $(date +%s) < deadline )) || { echo "no $1 after ${STAGE_WAIT:-1200} s" >&2; exit 1; }
    sleep 3
  done
}

staged_bundle() {  # DIR WHAT: DIR/bundle, the tar stream of the pieces a staging script made for WHAT,
  # carried into DIR (awaited until a call writes DIR/complete), checked against its SHA256SUMS; unpacked
  # once, whole or not at all
  if [[ ! -f "$1/bundle/SHA256SUMS" ]]; then
    echo "== waiting for the staged $2 ($1/complete)"
    wait_for "$1/complete"
    rm -rf "$1/bundle" "$1/bundle.part" && mkdir -p "$1/bundle.part"
    cat "$1"/piece.* | tar xf - -C "$1/bundle.part"
    mv "$1/bundle.part" "$1/bundle"
  fi
  (cd "$1/bundle" && sha256sum --quiet -c SHA256SUMS)
}

staged_model() {  # MODEL...: the converted checkpoints in $E2E_MODELS (default /tmp/hf), from the pieces of
  # `STAGE_VLLM=0 STAGE_MODELS="MODEL..." scripts/e2e/stage.sh` in /tmp/stage, for those not there yet
  local models="${E2E_MODELS:-/tmp/hf}" missing=() model
  for model in "$@"; do
    [[ -f "$models/$model/config.json" ]] || missing+=("$model")
  done
  (( ${#missing[@]} )) || return 0
  echo "== waiting for the staged models (/tmp/stage/complete)"
  wait_for /tmp/stage/complete
  bash scripts/e2e/unpack-stage.sh
  PYTHONPATH=/tmp/bundle/gguf-only PREFILL_ACCEL_CACHE=/tmp/bundle/cache python3 scripts/e2e/convert_models.py "$models" "${missing[@]}"
}

wait_for_gpu_run() {  # a device-run.sh / device-session.sh run under way holds the GPU until /tmp/e2e/done
  if [[ -d /tmp/e2e && ! -f /tmp/e2e/done ]]; then
    echo "== waiting for the run in /tmp/e2e to finish"
    until [[ -f /tmp/e2e/done ]]; do sleep 5; done
  fi
}
