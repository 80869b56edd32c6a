#!/usr/bin/env bash
# A long `pathgate validate` on a lent GPU, across several device calls (each at most 10
# minutes, and the machine can be taken back when the session's device time runs out).
#
#   bash benchmarks/device_validate.sh start SCOPE [validate options...]
#       starts the run in the background (with --resume when pathgate-out/device-validate
#       already holds a checkpoint, e.g. carried in from an earlier session) and returns;
#   bash benchmarks/device_validate.sh wait SECONDS
#       waits up to SECONDS for it, then copies what there is (checkpoint.json, or the
#       evidence and report once it has finished, and the log) to $OUT. Keep SECONDS well
#       inside the call's limit_s, which shrinks to the device time left.
#
# Call `start` and the first `wait` in the same device call: a machine left idle between calls
# for more than its idle release (30 s) is taken back, and the run with it (2026-12-04). Run
# nothing else on the GPU meanwhile (timed samples would share it); run tests before `start`
# or after the last `wait`.
#
# To continue in a later session: carry pathgate-out/device-validate/checkpoint.json (the
# device call's `carry`; `wait` keeps the latest one in $OUT, so a call cut off at its limit
# returns it too) and run `start` again with the same options, from a tree whose Python
# files (outside the tests) are the checkpoint's: a checkout of the commit it was made on. Any
# other tree is refused (its code digest).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=pathgate-out/device-validate
LOG=/tmp/device-validate.log
PID_FILE=/tmp/device-validate.pid

case "${1:-}" in
start)
    scope=$2
    shift 2
    resume=()
    [[ -f $RUN_DIR/checkpoint.json ]] && resume=(--resume)
    # setsid: the device kills what a call leaves running unless it is in a session of its own.
    setsid nohup python3 -m harness.cli validate "$scope" --out "$RUN_DIR" "${resume[@]}" "$@" \
        > "$LOG" 2>&1 < /dev/null &
    echo $! > "$PID_FILE"
    echo "started pid $(cat "$PID_FILE") ${resume[*]}"
    ;;
wait)
    deadline=$((SECONDS + $2))
    pid=$(cat "$PID_FILE")
    mkdir -p "$OUT"
    while kill -0 "$pid" 2> /dev/null && ((SECONDS < deadline)); do
        sleep 5
        # a call cut off at its limit still returns what is under $OUT: keep the log and the
        # latest checkpoint there (whole, through a rename), so a run the device time ran out
        # on can resume in a later session
        cp "$LOG" "$OUT/" 2> /dev/null || true
        if [[ $RUN_DIR/checkpoint.json -nt $OUT/checkpoint.json ]]; then
            cp "$RUN_DIR/checkpoint.json" "$OUT/checkpoint.json.part" 2> /dev/null &&
                mv "$OUT/checkpoint.json.part" "$OUT/checkpoint.json" || true
        fi
    done
    if kill -0 "$pid" 2> /dev/null; then echo "still running"; else echo "finished"; fi
    cp "$LOG" "$OUT/" 2> /dev/null || true
    for name in checkpoint.json evidence.json report.md error.log; do
        cp "$RUN_DIR/$name" "$OUT/" 2> /dev/null || true
    done
    grep -v -i warning "$LOG" | tail -n 25
    # the verdict's reasons and the claims, which the log's table scrolls away
    if [[ -f $RUN_DIR/evidence.json ]]; then
        python3 - "$RUN_DIR/evidence.json" << 'EOF_PY'
import json, sys
evidence = json.load(open(sys.argv[1]))
print("verdict:", evidence["verdict"])
for reason in evidence["verdict_reasons"]:
    print(" -", reason[:400])
for claim in evidence["claims"]:
    print(f" claim {claim['status']}: {claim['description']}: {claim['reason'][:160]}")
check = evidence.get("decode_check") or {}
print(" decode check:", {k: check.get(k) for k in ("status", "token_match", "mean_kl",
      "stock_kl_from_reference", "candidate_kl_from_reference")})
EOF_PY
    fi
    ;;
*)
    echo "usage: $0 start SCOPE [options] | wait SECONDS" >&2
    exit 2
    ;;
esac
