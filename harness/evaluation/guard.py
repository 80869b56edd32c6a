"""The dispatch guard on out-of-scope probes: `supports` must refuse, and the dispatching entry
must then give exactly the stock result (bit for bit), because outside its scope the specialized
path must not be taken at all."""

from __future__ import annotations

import torch

from harness.evaluation.cases import Case
from harness.evaluation.correctness import poisoned
from harness.evaluation.loading import LoadedPath
from harness.evaluation.outcomes import SUBMITTED_CODE_ERRORS, Crashed, Mismatch, Outcome, Passed
from harness.evaluation.plan import derive_seed, probe_runs_on_one_process


def check_probe(path: LoadedPath, probe: Case, secret_seed: int, device: torch.device) -> Outcome:
    try:
        accepted = path.supports(probe.for_guard())
    except SUBMITTED_CODE_ERRORS as exc:
        return Crashed(f"supports({probe.id}) raised {exc!r}")
    if accepted is not False:
        return Mismatch(
            (
                f"guard accepts an out-of-scope case ({probe.origin}): "
                f"supports returned {accepted!r}",
            )
        )
    if not probe_runs_on_one_process(probe):
        return Passed()
    return _falls_back_to_stock(path, probe, derive_seed(secret_seed, probe.id, "probe"), device)


def _falls_back_to_stock(path: LoadedPath, probe: Case, seed: int, device: torch.device) -> Outcome:
    problem = path.problem
    try:
        weights = problem.make_weights(probe, derive_seed(seed, "weights"), device)
        inputs = problem.make_inputs(probe, derive_seed(seed, "inputs"), device)
    except SUBMITTED_CODE_ERRORS as exc:
        # The problem itself cannot build this probe (e.g. a dtype it never makes): guard-only.
        return (
            Passed()
            if isinstance(exc, (ValueError, TypeError, NotImplementedError))
            else Crashed(f"building probe inputs raised {exc!r}")
        )
    stock = poisoned(problem.make_outputs(probe, device), float("nan"))
    dispatched = poisoned(problem.make_outputs(probe, device), float("nan"))
    calls = (
        ("the stock path", path.baseline, stock),
        ("the dispatching entry", path.candidate, dispatched),
    )
    for who, entry, outputs in calls:
        try:
            entry(
                {k: v.clone() for k, v in weights.items()},
                {k: v.clone() for k, v in inputs.items()},
                dict(outputs),
            )
        except SUBMITTED_CODE_ERRORS as exc:
            return Crashed(f"{who} raised on {probe.origin}: {exc!r}")
    differing = [
        name
        for name in stock
        if not torch.equal(stock[name].nan_to_num(0.0), dispatched[name].nan_to_num(0.0))
        or not torch.equal(stock[name].isnan(), dispatched[name].isnan())
    ]
    if differing:
        return Mismatch(
            (
                f"on {probe.origin} the dispatching entry does not give the stock result "
                f"(outputs {', '.join(differing)} differ)",
            )
        )
    return Passed()
