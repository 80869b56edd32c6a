"""benchmarks/batch1_bound.py: the batch-1 bound of a K-kernel layer from measured files."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import batch1_bound
from kernels.mla_moe_decode.config import LayerConfig

LAUNCH_FLOOR = {
    "chains": [
        {"programs": 1, "mode": "off", "per_kernel_us": 9.0},  # narrow chains are not used
        {"programs": 132, "mode": "off", "per_kernel_us": 1.2},
        {"programs": 132, "mode": "exit", "per_kernel_us": 0.8},
        {"programs": 132, "mode": "early", "per_kernel_us": 0.7},
    ]
}


def _evidence(cases: list[tuple[int, int, float]]) -> dict[str, object]:
    """(batch, context, local experts per layer) per case, at 4e12 B/s and 2 layers."""
    problem = batch1_bound.Problem({})
    rows = []
    for batch, context, experts in cases:
        layer = problem.layer_bytes(batch1_bound._case(context, batch), experts)
        rows.append(
            {
                "id": f"batch={batch} context={context}",
                "batch": batch,
                "context": context,
                "cp": 1,
                "gpus": 1,
                "dtype": "bfloat16",
                "origin": "grid",
                "performance": {
                    "layers": 2,
                    "bytes_moved": round(layer),
                    "hbm_bytes_per_s": 4e12,
                    "candidate_us_median": 100.0,
                    "candidate_hbm_fraction": layer / 4e12 / 100e-6,
                },
            }
        )
    return {
        "manifest": {"model": {"config": {}}},
        "run": {"seed": 7, "command": "pathgate validate ..."},
        "cases": rows,
    }


def test_the_local_expert_draw_is_hypergeometric() -> None:
    pmf = batch1_bound.local_expert_pmf(LayerConfig())
    assert sum(pmf) == pytest.approx(1.0)
    assert pmf[0] == pytest.approx(math.comb(336, 8) / math.comb(384, 8))  # 0.340
    assert pmf[0] == pytest.approx(0.340, abs=1e-3) and pmf[1] == pytest.approx(0.397, abs=1e-3)
    two_layers = batch1_bound.case_pmf(LayerConfig(), 2)
    assert sum(two_layers) == pytest.approx(1.0) and len(two_layers) == 17
    assert two_layers[0] == pytest.approx(pmf[0] ** 2)
    assert two_layers[1] == pytest.approx(2 * pmf[0] * pmf[1])
    assert sum(two_layers[1:]) == pytest.approx(0.884, abs=1e-3)
    assert sum(two_layers[2:]) == pytest.approx(0.614, abs=1e-3)


def test_a_case_meets_the_target_by_its_layers_mean_floor() -> None:
    """The bar sits between half an expert per layer and one: the two layers must bring two
    local experts between them (P 0.614), one is not enough (which P 0.884 would mean)."""
    problem, case = batch1_bound.Problem({}), batch1_bound._case(1024)
    half, one = (1e6 * problem.layer_bytes(case, n) / 4e12 for n in (0.5, 1.0))
    bar = (half + one) / 2
    cost = bar * 0.3 / 0.7 / 13  # a 14-kernel layer reaches 0.7 exactly at the bar
    chance = batch1_bound.chance_to_meet(problem, case, 2, 4e12, 14, cost, 0.7)
    assert chance == pytest.approx(sum(batch1_bound.case_pmf(problem.config, 2)[2:]))
    assert chance == pytest.approx(0.614, abs=1e-3)


def test_grouped_routing_and_incomplete_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="grouped"):
        batch1_bound.local_expert_pmf(LayerConfig(n_group=8, topk_group=4))
    without_exit = {"chains": LAUNCH_FLOOR["chains"][:2]}
    with pytest.raises(ValueError, match="exit"):
        batch1_bound.per_kernel_costs(without_exit)
    with pytest.raises(ValueError, match="no single-GPU batch-1"):
        batch1_bound.bounds(LAUNCH_FLOOR, _evidence([(8, 1024, 4.0)]), [14], 0.7)
    untimed = _evidence([(1, 1024, 1.0)])
    untimed["cases"][0]["performance"] = None  # type: ignore[index]
    with pytest.raises(ValueError, match="no floor bytes"):
        batch1_bound.bounds(LAUNCH_FLOOR, untimed, [14], 0.7)


def test_bounds_read_the_widest_chains_and_each_cases_own_draw() -> None:
    evidence = _evidence([(1, 1024, 0.0), (1, 32768, 1.0), (8, 1024, 7.0)])
    result = batch1_bound.bounds(LAUNCH_FLOOR, evidence, [14, 8], 0.7)
    assert result["per_kernel_us"] == {"off": 1.2, "exit": 0.8}
    rows = result["cases"]
    assert [r["context"] for r in rows] == [1024, 32768]  # batch 1 only
    assert [round(r["local_experts_per_layer"], 6) for r in rows] == [0.0, 1.0]
    floor = rows[0]["floor_us"]
    assert rows[0]["best"]["14 off"] == pytest.approx(floor / (floor + 13 * 1.2))
    assert rows[0]["best"]["8 exit"] == pytest.approx(floor / (floor + 7 * 0.8))
    # no local expert: a 17.5 µs floor, out of reach for 14 plain kernels
    assert rows[0]["best"]["14 off"] < 0.6
    for row in rows:  # fewer kernels and cheaper boundaries never lower the chance
        assert row["chance"]["8 off"] >= row["chance"]["14 off"]
        assert row["chance"]["14 exit"] >= row["chance"]["14 off"]
        assert 0.0 <= row["chance"]["14 off"] <= 1.0
    all_of = result["chance_all_contexts"]["14 off"]
    assert all_of == pytest.approx(rows[0]["chance"]["14 off"] * rows[1]["chance"]["14 off"])


def test_a_target_no_floor_can_reach_has_no_chance_and_zero_has_every_chance() -> None:
    evidence = _evidence([(1, 1024, 1.0)])
    problem = batch1_bound.Problem({})
    case = batch1_bound._case(1024)
    assert batch1_bound.chance_to_meet(problem, case, 2, 4e12, 14, 1.2, 1.0) == 0.0
    assert batch1_bound.chance_to_meet(problem, case, 2, 4e12, 14, 1.2, 0.0) == pytest.approx(1)
    row = batch1_bound.bounds(LAUNCH_FLOOR, evidence, [14], 0.7)["cases"][0]
    assert set(row["chance"]) == {"14 off", "14 exit"}


def test_time_above_the_floor_is_per_batch_and_sets_the_floor_a_case_needs() -> None:
    draws = [(8, 1024, 4.0), (8, 4096, 7.0), (8, 8192, 9.0), (8, 2048, 1.0), (1, 1024, 0.0)]
    evidence = _evidence(draws)
    rows = batch1_bound.time_above_floor(evidence, 0.7)
    assert [r["batch"] for r in rows] == [1, 8]
    floors = [1e6 * c["performance"]["bytes_moved"] / 4e12 for c in evidence["cases"][:4]]
    above = sorted(100.0 - f for f in floors)  # each case ran 100 µs
    eight = rows[1]
    assert eight["above_min_us"] == pytest.approx(above[0])
    assert eight["above_median_us"] == pytest.approx((above[1] + above[2]) / 2)  # 4 contexts
    assert eight["above_max_us"] == pytest.approx(above[3])
    assert eight["floor_needed_us"] == pytest.approx(eight["above_median_us"] * 0.7 / 0.3)


def test_a_persistent_kernels_barrier_counts_where_the_launch_floor_has_it() -> None:
    """launch_floor.py's "barrier" rows (a persistent kernel's phases) join the plain and PDL
    costs when present; older files without them still give the two; a second one is refused."""
    with_barrier = {
        "chains": [
            *LAUNCH_FLOOR["chains"],
            {"programs": 1, "mode": "barrier", "per_kernel_us": 0.1},  # narrow: not used
            {"programs": 132, "mode": "barrier", "per_kernel_us": 0.5},
        ]
    }
    costs = batch1_bound.per_kernel_costs(with_barrier)
    assert costs == {"off": 1.2, "exit": 0.8, "barrier": 0.5}
    row = batch1_bound.bounds(with_barrier, _evidence([(1, 1024, 0.0)]), [14], 0.7)["cases"][0]
    floor = row["floor_us"]
    assert row["best"]["14 barrier"] == pytest.approx(floor / (floor + 13 * 0.5))
    twice = {"chains": [*with_barrier["chains"], with_barrier["chains"][-1]]}
    with pytest.raises(ValueError, match="two 'barrier' chains"):
        batch1_bound.per_kernel_costs(twice)


def test_a_given_cost_per_step_is_bounded_beside_the_launch_floors() -> None:
    evidence = _evidence([(1, 1024, 1.0)])
    result = batch1_bound.bounds(LAUNCH_FLOOR, evidence, [10], 0.7, (2.9,))
    assert result["per_kernel_us"] == {"off": 1.2, "exit": 0.8, "2.9 us": 2.9}
    row = result["cases"][0]
    floor = row["floor_us"]
    assert row["best"]["10 2.9 us"] == pytest.approx(floor / (floor + 9 * 2.9))
    assert row["chance"]["10 2.9 us"] <= row["chance"]["10 off"]  # dearer steps: no better


def test_the_draws_are_each_timed_cases_local_experts_at_that_batch() -> None:
    evidence = _evidence([(8, 1024, 4.0), (8, 8192, 7.0), (1, 1024, 1.0), (8, 2048, 5.0)])
    evidence["cases"][3]["performance"] = None  # type: ignore[index]  # a case that did not run
    draws = batch1_bound.drawn_local_experts([evidence, _evidence([(8, 4096, 9.5)])], 8)
    assert draws == pytest.approx([4.0, 7.0, 9.5])


def _floor_us(context: int, experts: float, bytes_per_s: float, batch: int = 8) -> float:
    problem = batch1_bound.Problem({})
    return 1e6 * problem.layer_bytes(batch1_bound._case(context, batch), experts) / bytes_per_s


def test_the_fused_chance_is_the_share_of_draws_whose_floor_leaves_room_for_the_target() -> None:
    """A case that ran F µs over its floor meets 0.70 on a draw whose floor is at least
    F x 0.7 / 0.3. Here each context's F puts that bar at the floor of 6.25 local experts
    (8192) or 5.25 (1024), between draws half an expert apart, at the case's own bandwidth."""
    bandwidth, draws = 3.0e12, [5.0, 5.5, 6.0, 6.5, 7.0, 7.5]
    evidence = _evidence([(8, 8192, 7.0), (8, 1024, 7.0), (8, 2048, 9.0)])
    evidence["cases"][2]["cp"] = evidence["cases"][2]["gpus"] = 2  # not a single-GPU case
    bars = {8192: 6.25, 1024: 5.25}
    for case in evidence["cases"][:2]:
        perf, context = case["performance"], case["context"]
        perf["hbm_bytes_per_s"] = bandwidth
        above = _floor_us(context, bars[context], bandwidth) * 0.3 / 0.7
        perf["candidate_us_median"] = 1e6 * perf["bytes_moved"] / bandwidth + above
    result = batch1_bound.fused_chance(evidence, draws, 8, 0.7)
    rows = result["cases"]
    assert [row["context"] for row in rows] == [1024, 8192]  # by context, single-GPU only
    assert [row["chance"] for row in rows] == [5 / 6, 3 / 6]
    assert [row["local_experts_per_layer"] for row in rows] == pytest.approx([7.0, 7.0])
    assert result["chance_all_contexts"] == pytest.approx(5 / 6 * 3 / 6)
    # every draw passes once both bars are down at the floor of 5 experts
    needed = max(
        row["above_us"] - _floor_us(row["context"], 5.0, bandwidth) * 0.3 / 0.7 for row in rows
    )
    assert result["cut_needed_us"]["0.99"] == math.ceil(4 * needed) / 4
    assert result["cut_needed_us"]["0.5"] <= result["cut_needed_us"]["0.9"]


