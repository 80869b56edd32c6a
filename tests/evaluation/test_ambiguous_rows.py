"""Rows a problem calls near-tie decisions are left out of the error, within a cap, and on
record; a problem cannot hide a wrong kernel by calling everything ambiguous."""

from __future__ import annotations

import torch

from harness.evaluation.correctness import MAX_AMBIGUOUS_FRACTION, REDRAWS, check_case
from harness.evaluation.loading import load_path
from tests.evaluation.test_engine_catches import make_manifest
from tests.fixtures.bad_paths import MAX_BATCH

CPU = torch.device("cpu")


def _check(problem: str, batch: int = 16):  # type: ignore[no-untyped-def]
    manifest = make_manifest("wrong_first_row_forward")
    path_spec = manifest.path.model_copy(update={"problem": f"tests.fixtures.bad_paths:{problem}"})
    manifest = manifest.model_copy(update={"path": path_spec})
    from harness.evaluation.cases import Case

    case = Case(batch, None, 1, 1, "bfloat16", "cpu", config={"hidden": 256})
    return check_case(load_path(manifest), case, 5, 2, manifest.tolerance, CPU)


def test_a_declared_near_tie_row_is_left_out_and_recorded() -> None:
    result = _check("FirstRowAmbiguousProblem")
    assert result.outcome.status == "passed", result.outcome
    assert all(t.excluded_rows == {"out": 1} for t in result.trials)


def test_the_same_wrong_row_fails_when_nothing_is_declared() -> None:
    result = _check("Problem")
    assert result.outcome.status == "failed"


def test_a_problem_that_calls_everything_ambiguous_hides_nothing() -> None:
    result = _check("EverythingAmbiguousProblem")
    assert result.outcome.status == "failed"
    note = result.trials[0].notes[0]
    assert f"more than {MAX_AMBIGUOUS_FRACTION:.0%}: all were compared" in note
    assert result.trials[0].excluded_rows == {}


def test_one_row_of_a_single_token_batch_is_over_the_cap() -> None:
    # at batch 1 the one row is all of them: the trial is drawn again, and when every draw is
    # ambiguous (this problem always says so) every row is compared, so the wrong row fails
    assert MAX_BATCH >= 1
    result = _check("FirstRowAmbiguousProblem", batch=1)
    assert result.outcome.status == "failed"
    assert f"inputs drawn {REDRAWS} more time(s)" in result.trials[0].notes[-1]
