"""The engine catches bad candidate paths, each for the right reason, and passes an honest one.

Every run is a real `evaluate()` on CPU of a small add+RMSNorm scope (hidden 256, batch 1..64,
quick plan: batch 1, 8, 64 and one secret random size; probes at batch 65, cp 2 and float16) with
a candidate from tests/fixtures/bad_paths.py that is wrong in exactly one way.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.evaluation.engine import EngineOptions, evaluate
from harness.evaluation.evidence import CaseEvidence, Evidence
from harness.evaluation.timing import StopRule
from harness.reports.html import render_report_page
from scopes.manifest import ScopeManifest, validate_manifest
from tests.fixtures import bad_paths

FIXTURES = "tests.fixtures.bad_paths"
HIDDEN = 256
SEED = 20240611
# Timing only runs on cases that passed correctness; keep it to a couple of pairs.
FAST_STOP = StopRule(
    min_pairs=2, max_pairs=2, max_seconds=1.0, ci_relative_width=1.0, pairs_per_batch=2
)
PROBE_ORIGINS = {"probe: batch above max", "probe: unlisted CP degree", "probe: other dtype"}
BUDGET_REASON = "the stock error"


def make_manifest(
    candidate: str, supports: str = "honest_supports", **tolerance: Any
) -> ScopeManifest:
    """The shipped rmsnorm scope, shrunk (hidden 256, batch 1..64, no claims), with the
    candidate and guard taken from the fixtures."""
    return validate_manifest(
        {
            "name": "fused-add-rmsnorm-test",
            "summary": "Test scope for the engine's bad-path checks",
            "path": {
                "problem": "kernels.fused_add_rmsnorm.problem:Problem",
                "baseline": "kernels.fused_add_rmsnorm.stock:forward",
                "candidate": f"{FIXTURES}:{candidate}",
                "supports": f"{FIXTURES}:{supports}",
            },
            "model": {"id": "test/rmsnorm", "dtype": "bfloat16", "config": {"hidden": HIDDEN}},
            "hardware": {"gpu": ["cpu", "H200", "H100"], "gpus": [1]},  # either Hopper
            "workload": {
                "phase": "decode",
                "batch": {"min": bad_paths.MIN_BATCH, "max": bad_paths.MAX_BATCH},
                "context_parallel": [1],
            },
            "tolerance": {"error_budget": 2.0, "min_cosine": 0.9999, **tolerance},
            "claims": [],
        }
    )


def run(
    candidate: str,
    supports: str = "honest_supports",
    seed: int = SEED,
    device: str = "cpu",
    **tolerance: Any,
) -> Evidence:
    options = EngineOptions(device=device, quick=True, seed=seed, trials=2, stop=FAST_STOP)
    return evaluate(make_manifest(candidate, supports, **tolerance), options)


def failed(evidence: Evidence) -> list[CaseEvidence]:
    return [c for c in evidence.cases if c.status != "passed"]


def joined(reasons: list[str]) -> str:
    return "\n".join(reasons)


def assert_probes_pass(evidence: Evidence) -> None:
    assert {p.origin for p in evidence.probes} == PROBE_ORIGINS
    assert all(p.status == "passed" for p in evidence.probes), evidence.probes


def assert_plan_shape(evidence: Evidence) -> None:
    """The quick plan of 1..64: grid 1, 8, 64 plus exactly one off-grid random size."""
    grid = sorted(c.batch for c in evidence.cases if c.origin == "grid")
    randoms = [c.batch for c in evidence.cases if c.origin == "random"]
    assert grid == [1, 8, 64]
    assert len(randoms) == 1 and randoms[0] not in {1, 2, 4, 8, 16, 32, 64}


def test_honest_path_passes() -> None:
    evidence = run("honest_forward")
    assert evidence.verdict == "PASS", evidence.verdict_reasons
    assert_plan_shape(evidence)
    assert all(c.status == "passed" and not c.reasons for c in evidence.cases)
    assert all(
        c.correctness is not None and c.correctness.worst_error_ratio <= 1.0 for c in evidence.cases
    )
    assert all(c.performance is not None for c in evidence.cases)
    assert_probes_pass(evidence)
    assert evidence.verdict_reasons == [
        f"all {len(evidence.cases)} cases correct, guard right on all 3 probes, "
        "0 of 0 claims verified"
    ]


def test_wrong_at_one_grid_batch_fails_that_case_only() -> None:
    evidence = run("wrong_at_batch_64_forward")
    assert evidence.verdict == "FAIL"
    bad = failed(evidence)
    assert [(c.batch, c.origin, c.status) for c in bad] == [(64, "grid", "failed")]
    assert BUDGET_REASON in joined(bad[0].reasons)
    assert "'out'" in joined(bad[0].reasons) and "'residual_out'" not in joined(bad[0].reasons)
    assert evidence.verdict_reasons[0].startswith("case batch=64 cp=1 gpus=1 bfloat16: trial 0")
    assert len(evidence.verdict_reasons) == 1
    assert_probes_pass(evidence)


@pytest.mark.parametrize("seed", [SEED, 7, 123456789])
def test_wrong_off_grid_is_caught_by_the_secret_random_sizes(seed: int) -> None:
    evidence = run("wrong_off_grid_forward", seed=seed)
    assert_plan_shape(evidence)
    assert evidence.verdict == "FAIL"
    bad = failed(evidence)
    assert bad and {c.origin for c in bad} == {"random"}
    assert all(c.status == "failed" and BUDGET_REASON in joined(c.reasons) for c in bad)
    # Every grid size is a power of two, where this path is right.
    assert all(c.status == "passed" for c in evidence.cases if c.origin == "grid")
    assert evidence.run.seed == seed
    assert_probes_pass(evidence)


def test_off_grid_sizes_differ_between_seeds() -> None:
    """The random sizes come from the secret seed, so a path cannot be tuned to them."""
    drawn = {
        seed: [c.batch for c in run("honest_forward", seed=seed).cases if c.origin == "random"]
        for seed in (SEED, 7, 123456789)
    }
    assert len({tuple(batches) for batches in drawn.values()}) > 1, drawn


@pytest.mark.parametrize(
    ("candidate", "expected", "absent"),
    [
        pytest.param(
            "nan_output_forward", "'out': 1 NaN/Inf values", ["never written"], id="nan_output"
        ),
        pytest.param(
            "unwritten_tail_forward",
            "never written",
            ["NaN/Inf", "non-deterministic"],
            id="unwritten_tail",
        ),
        pytest.param(
            "modifies_inputs_forward",
            "modified its input 'x'",
            ["modified its input 'residual'", "modified its weight", BUDGET_REASON],
            id="modifies_inputs",
        ),
        pytest.param(
            "modifies_weight_forward",
            "modified its weight 'weight'",
            ["modified its input", BUDGET_REASON],
            id="modifies_weight",
        ),
        pytest.param(
            "nondeterministic_forward",
            "'out': non-deterministic, two runs on the same inputs differ in 2 elements",
            [BUDGET_REASON, "NaN/Inf", "never written"],
            id="nondeterministic",
        ),
    ],
)
def test_defect_fails_every_case_with_its_reason(
    candidate: str, expected: str, absent: list[str]
) -> None:
    evidence = run(candidate)
    assert evidence.verdict == "FAIL"
    assert_plan_shape(evidence)
    assert len(failed(evidence)) == len(evidence.cases) == 4
    for case in evidence.cases:
        reasons = joined(case.reasons)
        assert case.status == "failed"
        assert reasons.startswith("trial 0 (seed "), reasons
        assert expected in reasons
        for text in absent:
            assert text not in reasons
        assert case.performance is None  # a wrong case is never timed
    assert len(evidence.verdict_reasons) == 4
    assert all(expected in r for r in evidence.verdict_reasons)
    assert_probes_pass(evidence)


def test_unwritten_tail_reports_the_last_row() -> None:
    evidence = run("unwritten_tail_forward")
    for case in evidence.cases:
        first_tail = (case.batch - 1) * HIDDEN
        assert (
            f"'out': {HIDDEN} of {case.batch * HIDDEN} elements never written "
            f"(first at flat index {first_tail})"
        ) in joined(case.reasons)
        assert "'residual_out'" not in joined(case.reasons)


def test_nondeterminism_is_accepted_only_when_declared() -> None:
    """The same path passes when the manifest declares deterministic: false, so the failure above
    is the determinism check and nothing else."""
    evidence = run("nondeterministic_forward", deterministic=False)
    assert evidence.verdict == "PASS", evidence.verdict_reasons
    assert all(c.status == "passed" for c in evidence.cases)


def test_sloppy_accuracy_fails_the_error_budget() -> None:
    evidence = run("sloppy_bf16_forward")
    assert evidence.verdict == "FAIL"
    bad = failed(evidence)
    assert bad
    # bfloat16 accumulation is off by many times stock's error once there are a few rows.
    assert {c.batch for c in evidence.cases if c.batch >= 8} <= {c.batch for c in bad}
    for case in bad:
        reasons = joined(case.reasons)
        assert case.status == "failed"
        assert "'out': error" in reasons and BUDGET_REASON in reasons and "(budget 2.0x)" in reasons
        assert "'residual_out': error" not in reasons  # its residual sum is exact
        for text in ("NaN/Inf", "never written", "non-deterministic", "modified its"):
            assert text not in reasons
        assert case.correctness is not None and case.correctness.worst_error_ratio > 2.0
    assert_probes_pass(evidence)


def test_sloppy_accuracy_meets_a_loose_budget_and_goes_to_a_reviewer() -> None:
    """The sloppy path is merely inaccurate: with a budget of 50x (and a cosine floor it meets)
    every case passes, so the failure above is the budget; and a standard that loose is the
    submitter's own, so the verdict waits for a reviewer instead of passing."""
    evidence = run("sloppy_bf16_forward", error_budget=50.0, min_cosine=0.999)
    assert all(c.status == "passed" for c in evidence.cases)
    assert evidence.verdict == "NEEDS_REVIEW"
    assert [r.split(" to ")[0] for r in evidence.verdict_reasons] == [
        "the scope sets tolerance.error_budget",
        "the scope sets tolerance.min_cosine",
    ]


