"""The engine on a CUDA GPU: the example scope's cases and probes, timed as CUDA graphs."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.evaluation.engine import EngineOptions, evaluate
from scopes.manifest import load_manifest_file

SCOPES = Path(__file__).resolve().parents[2] / "scopes"
pytestmark = pytest.mark.gpu


def test_example_scope_on_gpu_is_correct_and_timed_as_graphs() -> None:
    manifest = load_manifest_file(SCOPES / "fused-add-rmsnorm-h200.yaml")
    evidence = evaluate(manifest, EngineOptions(device="cuda", quick=True, seed=11))
    assert evidence.cases and all(c.status == "passed" for c in evidence.cases), [
        c.reasons for c in evidence.cases
    ]
    assert all(p.status == "passed" for p in evidence.probes)
    for case in evidence.cases:
        perf = case.performance
        assert perf is not None
        assert perf.method == "cuda-graph" and perf.is_gpu_evidence
        assert perf.candidate_kernels_per_layer == 1.0
        assert perf.stock_kernels_per_layer is not None and perf.stock_kernels_per_layer > 1
        assert perf.speedup_ci95[0] <= perf.speedup <= perf.speedup_ci95[1]
        assert perf.candidate_hbm_fraction is not None and 0 < perf.candidate_hbm_fraction < 1.2
        # summed kernel time never exceeds the event time of the same replay by much
        assert perf.candidate_kernel_us_per_layer is not None
        assert perf.candidate_kernel_us_per_layer <= perf.candidate_us_median * 1.1
