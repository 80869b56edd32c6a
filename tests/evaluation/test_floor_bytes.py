"""The HBM fraction's byte count: exact for the timed inputs where the problem can say so, and
out of the candidate's reach."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from harness.evaluation.cases import Case
from harness.evaluation.engine import _bytes_moved
from harness.evaluation.loading import LoadedPath
from harness.evaluation.timing import LayerSet, layer_weights

CASE = Case(1, 1024, 1, 1, "bfloat16", "cpu")
CPU = torch.device("cpu")
SEED = 11


def _path(problem: object) -> LoadedPath:
    def noop(*_: object) -> None:
        return None

    return LoadedPath(problem, noop, noop, lambda case: True)


def _made(case: Case, seed: int, device: torch.device) -> dict:
    """Weights whose value is their seed's last digit: the count shows which weights it saw."""
    return {"router": torch.tensor(seed % 10)}


def _floor(case: Case, weights: dict, inputs: dict) -> int:
    return 1000 + 100 * int(inputs["experts"]) + int(weights["router"])


def _problem(**hooks: object) -> SimpleNamespace:
    return SimpleNamespace(make_weights=_made, **hooks)


def _layers(path: LoadedPath, *experts: int) -> LayerSet:
    """One layer per entry, weights as the engine makes them; the inputs say how many experts
    their routing activates."""
    args = [
        (layer_weights(path, CASE, SEED, layer, CPU), {"experts": torch.tensor(n)}, {})
        for layer, n in enumerate(experts)
    ]
    return LayerSet(args, 0)


def test_floor_bytes_of_the_timed_inputs_wins_over_the_estimate() -> None:
    path = _path(_problem(floor_bytes=_floor, bytes_moved=lambda case: 10**9))
    layers = _layers(path, 0, 1, 5)
    routers = [int(w["router"]) for w, _, _ in layers.args]
    # layers activating 0, 1 and 5 experts: the mean of their exact floors
    expected = round(sum(1000 + 100 * n + r for n, r in zip((0, 1, 5), routers, strict=True)) / 3)
    assert _bytes_moved(path, CASE, layers, SEED, CPU) == expected


def test_weights_the_candidate_rewrote_do_not_count() -> None:
    """A hostile path that rewrote the timed layers' router in place (to spread the routing
    over more experts) moves nothing: the count uses the weights made again from their seeds."""
    path = _path(_problem(floor_bytes=_floor))
    layers = _layers(path, 1, 1)
    honest = _bytes_moved(path, CASE, layers, SEED, CPU)
    for weights, _, _ in layers.args:
        weights["router"].add_(10**6)
    assert _bytes_moved(path, CASE, layers, SEED, CPU) == honest


def test_the_estimate_without_a_floor_hook() -> None:
    path = _path(_problem(bytes_moved=lambda case: 4096))
    assert _bytes_moved(path, CASE, _layers(path, 3), SEED, CPU) == 4096


def test_no_count_without_either_hook() -> None:
    path = _path(_problem())
    assert _bytes_moved(path, CASE, _layers(path, 3), SEED, CPU) is None


def test_under_context_parallelism_the_per_rank_estimate() -> None:
    """The timed layers hold whole inputs there; a rank moves only its share."""
    path = _path(_problem(floor_bytes=_floor, bytes_moved=lambda case: 777))
    cp_case = Case(1, 1024, 2, 2, "bfloat16", "cpu")
    assert _bytes_moved(path, cp_case, _layers(path, 0, 1, 5), SEED, CPU) == 777
