"""The plan: grid, secret-seeded off-grid values, probes outside the scope, hardware routing."""

from __future__ import annotations

from pathlib import Path

import torch

from harness.evaluation.cases import Case
from harness.evaluation.loading import LoadedPath
from harness.evaluation.plan import Host, derive_seed, make_plan
from harness.evaluation.timing import RankSync, StopRule, build_layers, sample_interleaved
from kernels.fused_add_rmsnorm import problem as rmsnorm_problem
from kernels.fused_add_rmsnorm import stock as rmsnorm_stock
from scopes.manifest import ScopeManifest, load_manifest_file

SCOPES = Path(__file__).resolve().parents[2] / "scopes"


def _rmsnorm() -> ScopeManifest:
    return load_manifest_file(SCOPES / "fused-add-rmsnorm-h200.yaml")


def _with_context(manifest: ScopeManifest) -> ScopeManifest:
    data = manifest.model_dump()
    data["workload"]["context"] = {"min": 1024, "max": 32768}
    data["workload"]["batch"] = {"min": 1, "max": 64}
    data["claims"] = []  # they name batches above 64
    return ScopeManifest.model_validate(data)


def test_grid_has_min_max_and_powers_of_two() -> None:
    plan = make_plan(_rmsnorm(), Host("cpu", 1), secret_seed=1)
    grid = sorted(c.batch for c in plan.cases if c.origin == "grid")
    assert grid == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def test_random_values_depend_on_the_secret_seed_only() -> None:
    def off_grid(seed: int) -> list[int]:
        return sorted(
            c.batch
            for c in make_plan(_rmsnorm(), Host("cpu", 1), seed).cases
            if c.origin == "random"
        )

    assert off_grid(7) == off_grid(7)
    assert len(off_grid(7)) == 2
    assert len({tuple(off_grid(seed)) for seed in range(10)}) > 5
    for seed in range(10):
        assert all(1 <= b <= 512 and b & (b - 1) != 0 for b in off_grid(seed))


def test_context_is_crossed_with_batch() -> None:
    plan = make_plan(_with_context(_rmsnorm()), Host("cpu", 1), secret_seed=3)
    pairs = {(c.batch, c.context) for c in plan.cases}
    batches = {c.batch for c in plan.cases}
    contexts = {c.context for c in plan.cases}
    assert pairs == {(b, c) for b in batches for c in contexts}
    assert {1024, 2048, 4096, 8192, 16384, 32768} <= contexts


def test_probes_lie_outside_the_scope() -> None:
    manifest = _with_context(_rmsnorm())
    plan = make_plan(manifest, Host("cpu", 1), secret_seed=3)
    workload = manifest.workload
    assert workload.context is not None
    origins = {p.origin for p in plan.probes}
    assert origins == {
        "probe: batch above max",
        "probe: context above max",
        "probe: unlisted CP degree",
        "probe: other dtype",
    }
    for probe in plan.probes:
        in_scope = (
            workload.batch.min <= probe.batch <= workload.batch.max
            and probe.context is not None
            and workload.context.min <= probe.context <= workload.context.max
            and probe.cp in workload.context_parallel
            and probe.dtype == manifest.model.dtype
        )
        assert not in_scope, probe


def test_quick_plan_is_a_subset_with_an_off_grid_value() -> None:
    full = make_plan(_rmsnorm(), Host("cpu", 1), secret_seed=5)
    quick = make_plan(_rmsnorm(), Host("cpu", 1), secret_seed=5, quick=True)
    assert set(quick.cases) < set(full.cases)
    assert {1, 512} <= {c.batch for c in quick.cases}
    assert any(c.origin == "random" for c in quick.cases)


def test_other_hardware_is_not_runnable_and_says_what_it_needs() -> None:
    kimi = load_manifest_file(SCOPES / "kimi-k3-mla-moe-decode-gb300.yaml")
    plan = make_plan(kimi, Host("H200", 1), secret_seed=1)
    assert not plan.runnable
    assert plan.not_run == ("not runnable here: needs 8x GB300; this host has 1x H200",)