def test_guard_accepting_everything_fails_every_probe() -> None:
    evidence = run("honest_forward", supports="accept_everything_supports")
    assert evidence.verdict == "FAIL"
    assert all(c.status == "passed" for c in evidence.cases)  # the in-scope work is right
    assert {p.origin for p in evidence.probes} == PROBE_ORIGINS
    for probe in evidence.probes:
        assert probe.status == "failed"
        assert probe.reasons == [
            f"guard accepts an out-of-scope case ({probe.origin}): supports returned True"
        ]
    assert sorted(evidence.verdict_reasons) == sorted(
        f"guard, {p.origin}: guard accepts an out-of-scope case ({p.origin}): "
        "supports returned True"
        for p in evidence.probes
    )


def test_an_entry_that_runs_its_own_code_out_of_scope_fails_the_probes() -> None:
    """The guard says no, but the entry does not give the stock result there."""
    evidence = run("own_code_out_of_scope_forward")
    assert evidence.verdict == "FAIL"
    assert all(c.status == "passed" for c in evidence.cases)
    one_process = [p for p in evidence.probes if p.origin != "probe: unlisted CP degree"]
    assert one_process and all(p.status == "failed" for p in one_process)
    assert all("does not give the stock result" in p.reasons[0] for p in one_process)


def test_a_guard_that_refuses_an_in_scope_case_fails_that_case() -> None:
    evidence = run("honest_forward", supports="refuses_batch_8_supports")
    assert evidence.verdict == "FAIL"
    [refused] = [c for c in evidence.cases if c.batch == 8]
    assert refused.status == "unsupported"
    assert refused.reasons == ["the guard refuses this in-scope case (supports returned False)"]


