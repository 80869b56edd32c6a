"""Cases on N ranks through the engine, on the CPU with gloo (2 and 4 processes).

The scope is the MLA+MoE layer at its CPU test size with decode context parallelism: every rank
holds a slice of the KV cache, the stock path merges the ranks' partial attention, and the
float64 reference attends over the whole cache on one process.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import MappingProxyType

import pytest
import torch

from harness.evaluation.cases import Case
from harness.evaluation.plan import Host, make_plan
from harness.evaluation.ranks import run_case_on_ranks
from harness.evaluation.timing import StopRule
from kernels.mla_moe_decode.fused import CPU_TEST_CONFIG
from scopes.manifest import ScopeManifest

STOP = StopRule(4, 4, 5.0, 0.05, pairs_per_batch=4, captures=1)
CPU = torch.device("cpu")


def _manifest(
    candidate: str = "kernels.mla_moe_decode.stock:forward", gpus: int = 2, cp: int = 2
) -> ScopeManifest:
    return ScopeManifest.model_validate(
        {
            "name": f"mla-cp{cp}-cpu",
            "summary": "stock MLA+MoE layer with decode CP on gloo ranks",
            "path": {
                "problem": "kernels.mla_moe_decode.problem:Problem",
                "baseline": "kernels.mla_moe_decode.stock:forward_compiled",
                "candidate": candidate,
                "supports": "tests.evaluation.rank_paths:always",
            },
            "model": {"id": "test/mla", "dtype": "bfloat16", "config": dict(CPU_TEST_CONFIG)},
            "hardware": {"gpu": ["cpu"], "gpus": [gpus]},
            "workload": {
                "phase": "decode",
                "batch": {"min": 3, "max": 3},
                "context": {"min": 45, "max": 45},
                "context_parallel": [cp],
            },
            "tolerance": {"error_budget": 2.0, "min_cosine": 0.9999},
        }
    )


def _case(gpus: int, cp: int) -> Case:
    return Case(3, 45, cp, gpus, "bfloat16", "cpu", config=MappingProxyType(dict(CPU_TEST_CONFIG)))


def _run(candidate: str, gpus: int = 2, cp: int = 2, timeout_s: float = 300.0):  # type: ignore[no-untyped-def]
    manifest = _manifest(candidate, gpus, cp)
    return run_case_on_ranks(manifest, _case(gpus, cp), 11, 2, STOP, 2, CPU, timeout_s)


@pytest.mark.parametrize(("gpus", "cp"), [(2, 2), (4, 4), (4, 2)])
def test_cp_stock_against_itself_passes_with_slowest_rank_samples(gpus: int, cp: int) -> None:
    ran = _run("kernels.mla_moe_decode.stock:forward", gpus, cp)
    assert ran.outcome.status == "passed", ran.outcome
    assert ran.correctness is not None and len(ran.correctness.trials) == 2
    # the CP path against the float64 attention over the whole cache: the stock error's size
    assert ran.correctness.worst_error_ratio <= 1.5
    performance = ran.performance
    assert performance is not None
    assert len(performance.stock_us) == len(performance.candidate_us) == STOP.min_pairs
    assert performance.stock_us_median > 0 and performance.speedup > 0


def test_a_path_that_ignores_the_other_ranks_slices_fails() -> None:
    ran = _run("tests.evaluation.rank_paths:ignores_its_share")
    assert ran.outcome.status == "failed"
    assert any("'out'" in reason for reason in ran.outcome.reasons)


def test_a_rank_that_raises_fails_the_case_with_its_error() -> None:
    ran = _run("tests.evaluation.rank_paths:raises_on_rank_one")
    assert ran.outcome.status == "crashed"
    assert "rank 1" in ran.outcome.error and "deliberate failure on rank 1" in ran.outcome.error


def test_replacing_a_harness_function_on_the_ranks_fails_the_case() -> None:
    """The ranks are processes of their own: each checks, as the engine does, that the
    submitted code replaced nothing the harness judges with."""
    ran = _run("tests.evaluation.rank_paths:tampers_on_ranks")
    assert ran.outcome.status == "crashed"
    assert "tampering: harness.evaluation.correctness.output_error replaced" in ran.outcome.error


def test_a_rank_that_hangs_times_the_case_out_and_ends_every_rank() -> None:
    ran = _run("tests.evaluation.rank_paths:hangs_on_rank_zero", timeout_s=20.0)
    assert ran.outcome.status == "timed_out"
    assert ran.outcome.after_s >= 20.0 and "[0, 1]" in ran.outcome.detail


def test_plan_crosses_gpu_counts_with_the_cp_degrees_that_split_them() -> None:
    data = _manifest().model_dump()
    data["hardware"] = {"gpu": ["H200"], "gpus": [2, 4, 8]}
    data["workload"]["context_parallel"] = [1, 2, 4, 8]
    manifest = ScopeManifest.model_validate(data)
    plan = make_plan(manifest, Host("H200", 8), secret_seed=1)
    assert {(c.gpus, c.cp) for c in plan.cases} == {
        (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4), (8, 8),
    }  # fmt: skip
    only_four = make_plan(manifest, Host("H200", 8), secret_seed=1, gpus=4)
    assert {c.gpus for c in only_four.cases} == {4}
    small_host = make_plan(manifest, Host("H200", 2), secret_seed=1)
    assert {c.gpus for c in small_host.cases} == {2}
    assert "gpus=8: needs 8x H200, this host has 2" in small_host.not_run


def test_a_result_wrong_on_one_rank_fails_the_case_naming_that_rank() -> None:
    """Rank 0's outputs are right; the last rank's are not: every rank's are checked."""
    ran = _run("tests.evaluation.rank_paths:wrong_on_the_last_rank")
    assert ran.outcome.status == "failed", ran.outcome
    assert ran.outcome.reasons and all(r.startswith("rank 1: ") for r in ran.outcome.reasons)


