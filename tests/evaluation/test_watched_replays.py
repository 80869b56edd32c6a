"""The timed replays are checked as they run (2026-12-06 review): every timed call of either
arm starts on outputs poisoned outside its interval; every candidate call is tallied on the
device against the candidate's own eager result (the same bits where the scope says the path is
deterministic, else the cosine floor and size); and one candidate call per batch, picked where
the candidate cannot see, is compared on the host, which names what is wrong."""

from __future__ import annotations

import time

import pytest
import torch

from harness.evaluation import engine
from harness.evaluation.cases import Case
from harness.evaluation.loading import load_path
from harness.evaluation.timing import (
    LayerSet,
    RankSync,
    StopRule,
    _first_disagreement,
    far_from,
    one_launch,
    output_poisoner,
    sample_interleaved,
    timed_pairs,
    watched_replays,
)
from kernels.fused_add_rmsnorm import stock
from kernels.fused_add_rmsnorm.problem import Problem
from tests.evaluation.test_engine_catches import make_manifest

CPU = torch.device("cpu")
STOP = StopRule(min_pairs=6, max_pairs=6, pairs_per_batch=3, captures=1)


def _spin(seconds: float, log: list[str], name: str):  # type: ignore[no-untyped-def]
    def call() -> None:
        log.append(name)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    return call


def test_the_work_between_and_after_calls_stays_outside_their_intervals() -> None:
    log: list[str] = []
    a, b = _spin(0.001, log, "a"), _spin(0.001, log, "b")
    pairs = timed_pairs(
        a,
        b,
        2,
        CPU,
        _spin(0.004, log, "poison"),
        _spin(0.004, log, "tally"),
        (1, _spin(0.004, log, "copy")),
    )
    # pair 1 runs b first: the copy follows that b call's tally, before pair 1's a
    assert log == [
        *("poison", "a", "poison", "b", "tally"),
        *("poison", "b", "tally", "copy", "poison", "a"),
    ]
    assert all(900 < us < 3000 for pair in pairs for us in pair), pairs


def _layer_set(batch: int = 4, layers: int = 2, device: torch.device = CPU) -> LayerSet:
    problem = Problem({"hidden": 64})
    case = Case(batch, None, 1, 1, "bfloat16", device.type)
    args = [
        (
            problem.make_weights(case, 10 + layer, device),
            problem.make_inputs(case, 20 + layer, device),
            problem.make_outputs(case, device),
        )
        for layer in range(layers)
    ]
    return LayerSet(args, 0)


def _steps(fn, layer_set: LayerSet):  # type: ignore[no-untyped-def]
    def step() -> None:
        for weights, inputs, outputs in layer_set.args:
            fn(weights, inputs, outputs)

    return [step]


def test_every_timed_call_of_both_arms_starts_on_poisoned_outputs() -> None:
    layer_set = _layer_set()
    seen: list[bool] = []

    def looking(weights, inputs, out) -> None:  # type: ignore[no-untyped-def]
        seen.append(all(bool(t.isnan().all()) for t in out.values()))
        stock.forward(weights, inputs, out)

    watched = watched_replays(stock.forward, layer_set, CPU, 0.9999, exact=True)
    steps = _steps(looking, layer_set)
    timing = sample_interleaved(steps, steps, layer_set, CPU, STOP, 1, None, watched)
    assert len(seen) == 2 * (3 + 6) * 2 and all(seen)  # 2 arms x (warm-up + 6) pairs x 2 layers
    assert timing.watched == 1 + 2 and timing.watched_problems == []
    assert timing.tallied == 3 + 6  # every candidate call, the warm-up's too


def _wrong_while_timed(scale: float):  # type: ignore[no-untyped-def]
    """Right on its first call per layer (the eager yardstick), then scaled."""
    calls = {"n": 0}

    def forward(weights, inputs, out) -> None:  # type: ignore[no-untyped-def]
        stock.forward(weights, inputs, out)
        calls["n"] += 1
        if calls["n"] > 2:
            out["out"].mul_(scale)

    return forward


