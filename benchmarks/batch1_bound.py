"""The best floor fraction a layer of K dependent kernels can reach at batch 1, and how often a
validate's batch-1 cases could all meet the issue's 0.70 with it; and, at every batch, how far
above the floor the fused path ran.

A layer of K plain-launched kernels in a CUDA graph takes at least its floor (the bytes its
routing draw needs, at the measured bandwidth) plus K - 1 kernel boundaries, each costing what
`launch_floor.py` measured for a dependent kernel that moves nothing:

    best fraction = floor / (floor + (K - 1) x per-kernel cost)

At batch 1 the floor depends mostly on how many of this GPU's experts the token chose: each one
is 88 MB, the rest of the layer about 68 MB plus the cache. This script reads

  - a launch_floor.json (per-kernel cost, plain and with programmatic dependent launch; and
    where the file has it, a persistent kernel's cost per phase between grid barriers), and
  - a validate's evidence (each batch-1 case's bytes, bandwidth, layers, measured fraction),

and prints, per batch-1 case, the bound for its own draw next to what the fused path reached;
then, from the routing draw (8 of the experts_total ids per token, `experts` of them local:
hypergeometric), the probability that a perfect K-kernel layer meets the target at each context
and at all of them in one validate; last, per batch, the fused path's µs above the floor and the
floor a case needs to meet the target with that much; and, at the batches of --chance (8 and 64
unless told), the fused path's own chance to meet its target at every context of a fresh
validate, from its measured µs above the floor and the routing draws of the evidence files
given (--evidence and --draws), with the cut in µs above the floor that a higher chance needs.
Nothing here runs on a GPU: every number comes from the measured files, the problem's byte
counts (Problem.layer_bytes) and any cost per step given with --step-us (say, what the cheapest
real kernel of the layer costs in its chain, from a profile).

    python3 benchmarks/batch1_bound.py \\
        --launch-floor docs/runs/2026-12-03-launch-floor/launch_floor.json \\
        --evidence docs/runs/2026-12-04-kimi-k2-h200-full-12/evidence.json.gz \\
        [--kernels 14 15 8] [--target 0.7] [--step-us 2.9]
        [--chance 8:0.70 64:0.85] [--draws docs/runs/*-kimi-k2-h200-full-*/evidence.json*]
        [--out pathgate-out/benchmarks/batch1_bound.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.evaluation.cases import Case
from kernels.mla_moe_decode.config import LayerConfig
from kernels.mla_moe_decode.problem import Problem

MODES = ("off", "exit")  # plain launches, and PDL released as programs exit (launch_floor.py)
# a persistent kernel's phases between grid barriers (launch_floor.py since 2026-12-04): used
# where the file has it, the cost of one phase standing for one kernel boundary
OPTIONAL_MODES = ("barrier",)


def per_kernel_costs(launch_floor: dict[str, Any]) -> dict[str, float]:
    """µs per dependent kernel by launch mode, from the widest chains (one program per SM, as
    the layer's kernels have). Each of MODES must be there exactly once, each of
    OPTIONAL_MODES at most once."""
    widest = max(row["programs"] for row in launch_floor["chains"])
    costs: dict[str, float] = {}
    for row in launch_floor["chains"]:
        if row["programs"] != widest or row["mode"] not in MODES + OPTIONAL_MODES:
            continue
        if row["mode"] in costs:
            raise ValueError(f"launch floor: two {row['mode']!r} chains of {widest} programs")
        costs[row["mode"]] = row["per_kernel_us"]
    missing = [mode for mode in MODES if mode not in costs]
    if missing:
        raise ValueError(f"launch floor: no {', '.join(missing)} chain of {widest} programs")
    return costs


def best_fraction(floor_us: float, kernels: int, per_kernel_us: float) -> float:
    return floor_us / (floor_us + (kernels - 1) * per_kernel_us)


def local_expert_pmf(c: LayerConfig) -> list[float]:
    """P(n of this GPU's experts among one token's top_k distinct ids), n = 0..top_k, for
    uniformly spread, ungrouped routing: hypergeometric (experts_total ids, experts local, top_k
    draws). Grouped routing (n_group > 1) limits which ids can be drawn together: not modelled."""
    if c.n_group > 1:
        raise ValueError(f"grouped routing (n_group {c.n_group}) is not modelled")
    remote = c.experts_total - c.experts
    total = math.comb(c.experts_total, c.top_k)
    ways = [math.comb(c.experts, n) * math.comb(remote, c.top_k - n) for n in range(c.top_k + 1)]
    return [w / total for w in ways]


def case_pmf(c: LayerConfig, layers: int) -> list[float]:
    """P(n local experts over a case's `layers` layers, each drawn independently)."""
    one = local_expert_pmf(c)
    pmf = [1.0]
    for _ in range(layers):
        pmf = [
            sum(pmf[i] * one[n - i] for i in range(len(pmf)) if 0 <= n - i < len(one))
            for n in range(len(pmf) + len(one) - 1)
        ]
    return pmf


def chance_to_meet(
    problem: Problem,
    case: Case,
    layers: int,
    bytes_per_s: float,
    kernels: int,
    per_kernel_us: float,
    target: float,
) -> float:
    """P(a perfect `kernels`-kernel layer reaches `target` of the floor on a case of `layers`
    layers): the case's floor is the layers' mean, so it needs enough local experts in total."""
    pmf = case_pmf(problem.config, layers)
    met = 0.0
    for n, p in enumerate(pmf):
        floor_us = 1e6 * problem.layer_bytes(case, n / layers) / bytes_per_s
        if best_fraction(floor_us, kernels, per_kernel_us) >= target:
            met += p
    return met


def batch1_rows(evidence: dict[str, Any]) -> list[dict[str, Any]]:
    """The single-GPU batch-1 cases; every one must carry its timing, or the chance at all
    contexts would silently be a product over fewer of them."""
    rows = [
        {
            "context": case["context"],
            "origin": case["origin"],
            "layers": perf["layers"],
            "bytes_per_layer": perf["bytes_moved"],
            "bytes_per_s": perf["hbm_bytes_per_s"],
            "fused_us": perf["candidate_us_median"],
            "fused_fraction": perf["candidate_hbm_fraction"],
        }
        for case, perf in _single_gpu_cases(evidence, 1)
    ]
    return sorted(rows, key=lambda r: r["context"])


def bounds(
    launch_floor: dict[str, Any],
    evidence: dict[str, Any],
    kernel_counts: list[int],
    target: float,
    step_costs: tuple[float, ...] = (),
) -> dict[str, Any]:
    """The tables below, for each launch mode of the launch floor and each of `step_costs`
    (µs per dependent step taken as given, e.g. what the cheapest real kernel of the layer
    costs in its chain: a mode named "<µs> us")."""
    problem = Problem(evidence["manifest"]["model"]["config"])
    c = problem.config
    costs = per_kernel_costs(launch_floor) | {f"{us:g} us": us for us in step_costs}
    rows = batch1_rows(evidence)
    if not rows:
        raise ValueError("the evidence has no single-GPU batch-1 case")
    per_expert = problem.layer_bytes(_case(1024), 1) - problem.layer_bytes(_case(1024), 0)
    for row in rows:
        case = _case(row["context"])
        floor_us = 1e6 * row["bytes_per_layer"] / row["bytes_per_s"]
        row["floor_us"] = floor_us
        row["local_experts_per_layer"] = (
            row["bytes_per_layer"] - problem.layer_bytes(case, 0)
        ) / per_expert
        row["best"] = {
            f"{k} {mode}": best_fraction(floor_us, k, cost)
            for k in kernel_counts
            for mode, cost in costs.items()
        }
        row["chance"] = {
            f"{k} {mode}": chance_to_meet(
                problem, case, row["layers"], row["bytes_per_s"], k, cost, target
            )
            for k in kernel_counts
            for mode, cost in costs.items()
        }
    keys = rows[0]["chance"]
    all_contexts = {key: math.prod(row["chance"][key] for row in rows) for key in keys}
    return {
        "target": target,
        "per_kernel_us": costs,
        "local_expert_pmf": local_expert_pmf(c),
        "expert_bytes": per_expert,
        "cases": rows,
        "chance_all_contexts": all_contexts,
        "launch_floor_device": launch_floor.get("device"),
        "time_above_floor": time_above_floor(evidence, target),
        "evidence_seed": evidence["run"]["seed"],
        "evidence_command": evidence["run"]["command"],
    }


def time_above_floor(evidence: dict[str, Any], target: float) -> list[dict[str, Any]]:
    """Per batch, the fused path's µs per layer above its case's floor (min, median, max over
    the contexts), and the floor a case needs for `target` at the median: floor >= above x
    target / (1 - target). Where this time moves little with the draw, a draw with few local
    experts (a small floor) is what misses the target."""
    above: dict[int, list[float]] = {}
    for case in evidence["cases"]:
        perf = case.get("performance") or {}
        if not perf.get("hbm_bytes_per_s") or not perf.get("bytes_moved"):
            continue
        floor_us = 1e6 * perf["bytes_moved"] / perf["hbm_bytes_per_s"]
        above.setdefault(case["batch"], []).append(perf["candidate_us_median"] - floor_us)
    rows = []
    for batch, values in sorted(above.items()):
        middle = statistics.median(values)
        rows.append(
            {
                "batch": batch,
                "above_min_us": min(values),
                "above_median_us": middle,
                "above_max_us": max(values),
                "floor_needed_us": middle * target / (1 - target),
            }
        )
    return rows


def _case(context: int, batch: int = 1, dtype: str = "bfloat16") -> Case:
    return Case(batch, context, 1, 1, dtype, "H200", config={})


# Above batch 1 the routing draw is not modelled but taken from the validates' own draws: the
# synthetic router puts a large batch's tokens on fewer distinct experts than independent
# uniform tokens would (at batch 64, 30-33 local experts per layer in runs 2-16 against 35.5),
# so a uniform model would overstate the floors there.
CHANCE_LEVELS = (0.5, 0.9, 0.99)


def drawn_local_experts(evidences: list[dict[str, Any]], batch: int) -> list[float]:
    """The local experts per layer (each case's mean over its layers) of every single-GPU case
    at `batch` in these evidences: the routing draws validates have made at that batch. A mean
    over 2 layers spreads less than one over 1, so every case must have timed as many."""
    draws, layer_counts = [], set()
    for evidence in evidences:
        problem = Problem(evidence["manifest"]["model"]["config"])
        for case, perf in _single_gpu_cases(evidence, batch, timed_only=True):
            draws.append(_local_experts(problem, case, perf["bytes_moved"]))
            layer_counts.add(perf["layers"])
    if len(layer_counts) > 1:
        raise ValueError(f"batch-{batch} draws over different layer counts: {layer_counts}")
    return draws


def fused_chance(
    evidence: dict[str, Any],
    draws: list[float],
    batch: int,
    target: float,
    draw_bytes_per_s: float | None = None,
) -> dict[str, Any]:
    """The chance that the fused path meets `target` of the floor at every context of `batch`
    in a validate with fresh routing draws (each as likely as one of `draws`), taking each
    context's µs above the floor as this evidence measured it (the fused layer's time above its
    floor moves little with the draw: "Time above the floor" in docs/benchmarks.md); and the
    cut in µs above the floor, the same at every context, that would raise that chance to each
    of CHANCE_LEVELS. Conditional on this evidence's machine and bandwidth reading (the floors'
    divisor), which are not drawn: a validate on another day reads another bandwidth.
    `draw_bytes_per_s`: the draws' floors divide by this instead (another machine's floor
    bandwidth), the µs above the floor staying this evidence's: what the same kernels would
    give on an HBM of that speed if their time above the floor stayed as it is (a model)."""
    if not draws:
        raise ValueError(f"no routing draws at batch {batch}")
    problem = Problem(evidence["manifest"]["model"]["config"])
    rows = []
    for case, perf in _single_gpu_cases(evidence, batch):
        bytes_per_s = perf["hbm_bytes_per_s"]
        floor_us = 1e6 * perf["bytes_moved"] / bytes_per_s
        context_case = _case(case["context"], batch, case["dtype"])
        rows.append(
            {
                "context": case["context"],
                "local_experts_per_layer": _local_experts(problem, case, perf["bytes_moved"]),
                "floor_us": floor_us,
                "fused_fraction": perf["candidate_hbm_fraction"],
                "above_us": perf["candidate_us_median"] - floor_us,
                "draw_floors_us": [
                    1e6 * problem.layer_bytes(context_case, n) / (draw_bytes_per_s or bytes_per_s)
                    for n in draws
                ],
            }
        )
    if not rows:
        raise ValueError(f"the evidence has no single-GPU batch-{batch} case")
    rows.sort(key=lambda row: row["context"])
    for row in rows:
        row["chance"] = _chance_at(row, 0.0, target)
    return {
        "batch": batch,
        "target": target,
        "draws": len(draws),
        "draw_bytes_per_s": draw_bytes_per_s,  # None: each case's own reading
        "draws_local_experts_per_layer": [min(draws), statistics.median(draws), max(draws)],
        "chance_all_contexts": math.prod(row["chance"] for row in rows),
        "cut_needed_us": {str(level): _cut_for(rows, level, target) for level in CHANCE_LEVELS},
        "cases": [{k: v for k, v in row.items() if k != "draw_floors_us"} for row in rows],
    }


def _single_gpu_cases(
    evidence: dict[str, Any], batch: int, timed_only: bool = False
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The single-GPU cases at `batch` with their performance records. Each must carry its
    floor's bytes and bandwidth (or a chance over all contexts would silently be a product over
    fewer of them), unless `timed_only`: then the others are left out."""
    pairs = []
    for case in evidence["cases"]:
        if case["batch"] != batch or case.get("cp", 1) != 1 or case.get("gpus", 1) != 1:
            continue
        perf = case.get("performance") or {}
        if not perf.get("hbm_bytes_per_s") or not perf.get("bytes_moved"):
            if timed_only:
                continue
            raise ValueError(f"{case['id']}: no floor bytes or bandwidth in the evidence")
        pairs.append((case, perf))
    return pairs


def _local_experts(problem: Problem, case: dict[str, Any], bytes_per_layer: float) -> float:
    context_case = _case(case["context"], case["batch"], case["dtype"])
    none = problem.layer_bytes(context_case, 0)
    return (bytes_per_layer - none) / (problem.layer_bytes(context_case, 1) - none)


def _chance_at(row: dict[str, Any], cut_us: float, target: float) -> float:
    """The share of the draws whose floor is large enough for `target` with `cut_us` less
    above it: floor >= above x target / (1 - target)."""
    needed = max(0.0, row["above_us"] - cut_us) * target / (1 - target)
    floors = row["draw_floors_us"]
    return sum(floor >= needed for floor in floors) / len(floors)


def _cut_for(rows: list[dict[str, Any]], level: float, target: float) -> float:
    """The least cut, in steps of 0.25 µs, at which all contexts together reach `level` (at
    the latest when nothing is left above any floor, where every draw passes)."""
    for step in range(max(0, math.ceil(4 * max(row["above_us"] for row in rows))) + 1):
        if math.prod(_chance_at(row, step / 4, target) for row in rows) >= level:
            return step / 4
    raise ValueError(f"chance {level} not reached even with nothing above the floor")


def print_tables(result: dict[str, Any]) -> None:
    costs = ", ".join(f"{m} {us:.2f} µs" for m, us in result["per_kernel_us"].items())
    pmf = ", ".join(f"{n}: {p:.3f}" for n, p in enumerate(result["local_expert_pmf"][:4]))
    print(f"per dependent kernel: {costs}; local experts per layer at batch 1: {pmf}, ...")
    keys = list(result["chance_all_contexts"])
    head = " | ".join(f"best {k}" for k in keys)
    print(f"\n| context | local experts / layer | floor µs | fused | {head} |")
    print("|---" * (4 + len(keys)) + "|")
    for row in result["cases"]:
        best = " | ".join(f"{row['best'][k]:.2f}" for k in keys)
        print(
            f"| {row['context']} | {row['local_experts_per_layer']:.1f} | {row['floor_us']:.1f} "
            f"| {row['fused_fraction']:.2f} | {best} |"
        )
    target = result["target"]
    print(
        f"\nP(a perfect layer reaches {target:.2f} of the floor), per context and at all of them:"
    )
    print(f"| context | {' | '.join(keys)} |")
    print("|---" * (1 + len(keys)) + "|")
    for row in result["cases"]:
        chances = " | ".join(f"{row['chance'][k]:.2f}" for k in keys)
        print(f"| {row['context']} | {chances} |")
    all_of = " | ".join(f"{result['chance_all_contexts'][k]:.2f}" for k in keys)
    print(f"| all | {all_of} |")
    print("\nFused µs per layer above the floor, by batch (min / median / max over contexts):")
    print(f"| batch | above the floor µs | floor needed for {target:.2f} at the median µs |")
    print("|---|---|---|")
    for row in result["time_above_floor"]:
        print(
            f"| {row['batch']} | {row['above_min_us']:.1f} / {row['above_median_us']:.1f} / "
            f"{row['above_max_us']:.1f} | {row['floor_needed_us']:.0f} |"
        )


def print_fused_chance(chance: dict[str, Any]) -> None:
    low, middle, high = chance["draws_local_experts_per_layer"]
    print(
        f"\nBatch {chance['batch']}: the fused path's chance to reach {chance['target']:.2f} of "
        f"the floor on a fresh draw, at this run's µs above the floor ({chance['draws']} "
        f"draws, local experts per layer {low:.1f} / {middle:.1f} / {high:.1f}):"
    )
    if chance["draw_bytes_per_s"]:
        print(
            f"(the draws' floors at {chance['draw_bytes_per_s'] / 1e12:.2f} TB/s, not this "
            "run's: a model of another machine, the floor column stays this run's)"
        )
    print("| context | local experts / layer | floor µs | fused | above the floor µs | chance |")
    print("|---|---|---|---|---|---|")
    for row in chance["cases"]:
        print(
            f"| {row['context']} | {row['local_experts_per_layer']:.1f} | {row['floor_us']:.1f} "
            f"| {row['fused_fraction']:.3f} | {row['above_us']:.1f} | {row['chance']:.2f} |"
        )
    print(f"| all | | | | | {chance['chance_all_contexts']:.2f} |")
    cuts = ", ".join(
        f"{float(level):.2f}: {cut:.2f} µs" for level, cut in chance["cut_needed_us"].items()
    )
    print(f"µs less above the floor at every context for a chance of {cuts}")


def _batch_and_target(pair: str) -> tuple[int, float]:
    """Parse "8:0.70" as (8, 0.7); a target must lie strictly between 0 and 1."""
    batch, target = pair.split(":")
    if not 0.0 < float(target) < 1.0:
        raise argparse.ArgumentTypeError(f"{pair}: the target must lie strictly between 0 and 1")
    return int(batch), float(target)


def _load(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--launch-floor", type=Path, required=True)
    parser.add_argument("--evidence", type=Path, required=True)
    parser.add_argument("--kernels", type=int, nargs="+", default=[14, 15, 8])
    parser.add_argument("--target", type=float, default=0.7)
    parser.add_argument(
        "--step-us",
        type=float,
        nargs="*",
        default=[],
        help="more costs per dependent step to bound with, in µs (beside the launch floor's)",
    )
    parser.add_argument(
        "--chance",
        nargs="*",
        type=_batch_and_target,
        default=[(8, 0.7), (64, 0.85)],
        help="BATCH:TARGET pairs: the fused path's own chance to meet TARGET at every context "
        "of BATCH in a fresh validate (fused_chance)",
    )
    parser.add_argument(
        "--draws",
        type=Path,
        nargs="*",
        default=[],
        help="more evidence files whose cases' routing draws the chance uses (besides --evidence)",
    )
    parser.add_argument(
        "--draw-bandwidth",
        type=float,
        default=None,
        help="TB/s: the draws' floors at another machine's floor bandwidth, the µs above the "
        "floor staying the evidence's (what these kernels would give there if that held)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("pathgate-out/benchmarks/batch1_bound.json")
    )
    args = parser.parse_args()
    launch_floor, evidence = _load(args.launch_floor), _load(args.evidence)
    result = bounds(launch_floor, evidence, args.kernels, args.target, tuple(args.step_us))
    draw_files: list[Path] = []  # each file once, however spelled; the evidence first
    seen: set[Path] = set()
    for path in [args.evidence, *args.draws]:
        if path.resolve() not in seen:
            seen.add(path.resolve())
            draw_files.append(path)
    evidences = [evidence, *(_load(path) for path in draw_files[1:])]
    result["draw_files"] = [str(path) for path in draw_files]
    result["fused_chance"] = []
    for batch, target in args.chance:
        if not _single_gpu_cases(evidence, batch, timed_only=True):
            print(f"(no batch-{batch} case in the evidence: no chance computed for it)")
            continue
        draws = drawn_local_experts(evidences, batch)
        draw_bw = args.draw_bandwidth * 1e12 if args.draw_bandwidth else None
        result["fused_chance"].append(fused_chance(evidence, draws, batch, target, draw_bw))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_tables(result)
    for chance in result["fused_chance"]:
        print_fused_chance(chance)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
