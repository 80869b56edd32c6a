"""The engine on a CUDA GPU: the example scope's cases and probes, timed as CUDA graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from harness.evaluation import timing
from harness.evaluation.engine import EngineOptions, evaluate
from harness.evaluation.environment import gpu_kind
from scopes.manifest import KNOWN_GPUS, ScopeManifest, validate_manifest

SCOPES = Path(__file__).resolve().parents[2] / "scopes"
pytestmark = pytest.mark.gpu


def _example_scope_here() -> ScopeManifest:
    """The shipped example scope with this GPU's kind added to its hardware: its claims are
    an H200's (not measurable elsewhere), but its cases and probes run on any known GPU, and
    they are what this test checks."""
    kind = gpu_kind(torch.cuda.get_device_name())
    if kind not in KNOWN_GPUS:
        pytest.skip(f"{kind}: no scope can name this GPU")
    data = yaml.safe_load((SCOPES / "fused-add-rmsnorm-h200.yaml").read_text())
    if kind not in data["hardware"]["gpu"]:
        data["hardware"]["gpu"].append(kind)
    return validate_manifest(data)


def test_example_scope_on_gpu_is_correct_and_timed_as_graphs() -> None:
    manifest = _example_scope_here()
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
        # every timed candidate replay compared, each pair on inputs of its own
        assert perf.watched_replays and perf.timed_input_sets == perf.watched_replays
        assert perf.watched_replays % 10 == 0 and perf.tallied_replays is None
        # every sampled call was checked for a start before it was queued (the count may be
        # nonzero on a slow host: the report warns then); each batch with such a call doubled
        # the spin before the start events
        assert perf.timed_calls == 2 * len(perf.stock_us) and perf.late_starts is not None
        assert perf.late_batches is not None and perf.late_batches <= timing.LEAD_DOUBLINGS
        assert perf.lead_cycles == timing.LEAD_CYCLES << perf.late_batches
        assert perf.candidate_hbm_fraction is not None and 0 < perf.candidate_hbm_fraction < 1.2
        # summed kernel time never exceeds the event time of the same replay by much
        assert perf.candidate_kernel_us_per_layer is not None
        assert perf.candidate_kernel_us_per_layer <= perf.candidate_us_median * 1.1