def test_another_machines_bandwidth_divides_the_draws_floors_and_keeps_the_time_above() -> None:
    """At twice the bandwidth every draw's floor halves while the case's 60 µs above the floor
    stays: 0.70 then needs floor >= 140 µs of the faster HBM, which of these draws only 9
    experts reach (all five at the evidence's own bandwidth); the floor column stays the
    evidence's own."""
    bandwidth, draws = 3.0e12, [5.0, 6.0, 7.0, 8.0, 9.0]
    evidence = _evidence([(8, 1024, 7.0)])
    perf = evidence["cases"][0]["performance"]
    perf["hbm_bytes_per_s"] = bandwidth
    perf["candidate_us_median"] = 1e6 * perf["bytes_moved"] / bandwidth + 60.0
    same = batch1_bound.fused_chance(evidence, draws, 8, 0.7)
    faster = batch1_bound.fused_chance(evidence, draws, 8, 0.7, 2 * bandwidth)
    assert faster["draw_bytes_per_s"] == 2 * bandwidth and same["draw_bytes_per_s"] is None
    assert faster["cases"][0]["above_us"] == pytest.approx(60.0)
    assert faster["cases"][0]["floor_us"] == same["cases"][0]["floor_us"]
    bar = 60.0 * 0.7 / 0.3
    passing = [n for n in draws if _floor_us(1024, n, 2 * bandwidth) >= bar]
    assert faster["chance_all_contexts"] == len(passing) / len(draws)
    assert (faster["chance_all_contexts"], same["chance_all_contexts"]) == (1 / 5, 1.0)