def test_multi_gpu_counts_are_listed_as_not_run() -> None:
    data = _rmsnorm().model_dump()
    data["hardware"]["gpus"] = [1, 8]
    data["workload"]["context_parallel"] = [1, 2]
    plan = make_plan(ScopeManifest.model_validate(data), Host("H200", 1), secret_seed=1)
    assert {c.gpus for c in plan.cases} == {1}
    assert {c.cp for c in plan.cases} == {1}
    assert "gpus=8: needs 8x H200, this host has 1" in plan.not_run
    assert any(item.startswith("cp=2 with gpus=1") for item in plan.not_run)


def test_derived_seeds_differ_by_purpose() -> None:
    assert derive_seed(1, "a") == derive_seed(1, "a")
    assert len({derive_seed(1, "a"), derive_seed(1, "b"), derive_seed(2, "a")}) == 3
    assert 0 <= derive_seed(1, "a") < 2**63


def test_build_layers_uses_the_count_the_ranks_agreed_on() -> None:
    problem = rmsnorm_problem.Problem({"hidden": 64})
    forward = rmsnorm_stock.forward
    path = LoadedPath(problem, forward, forward, lambda case: True)
    case = Case(4, None, 1, 1, "float32", "cpu")
    asked: list[int] = []

    def agree(layers: int) -> int:
        asked.append(layers)
        return layers + 3

    sync = RankSync(layers=agree, align=lambda: None)
    layer_set = build_layers(path, case, 1, torch.device("cpu"), 8, sync)
    assert asked == [8] and len(layer_set.args) == 11  # tiny layers: max_layers, then agreed


def test_on_ranks_every_batch_of_timed_pairs_starts_aligned() -> None:
    events: list[str] = []
    sync = RankSync(layers=lambda n: n, align=lambda: events.append("align"))
    stock = [lambda: events.append("stock")]
    candidate = [lambda: events.append("candidate")]
    problem = rmsnorm_problem.Problem({"hidden": 64})
    forward = rmsnorm_stock.forward
    path = LoadedPath(problem, forward, forward, lambda case: True)
    layer_set = build_layers(path, Case(2, None, 1, 1, "float32", "cpu"), 1, torch.device("cpu"), 2)
    stop = StopRule(min_pairs=6, max_pairs=6, pairs_per_batch=2, captures=1)
    timing = sample_interleaved(stock, candidate, layer_set, torch.device("cpu"), stop, 1, sync)
    assert len(timing.stock_us) == 6
    batches = "".join("|" if e == "align" else e[0] for e in events).split("|")
    # A B, B A: a warm-up batch and three sampled, each aligned
    assert batches == ["", "sccs", "sccs", "sccs", "sccs"]


def _claiming(manifest: ScopeManifest, where: dict) -> ScopeManifest:
    data = manifest.model_dump()
    data["claims"] = [{"metric": "speedup", "where": where, "at_least": 1.0}]
    return ScopeManifest.model_validate(data)


def test_every_value_a_claim_names_is_measured_even_in_quick_mode() -> None:
    manifest = _claiming(_with_context(_rmsnorm()), {"batch": [3, 8], "context": 5000})
    for quick in (False, True):
        plan = make_plan(manifest, Host("cpu", 1), secret_seed=5, quick=quick)
        assert {3, 8} <= {c.batch for c in plan.cases}
        assert 5000 in {c.context for c in plan.cases}


def test_gpu_counts_the_host_lacks_are_left_out_and_cp_combinations_only_noted() -> None:
    data = _rmsnorm().model_dump()
    data["hardware"]["gpus"] = [1, 96]  # 96 ranks split into CP groups of each degree below
    data["workload"]["context_parallel"] = [1, 2, 3, 4, 8, 16, 32]  # every degree probes try
    plan = make_plan(ScopeManifest.model_validate(data), Host("cpu", 1), secret_seed=5)
    assert plan.left_out == ("gpus=96: needs 96x cpu, this host has 1",)
    assert "cp=2 with gpus=1: a CP degree needs that many GPUs" in plan.not_run
    assert "cp=2 with gpus=1: a CP degree needs that many GPUs" not in plan.left_out
    [cp_probe] = [p for p in plan.probes if p.origin == "probe: unlisted CP degree"]
    assert cp_probe.cp == 33
