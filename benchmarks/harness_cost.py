"""Where the harness's time goes in one case: `engine.measure_case` under cProfile.

Timing every pair on inputs of its own (2026-12-07) took the H200 scope's full validate from
409 s (run 19) to 901 s (run 21), and 15 of its 72 cases to the 10 s sampling cap. Per pair the
harness now draws inputs until their routing does the timed work (the stock attention block per
draw), writes them, and after each batch runs the candidate's eager call on every pair's
inputs (one pair a batch is also held to the stock's timed result). This script runs the named
cases as a validate times them and prints, per case, the wall seconds of each of those steps
(cProfile's cumulative time, which on a GPU includes the waits for the device) and how often
each ran: which to make cheaper.

    python3 benchmarks/harness_cost.py scopes/kimi-k2-mla-moe-decode-h200.yaml --device cuda \\
        --cases 8:4096 64:8192 [--quick] [--seed N] [--out $OUT/harness_cost.json]

The correctness trials of a validate are not run (they do not change with the pairs' inputs);
the first case's seconds include compiling both paths.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path
from types import MappingProxyType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.evaluation.cases import Case
from harness.evaluation.engine import default_stop_rule, measure_case
from harness.evaluation.environment import REPO_ROOT, detect_host, fingerprint, git_sha
from harness.evaluation.loading import load_path
from scopes.manifest import load_manifest_file

# (module file, function): the steps of measure_case, in the order they run. Nested steps
# (indented) are part of the one above them.
STEPS = [
    ("timing.py", "build_layers", "layers built (weights, inputs, outputs)"),
    ("timing.py", "step_runners", "both paths compiled and captured"),
    ("timing.py", "pair_inputs", "timed work anchored (32 draws a layer)"),
    ("engine.py", "_bytes_moved", "bytes moved"),
    ("timing.py", "sample_interleaved", "sampling, all of it"),
    ("timing.py", "seeds_for_batch", "  draws kept for the pairs"),
    ("timing.py", "work", "    their routing checked (floor_bytes)"),
    ("timing.py", "draw", "    inputs drawn (every draw, also when written)"),
    ("timing.py", "write", "  pairs' inputs written"),
    ("timing.py", "timed_pairs", "  timed pairs (events, poison, copies)"),
    ("timing.py", "disagreements", "  timed replays checked after each batch"),
    ("timing.py", "yardstick", "    candidate's eager calls (and near-tie rows, if inexact)"),
    ("timing.py", "against_stock", "    near-tie rows for the check against the stock"),
    ("profiling.py", "profile_step", "kernel profiles"),
    ("timing.py", "wall_us_per_layer", "wall clock per layer"),
    ("timing.py", "eager_us", "eager times"),
    ("timing.py", "replay_mismatches", "post-timing replay check"),
]


def profile_case(path, case: Case, seed: int, stop, device: torch.device, manifest) -> dict:
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    performance, stale, timing = measure_case(
        path, case, seed, stop, 64 if device.type == "cuda" else 2, device, manifest
    )
    profiler.disable()
    total = time.perf_counter() - started
    return {
        "case": case.id,
        "seconds": total,
        "pairs": len(timing.stock_us),
        "layers": timing.layers,
        "stop_reason": timing.stop_reason,
        "watched_replays": timing.watched,
        "stock_us_median": performance.stock_us_median,
        "candidate_us_median": performance.candidate_us_median,
        "stale": stale,
        "steps": _steps(pstats.Stats(profiler)),
    }


def _steps(stats: pstats.Stats) -> list[dict]:
    """Each STEPS entry's calls and cumulative seconds, summed over the functions of that name
    in that file (closures of one name in one module, e.g. `work`, count together)."""
    rows = []
    for filename, name, label in STEPS:
        calls, seconds = 0, 0.0
        for (file, _, function), (_, ncalls, _, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
            if function == name and file.endswith(filename):
                calls += ncalls
                seconds += cumtime
        rows.append({"step": label.strip(), "depth": _depth(label), "calls": calls, "s": seconds})
    return rows


def _depth(label: str) -> int:
    return (len(label) - len(label.lstrip(" "))) // 2


def print_table(result: dict) -> None:
    print(
        f"\n{result['case']}: {result['seconds']:.1f} s, {result['pairs']} pairs, "
        f"{result['layers']} layers ({result['stop_reason']})"
    )
    print("| step | calls | s | share |\n|---|---|---|---|")
    for row in result["steps"]:
        share = row["s"] / result["seconds"] if result["seconds"] else 0.0
        name = ". " * row["depth"] + row["step"]
        print(f"| {name} | {row['calls']} | {row['s']:.2f} | {share:.0%} |")


def parse_case(text: str) -> tuple[int, int | None]:
    batch, _, context = text.partition(":")
    return int(batch), int(context) if context else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scope", type=Path)
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--cases", nargs="+", required=True, help="BATCH:CONTEXT ...")
    parser.add_argument("--quick", action="store_true", help="the quick validate's stop rule")
    parser.add_argument("--seed", type=int, default=20261207)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    manifest = load_manifest_file(args.scope)
    path = load_path(manifest)
    device = torch.device(args.device)
    host = detect_host(args.device)
    stop = default_stop_rule(device, args.quick)
    results = []
    for text in args.cases:
        batch, context = parse_case(text)
        case = Case(
            batch=batch,
            context=context,
            cp=1,
            gpus=1,
            dtype=manifest.model.dtype,
            gpu=host.gpu,
            config=MappingProxyType(dict(manifest.model.config)),
        )
        results.append(profile_case(path, case, args.seed, stop, device, manifest))
        print_table(results[-1])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "scope": str(args.scope),
            "quick": args.quick,
            "seed": args.seed,
            "environment": fingerprint(host, git_sha(REPO_ROOT)),
            "cases": results,
        }
        args.out.write_text(json.dumps(record, indent=1))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