def test_the_fused_path_under_cp_matches_the_whole_cache_reference() -> None:
    """The fused kernels (Triton interpreter) on 2 ranks with CP 2: each rank's slice through
    the split kernel, the ranks' merged splits gathered and combined, against the float64
    attention over the whole cache; then timed as any case."""
    ran = _run("kernels.mla_moe_decode.fused:forward", gpus=2, cp=2)
    assert ran.outcome.status == "passed", ran.outcome
    assert ran.correctness is not None and ran.correctness.worst_error_ratio <= 1.5
    assert ran.performance is not None and ran.performance.candidate_us_median > 0


def test_the_cp_showcase_scope_is_one_job_per_gpu_count_and_its_guard_fits_its_plan() -> None:
    from kernels.mla_moe_decode.fused import supports_context_parallel
    from scopes.manifest import load_manifest_file
    from workers.routing import queues_for_manifest

    scope = Path(__file__).resolve().parents[2] / "scopes" / "kimi-k2-mla-moe-decode-h200-cp.yaml"
    manifest = load_manifest_file(scope)
    assert queues_for_manifest(manifest) == ["gpu.h200.x2", "gpu.h200.x4", "gpu.h200.x8"]
    plan = make_plan(manifest, Host("H200", 8), secret_seed=1, quick=True)
    assert all(supports_context_parallel(case) for case in plan.cases)
    assert not any(supports_context_parallel(probe) for probe in plan.probes)
    assert make_plan(manifest, Host("H200", 1), secret_seed=1).runnable is False


# --- on GPUs: NCCL, rank r on GPU r (skipped with fewer than two) ---

GPU_FAST = StopRule(20, 20, 30.0, 0.05, pairs_per_batch=10, captures=1)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("cp", [1, 2])
def test_the_fused_layer_under_cp_on_two_gpus(cp: int) -> None:
    """The real Kimi-K2 shard's fused layer on 2 GPUs (NCCL) at CP 1 and 2, against the compiled
    stock with the same CP degree and the float64 attention over the whole cache."""
    from kernels.mla_moe_decode.fused import supports_context_parallel
    from scopes.manifest import load_manifest_file

    scope = Path(__file__).resolve().parents[2] / "scopes" / "kimi-k2-mla-moe-decode-h200-cp.yaml"
    manifest = load_manifest_file(scope)
    config = MappingProxyType(dict(manifest.model.config))
    case = Case(8, 8192, cp, 2, "bfloat16", "H200", config=config)
    assert supports_context_parallel(case)
    ran = run_case_on_ranks(manifest, case, 11, 1, GPU_FAST, 4, torch.device("cuda"), 600.0)
    assert ran.outcome.status == "passed", ran.outcome
    assert ran.performance is not None and ran.performance.speedup > 1.0


def test_a_multi_rank_case_reports_the_slowest_ranks_fraction_and_every_ranks_flags() -> None:
    """The samples are the slowest rank's, so the floor fraction must be too; an integrity flag
    raised on any rank must reach the evidence (named by rank), not only rank 0's."""
    from harness.evaluation.engine import hbm_fraction
    from harness.evaluation.evidence import PerformanceEvidence
    from harness.evaluation.ranks import _slowest_rank_performance
    from harness.evaluation.timing import Timing

    run = Path(__file__).resolve().parents[2] / "docs/runs/2026-12-03-kimi-k2-h200-quick"
    stored = json.loads(gzip.decompress((run / "evidence.json.gz").read_bytes()))
    stored = stored["cases"][0]["performance"]
    root = PerformanceEvidence.model_validate(stored | {"integrity_flags": ["a rank-0 flag"]})
    peer = root.model_copy(update={"integrity_flags": ["wall clock 3x the events"]})
    fast = [100.0 + i % 3 for i in range(30)]
    timings = [
        Timing("cuda-graph", 2, 1, stock_us=fast, candidate_us=fast, capture_index=[0] * 30),
        Timing("cuda-graph", 2, 1, stock_us=fast, candidate_us=[2 * t for t in fast],
               capture_index=[0] * 30),
    ]  # fmt: skip
    combined = _slowest_rank_performance([root, peer], timings, seed=1)
    assert combined.candidate_us_median == 2 * 101.0
    expected = hbm_fraction(root.bytes_moved, 202.0, root.hbm_bytes_per_s)
    assert combined.candidate_hbm_fraction == pytest.approx(expected)
    assert combined.candidate_hbm_fraction != root.candidate_hbm_fraction
    assert combined.integrity_flags == ["a rank-0 flag", "rank 1: wall clock 3x the events"]


def test_ranks_draw_fresh_inputs_together_when_one_rank_needs_them() -> None:
    """A trial whose inputs put too many rows on near-ties is drawn again; a rank that did so
    alone would call the path (and its collectives) once more than its peer."""
    data = _manifest().model_dump(mode="json")
    data["path"]["problem"] = "tests.evaluation.rank_paths:OverCapOnRankZeroOnce"
    manifest = ScopeManifest.model_validate(data)
    ran = run_case_on_ranks(manifest, _case(2, 2), 11, 2, STOP, 2, CPU, 120.0)
    assert ran.outcome.status == "passed", ran.outcome
    assert ran.correctness is not None
    assert "inputs drawn 1 more time(s)" in " ".join(ran.correctness.trials[0].notes)
