#!/usr/bin/env bash
# Create (or reuse) the CPU test environment in .venv and install the project into it.
# Usage: bash ci/setup-env.sh [VENV_DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$root/.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -r "$root/ci/requirements-cpu.txt"
"$venv/bin/python" -m pip install -q --no-deps -e "$root"
"$venv/bin/python" -c "import prefill_accel, torch, triton; print('prefill_accel', prefill_accel.__version__, '| torch', torch.__version__, '| triton', triton.__version__)"