def _problems_of_timing(candidate, exact: bool) -> list[str]:  # type: ignore[no-untyped-def]
    """The watched replays' findings after the stock path and `candidate` were timed."""
    layer_set = _layer_set()
    watched = watched_replays(candidate, layer_set, CPU, 0.9999, exact)
    stock_steps, candidate_steps = _steps(stock.forward, layer_set), _steps(candidate, layer_set)
    timing = sample_interleaved(
        stock_steps, candidate_steps, layer_set, CPU, STOP, 1, None, watched
    )
    return timing.watched_problems


@pytest.mark.parametrize(
    ("scale", "exact", "wanted"),
    [
        (-1.0, False, "a cosine of 0.9999 and the same size"),
        (0.5, False, "a cosine of 0.9999 and the same size"),  # halved: cosine 1, not the size
        (1.0 + 2**-7, True, "other bits"),  # one bf16 step larger: close, but not the same bits
    ],
)
def test_a_timed_replay_that_differs_from_the_eager_result_is_named(
    scale: float, exact: bool, wanted: str
) -> None:
    first, *rest = _problems_of_timing(_wrong_while_timed(scale), exact)
    # exact: every replay's tally finds it ("3 of the 3"); else the compared one names the error
    assert "of the candidate (batch 0, capture 0)" in first and wanted in first, first
    assert rest == ["batch 1", "batch 2"]  # a warm-up batch and two sampled


def test_exactness_catches_what_the_cosine_lets_through() -> None:
    """The requantized capture of the review: a close, cheaper result (0.5% off in size, within
    the cosine floor's closeness)."""
    for exact, caught in ((False, False), (True, True)):
        assert bool(_problems_of_timing(_wrong_while_timed(1.005), exact)) == caught


