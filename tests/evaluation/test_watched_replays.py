"""The timed replays are held to account (2026-12-06 review, 2026-12-07): every timed call of
either arm starts on outputs poisoned outside its interval; every pair runs on inputs of its
own, drawn with the timed inputs' work; and every candidate call's outputs are compared with the
candidate's own eager result on its pair's inputs (the same bits where the scope says the path
is deterministic, else the cosine floor and size), which names what is wrong."""

from __future__ import annotations

import time

import pytest
import torch

from harness.evaluation import engine
from harness.evaluation.cases import Case
from harness.evaluation.loading import LoadedPath, load_path
from harness.evaluation.timing import (
    MAX_INPUT_DRAWS,
    LayerSet,
    RankSync,
    StopRule,
    one_launch,
    output_poisoner,
    pair_inputs,
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
        lambda pair: _spin(0.004, log, f"inputs {pair}")(),
        lambda pair: _spin(0.004, log, f"copy {pair}")(),
    )
    # pair 1 runs b first: its inputs come before its first call's poison
    assert log == [
        *("inputs 0", "poison", "a", "poison", "b", "copy 0"),
        *("inputs 1", "poison", "b", "copy 1", "poison", "a"),
    ]
    assert all(900 < us < 3000 for pair in pairs for us in pair), pairs


CASE = Case(4, None, 1, 1, "bfloat16", "cpu")


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


def _watched(candidate, layer_set: LayerSet, exact: bool, problem=None, device=CPU):  # type: ignore[no-untyped-def]
    problem = problem or Problem({"hidden": 64})
    path = LoadedPath(problem, stock.forward, candidate, lambda case: True)
    case = Case(4, None, 1, 1, "bfloat16", device.type)
    inputs = pair_inputs(path, case, layer_set, 5, device)
    return watched_replays(candidate, layer_set, device, 0.9999, exact, inputs, problem)


def test_every_timed_call_of_both_arms_starts_on_poisoned_outputs() -> None:
    layer_set = _layer_set()
    seen: list[bool] = []

    def looking(weights, inputs, out) -> None:  # type: ignore[no-untyped-def]
        seen.append(all(bool(t.isnan().all()) for t in out.values()))
        stock.forward(weights, inputs, out)

    watched = _watched(stock.forward, layer_set, exact=True)
    steps = _steps(looking, layer_set)
    timing = sample_interleaved(steps, steps, layer_set, CPU, STOP, 1, None, watched)
    assert len(seen) == 2 * (3 + 6) * 2 and all(seen)  # 2 arms x (warm-up + 6) pairs x 2 layers
    assert timing.watched == 3 + 6 and timing.watched_problems == []  # every candidate call
    assert timing.input_sets == 3 + 6
    assert timing.timed_calls == 2 * 6 and timing.late_starts == 0  # sampled calls; host clock


def test_every_pair_runs_on_inputs_of_its_own_and_both_arms_on_the_same() -> None:
    """The checksum cache of the 2026-12-07 review: no timed call may meet inputs the candidate
    has seen, and the stock path must time the same inputs as the candidate beside it."""
    layer_set = _layer_set()
    buffers = {i["x"].data_ptr() for _, i, _ in layer_set.args}  # the timed graphs' inputs
    built_with = {_content(i["x"]) for _, i, _ in layer_set.args}
    calls: list[tuple[str, bool, bytes]] = []  # (arm, timed, x)

    def recording(arm: str):  # type: ignore[no-untyped-def]
        def forward(weights, inputs, out) -> None:  # type: ignore[no-untyped-def]
            calls.append((arm, inputs["x"].data_ptr() in buffers, _content(inputs["x"])))
            stock.forward(weights, inputs, out)

        return forward

    watched = _watched(recording("c"), layer_set, exact=True)
    steps = [_steps(recording(arm), layer_set) for arm in ("s", "c")]
    timing = sample_interleaved(*steps, layer_set, CPU, STOP, 1, None, watched)
    assert timing.watched_problems == []
    stock_x = [x for arm, _, x in calls if arm == "s"]
    candidate_timed = [x for arm, timed, x in calls if arm == "c" and timed]
    checked = [x for arm, timed, x in calls if arm == "c" and not timed]  # eager, on copies
    assert len(stock_x) == 2 * (3 + 6) == len(set(stock_x))  # layers x pairs: all different
    assert not set(stock_x) & built_with
    assert sorted(candidate_timed) == sorted(stock_x) == sorted(checked)
    for x in candidate_timed:  # timed before it was ever checked
        first = next(n for n, call in enumerate(calls) if call[0] == "c" and call[2] == x)
        assert calls[first][1], "the candidate met a timed pair's inputs before it was timed"


def _content(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.contiguous().view(torch.uint8).flatten().tolist())


