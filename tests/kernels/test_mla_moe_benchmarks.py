"""The MLA+MoE device scripts run end to end on the CPU at test sizes (their `--small` mode), so
that what a scarce GPU session runs has run somewhere first: the per-kernel profile, the
attention sweep and the trial replay each write the JSON their docs promise."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import mla_moe_device_check as device_check
from benchmarks.mla_moe_device_check import (
    MOE_PLAN_VARIANTS,
    SMALL_KERNEL_VARIANTS,
    moe_before_seventeenth,
    run18_moe_plan,
    run19_moe_plan,
    with_plan_value,
)
from kernels.mla_moe_decode import fused
from kernels.mla_moe_decode.config import LayerConfig

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_profile_fused_writes_each_kernel_of_a_layer(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    _run("mla_moe_device_check.py", "--small", "--quick", "--profile-fused", "--out", str(out))
    rows = json.loads(out.read_text())["profile"]
    assert [(r["batch"], r["errors"]) for r in rows] == [(1, [])]
    assert rows[0]["layer_us"] > 0 and rows[0]["kernels"]
    assert all({"name", "us", "gap_before_us"} <= set(k) for k in rows[0]["kernels"])
    # the middle layer's floor and its MoE part (the CPU profile records host ops, no kernels)
    assert rows[0]["floor_us"] > rows[0]["moe_floor_us"] > 0
    assert rows[0]["fused_local_experts"] >= 0 and rows[0]["active_local_experts"] >= 0
    assert rows[0]["above_floor"] is None


def test_above_floor_split_charges_the_moe_kernels_and_the_rest_with_every_gap() -> None:
    kernels = [
        {"name": "kernel_cutlass_norm", "us": 2.5, "gap_before_us": 0.5},
        {"name": "_route_kernel", "us": 5.0, "gap_before_us": 0.5},
        {"name": "_gate_up_kernel", "us": 100.0, "gap_before_us": 0.5},
        {"name": "_down_items_kernel", "us": 50.0, "gap_before_us": 0.5},
    ]
    row = device_check.ProfileRow(8, 1024, kernels=kernels, floor_us=150.0, moe_floor_us=140.0)
    split = device_check.above_floor_split(row)
    assert split == {
        "moe_us": 150.0,
        "moe_above_us": 10.0,
        "rest_us": 9.5,  # 2.5 + 5.0 and all four gaps
        "rest_floor_us": 10.0,
        "rest_above_us": -0.5,
    }
    assert device_check.above_floor_split(dataclasses.replace(row, kernels=kernels[:2])) is None


def test_attention_sweep_checks_every_variant_against_the_reference(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    args = ("--small", "--quick", "--sweep-attention", "--batches", "1", "9", "--out", str(out))
    _run("mla_moe_device_check.py", *args)
    rows = json.loads(out.read_text())["kernels"]
    # batch 1 and 9 (past 8: the large-batch variants): the plan, then two variants each on
    # the CPU
    assert [r["batch"] for r in rows] == [1, 1, 1, 9, 9, 9]
    assert [r["note"].split(";")[0] for r in rows[::3]] == ["plan", "plan"]
    assert "(32, 2, 4, 4, 3, 128, 32)" in rows[4]["note"]
    for row in rows:
        assert row["error"] is None, row
        assert row["relative_error"] < 1e-2, row


def test_router_sweep_checks_each_variant_against_torchs_selection(tmp_path: Path) -> None:
    out = tmp_path / "router.json"
    args = ("--small", "--sweep-router", "--batches", "3", "--out", str(out))
    _run("mla_moe_device_check.py", *args)
    rows = json.loads(out.read_text())["kernels"]
    variants = [r["note"].split(";")[0] for r in rows]
    assert variants == ["variant plan", "variant (64, 128, 14, 4, 4)"]
    for row in rows:
        assert row["error"] is None, row
        assert row["relative_error"] < 1e-5 and "K splits" in row["note"]


def test_trial_probe_replays_a_trial_and_reports_every_token(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    args = ("--small", "--batch", "3", "--context", "40", "--seed", "5", "--out", str(out))
    _run("mla_moe_trial_probe.py", *args)
    result = json.loads(out.read_text())
    assert result["case"].startswith("batch=3 context=40") and result["reasons"] == []
    assert [t["token"] for t in result["tokens"]] == [0, 1, 2]
    for token in result["tokens"]:
        assert token["candidate_error"] < 0.05 and token["boundary_gap"] >= 0
        assert len(token["best_experts"]) == 12


def test_precision_probe_finds_the_fused_path_no_further_from_float64_than_eager(
    tmp_path: Path,
) -> None:
    """The fused kernels round only where a value leaves as bf16, eager PyTorch after every op:
    on kv_new and residual_out (no routing in them) the fused path must be the closer one."""
    out = tmp_path / "precision.json"
    _run("mla_moe_precision_probe.py", "--small", "--out", str(out))
    record = json.loads(out.read_text())
    errors = {r["output"]: r for r in record["rows"]}
    assert set(errors) == {"out", "residual_out", "kv_new"}
    for name in ("kv_new", "residual_out"):
        assert 0 < errors[name]["fused"] < errors[name]["eager"], errors[name]
    [decode] = record["decode"]  # 2 sequences x 4 steps: too few tokens for its verdict
    for path in ("stock", "candidate"):
        assert decode[f"{path}_kl_from_reference"] >= 0


def test_combine_sweep_checks_each_program_shape_against_the_reference(tmp_path: Path) -> None:
    out = tmp_path / "combine.json"
    args = ("--small", "--quick", "--sweep-combine", "--batches", "9", "--out", str(out))
    _run("mla_moe_device_check.py", *args)
    rows = json.loads(out.read_text())["kernels"]
    # one context, two combine shapes and two q_absorb widths on the CPU
    assert [r["kernel"].split(" (")[0] for r in rows] == ["MLA combine"] * 2 + [
        "q_nope @ W_UK + RoPE(q)"
    ] * 2
    assert all(r["error"] is None and r["relative_error"] < 0.01 for r in rows)
    assert {r["note"] for r in rows[2:]} == {
        "32 latent columns per program",
        "64 latent columns per program",
    }


def test_small_kernel_sweep_times_each_change_against_the_plan(tmp_path: Path) -> None:
    out = tmp_path / "small.json"
    args = ("--small", "--quick", "--sweep-small-kernels", "--batches", "3", "--out", str(out))
    _run("mla_moe_device_check.py", *args)
    rows = json.loads(out.read_text())["pdl"]
    assert [(r["batch"], r["errors"]) for r in rows] == [(3, [])]
    assert set(rows[0]["us"]) == set(SMALL_KERNEL_VARIANTS)
    # the interpreter ignores num_warps, and the routing orders give the same bits anyway; the
    # folded latent_prep rounds q_a * weight where the plan rounds q_c, and the absorbed query
    # rounds its weight where the plan rounds q_nope, and the folded router does not round the
    # norm's output, nor does the input norm folded into qkv_a: other bits. The combine with
    # w_uv in it rounds o_lat where the combine does and sums in the same order here: the same
    expected = dict.fromkeys(SMALL_KERNEL_VARIANTS, True)
    expected["latent_prep folded into q_b"] = False
    expected["query absorbed the other way"] = False
    expected["router in o_proj the other way"] = False
    expected["input norm in qkv_a"] = False
    expected["input norm in qkv_a, w_uv in the combine"] = False
    assert rows[0]["same_bits"] == expected
    assert all(rows[0]["us"][v] > 0 and rows[0]["off_us"][v] > 0 for v in SMALL_KERNEL_VARIANTS)


def test_small_kernel_sweep_takes_only_the_variants_named(monkeypatch) -> None:
    """--variants NAME ...: the device's minutes go to the changes asked about; the plan stays
    the baseline, and the GEMVs variant flips exactly the plan's gemv_cute: off at batch 8,
    where the GPU plan takes the CuTe DSL GEMVs, on at batch 64, where it takes Triton's."""
    compared: list[dict] = []
    monkeypatch.setattr(device_check, "_compare_plans", lambda *args: compared.append(args[-1]))
    only = ("GEMVs in the other language",)
    device_check._compare_small_kernels(None, [], None, None, None, only=only)  # type: ignore[arg-type]
    assert list(compared[0]) == list(only)
    for batch, cute in [(8, True), (64, False)]:
        plan = fused.layer_plan(LayerConfig(), batch, 1024, True, 132)
        assert plan.gemv_cute is cute
        flipped = compared[0]["GEMVs in the other language"](plan)
        assert flipped == dataclasses.replace(plan, gemv_cute=not cute)
    with pytest.raises(SystemExit):
        device_check._parse_args(["--sweep-small-kernels", "--variants", "GEMVs in Cute"])