def test_the_cut_is_the_least_quarter_microsecond_that_reaches_the_chance() -> None:
    """Two contexts, each 30 µs over its floor, each with draws of floors 50, 60, 70 and 80 µs:
    0.70 needs floor >= (30 - cut) x 7/3, so three draws pass from a cut of 30 - 60 x 3/7
    (4.29: 4.5 in quarter steps) and all four from 30 - 50 x 3/7 (8.57: 8.75). The contexts'
    chances multiply: 0.75 at each is 0.5625 in all, short of 0.6."""
    rows = [{"above_us": 30.0, "draw_floors_us": [50.0, 60.0, 70.0, 80.0]} for _ in range(2)]
    assert batch1_bound._cut_for(rows, 0.5, 0.7) == 4.5
    assert batch1_bound._cut_for(rows, 0.6, 0.7) == 8.75
    assert batch1_bound._chance_at(rows[0], 8.75, 0.7) == 1.0
    assert batch1_bound._chance_at(rows[0], 8.5, 0.7) == 0.75
    no_floor = [{"above_us": 30.0, "draw_floors_us": [0.0]}]
    assert batch1_bound._cut_for(no_floor, 0.99, 0.7) == 30.0  # only nothing above the floor


def test_the_fused_chance_refuses_a_batch_it_has_no_draws_or_cases_for() -> None:
    evidence = _evidence([(8, 1024, 7.0)])
    with pytest.raises(ValueError, match="no routing draws"):
        batch1_bound.fused_chance(evidence, [], 8, 0.7)
    with pytest.raises(ValueError, match="no single-GPU batch-64"):
        batch1_bound.fused_chance(evidence, [7.0], 64, 0.85)


