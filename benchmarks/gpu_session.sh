#!/usr/bin/env bash
# One device call: GPU tests, the adversarial corpus on the GPU, the example scope validated in
# full, and (unless SKIP_FIDELITY=1) the timing-fidelity benchmark. Run from the repository root on the GPU machine, with the wheels of the packages its
# image lacks in .whl/ (pydantic and friends). Logs and JSON land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/pathgate-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
python3 -c "import torch, triton, pydantic; print('torch', torch.__version__, 'triton', triton.__version__, 'pydantic', pydantic.VERSION)"
echo "== pytest -m gpu"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/evaluation tests/kernels \
    tests/workers/test_gpu_health.py 2>&1 | grep -v USDT | tee "$OUT/pytest_gpu.log" | tail -15
echo "== adversarial corpus (cuda)"
python3 benchmarks/adversarial_corpus.py --device cuda --out "$OUT/adversarial_cuda.json" 2>&1 \
    | grep -v USDT | tee "$OUT/adversarial_cuda.log" | tail -30
echo "== pathgate validate (full)"
python3 -m harness.cli validate scopes/fused-add-rmsnorm-h200.yaml --device cuda \
    --out "$OUT/rmsnorm" 2>&1 | grep -v USDT | tee "$OUT/validate.log" | tail -45
[ "${SKIP_FIDELITY:-0}" = 1 ] && exit 0
echo "== timing fidelity"
timeout 330 python3 benchmarks/timing_fidelity.py --out "$OUT/timing_fidelity.json" 2>&1 \
    | grep -v USDT | tee "$OUT/timing_fidelity.log" | tail -14