def test_moe_plan_sweep_times_the_earlier_moe_plan_against_the_plan(tmp_path: Path) -> None:
    out = tmp_path / "moe_plan.json"
    args = ("--small", "--quick", "--sweep-moe-plan", "--batches", "3", "--out", str(out))
    _run("mla_moe_device_check.py", *args)
    rows = json.loads(out.read_text())["pdl"]
    assert [(r["batch"], r["errors"]) for r in rows] == [(3, [])]
    variants = list(MOE_PLAN_VARIANTS)
    assert set(rows[0]["us"]) == set(variants)
    # at batch 3 (<= 4) the MoE plans of runs 18 and 19 and before are the plan's; the stream
    # does not run there, so its down's width changes nothing
    assert all(rows[0]["same_bits"].values())
    assert all(rows[0]["us"][v] > 0 and rows[0]["off_us"][v] > 0 for v in variants)


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_the_moe_plans_the_sweep_compares(batch: int) -> None:
    """What --sweep-moe-plan compares against: the H200 plan's MoE as it was in runs 19, 18 and
    before the seventeenth session, and the one-kernel MoE's down 32 columns wide; the rest of
    the plan as it is."""
    plan = fused.layer_plan(LayerConfig(), batch, 1024, True, 132)
    changed = {name: change(plan, batch=batch) for name, change in MOE_PLAN_VARIANTS.items()}
    assert all(dataclasses.replace(p, moe=plan.moe) == plan for p in changed.values())
    if batch == 1:  # unchanged at batch <= 4, where the plan splits the shared expert
        assert plan.moe.stream_programs == 0 and plan.moe.shared_splits == 14
        assert all(p == plan for p in changed.values())
        return
    # the plan: the MoE as one kernel, 2 programs per SM, the down's items 64 columns wide
    moe = plan.moe
    assert (moe.stream_programs, moe.down_cols, moe.token_rows, moe.shared_splits) == (
        264,
        64,
        16,
        1,
    )
    assert changed["stream, down 32 columns"].moe == dataclasses.replace(moe, down_cols=32)
    # run 19's: two kernels, the down as items (32 columns, 4 per SM), the cap at batch 5-8
    run19 = changed["run 19"].moe
    cap = 264 if batch <= 8 else 0
    assert (run19.stream_programs, run19.gate_up_programs, run19.token_rows) == (0, cap, 16)
    assert (run19.down_programs, run19.down_cols, run19.down_k) == (528, 32, 128)
    assert run19_moe_plan(plan, batch) == changed["run 19"]
    # run 18's: the down walking the experts, the cap at every batch above 4
    run18 = changed["run 18"].moe
    assert run18 == dataclasses.replace(
        run19, down_programs=0, down_k=256 if batch <= 32 else 128, gate_up_programs=264
    )
    assert run18_moe_plan(plan, batch) == changed["run 18"]
    before = moe_before_seventeenth(plan, batch).moe
    assert (before.gate_up_programs, before.token_rows, before.down_k) == (0, 0, 128)
    assert (before.down_programs, before.stream_programs) == (0, 0)
    assert before.num_stages == (4 if batch <= 16 else 3)