def test_a_cosine_below_the_floor_fails_however_loose_the_budget() -> None:
    evidence = run("slightly_off_forward", error_budget=1000.0, min_cosine=0.99999)
    assert evidence.verdict == "FAIL"
    assert all(c.status == "failed" for c in evidence.cases)
    assert "'out': cosine " in evidence.cases[0].reasons[0]
    assert "< 0.99999" in evidence.cases[0].reasons[0]


def test_the_guard_never_sees_a_cases_origin() -> None:
    """A guard that could tell the probes and the decode check from real cases would refuse
    them and accept anything else; shown no origin, it accepts the probes and fails them."""
    evidence = run("honest_forward", supports="origin_sniffing_supports")
    assert evidence.verdict == "FAIL"
    assert {p.origin for p in evidence.probes} == PROBE_ORIGINS
    assert all(p.status == "failed" for p in evidence.probes)
    assert evidence.decode_check is not None and evidence.decode_check.status == "passed"


def test_a_guard_that_refuses_the_decode_checks_in_scope_case_fails() -> None:
    evidence = run("honest_forward", supports="refuses_batch_4_supports")
    assert evidence.decode_check is not None and evidence.decode_check.status == "failed"
    assert "the guard refuses" in evidence.decode_check.reasons[0]
    assert "an in-scope case" in evidence.decode_check.reasons[0]
    assert evidence.verdict == "FAIL"


