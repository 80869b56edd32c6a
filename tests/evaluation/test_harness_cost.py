"""benchmarks/harness_cost.py runs one case as a validate times it and accounts for its seconds:
on the CPU, the Kimi-K2 layer at test size with the eager stock in both arms (the fused path's
interpreted kernels would take minutes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from kernels.mla_moe_decode import fused

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness_cost  # noqa: E402


def small_scope(tmp_path: Path) -> Path:
    scope = yaml.safe_load((ROOT / "scopes/kimi-k2-mla-moe-decode-h200.yaml").read_text())
    scope["model"]["config"] = dict(fused.CPU_TEST_CONFIG)
    scope["workload"]["context"] = {"min": 1, "max": 256}
    scope["path"]["baseline"] = scope["path"]["candidate"] = "kernels.mla_moe_decode.stock:forward"
    scope["claims"] = []
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(scope))
    return path


def test_each_step_of_a_case_is_counted_and_timed(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    harness_cost.main(
        [
            str(small_scope(tmp_path)),
            "--device",
            "cpu",
            "--cases",
            "8:40",
            "--quick",
            "--out",
            str(out),
        ]
    )
    (case,) = json.loads(out.read_text())["cases"]
    steps = {row["step"]: row for row in case["steps"]}
    assert case["case"].startswith("batch=8 context=40") and case["stale"] == []
    assert case["watched_replays"] >= case["pairs"] >= 4  # a warm-up batch is checked, not kept
    assert (case["lead_cycles"], case["late_batches"], case["late_starts"]) == (0, 0, 0)  # host
    # at least one draw per pair and layer, each routed by the stock (the 32 anchor draws a
    # layer are the anchoring step's, counted there)
    routed = steps["their routing checked (floor_bytes)"]["calls"]
    assert routed >= case["layers"] * case["watched_replays"]
    assert steps["timed work anchored (32 draws a layer)"]["calls"] == 1
    eager = steps["candidate's eager calls (and near-tie rows, if inexact)"]["calls"]
    assert eager == case["watched_replays"]
    sampling = steps["sampling, all of it"]["s"]
    assert 0 < steps["timed pairs (events, poison, copies)"]["s"] <= sampling <= case["seconds"]
    # every step of measure_case ran and was seen where the engine calls it
    for label in ("layers built (weights, inputs, outputs)", "both paths compiled and captured"):
        assert steps[label]["calls"] >= 1 and steps[label]["s"] > 0
    assert steps["both paths compiled and captured"]["calls"] == 2  # stock and candidate
    assert steps["eager times"]["calls"] == 2 and steps["post-timing replay check"]["calls"] == 1
    assert steps["outputs poisoned"]["calls"] == 2 * case["watched_replays"]  # before each call
    rest = steps["no step (statistics, the rest)"]["s"]
    top = sum(row["s"] for row in case["steps"] if row["depth"] == 0)
    assert abs(top - case["seconds"]) < 1e-6 and 0 <= rest < case["seconds"]