@pytest.mark.parametrize("batch", [8, 64])
def test_with_plan_value_changes_that_kernel_alone(batch: int) -> None:
    plan = fused.layer_plan(LayerConfig(), batch, 1024, True, 132)
    for field_name, value in SMALL_KERNEL_VARIANTS.values():
        expected = dataclasses.asdict(plan)
        names = field_name.split("+")  # a variant may change several fields, each its own way
        values = value if isinstance(value, tuple) else (value,) * len(names)
        for one, one_value in zip(names, values, strict=True):
            owner = expected["attention"] if one in expected["attention"] else expected
            one_value = not owner[one] if one_value is None else one_value
            assert owner[one] != one_value  # the plan's own value is the "off" variant
            owner[one] = one_value
        assert dataclasses.asdict(with_plan_value(plan, field_name, value)) == expected


def test_small_kernel_sweep_sets_each_variants_plan_and_restores_the_plan_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The comparison itself stubbed: each variant's set-up makes the layer's own plan lookup
    (fused._plan) return that variant's plan and "off" the plan itself; afterwards, even when
    the comparison raises, fused.layer_plan is the original again."""
    original = fused.layer_plan
    x = torch.empty(8, LayerConfig().hidden)
    seen = {}

    def compare(*args: object) -> None:
        for name, set_up in args[-1].items():  # type: ignore[attr-defined]
            set_up()
            seen[name] = fused._plan(LayerConfig(), x, 1024)
        raise RuntimeError("stop")

    monkeypatch.setattr(device_check, "_compare_variants", compare)
    with pytest.raises(RuntimeError, match="stop"):
        device_check._compare_small_kernels(None, [], None, None, None)  # type: ignore[arg-type]
    assert fused.layer_plan is original
    plan = original(LayerConfig(), 8, 1024, False, 0)
    assert seen["off"] == plan
    for name, (field_name, value) in SMALL_KERNEL_VARIANTS.items():
        assert seen[name] == with_plan_value(plan, field_name, value) != plan


def test_moe_check_times_each_kernel_alone_with_its_own_bytes() -> None:
    """--sweep-moe's rows for the gate_up alone and the down alone: each reaches the same
    output as the pair (the down reads the act its copy's gate_up made), and their bytes add
    up to the pair's, so each kernel's rate can be read against the HBM's."""
    from kernels.mla_moe_decode.problem import Problem

    problem = Problem(dict(fused.CPU_TEST_CONFIG))
    t = device_check.Target(torch.device("cpu"), small=True)
    weights = problem.make_weights(device_check._case(1, 1024, t), 0, t.device)
    checks = {}
    for part in ("both", "gate_up", "down"):
        gen = torch.Generator().manual_seed(3)
        check = device_check._check_moe(problem.config, weights, 3, gen, t, part=part)
        row = device_check.run_kernel_check(check, 3, t)
        assert row.relative_error is not None and row.relative_error < 1e-2, (part, row)
        assert row.us is not None and row.us > 0
        checks[part] = check
    assert checks["gate_up"].bytes_moved + checks["down"].bytes_moved == checks["both"].bytes_moved
    assert checks["down"].bytes_moved < checks["gate_up"].bytes_moved


def test_moe_down_sweep_times_each_down_as_the_pair_and_alone(tmp_path: Path) -> None:
    out = tmp_path / "moe_down.json"
    args = ("--small", "--quick", "--sweep-moe-down", "--batches", "3", "--out", str(out))
    _run("mla_moe_device_check.py", *args)
    rows = json.loads(out.read_text())["kernels"]
    # the plan's down (the walker on the CPU plan) and each MOE_DOWN_ITEMS down, each twice
    downs = [r["note"].split(";")[0] for r in rows[::2]]
    assert len(downs) == 1 + len(device_check.MOE_DOWN_ITEMS)
    assert downs[0].endswith(", 0)")
    assert [r["kernel"].endswith("alone") for r in rows] == [False, True] * len(downs)
    for row in rows:
        assert row["error"] is None and row["relative_error"] < 1e-2, row


def test_moe_rounds_sweep_times_each_gate_up_grid_per_expert_count(tmp_path: Path) -> None:
    out = tmp_path / "moe_rounds.json"
    args = ("--small", "--quick", "--sweep-moe-rounds", "--batches", "3", "--out", str(out))
    _run("mla_moe_device_check.py", *args)
    rows = json.loads(out.read_text())["kernels"]
    notes = [r["note"].split("; ") for r in rows]
    # the CPU's counts (2 and 3 local experts) x the plan's grid (one per item), 2 and 3 per
    # SM of the CPU target's 4 "SMs"
    assert [n[:2] for n in notes] == [
        [f"{n} local experts", grid]
        for n in (2, 3)
        for grid in ("gate_up grid one per item (plan)", "gate_up grid 8", "gate_up grid 12")
    ]
    # every launch read exactly that many of the shard's experts
    assert [n[2] for n in notes] == [
        f"active local experts per launch {n}-{n}" for n in (2, 2, 2, 3, 3, 3)
    ]
    for row in rows:
        assert row["error"] is None and row["relative_error"] < 1e-2, row


@pytest.mark.parametrize("n", [0, 1, 5, 8])
def test_ids_with_local_experts_choose_exactly_n_of_the_shards(n: int) -> None:
    c = LayerConfig(**fused.CPU_TEST_CONFIG)  # rank 2: local ids start past other ranks'
    gen = torch.Generator().manual_seed(n)
    ids = device_check._ids_with_local_experts(c, 3, n, gen, torch.device("cpu"))
    assert ids.shape == (3, c.top_k) and ids.dtype == torch.int32
    local = (ids >= c.expert_offset) & (ids < c.expert_offset + c.experts)
    assert int(local.sum()) == n == device_check._local_experts(c, ids)
    assert all(len(set(row.tolist())) == c.top_k for row in ids)  # distinct within a token
    assert int(ids.min()) >= 0 and int(ids.max()) < c.experts_total


def test_ids_with_local_experts_refuse_more_than_the_shard_holds() -> None:
    c = LayerConfig(**fused.CPU_TEST_CONFIG)
    with pytest.raises(ValueError, match="local experts"):
        device_check._ids_with_local_experts(
            c, 3, c.experts + 1, torch.Generator(), torch.device("cpu")
        )
