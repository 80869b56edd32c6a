"""The HBM fraction's byte count: exact for the timed inputs where the problem can say so."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from harness.evaluation.cases import Case
from harness.evaluation.engine import _bytes_moved
from harness.evaluation.loading import LoadedPath
from harness.evaluation.timing import LayerSet

CASE = Case(1, 1024, 1, 1, "bfloat16", "cpu")


def _path(problem: object) -> LoadedPath:
    def noop(*_: object) -> None:
        return None

    return LoadedPath(problem, noop, noop, lambda case: True)


def _layers(*experts: int) -> LayerSet:
    """One layer per entry; its inputs say how many experts their routing activates."""
    args = [({}, {"experts": torch.tensor(n)}, {}) for n in experts]
    return LayerSet(args, 0)


def _floor(case: Case, weights: dict, inputs: dict) -> int:
    return 1000 + 100 * int(inputs["experts"])


def test_floor_bytes_of_the_timed_inputs_wins_over_the_estimate() -> None:
    problem = SimpleNamespace(floor_bytes=_floor, bytes_moved=lambda case: 10**9)
    # layers activating 0, 1 and 5 experts: the mean of their exact floors
    assert _bytes_moved(_path(problem), CASE, _layers(0, 1, 5)) == 1200


def test_the_estimate_without_a_floor_hook() -> None:
    problem = SimpleNamespace(bytes_moved=lambda case: 4096)
    assert _bytes_moved(_path(problem), CASE, _layers(3)) == 4096


def test_no_count_without_either_hook() -> None:
    assert _bytes_moved(_path(SimpleNamespace()), CASE, _layers(3)) is None


def test_under_context_parallelism_the_per_rank_estimate() -> None:
    """The timed layers hold whole inputs there; a rank moves only its share."""
    problem = SimpleNamespace(floor_bytes=_floor, bytes_moved=lambda case: 777)
    cp_case = Case(1, 1024, 2, 2, "bfloat16", "cpu")
    assert _bytes_moved(_path(problem), cp_case, _layers(0, 1, 5)) == 777
