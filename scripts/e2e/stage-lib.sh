# Sourced by the staging scripts that run here (stage.sh, stage-gpu-build.sh, stage-sglang.sh,
# stage-verify-gpu.sh). Sets `py`, the interpreter they run the tooling and pip with:
# $PREFILL_ACCEL_TOOL_PYTHON, else the checkout's .venv, else python3.

stage_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
py="${PREFILL_ACCEL_TOOL_PYTHON:-$stage_root/.venv/bin/python}"
[[ -x "$py" ]] || py=python3

target_file() {  # TARGET FILE: the path of one of TARGET's pinned files, from the cache `fetch` and `build`
  # fill (downloaded where missing, its checksum checked): FILE is "artifact" (the upstream source archive) or
  # "wheel:cpXY" (the engine wheel for that CPython, Target.wheel_for)
  PYTHONPATH="$stage_root/kernels" "$py" - "$stage_root" "$1" "$2" <<'EOF'
import sys
from pathlib import Path

from prefill_accel.tooling import registry
from prefill_accel.tooling.targets import Targets

root, name, kind = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
target = Targets.load(root).resolve(name)
if kind == "artifact":
    filename, sha256 = target.artifact, target.artifact_sha256
else:
    filename, sha256 = target.wheel_for(kind.removeprefix("wheel:"))
print(registry.fetch_file(target.engine, filename, sha256, root))
EOF
}

device_platform() {  # VERSION: sets the array `platform`, pip's flags for wheels the GPU machine's CPython
  # VERSION (e.g. 3.12) installs on Linux x86_64
  platform=(--python-version "$1" --implementation cp --abi "cp${1/./}" --only-binary=:all:)
  local tag
  for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
             manylinux2014 manylinux1; do
    platform+=(--platform "${tag}_x86_64")
  done
}

patched_files() {  # TARGET WHEEL PACKAGE TAR WORK: the files of PACKAGE/ in the engine WHEEL that the
  # prefill-accel series and overlay for TARGET change or add (`prefill-accel apply` to the wheel unpacked in
  # the new scratch folder WORK, which the caller removes), as TAR
  local work="$5"
  mkdir -p "$work/orig"
  python3 -m zipfile -e "$2" "$work/site"
  cp -a "$work/site/$3" "$work/orig/$3"
  "$stage_root/scripts/prefill-accel" apply -q "$1" "$work/site"
  (cd "$work" && diff -rq "orig/$3" "site/$3" | grep -v __pycache__ \
    | sed -E 's#^Files orig/(.*) and site/.* differ$#\1#; s#^Only in site/(.*): (.*)$#\1/\2#' > "$work/changed") || true
  if grep -q '^Only in orig' "$work/changed" || [[ ! -s "$work/changed" ]]; then
    echo "unexpected apply result:" >&2; cat "$work/changed" >&2; return 1
  fi
  (cd "$work/site" && tar cf "$4" -T "$work/changed")
  echo "patched files: $(wc -l < "$work/changed")" >&2
}
