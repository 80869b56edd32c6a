#!/usr/bin/env bash
# One device call (after CuTe DSL is unpacked and the wheels installed): the MLA+MoE layer's
# tuning runs, each under its own time limit so that one slow sweep cannot cost the others, each
# log and JSON in $OUT. The tables are the last lines of each log. All four can take up to 690 s,
# more than one device call may run (600 s), so split them over two calls:
#
#   source /tmp/cutedsl/env.sh && export PYTHONPATH=$PYTHONPATH:/tmp/site:$PWD
#   bash benchmarks/mla_moe_sweeps.sh profile moe        # call 1, at most 330 s
#   bash benchmarks/mla_moe_sweeps.sh attention pdl      # call 2, at most 360 s
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pathgate-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
declare -A FLAG=([profile]=--profile-fused [moe]=--sweep-moe [attention]=--sweep-attention
    [pdl]=--sweep-pdl)
declare -A LIMIT_S=([profile]=90 [moe]=240 [attention]=240 [pdl]=120)
for run in "${@:-profile moe attention pdl}"; do
    for name in $run; do
        echo "== $name (${FLAG[$name]}, at most ${LIMIT_S[$name]} s)"
        timeout "${LIMIT_S[$name]}" python3 benchmarks/mla_moe_device_check.py "${FLAG[$name]}" \
            --out "$OUT/$name.json" 2>&1 | grep -v -i warning > "$OUT/$name.log"
        grep "^|" "$OUT/$name.log" | tail -n 40
    done
done
