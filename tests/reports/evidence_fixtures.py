"""Evidence produced by the real engine, stored under tests/fixtures/:

- evidence_h200_rmsnorm.json.gz, evidence_h200_rmsnorm_rerun.json.gz: the shipped add+RMSNorm
  scope validated twice on an H200 (`pathgate validate scopes/fused-add-rmsnorm-h200.yaml
  --device cuda`), PASS, two claims verified; two runs of one scope for the compare view.
- evidence_h200_claims.json.gz: tests/reports/claims-h200.yaml validated on the same H200, FAIL:
  its claims land on every status (verified, refuted, inconclusive, not measurable).
- evidence_cpu_rmsnorm.json: the shipped scope with `--device cpu --quick`: INCONCLUSIVE, CPU
  timings, every claim not measurable here.
- evidence_cpu_offgrid_fail.json: a candidate wrong off the power-of-two grid
  (tests.fixtures.bad_paths:wrong_off_grid_forward, hidden 256, batch 1..64) on CPU: FAIL.

The H200 runs are gzipped (about 200 KB each as text, and the working tree a device call carries
must stay small). `many_cases` builds a report with hundreds of cases by replicating those real
case entries under distinct ids (the plan of a real scope here has a dozen cases), and
re-deciding the verdict with the engine's own `decide`.
"""

from __future__ import annotations

import gzip
from pathlib import Path

from harness.evaluation.evidence import Evidence
from harness.evaluation.verdict import decide

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def load(name: str) -> Evidence:
    path = FIXTURES / f"evidence_{name}.json"
    zipped = path.with_suffix(".json.gz")
    text = gzip.decompress(zipped.read_bytes()) if zipped.exists() else path.read_bytes()
    return Evidence.model_validate_json(text)


def many_cases(copies: int = 30, failing_copies: int = 25) -> Evidence:
    """12 real H200 cases x `copies` plus the real failing CPU case x `failing_copies`."""
    gpu, fail = load("h200_claims"), load("cpu_offgrid_fail")
    cases = [
        case.model_copy(update={"id": f"{case.id} copy={k}"})
        for k in range(copies)
        for case in gpu.cases
    ]
    failing = [c for c in fail.cases if c.status != "passed"]
    cases += [
        case.model_copy(update={"id": f"{case.id} copy={k}"})
        for k in range(failing_copies)
        for case in failing
    ]
    verdict, reasons = decide(cases, gpu.probes, gpu.claims, gpu.not_run)
    return gpu.model_copy(update={"cases": cases, "verdict": verdict, "verdict_reasons": reasons})
