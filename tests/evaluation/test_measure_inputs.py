"""measure_case's cross-checks see the timed work: the profile and the eager times (and on a
GPU the wall clock, between them) run on the inputs of the last timed pair (every pair's draw
does the timed inputs' work: timing.PairInputs), and only then do fresh inputs test for stale
outputs. (A MoE's time depends on its routing: on other inputs a profile measures other work.)"""

from __future__ import annotations

import pytest
import torch

from harness.evaluation import engine
from harness.evaluation.cases import Case
from harness.evaluation.loading import load_path
from harness.evaluation.timing import StopRule
from tests.evaluation.test_engine_catches import make_manifest

CPU = torch.device("cpu")


def _inputs_digest(layer_set: object) -> float:
    return sum(float(t.double().sum()) for _, inputs, _ in layer_set.args for t in inputs.values())


def test_profile_and_eager_times_run_on_the_timed_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, list[float]] = {}
    layer_sets: list[object] = []

    def spy(name: str, real: object) -> object:
        """`real`, recording the digest of the case's layers' inputs at each call."""

        def wrapped(*args: object, **kwargs: object) -> object:
            seen.setdefault(name, []).append(_inputs_digest(layer_sets[-1]))
            result = real(*args, **kwargs)
            seen.setdefault(f"after {name}", []).append(_inputs_digest(layer_sets[-1]))
            return result

        return wrapped

    build = engine.build_layers

    def remembering_build(*args: object, **kwargs: object) -> object:
        layer_sets.append(build(*args, **kwargs))
        return layer_sets[-1]

    monkeypatch.setattr(engine, "build_layers", remembering_build)
    for name in ("sample_interleaved", "profile_step", "eager_us", "replay_mismatches"):
        monkeypatch.setattr(engine, name, spy(name, getattr(engine, name)))

    manifest = make_manifest("honest_forward")
    stop = StopRule(min_pairs=4, max_pairs=4, pairs_per_batch=2, captures=1)
    case = Case(3, None, 1, 1, "bfloat16", "cpu")
    performance, stale, _ = engine.measure_case(
        load_path(manifest), case, 7, stop, 2, CPU, manifest
    )

    assert stale == [] and performance.candidate_us_median > 0
    (built,) = seen["sample_interleaved"]
    (timed,) = seen["after sample_interleaved"]  # the last pair's
    assert timed != built  # the pairs ran on inputs of their own
    assert seen["profile_step"] == [timed, timed]  # stock, then candidate
    assert seen["eager_us"] == [timed, timed]
    (checked,) = seen["replay_mismatches"]
    assert checked != timed  # the stale-output check still gets inputs of its own
