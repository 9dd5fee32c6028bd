#!/usr/bin/env bash
# On the GPU machine: join the pieces of scripts/e2e/stage.sh in /tmp/stage into /tmp/bundle, check
# them against the bundle's SHA256SUMS, and install the GGUF reader alone into /tmp/bundle/gguf-only
# (the accuracy harness and the model conversion need nothing else from the bundle).
set -euo pipefail
echo "== assembling $(ls /tmp/stage/piece.* | wc -l) pieces"
rm -rf /tmp/bundle && mkdir -p /tmp/bundle/gguf-only
cat /tmp/stage/piece.* | tar xf - -C /tmp/bundle
(cd /tmp/bundle && grep -v " ./SHA256SUMS$" SHA256SUMS | sha256sum --quiet -c -)
python3 -m pip install -q --no-index --no-deps --target /tmp/bundle/gguf-only /tmp/bundle/wheels/gguf-*.whl
