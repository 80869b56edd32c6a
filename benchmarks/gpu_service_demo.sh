#!/usr/bin/env bash
# The service on a GPU machine, embedded defaults (SQLite, embedded broker): `pathgate serve`
# starts the API and a worker that detects the H200 and serves `cpu` and `gpu.h200.x1`; the
# example scope is submitted and waited for. Wheels of the packages the GPU image lacks are in
# .whl/. Logs and the report land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/pathgate-out}
REPO=$PWD
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$REPO PYTHONUNBUFFERED=1
SERVICE_DIR=$(mktemp -d)
cd "$SERVICE_DIR"
python3 -m harness.cli serve --port 8765 > "$OUT/serve.log" 2>&1 &
SERVE_PID=$!
for _ in $(seq 60); do
    python3 -c "import httpx; httpx.get('http://127.0.0.1:8765/healthz').raise_for_status()" \
        2>/dev/null && break
    sleep 1
done
TOKEN=$(python3 -m harness.cli token create --role contributor --name gpu-demo | awk '{print $NF}')
python3 -m harness.cli submit "$REPO/scopes/fused-add-rmsnorm-h200.yaml" \
    --server http://127.0.0.1:8765 --token "$TOKEN" --wait --timeout 420
echo "submit exit code: $?"
python3 - "$TOKEN" "$OUT" <<'PY'
import sys, httpx
token, out = sys.argv[1], sys.argv[2]
headers = {"Authorization": f"Bearer {token}"}
md = httpx.get("http://127.0.0.1:8765/v1/submissions/1/report.md", headers=headers).text
open(f"{out}/service_report.md", "w").write(md)
body = httpx.get("http://127.0.0.1:8765/v1/submissions/1", headers=headers).json()
for job in body["jobs"]:
    print(job["queue"], job["state"], job["verdict"], job["attempts"], job["worker"])
print("submission:", body["state"], body["verdict"], body["verdict_reasons"])
PY
kill $SERVE_PID; wait $SERVE_PID 2>/dev/null
grep -E "ERROR|CRITICAL" "$OUT/serve.log" | head -5