def _with_problem(problem: str, candidate: str, baseline: str | None = None) -> Evidence:
    manifest = make_manifest(candidate)
    data = manifest.model_dump()
    data["path"]["problem"] = f"{FIXTURES}:{problem}"
    if baseline is not None:
        data["path"]["baseline"] = f"{FIXTURES}:{baseline}"
    options = EngineOptions(device="cpu", quick=True, seed=SEED, trials=2, stop=FAST_STOP)
    return evaluate(validate_manifest(data), options)


def test_a_problem_with_nothing_to_compare_fails_every_case() -> None:
    evidence = _with_problem("NoOutputsProblem", "does_nothing_forward", "does_nothing_forward")
    assert evidence.verdict == "FAIL"
    assert evidence.cases and all(c.status == "failed" for c in evidence.cases)
    assert "nothing was checked" in evidence.cases[0].reasons[0]
    assert "nothing was checked" in render_report_page(evidence)  # the report renders it


def test_a_problem_that_raises_crashes_its_case_not_the_run() -> None:
    evidence = _with_problem("InputsRaiseProblem", "honest_forward")
    assert evidence.verdict == "FAIL"
    crashed = [c for c in evidence.cases if c.status == "crashed"]
    assert [c.batch for c in crashed] == [8]
    assert "KeyError" in crashed[0].reasons[0]
    assert all(c.status == "passed" for c in evidence.cases if c.batch != 8)


# A candidate that rebinds a dict entry instead of writing the tensor in place must not escape:
# the engine hands each call its own dicts and reads back the tensors it allocated.
def test_rebinding_outputs_is_never_written() -> None:
    evidence = run("rebinds_outputs_forward")
    assert evidence.verdict == "FAIL"
    assert all("never written" in joined(c.reasons) for c in evidence.cases)


def test_hidden_input_change_is_caught() -> None:
    evidence = run("hides_input_change_forward")
    assert evidence.verdict == "FAIL"
    assert all("modified its input 'x'" in joined(c.reasons) for c in evidence.cases)


def test_sys_exit_in_a_path_is_a_crash_not_the_end_of_the_run() -> None:
    evidence = run("exits_forward")
    assert evidence.verdict == "FAIL"
    assert all(c.status == "crashed" for c in evidence.cases)
    assert "SystemExit" in joined(evidence.verdict_reasons)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("candidate", "supports", "reason"),
    [
        ("honest_forward", "honest_supports", None),
        ("wrong_off_grid_forward", "honest_supports", BUDGET_REASON),
        ("nan_output_forward", "honest_supports", "NaN/Inf"),
        ("unwritten_tail_forward", "honest_supports", "never written"),
        ("modifies_inputs_forward", "honest_supports", "modified its input 'x'"),
        ("nondeterministic_forward", "honest_supports", "non-deterministic"),
        ("rebinds_outputs_forward", "honest_supports", "never written"),
        ("honest_forward", "accept_everything_supports", "guard accepts an out-of-scope case"),
    ],
)
def test_the_same_catches_on_cuda(candidate: str, supports: str, reason: str | None) -> None:
    evidence = run(candidate, supports, device="cuda")
    if reason is None:
        assert evidence.verdict == "PASS", evidence.verdict_reasons
        assert all(c.performance and c.performance.method == "cuda-graph" for c in evidence.cases)
    else:
        assert evidence.verdict == "FAIL"
        assert reason in joined(evidence.verdict_reasons)
