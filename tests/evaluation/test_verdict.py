"""Claims against measured intervals, and the verdict's precedence:
FAIL > NEEDS_REVIEW > INCONCLUSIVE > PASS."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.evaluation.evidence import (
    CaseEvidence,
    ClaimEvidence,
    CorrectnessEvidence,
    OutputErrorEvidence,
    PerformanceEvidence,
    ProbeEvidence,
    TrialEvidence,
)
from harness.evaluation.verdict import check_claim, decide, looser_standard
from scopes.manifest import Claim, load_manifest_file


def _perf(
    speedup: tuple[float, float, float], latency: tuple[float, float, float], kernels: float = 1.0
) -> PerformanceEvidence:
    return PerformanceEvidence(
        method="cuda-graph",
        is_gpu_evidence=True,
        layers=8,
        working_set_bytes=1 << 28,
        exceeds_l2=True,
        stock_us=[1.0],
        candidate_us=[1.0],
        stock_us_median=latency[0] * speedup[0],
        stock_us_ci95=(1.0, 1.0),
        candidate_us_median=latency[0],
        candidate_us_ci95=(latency[1], latency[2]),
        speedup=speedup[0],
        speedup_ci95=(speedup[1], speedup[2]),
        speedup_ci95_sampling=(speedup[1], speedup[2]),
        captures=3,
        capture_spread=0.0,
        stop_reason="",
        stock_eager_us=None,
        candidate_eager_us=None,
        stock_kernels_per_layer=5.0,
        candidate_kernels_per_layer=kernels,
        stock_kernel_us_per_layer=None,
        candidate_kernel_us_per_layer=None,
        stock_kernel_span_us_per_layer=None,
        candidate_kernel_span_us_per_layer=None,
        kernel_source="cupti",
        candidate_kernel_names=[],
        bytes_moved=1000,
        hbm_bytes_per_s=4e12,
        candidate_hbm_fraction=0.8,
        stock_hbm_fraction=0.4,
    )


def _case(batch: int, perf: PerformanceEvidence | None, status: str = "passed") -> CaseEvidence:
    return CaseEvidence(
        id=f"batch={batch}",
        batch=batch,
        context=None,
        cp=1,
        gpus=1,
        dtype="bfloat16",
        origin="grid",
        status=status,
        reasons=[],  # type: ignore[arg-type]
        correctness=None,
        performance=perf,
    )


CASES = [
    _case(1, _perf((1.9, 1.85, 1.95), (50, 49, 51))),
    _case(64, _perf((1.3, 1.2, 1.4), (80, 78, 82), kernels=2)),
]


@pytest.mark.parametrize(
    ("claim", "status"),
    [
        ({"metric": "speedup", "where": {"batch": 1}, "at_least": 1.8}, "verified"),
        ({"metric": "speedup", "where": {"batch": 1}, "at_least": 1.9}, "inconclusive"),
        ({"metric": "speedup", "where": {"batch": 1}, "at_least": 2.0}, "refuted"),
        (
            {"metric": "speedup", "where": {"batch": 1}, "at_least": 2.0, "tolerance": 0.1},
            "verified",
        ),
        ({"metric": "speedup", "at_least": 1.5}, "refuted"),
        ({"metric": "speedup", "where": {"batch": [1, 64]}, "at_least": 1.1}, "verified"),
        ({"metric": "latency_us", "where": {"batch": 1}, "at_most": 52}, "verified"),
        ({"metric": "latency_us", "where": {"batch": 1}, "at_most": 48}, "refuted"),
        ({"metric": "latency_us", "where": {"batch": 1}, "at_most": 50}, "inconclusive"),
        (
            {"metric": "latency_us", "where": {"batch": 1}, "at_most": 48, "tolerance": 0.07},
            "verified",
        ),
        # the fraction's interval from the latency's: 0.8 x 50/51 .. 0.8 x 50/49
        ({"metric": "hbm_fraction", "where": {"batch": 1}, "at_least": 0.79}, "inconclusive"),
        ({"metric": "hbm_fraction", "where": {"batch": 1}, "at_least": 0.83}, "refuted"),
        ({"metric": "kernels_per_layer", "at_most": 1}, "refuted"),
        ({"metric": "kernels_per_layer", "at_most": 2}, "verified"),
        ({"metric": "hbm_fraction", "where": {"batch": 1}, "at_least": 0.7}, "verified"),
        ({"metric": "speedup", "where": {"batch": 3}, "at_least": 1.0}, "not_measurable"),
        # batch 48 never measured: judging the claim on batch 1 alone would verify it
        ({"metric": "speedup", "where": {"batch": [1, 48]}, "at_least": 1.1}, "inconclusive"),
        ({"metric": "speedup", "at_least": 1.0, "hardware": "GB300"}, "not_measurable"),
        ({"metric": "tokens_per_s", "at_least": 100}, "not_measurable"),
    ],
)
def test_claim_status(claim: dict, status: str) -> None:
    result = check_claim(Claim.model_validate(claim), CASES, host_gpu="H200")
    assert result.status == status, result.reason


def test_claims_on_cpu_are_not_gpu_evidence() -> None:
    claim = Claim.model_validate({"metric": "speedup", "at_least": 1.0})
    result = check_claim(claim, CASES, host_gpu="cpu")
    assert result.status == "not_measurable"
    assert "not GPU evidence" in result.reason


def _claim(status: str) -> ClaimEvidence:
    return ClaimEvidence(
        claim={},
        description="d",
        status=status,
        measured=None,
        ci95=None,  # type: ignore[arg-type]
        cases=[],
        reason="r",
    )


PROBE_OK = ProbeEvidence(id="p", origin="probe: x", status="passed", reasons=[])
PROBE_BAD = ProbeEvidence(id="p", origin="probe: x", status="failed", reasons=["accepts"])


@pytest.mark.parametrize(
    ("cases", "probes", "claims", "verdict"),
    [
        (CASES, [PROBE_OK], [_claim("verified")], "PASS"),
        (CASES, [PROBE_OK], [], "PASS"),
        (CASES, [PROBE_OK], [_claim("verified"), _claim("not_measurable")], "INCONCLUSIVE"),
        (CASES, [PROBE_OK], [_claim("inconclusive")], "INCONCLUSIVE"),
        (CASES, [PROBE_OK], [_claim("refuted"), _claim("inconclusive")], "FAIL"),
        (CASES, [PROBE_BAD], [_claim("verified")], "FAIL"),
        ([*CASES, _case(2, None, "failed")], [PROBE_OK], [_claim("inconclusive")], "FAIL"),
        ([*CASES, _case(2, None, "unsupported")], [PROBE_OK], [], "FAIL"),
        ([*CASES, _case(2, None, "crashed")], [PROBE_OK], [], "FAIL"),
        ([*CASES, _case(2, None, "timed_out")], [PROBE_OK], [], "FAIL"),
        ([], [], [_claim("not_measurable")], "INCONCLUSIVE"),
    ],
)
def test_verdict_precedence(cases: list, probes: list, claims: list, verdict: str) -> None:
    decided, reasons = decide(cases, probes, claims, ["not runnable here: needs 8x GB300"])
    assert decided == verdict
    assert reasons


def _suspicious(**changes: object) -> list[CaseEvidence]:
    perf = _perf((1.9, 1.85, 1.95), (50, 49, 51)).model_copy(update=changes)
    return [_case(1, perf)]


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"speedup": 12.5}, "speedup 12.50x is above 10x"),
        ({"candidate_hbm_fraction": 1.3}, "130% of the HBM floor"),
        ({"integrity_flags": ["the wall clock measured 9 us"]}, "the wall clock measured 9 us"),
    ],
    ids=["above-10x", "beyond-floor", "cross-check"],
)
def test_too_good_to_be_true_needs_review_never_passes(changes: dict, reason: str) -> None:
    for claims in ([_claim("verified")], [_claim("not_measurable")]):
        decided, reasons = decide(_suspicious(**changes), [PROBE_OK], claims, [])
        assert decided == "NEEDS_REVIEW"
        assert any(reason in r for r in reasons), reasons


def test_a_failure_outranks_review() -> None:
    cases = [*_suspicious(speedup=50.0), _case(2, None, "failed")]
    decided, _ = decide(cases, [PROBE_OK], [], [])
    assert decided == "FAIL"


def test_cpu_timings_never_send_to_review() -> None:
    perf = _perf((40.0, 39.0, 41.0), (1, 1, 1)).model_copy(update={"is_gpu_evidence": False})
    decided, _ = decide([_case(1, perf)], [PROBE_OK], [], [])
    assert decided == "PASS"


def test_infinite_errors_survive_the_json_round_trip() -> None:
    """A NaN output has an infinite error; the evidence must still travel as JSON (the runner's
    result channel, the store) and read back the same."""
    infinite = OutputErrorEvidence(
        name="out",
        candidate_error=float("inf"),
        stock_error=1e-3,
        error_ratio=float("inf"),
        cosine=float("nan"),
    )
    correctness = CorrectnessEvidence(
        status="failed",
        reasons=["NaN"],
        worst_error_ratio=float("inf"),
        trials=[TrialEvidence(seed=1, outputs=[infinite], reasons=["NaN"])],
    )
    case = _case(1, None, "failed").model_copy(update={"correctness": correctness})
    back = CaseEvidence.model_validate_json(case.model_dump_json())
    assert back.correctness is not None
    assert back.correctness.worst_error_ratio == float("inf")
    assert (
        back.correctness.trials[0].outputs[0].cosine != back.correctness.trials[0].outputs[0].cosine
    )


def test_a_run_that_left_part_of_its_scope_out_is_no_pass() -> None:
    left_out = ["gpus=16: needs 16x H200, this host has 1"]
    verdict, reasons = decide(
        CASES, [PROBE_OK], [_claim("verified")], left_out, None, None, left_out
    )
    assert verdict == "INCONCLUSIVE"
    assert reasons == [f"part of the scope did not run here: {left_out[0]}"]
    # a failure still decides
    failed = [*CASES, _case(2, None, "failed")]
    assert decide(failed, [PROBE_OK], [], left_out, None, None, left_out)[0] == "FAIL"


def test_the_hbm_fraction_is_floor_time_over_measured_time() -> None:
    from harness.evaluation.engine import hbm_fraction

    # 4 kB at 4 GB/s is 1 µs: measured in 1 µs, the whole bandwidth; in 4 µs, a quarter
    assert hbm_fraction(4_000, 1.0, 4e9) == pytest.approx(1.0)
    assert hbm_fraction(4_000, 4.0, 4e9) == pytest.approx(0.25)
    assert hbm_fraction(None, 1.0, 4e9) is None and hbm_fraction(4_000, 1.0, None) is None


def test_a_correctness_standard_looser_than_the_defaults_goes_to_a_reviewer() -> None:
    """The submitter writes the manifest: each field loosened is named, the defaults and
    stricter values are not, and a declared non-determinism is no looser standard."""
    shipped = load_manifest_file(Path(__file__).parents[2] / "scopes/fused-add-rmsnorm-h200.yaml")
    assert looser_standard(shipped) == []
    stricter = shipped.model_copy(
        update={
            "tolerance": shipped.tolerance.model_copy(
                update={"error_budget": 1.5, "min_cosine": 0.99999, "deterministic": False}
            ),
            "model_check": shipped.model_check.model_copy(update={"max_mean_kl": 1e-4}),
        }
    )
    assert looser_standard(stricter) == []
    loose = shipped.model_copy(
        update={
            "tolerance": shipped.tolerance.model_copy(
                update={"error_budget": 1e9, "min_cosine": 1e-6, "abs_floor": 0.5}
            ),
            "model_check": shipped.model_check.model_copy(
                update={"min_token_match": 0.001, "max_mean_kl": 1e9, "kl_budget": 1e9}
            ),
        }
    )
    reasons = looser_standard(loose)
    assert [r.split(" to ")[0] for r in reasons] == [
        f"the scope sets {field}"
        for field in (
            "tolerance.error_budget",
            "tolerance.min_cosine",
            "tolerance.abs_floor",
            "model_check.min_token_match",
            "model_check.max_mean_kl",
            "model_check.kl_budget",
        )
    ]
    assert "to 1e+09, looser than the harness's 2:" in reasons[0]
    assert "derived from each output's dtype" in reasons[2]
    verdict, why = decide([_case(1, None)], [PROBE_OK], [], [], review=reasons)
    assert verdict == "NEEDS_REVIEW" and why == reasons