def _timed_inputs(layer_set: LayerSet) -> set[int]:
    """Where the timed graphs' inputs live: the eager checks run on copies elsewhere."""
    return {inputs["x"].data_ptr() for _, inputs, _ in layer_set.args}


def _wrong_while_timed(scale: float, layer_set: LayerSet):  # type: ignore[no-untyped-def]
    """Right in its eager calls (the yardstick), scaled in its timed ones."""
    timed = _timed_inputs(layer_set)

    def forward(weights, inputs, out) -> None:  # type: ignore[no-untyped-def]
        stock.forward(weights, inputs, out)
        if inputs["x"].data_ptr() in timed:
            out["out"].mul_(scale)

    return forward


def _problems_of_timing(scale: float, exact: bool) -> list[str]:
    """The watched replays' findings after the stock path and a candidate wrong by `scale`
    while timed were timed."""
    layer_set = _layer_set()
    candidate = _wrong_while_timed(scale, layer_set)
    watched = _watched(candidate, layer_set, exact)
    return _timed_beside_the_stock(candidate, layer_set, watched).watched_problems


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
    first, *rest = _problems_of_timing(scale, exact)
    assert first.startswith("3 of the 3 timed replays of the candidate (batch 0, capture 0)")
    assert wanted in first, first
    assert rest == ["batch 1", "batch 2"]  # a warm-up batch and two sampled


def test_exactness_catches_what_the_cosine_lets_through() -> None:
    """The requantized capture of the review: a close, cheaper result (0.5% off in size, within
    the cosine floor's closeness)."""
    for exact, caught in ((False, False), (True, True)):
        assert bool(_problems_of_timing(1.005, exact)) == caught