def test_measure_case_fails_a_case_whose_timed_replays_were_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A candidate wrong only while it is timed (here: the sampling itself flips it) passes
    every check before and after the timing; the watched replays name it."""
    from tests.fixtures import bad_paths

    timing_now = {"on": False}
    real = engine.sample_interleaved

    def flagged(*args: object, **kwargs: object) -> object:
        timing_now["on"] = True
        try:
            return real(*args, **kwargs)
        finally:
            timing_now["on"] = False

    def wrong_while_sampled(weights, inputs, out) -> None:  # type: ignore[no-untyped-def]
        stock.forward(weights, inputs, out)
        if timing_now["on"]:
            out["out"].neg_()

    monkeypatch.setattr(engine, "sample_interleaved", flagged)
    monkeypatch.setattr(bad_paths, "honest_forward", wrong_while_sampled)
    manifest = make_manifest("honest_forward")
    stop = StopRule(min_pairs=4, max_pairs=4, pairs_per_batch=2, captures=1)
    case = Case(3, None, 1, 1, "bfloat16", "cpu")
    performance, stale, _ = engine.measure_case(
        load_path(manifest), case, 7, stop, 2, CPU, manifest
    )
    assert performance.watched_replays == 3  # a warm-up batch and two sampled
    assert performance.tallied_replays == 3 * 2
    assert len(stale) == 2, stale
    assert stale[0].startswith("2 of the 2 timed replays of the candidate (batch 0, capture 0)")
    assert "other bits" in stale[0]
    assert stale[1] == "so did 2 more of 3"


def test_integer_outputs_are_poisoned_with_their_largest_value() -> None:
    outputs = {"ids": torch.zeros(3, dtype=torch.int32), "mask": torch.zeros(2, dtype=torch.bool)}
    layer_set = LayerSet([({}, {}, outputs)], 0)
    output_poisoner(layer_set, CPU)()
    assert outputs["ids"].tolist() == [2**31 - 1] * 3 and outputs["mask"].all()


def _skips_one_step_in(every: int, device: torch.device):  # type: ignore[no-untyped-def]
    """Right on every call but each `every`-th step (two layers), which leaves its outputs as
    they were. The count lives on the device, so each replay of one captured graph decides
    afresh (as the corpus's skips_now_and_then)."""
    calls = torch.zeros((), dtype=torch.int64, device=device)

    def forward(weights, inputs, out) -> None:  # type: ignore[no-untyped-def]
        calls.add_(1)
        skip = torch.remainder(torch.div(calls - 1, 2, rounding_mode="floor"), every) == every - 1
        fresh = {name: torch.empty_like(value) for name, value in out.items()}
        stock.forward(weights, inputs, fresh)
        for name, value in out.items():
            value.copy_(torch.where(skip, value, fresh[name]))

    return forward


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_every_timed_replay_is_tallied_so_a_rarely_skipped_one_is_caught(
    exact: bool, device: str
) -> None:
    """A capture skipping one timed replay in nine: the one compared replay per batch misses it
    most of the time, the tally of every replay does not (the skipped one stays poisoned). On
    CUDA both steps and the tally (far_from where not exact) are captured graphs."""
    where = torch.device(device)
    stop = StopRule(min_pairs=27, max_pairs=27, pairs_per_batch=9, captures=1)
    layer_set = _layer_set(device=where)
    candidate = _skips_one_step_in(9, where)
    watched = watched_replays(candidate, layer_set, where, 0.9999, exact)  # its first step: right
    stock_step, candidate_step = (
        one_launch(_steps(fn, layer_set)[0], where) for fn in (stock.forward, candidate)
    )
    timing = sample_interleaved(
        [stock_step], [candidate_step], layer_set, where, stop, 1, None, watched
    )
    check = "other bits" if exact else "were not written, finite and as close"
    first, *rest = timing.watched_problems
    assert first.startswith("1 of the 9 timed replays of the candidate (batch 0, capture 0)")
    assert check in first and rest == ["batch 1", "batch 2", "batch 3"]
    assert timing.tallied == 4 * 9


def test_a_right_candidate_tallies_clean_in_both_modes() -> None:
    for exact in (True, False):
        layer_set = _layer_set()
        watched = watched_replays(stock.forward, layer_set, CPU, 0.9999, exact)
        steps = _steps(stock.forward, layer_set)
        timing = sample_interleaved(steps, steps, layer_set, CPU, STOP, 1, None, watched)
        assert timing.watched_problems == [] and timing.tallied == 9


def test_on_ranks_every_rank_copies_the_replay_they_agreed_on() -> None:
    """The ranks sum their draws (here: a sum of 7), so each copies the same pair's replay:
    pair 7 % 3 = 1 of every batch, which runs the candidate first."""
    layer_set = _layer_set()
    log: list[str] = []
    watched = watched_replays(stock.forward, layer_set, CPU, 0.9999, exact=True)
    watched.copy = lambda: log.append("copy")  # type: ignore[method-assign]
    sync = RankSync(layers=lambda n: n, align=lambda: log.append("|"), same_pick=lambda d: 7)
    stock_step, candidate_step = [lambda: log.append("s")], [lambda: log.append("c")]
    sample_interleaved(stock_step, candidate_step, layer_set, CPU, STOP, 1, sync, watched)
    batches = "".join(log).split("|")[1:]
    assert batches == ["sc" + "c" + "copy" + "s" + "sc"] * 3  # a warm-up batch and two sampled


def _near_tie_row_wrong(out: torch.Tensor) -> torch.Tensor:
    wrong = out.clone()
    wrong[1] = -wrong[1]
    return wrong


@pytest.mark.parametrize(
    ("change", "keep_row_1"),
    [
        (lambda out: out.clone(), True),
        (lambda out: out * (1 + 2**-7), True),  # close: within the cosine floor's closeness
        (lambda out: out * 0.5, True),  # cosine 1, size off
        (lambda out: -out, True),
        (lambda out: torch.full_like(out, float("nan")), True),
        (lambda out: out + 0.3 * torch.randn_like(out), True),
        (lambda out: torch.zeros_like(out), True),
        (_near_tie_row_wrong, True),  # wrong in a row the check compares
        (_near_tie_row_wrong, False),  # the same row left out as a near tie
    ],
)
def test_the_device_tally_applies_the_replay_checks_rule(change, keep_row_1: bool) -> None:  # type: ignore[no-untyped-def]
    """far_from (capturable, no host synchronization) decides as _first_disagreement does
    where the scope is not deterministic."""
    expected = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got = change(expected).to(torch.bfloat16)
    keep = torch.tensor([True, keep_row_1, True, True])
    host = _first_disagreement([{"out": got}], [{"out": expected}], 0.9999, [{"out": keep}])
    device = far_from(got, expected, keep, 0.9999)
    assert device.dtype == torch.bool and device.dim() == 0
    assert bool(device) == (host is not None), host
    assert bool(far_from(torch.zeros(3), torch.zeros(3), None, 0.9999)) is False