def test_an_untimed_case_at_the_batch_is_refused_not_left_out() -> None:
    """Left out, it would make the chance at every context a product over fewer contexts."""
    evidence = _evidence([(8, 1024, 7.0), (8, 2048, 7.0)])
    evidence["cases"][1]["performance"] = None  # type: ignore[index]
    with pytest.raises(ValueError, match="batch=8 context=2048: no floor bytes"):
        batch1_bound.fused_chance(evidence, [7.0], 8, 0.7)


def test_draws_over_different_layer_counts_are_refused() -> None:
    one, two = _evidence([(8, 1024, 7.0)]), _evidence([(8, 1024, 6.0)])
    two["cases"][0]["performance"]["layers"] = 3  # type: ignore[index]
    with pytest.raises(ValueError, match="different layer counts"):
        batch1_bound.drawn_local_experts([one, two], 8)


def test_the_script_counts_the_evidence_once_and_refuses_a_target_of_one(
    tmp_path, monkeypatch, capsys
) -> None:
    """--draws may name the evidence again, spelled another way: its draws count once."""
    evidence = tmp_path / "evidence.json"
    evidence.write_text(json.dumps(_evidence([(1, 1024, 1.0), (8, 1024, 7.0), (8, 4096, 6.0)])))
    floor = tmp_path / "launch_floor.json"
    floor.write_text(json.dumps(LAUNCH_FLOOR))
    out = tmp_path / "out.json"
    monkeypatch.chdir(tmp_path)
    argv = ["batch1_bound.py", "--launch-floor", str(floor), "--evidence", "evidence.json"]
    argv += ["--draws", str(evidence), "--chance", "8:0.7", "--out", str(out)]
    monkeypatch.setattr("sys.argv", argv)
    batch1_bound.main()
    result = json.loads(out.read_text())
    assert result["draw_files"] == ["evidence.json"]
    assert [c["draws"] for c in result["fused_chance"]] == [2]
    monkeypatch.setattr("sys.argv", [*argv[:-4], "--chance", "8:1.0"])
    with pytest.raises(SystemExit):
        batch1_bound.main()
    assert "strictly between 0 and 1" in capsys.readouterr().err
