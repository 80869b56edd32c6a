"""The decode-CP table of issue 9 from the evidence of a multi-GPU validate run.

    pathgate validate scopes/kimi-k2-mla-moe-decode-h200-cp.yaml --device cuda --gpus 8 --out DIR
    python benchmarks/cp_table.py DIR/evidence.json [--out cp_table.json]

Per GPU count, batch and context, one row per CP degree: the fused path's µs per layer (the
slowest rank's per-sample time, median and its 95% CI), the compiled stock's on the same ranks
and CP degree, the speedup over it with its CI, the fused time's speedup over CP 1 of the same
batch and context (ratio of medians), and the case's correctness outcome. Every number is read
from the stored evidence; nothing is measured here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from harness.evaluation.evidence import CaseEvidence, Evidence


def rows(evidence: Evidence) -> list[dict[str, Any]]:
    fused_cp1 = {
        (c.gpus, c.batch, c.context): c.performance.candidate_us_median
        for c in evidence.cases
        if c.cp == 1 and c.performance is not None
    }
    table = []
    for case in sorted(evidence.cases, key=lambda c: (c.gpus, c.batch, c.context or 0, c.cp)):
        table.append(_row(case, fused_cp1.get((case.gpus, case.batch, case.context))))
    return table


def _row(case: CaseEvidence, fused_cp1_us: float | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "gpus": case.gpus,
        "batch": case.batch,
        "context": case.context,
        "cp": case.cp,
        "correctness": case.status,
    }
    performance = case.performance
    if performance is None:
        return row
    fused = performance.candidate_us_median
    return {
        **row,
        "fused_us": fused,
        "fused_us_ci95": list(performance.candidate_us_ci95),
        "stock_us": performance.stock_us_median,
        "speedup_vs_stock": performance.speedup,
        "speedup_vs_stock_ci95": list(performance.speedup_ci95),
        "speedup_vs_cp1": fused_cp1_us / fused if fused_cp1_us and fused else None,
    }


def markdown(table: list[dict[str, Any]], evidence: Evidence) -> str:
    lines = [
        f"{evidence.environment.get('gpu_name', evidence.run.device)}, `{evidence.run.command}`",
        "",
        "| GPUs | batch | context | CP | fused µs [95% CI] | stock µs | speedup vs stock "
        "[95% CI] | fused speedup vs CP 1 | correctness |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        if "fused_us" not in r:
            cells = ["-"] * 4
        else:
            low, high = r["fused_us_ci95"]
            s_low, s_high = r["speedup_vs_stock_ci95"]
            vs_cp1 = f"{r['speedup_vs_cp1']:.2f}" if r["speedup_vs_cp1"] else "-"
            cells = [
                f"{r['fused_us']:.1f} [{low:.1f}, {high:.1f}]",
                f"{r['stock_us']:.1f}",
                f"{r['speedup_vs_stock']:.2f} [{s_low:.2f}, {s_high:.2f}]",
                vs_cp1,
            ]
        head = [r["gpus"], r["batch"], r["context"], r["cp"]]
        lines.append("| " + " | ".join(str(v) for v in [*head, *cells, r["correctness"]]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("evidence", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    evidence = Evidence.model_validate_json(args.evidence.read_text())
    table = rows(evidence)
    print(markdown(table, evidence))
    if args.out:
        args.out.write_text(json.dumps({"command": evidence.run.command, "rows": table}, indent=1))


if __name__ == "__main__":
    main()
