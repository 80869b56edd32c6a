"""Correctness of one case: the candidate against an upcast reference, judged by the stock error.

Per trial: fresh seeded weights and inputs; a first candidate run into NaN-poisoned outputs
(before the stock path has run on these inputs, so no result of it can linger in freed memory); a
float64 reference (the baseline run on upcast copies); the stock path's own error against it; a
second candidate run into outputs filled with the dtype's largest value. Both candidate runs get
clones of the same inputs. An element still holding its poison in both runs was never written;
the two runs must agree bit for bit unless the manifest says the path is non-deterministic.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from harness.evaluation.cases import Case
from harness.evaluation.integrity import TamperedTensors, require_plain_tensors
from harness.evaluation.loading import LoadedPath, PathFn
from harness.evaluation.outcomes import SUBMITTED_CODE_ERRORS, Crashed, Mismatch, Outcome, Passed
from harness.evaluation.plan import derive_seed
from scopes.manifest import Tolerance

Tensors = dict[str, torch.Tensor]
REFERENCE_DTYPE = torch.float64


@dataclass(frozen=True)
class OutputError:
    name: str
    candidate_error: float  # ||candidate - reference|| / ||reference||
    stock_error: float
    error_ratio: float  # candidate_error / max(stock_error, floor)
    cosine: float


# A problem may name rows of an output whose value hangs on a near-tie discrete decision (an MoE
# token whose k-th and (k+1)-th expert scores nearly tie): any two roundings may decide it
# differently, so those rows are left out of the error. The problem is part of the submission, so
# the harness caps what it may leave out and records every row it did.
MAX_AMBIGUOUS_FRACTION = 0.1
# Below 10 rows one ambiguous row is already over the cap, so small batches rely on drawing again.
# With the Kimi-K2 scope's margin about 8% of tokens are ambiguous: a batch-8 draw is over the
# cap with probability 1 - 0.92^8 = 0.49, so 3 redraws still compared every row in 0.49^4 = 6% of
# batch-8 trials, and the H200 validate of 2026-12-03 (run 4) failed two cases that way: a token
# both bf16 paths routed alike and float64 otherwise (error ratio 1.00). 8 redraws: 0.49^9 = 0.2%.
REDRAWS = 8


@dataclass
class TrialResult:
    seed: int
    outputs: list[OutputError] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    excluded_rows: dict[str, int] = field(default_factory=dict)  # output -> rows left out
    notes: list[str] = field(default_factory=list)
    over_cap: bool = False  # the problem called more rows ambiguous than may be left out

    @property
    def worst_error_ratio(self) -> float:
        return max((o.error_ratio for o in self.outputs), default=0.0)


@dataclass
class CorrectnessResult:
    outcome: Outcome
    trials: list[TrialResult]

    @property
    def worst_error_ratio(self) -> float:
        return max((t.worst_error_ratio for t in self.trials), default=0.0)


def check_case(
    path: LoadedPath,
    case: Case,
    secret_seed: int,
    trials: int,
    tolerance: Tolerance,
    device: torch.device,
    all_passed: Callable[[bool], bool] | None = None,
    all_settled: Callable[[bool], bool] | None = None,
) -> CorrectnessResult:
    """`all_passed(this_one_passed)`: on N ranks, whether every rank's trial passed, so that
    all stop after the same trial (a rank that stopped alone would leave its peers waiting in
    a collective). `all_settled(this_one_settled)`: likewise whether every rank's inputs need
    no redraw, so that all draw the same number of times."""
    results: list[TrialResult] = []
    for trial in range(trials):
        try:
            seed, result = _trial(path, case, secret_seed, trial, tolerance, device, all_settled)
        except CandidateCrash as crash:
            return CorrectnessResult(Crashed(crash.error), results)
        except SUBMITTED_CODE_ERRORS as exc:  # the problem, the stock or the reference path
            error = f"building or checking the trial raised {_describe_exception(exc)}"
            return CorrectnessResult(Crashed(error), results)
        results.append(result)
        passed = not result.reasons
        everyone_passed = all_passed(passed) if all_passed else passed  # once per trial
        if not passed:
            reasons = tuple(f"trial {trial} (seed {seed}): {r}" for r in result.reasons)
            return CorrectnessResult(Mismatch(reasons), results)
        if not everyone_passed:  # another rank failed this trial: its outcome is the case's
            return CorrectnessResult(Passed(), results)
    return CorrectnessResult(Passed(), results)


def _trial(
    path: LoadedPath,
    case: Case,
    secret_seed: int,
    trial: int,
    tolerance: Tolerance,
    device: torch.device,
    all_settled: Callable[[bool], bool] | None = None,
) -> tuple[int, TrialResult]:
    """One trial; drawn again (at most REDRAWS times) while more rows are near-tie decisions
    than may be left out: at batch 1 one such token is the whole output. After the last redraw
    every row is compared, so a problem that calls everything ambiguous gains nothing. On N
    ranks all draw again while any one needs to (each candidate call may hold collectives)."""
    for attempt in range(REDRAWS + 1):
        seed = derive_seed(
            secret_seed, case.id, "trial", trial, *(("redraw", attempt) if attempt else ())
        )
        result = run_trial(path, case, seed, tolerance, device)
        settled = not result.over_cap
        if all_settled(settled) if all_settled else settled:
            break
    if attempt:
        result.notes.append(f"inputs drawn {attempt} more time(s): too many near-tie rows")
    return seed, result


class CandidateCrash(Exception):
    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


def run_trial(
    path: LoadedPath, case: Case, seed: int, tolerance: Tolerance, device: torch.device
) -> TrialResult:
    problem = path.problem
    weights = problem.make_weights(case, derive_seed(seed, "weights"), device)
    inputs = problem.make_inputs(case, derive_seed(seed, "inputs"), device)
    result = TrialResult(seed)
    # The candidate runs before the stock path sees these inputs: memory the stock path freed
    # (its result among it) must not be there for an uninitialised output to pick up.
    first = _candidate_run(
        path.candidate, weights, inputs, problem.make_outputs(case, device), float("nan"), result
    )
    reference = _run(
        path.reference_fn,
        upcast(weights),
        upcast(inputs),
        upcast(problem.make_outputs(case, device)),
    )
    stock = _run(
        path.baseline,
        _clone(weights),
        _clone(inputs),
        poisoned(problem.make_outputs(case, device), float("nan")),
    )
    second = _candidate_run(
        path.candidate, weights, inputs, problem.make_outputs(case, device), None, result
    )
    keep = comparable_rows(problem, weights, inputs, result)
    for name in reference:
        unwritten = first[name].isnan() & (second[name] == _sentinel(second[name]))
        result.reasons += _written_and_finite(name, first[name], second[name], unwritten)
        result.reasons += _deterministic(name, first[name], second[name], unwritten, tolerance)
        rows = keep.get(name)
        error = output_error(
            name,
            _rows(first[name], rows),
            _rows(stock[name], rows),
            _rows(reference[name], rows),
            tolerance,
        )
        result.outputs.append(error)
        result.reasons += _within_tolerance(error, tolerance)
    if not any(reference[name].numel() for name in reference):
        # nothing compared is no evidence of correctness (a problem that declares no outputs)
        result.reasons.append(
            f"nothing was checked: the problem declares {len(reference)} outputs with no element"
        )
    return result


def comparable_rows(
    problem: object, weights: Tensors, inputs: Tensors, result: TrialResult | None = None
) -> dict[str, torch.Tensor]:
    """Per output, the rows to compare (a bool mask), from the problem's `ambiguous_rows`
    hook; a declaration that would leave out more than MAX_AMBIGUOUS_FRACTION is ignored."""
    hook = getattr(problem, "ambiguous_rows", None)
    if hook is None:
        return {}
    keep = {}
    for name, ambiguous in hook(weights, inputs).items():
        left_out = int(ambiguous.sum())
        if left_out > MAX_AMBIGUOUS_FRACTION * ambiguous.numel():
            if result is not None:
                result.over_cap = True
                result.notes.append(
                    f"'{name}': the problem called {left_out} of {ambiguous.numel()} rows "
                    f"ambiguous, more than {MAX_AMBIGUOUS_FRACTION:.0%}: all were compared"
                )
            continue
        keep[name] = ~ambiguous
        if result is not None and left_out:
            result.excluded_rows[name] = left_out
    return keep


def pooled_comparable_rows(
    problem: object,
    pairs: list[tuple[Tensors, Tensors]],
    max_fraction: float = MAX_AMBIGUOUS_FRACTION,
) -> list[dict[str, torch.Tensor]]:
    """comparable_rows for several layers' (weights, inputs), the cap applied to their rows
    together: at batch 8 one near-tie token is 12% of a layer's output but a few percent of
    a timed step's layers. Over the cap, every row of that output is compared (1.0: no cap)."""
    hook = getattr(problem, "ambiguous_rows", None)
    if hook is None:
        return [{} for _ in pairs]
    declared = [hook(weights, inputs) for weights, inputs in pairs]
    keeps: list[dict[str, torch.Tensor]] = [{} for _ in pairs]
    for name in {name for layer in declared for name in layer}:
        masks = [layer.get(name) for layer in declared]
        left_out = sum(int(m.sum()) for m in masks if m is not None)
        rows = sum(m.numel() for m in masks if m is not None)
        if left_out > max_fraction * rows:
            continue
        for keep, mask in zip(keeps, masks, strict=True):
            if mask is not None:
                keep[name] = ~mask
    return keeps