def test_measure_case_fails_a_case_whose_timed_replays_were_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A candidate wrong only while it is timed (here: the timed pairs themselves flip it)
    passes every check before and after the timing; the watched replays name it."""
    from harness.evaluation import timing
    from tests.fixtures import bad_paths

    timing_now = {"on": False}
    real = timing.timed_pairs

    def flagged(*args: object, **kwargs: object) -> object:
        timing_now["on"] = True
        try:
            return real(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            timing_now["on"] = False

    def wrong_while_timed(weights, inputs, out) -> None:  # type: ignore[no-untyped-def]
        stock.forward(weights, inputs, out)
        if timing_now["on"]:
            out["out"].neg_()

    monkeypatch.setattr(timing, "timed_pairs", flagged)
    monkeypatch.setattr(bad_paths, "honest_forward", wrong_while_timed)
    manifest = make_manifest("honest_forward")
    stop = StopRule(min_pairs=4, max_pairs=4, pairs_per_batch=2, captures=1)
    case = Case(3, None, 1, 1, "bfloat16", "cpu")
    performance, stale, _ = engine.measure_case(
        load_path(manifest), case, 7, stop, 2, CPU, manifest
    )
    assert performance.watched_replays == 3 * 2  # a warm-up batch and two sampled, all pairs
    assert performance.timed_input_sets == 3 * 2 and performance.tallied_replays is None
    assert performance.timed_calls == 2 * 4 and performance.late_starts == 0
    assert len(stale) == 2, stale
    assert stale[0].startswith("2 of the 2 timed replays of the candidate (batch 0, capture 0)")
    assert "other bits" in stale[0]
    assert stale[1] == "so did replays in 2 later batches"


def test_integer_outputs_are_poisoned_with_their_largest_value() -> None:
    outputs = {"ids": torch.zeros(3, dtype=torch.int32), "mask": torch.zeros(2, dtype=torch.bool)}
    layer_set = LayerSet([({}, {}, outputs)], 0)
    output_poisoner(layer_set, CPU)()
    assert outputs["ids"].tolist() == [2**31 - 1] * 3 and outputs["mask"].all()


def _skips_one_step_in(every: int, layer_set: LayerSet, device: torch.device):  # type: ignore[no-untyped-def]
    """Right in its eager calls; in its timed ones right but each `every`-th step (two layers),
    which leaves its outputs as they were. The count lives on the device, so each replay of
    one captured graph decides afresh (as the corpus's skips_now_and_then)."""
    calls = torch.zeros((), dtype=torch.int64, device=device)
    timed = _timed_inputs(layer_set)

    def forward(weights, inputs, out) -> None:  # type: ignore[no-untyped-def]
        if inputs["x"].data_ptr() not in timed:
            stock.forward(weights, inputs, out)
            return
        calls.add_(1)
        skip = torch.remainder(torch.div(calls - 1, 2, rounding_mode="floor"), every) == every - 1
        fresh = {name: torch.empty_like(value) for name, value in out.items()}
        stock.forward(weights, inputs, fresh)
        for name, value in out.items():
            value.copy_(torch.where(skip, value, fresh[name]))

    return forward


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_every_timed_replay_is_checked_so_a_rarely_skipped_one_is_caught(
    exact: bool, device: str
) -> None:
    """A capture skipping one timed replay in nine (its outputs stay poisoned) is found in
    every batch. On CUDA both steps are captured graphs and the pairs' inputs are written
    between their replays."""
    where = torch.device(device)
    stop = StopRule(min_pairs=27, max_pairs=27, pairs_per_batch=9, captures=1)
    layer_set = _layer_set(device=where)
    candidate = _skips_one_step_in(9, layer_set, where)
    watched = _watched(candidate, layer_set, exact, device=where)
    stock_step, candidate_step = (
        one_launch(_steps(fn, layer_set)[0], where) for fn in (stock.forward, candidate)
    )
    timing = sample_interleaved(
        [stock_step], [candidate_step], layer_set, where, stop, 1, None, watched
    )
    check = "other bits" if exact else "were not written, finite and as close"
    first, *rest = timing.watched_problems
    assert first.startswith("1 of the 9 timed replays of the candidate (batch 0, capture 0)")
    assert check in first and "left layer 0's 'out' unwritten" in first, first
    assert rest == ["batch 1", "batch 2", "batch 3"]
    assert timing.watched == timing.input_sets == 4 * 9


def test_a_right_candidate_is_clean_in_both_modes() -> None:
    for exact in (True, False):
        layer_set = _layer_set()
        watched = _watched(stock.forward, layer_set, exact)
        steps = _steps(stock.forward, layer_set)
        timing = sample_interleaved(steps, steps, layer_set, CPU, STOP, 1, None, watched)
        assert timing.watched_problems == [] and timing.watched == 9


def test_a_result_kept_while_the_inputs_look_unchanged_is_never_served_while_timed() -> None:
    """The checksum cache: copies the result it kept whenever its inputs' checksum is the last
    one's. On one fixed input set every timed call after the first would be served from the
    cache, right and fast; with inputs of its own for every pair, none is."""
    layer_set = _layer_set()
    timed = _timed_inputs(layer_set)
    served: list[bool] = []
    kept: dict[int, tuple[float, dict[str, torch.Tensor]]] = {}  # by input address

    def caching(weights, inputs, out) -> None:  # type: ignore[no-untyped-def]
        where, checksum = inputs["x"].data_ptr(), float(inputs["x"].float().sum())
        if where in kept and kept[where][0] == checksum:
            for name, value in out.items():
                value.copy_(kept[where][1][name])
            served.append(where in timed)
            return
        stock.forward(weights, inputs, out)
        kept[where] = (checksum, {n: t.clone() for n, t in out.items()})

    watched = _watched(caching, layer_set, exact=True)
    steps = _steps(stock.forward, layer_set)
    timing = sample_interleaved(
        steps, _steps(caching, layer_set), layer_set, CPU, STOP, 1, None, watched
    )
    assert timing.watched_problems == [] and timing.watched == 9
    assert True not in served  # no timed call met the inputs of the call before it


class _Counted(Problem):
    """Work that depends on the inputs, as a MoE's active experts do: rarely more."""

    def floor_bytes(self, case: Case, weights: dict, inputs: dict) -> int:  # type: ignore[type-arg]
        return 1000 + 500 * int(inputs["x"][0, 0].abs() > 4 * inputs["x"][1:].float().std())


def test_each_pairs_inputs_are_drawn_with_the_timed_work_its_most_common() -> None:
    """Timed inputs whose work is rare (here set by hand) are replaced by a draw of the most
    common work, and every pair's draw needs the same bytes, layer by layer."""
    layer_set = _layer_set()
    problem = _Counted({"hidden": 64})
    for _, inputs, _ in layer_set.args:
        inputs["x"][0, 0] = 1e4  # the rare work
    assert {problem.floor_bytes(CASE, w, i) for w, i, _ in layer_set.args} == {1500}
    path = LoadedPath(problem, stock.forward, stock.forward, lambda case: True)
    inputs = pair_inputs(path, CASE, layer_set, 5, CPU)
    assert inputs.wanted == [1000, 1000]
    assert [problem.floor_bytes(CASE, w, i) for w, i, _ in layer_set.args] == [1000, 1000]
    for pair_seeds in inputs.seeds_for_batch(0, 8):
        inputs.write(pair_seeds)
        assert [problem.floor_bytes(CASE, w, i) for w, i, _ in layer_set.args] == [1000, 1000]


def test_a_problem_whose_pair_inputs_never_do_the_timed_work_says_so() -> None:
    class NeverTheSame(Problem):
        def floor_bytes(self, case: Case, weights: dict, inputs: dict) -> int:  # type: ignore[type-arg]
            return int(inputs["x"].float().sum() * 1e6)

    layer_set = _layer_set()
    path = LoadedPath(NeverTheSame({"hidden": 64}), stock.forward, stock.forward, lambda c: True)
    inputs = pair_inputs(path, CASE, layer_set, 5, CPU)
    with pytest.raises(RuntimeError, match=f"none of {MAX_INPUT_DRAWS} input sets"):
        inputs.seeds_for_batch(0, 1)


def test_pair_inputs_the_layers_do_not_hold_are_refused() -> None:
    class Misshapen(Problem):
        def pair_inputs(self, case: Case, seed: int, device: torch.device) -> dict:  # type: ignore[type-arg]
            return {"x": torch.zeros(case.batch + 1, 64, dtype=torch.bfloat16)}

    layer_set = _layer_set()
    path = LoadedPath(Misshapen({"hidden": 64}), stock.forward, stock.forward, lambda c: True)
    with pytest.raises(TypeError, match=r"Misshapen's pair inputs give 'x' as \(5, 64\)"):
        pair_inputs(path, CASE, layer_set, 5, CPU)


def _stashing(scale: float, layer_set: LayerSet):  # type: ignore[no-untyped-def]
    """Scaled (cheap, wrong) in its timed calls, which stash their inputs and result; its eager
    calls answer from the stash when their inputs' content is there, so the yardstick made
    after the timed call agrees with it."""
    timed = _timed_inputs(layer_set)
    stash: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []

    def forward(weights, inputs, out) -> None:  # type: ignore[no-untyped-def]
        if inputs["x"].data_ptr() not in timed:
            for x, result in stash:
                if torch.equal(x, inputs["x"]):
                    for name, value in out.items():
                        value.copy_(result[name])
                    return
        stock.forward(weights, inputs, out)
        if inputs["x"].data_ptr() in timed:
            out["out"].mul_(scale)
            stash.append((inputs["x"].clone(), {n: t.clone() for n, t in out.items()}))

    return forward


def _timed_beside_the_stock(candidate, layer_set, watched, sync=None):  # type: ignore[no-untyped-def]
    stock_steps, candidate_steps = _steps(stock.forward, layer_set), _steps(candidate, layer_set)
    return sample_interleaved(stock_steps, candidate_steps, layer_set, CPU, STOP, 1, sync, watched)


def test_a_timed_replay_its_eager_calls_were_told_to_agree_with_is_held_to_the_stock() -> None:
    layer_set = _layer_set()
    candidate = _stashing(-1.0, layer_set)
    watched = _watched(candidate, layer_set, exact=True)
    timing = _timed_beside_the_stock(candidate, layer_set, watched)
    first, *rest = timing.watched_problems
    assert first.startswith("a timed replay of the candidate (batch 0, capture 0) gave layer 0's")
    assert "to the stock path's timed result on the same inputs" in first, first
    assert rest == ["batch 1", "batch 2"]


def test_on_ranks_every_rank_checks_the_pair_they_agreed_on_against_the_stock() -> None:
    """The ranks sum their draws (here: a sum of 7), so each copies the same pair's stock
    result: pair 7 % 3 = 1 of every batch, which runs the candidate first."""
    layer_set = _layer_set()
    log: list[str] = []
    watched = _watched(stock.forward, layer_set, exact=True)
    copy_stock = watched.copy_stock
    watched.copy_stock = lambda pair: (log.append(f"s{pair}"), copy_stock(pair))  # type: ignore[method-assign,func-returns-value]
    sync = RankSync(layers=lambda n: n, align=lambda: None, rank_sum=lambda d: 7)
    timing = _timed_beside_the_stock(stock.forward, layer_set, watched, sync)
    assert timing.watched_problems == [] and watched.picked == 1
    assert log == ["s0", "s1", "s2"] * 3  # every pair's stock call is offered; pair 1 is kept


class _NearTieInRow1(Problem):
    def ambiguous_rows(self, weights: dict, inputs: dict) -> dict:  # type: ignore[type-arg]
        return {"out": torch.tensor([False, True, False, False])}


@pytest.mark.parametrize(("row", "caught"), [(0, True), (1, False)])
def test_near_tie_rows_are_left_out_of_the_check_against_the_stock(row: int, caught: bool) -> None:
    layer_set = _layer_set()
    timed = _timed_inputs(layer_set)

    def differs_in_one_row(weights, inputs, out) -> None:  # type: ignore[no-untyped-def]
        stock.forward(weights, inputs, out)
        if inputs["x"].data_ptr() in timed:  # its eager calls agree: only the stock can tell
            out["out"][row].neg_()

    problem = _NearTieInRow1({"hidden": 64})
    watched = _watched(differs_in_one_row, layer_set, exact=False, problem=problem)
    watched.yardstick = lambda: lambda copied: None  # type: ignore[method-assign] (as if told)
    timing = _timed_beside_the_stock(differs_in_one_row, layer_set, watched)
    assert bool(timing.watched_problems) == caught, timing.watched_problems
