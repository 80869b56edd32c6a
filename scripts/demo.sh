#!/usr/bin/env bash
# Install pathgate into .venv and validate the small example scope on this machine.
# On a machine without an H200 the verdict is INCONCLUSIVE: every case is checked for correctness
# (the Triton candidate runs under Triton's interpreter on CPU), but the scope's speed claims are
# for an H200 and CPU timings are not GPU evidence.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0 -e .
status=0
.venv/bin/pathgate validate scopes/fused-add-rmsnorm-h200.yaml --quick "$@" || status=$?
if [ "$status" -eq 3 ]; then
    echo "INCONCLUSIVE is the expected verdict without an H200 (see the claims above)."
    exit 0
fi
if [ "$status" -eq 4 ]; then
    echo "NEEDS_REVIEW is the expected verdict on an H200: a speedup above 10x goes to a reviewer."
    exit 0
fi
exit "$status"
