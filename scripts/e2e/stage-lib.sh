# Sourced by the staging scripts that run here (stage.sh, stage-gpu-build.sh, stage-sglang.sh).

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
  local root work="$5"
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  mkdir -p "$work/orig"
  python3 -m zipfile -e "$2" "$work/site"
  cp -a "$work/site/$3" "$work/orig/$3"
  "$root/scripts/prefill-accel" apply -q "$1" "$work/site"
  (cd "$work" && diff -rq "orig/$3" "site/$3" | grep -v __pycache__ \
    | sed -E 's#^Files orig/(.*) and site/.* differ$#\1#; s#^Only in site/(.*): (.*)$#\1/\2#' > "$work/changed") || true
  if grep -q '^Only in orig' "$work/changed" || [[ ! -s "$work/changed" ]]; then
    echo "unexpected apply result:" >&2; cat "$work/changed" >&2; return 1
  fi
  (cd "$work/site" && tar cf "$4" -T "$work/changed")
  echo "patched files: $(wc -l < "$work/changed")" >&2
}