def _rows(tensor: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    return tensor if keep is None else tensor[keep.to(tensor.device)]


def _candidate_run(
    candidate: PathFn,
    weights: Tensors,
    inputs: Tensors,
    outputs: Tensors,
    poison: float | None,
    result: TrialResult,
) -> Tensors:
    """Run on clones into poisoned outputs; note any input or weight the candidate changed."""
    weights_copy, inputs_copy = _clone(weights), _clone(inputs)
    outputs = poisoned(outputs, poison)
    try:
        _run(candidate, weights_copy, inputs_copy, outputs)
    except TamperedTensors as exc:  # its own words: where it happened is in them
        raise CandidateCrash(str(exc)) from None
    except SUBMITTED_CODE_ERRORS as exc:
        raise CandidateCrash(_describe_exception(exc)) from None
    for label, given, original in (
        ("input", inputs_copy, inputs),
        ("weight", weights_copy, weights),
    ):
        for name in original:
            if not torch.equal(given[name], original[name]):
                result.reasons.append(f"modified its {label} '{name}'")
    return outputs


def _run(fn: PathFn, weights: Tensors, inputs: Tensors, outputs: Tensors) -> Tensors:
    # The path gets its own dicts: rebinding an entry must not replace the tensors we read back.
    fn(dict(weights), dict(inputs), dict(outputs))
    require_plain_tensors(weights, inputs, outputs, when="after a call of a path")
    if outputs and next(iter(outputs.values())).is_cuda:
        torch.cuda.synchronize()
    return outputs


def output_error(
    name: str,
    candidate: torch.Tensor,
    stock: torch.Tensor,
    reference: torch.Tensor,
    tolerance: Tolerance,
) -> OutputError:
    ref = reference.to(REFERENCE_DTYPE)
    cand_error = relative_error(candidate, ref)
    stock_error = relative_error(stock, ref)
    floor = tolerance.abs_floor or default_floor(candidate.dtype)
    cosine = cosine_similarity(candidate, ref)
    return OutputError(name, cand_error, stock_error, cand_error / max(stock_error, floor), cosine)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    diff = value.to(REFERENCE_DTYPE) - reference
    denom = torch.linalg.vector_norm(reference).item()
    num = torch.linalg.vector_norm(diff).item()
    if num != num:  # NaN anywhere makes the error infinite, not NaN
        return float("inf")
    return num / denom if denom > 0 else num


def cosine_similarity(value: torch.Tensor, reference: torch.Tensor) -> float:
    v = value.to(REFERENCE_DTYPE).flatten()
    r = reference.flatten()
    denom = (torch.linalg.vector_norm(v) * torch.linalg.vector_norm(r)).item()
    if denom == 0 or denom != denom:
        return 1.0 if torch.equal(v, r) else 0.0
    return float((v @ r).item() / denom)


def default_floor(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) / 8 if dtype.is_floating_point else 0.0


def _written_and_finite(
    name: str, first: torch.Tensor, second: torch.Tensor, unwritten: torch.Tensor
) -> list[str]:
    reasons = []
    if unwritten.any():
        index = unwritten.flatten().nonzero()[0].item()
        reasons.append(
            f"'{name}': {int(unwritten.sum())} of {unwritten.numel()} elements never "
            f"written (first at flat index {index})"
        )
    written = ~unwritten
    nonfinite = written & ~(first.isfinite() & second.isfinite())
    nonfinite &= second != _sentinel(second)
    if nonfinite.any():
        reasons.append(f"'{name}': {int(nonfinite.sum())} NaN/Inf values")
    return reasons


def _deterministic(
    name: str,
    first: torch.Tensor,
    second: torch.Tensor,
    unwritten: torch.Tensor,
    tolerance: Tolerance,
) -> list[str]:
    if not tolerance.deterministic:
        return []
    differ = (first != second) & ~unwritten & ~(first.isnan() & second.isnan())
    if differ.any():
        return [
            f"'{name}': non-deterministic, two runs on the same inputs differ in "
            f"{int(differ.sum())} elements"
        ]
    return []


def _within_tolerance(error: OutputError, tolerance: Tolerance) -> list[str]:
    reasons = []
    if not error.error_ratio <= tolerance.error_budget:
        reasons.append(
            f"'{error.name}': error {error.candidate_error:.3e} vs the reference is "
            f"{error.error_ratio:.2f}x the stock error {error.stock_error:.3e} "
            f"(budget {tolerance.error_budget}x)"
        )
    if not error.cosine >= tolerance.min_cosine:
        reasons.append(f"'{error.name}': cosine {error.cosine:.6f} < {tolerance.min_cosine}")
    return reasons


def poisoned(outputs: Tensors, value: float | None) -> Tensors:
    """Fill outputs with value (None: the dtype's largest finite value) so unwritten cells show."""
    for tensor in outputs.values():
        tensor.fill_(_sentinel(tensor) if value is None else value)
    return outputs


def _sentinel(tensor: torch.Tensor) -> float:
    return float(torch.finfo(tensor.dtype).max)


def _clone(tensors: Tensors) -> Tensors:
    return {name: t.clone() for name, t in tensors.items()}


def upcast(tensors: Tensors) -> Tensors:
    """Float tensors widened to the reference's dtype (float64), the others cloned."""
    return {
        name: t.to(REFERENCE_DTYPE) if t.is_floating_point() else t.clone()
        for name, t in tensors.items()
    }


def _describe_exception(exc: BaseException) -> str:
    tail = traceback.format_exception(exc)[-3:]
    return "".join(tail).strip()[-2000:]
