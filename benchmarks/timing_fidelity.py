"""Timing fidelity of pathgate's timer, on a GPU.

(a) A/A: the same path in both arms, repeated: the speedup's 95% CI must contain 1.0 in >= 95%
    of repetitions (a false "faster" or "slower" in at most 1 of 20).
(b) A path made slower on purpose (it copies 3% or 5% more bytes, same kernel count) must be
    found slower (CI entirely below 1.0) in >= 95% of repetitions.
(c) CUDA-event time of a graph replay vs the summed CUPTI kernel time: within 5%.

Each repetition is one `sample_interleaved` call with the engine's quick stop rule (as
`pathgate validate --quick` times a case) capped at 1 s. Prints a table; writes JSON to --out.

    python3 benchmarks/timing_fidelity.py --out $OUT/timing_fidelity.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.evaluation.engine import default_stop_rule
from harness.evaluation.environment import detect_host, fingerprint
from harness.evaluation.profiling import profile_step
from harness.evaluation.stats import median, speedup_ci95
from harness.evaluation.timing import LayerSet, capture_graph, sample_interleaved

Tensors = dict[str, torch.Tensor]
# The engine's quick rule (CI narrower than 1%, at least 30 pairs) with a 1 s cap per repetition
# instead of 3 s, so 40 repetitions of every experiment fit one device call.
BENCH_STOP = replace(default_stop_rule(torch.device("cuda"), quick=True), max_seconds=1.0)


def copy_layers(bytes_per_layer: int, layers: int, extra: float) -> LayerSet:
    """Each layer copies its own buffer; `extra` > 0 leaves room to copy that fraction more."""
    n = bytes_per_layer // 2
    size = int(n * (1 + extra)) + 1
    args = []
    for _ in range(layers):
        src = torch.randn(size, device="cuda", dtype=torch.bfloat16)
        args.append(({}, {"src": src}, {"dst": torch.empty_like(src)}))
    return LayerSet(args, layers * 2 * size * 2)


def copy_path(fraction: float, n: int) -> Callable[[Tensors, Tensors, Tensors], None]:
    count = int(n * fraction)

    def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
        out["dst"][:count].copy_(inputs["src"][:count])

    return forward


def rmsnorm_layers(batch: int, layers: int) -> tuple[LayerSet, Callable]:
    from harness.evaluation.cases import Case
    from kernels.fused_add_rmsnorm import stock
    from kernels.fused_add_rmsnorm.problem import Problem

    problem = Problem({"hidden": 4096})
    case = Case(batch=batch, context=None, cp=1, gpus=1, dtype="bfloat16", gpu="H200")
    device = torch.device("cuda")
    args = [
        (
            problem.make_weights(case, i, device),
            problem.make_inputs(case, i, device),
            problem.make_outputs(case, device),
        )
        for i in range(layers)
    ]
    return LayerSet(args, 0), stock.forward


def repeat(
    stock_step: Callable[[], None],
    candidate_step: Callable[[], None],
    layer_set: LayerSet,
    repetitions: int,
) -> list[dict]:
    stop = BENCH_STOP
    runs = []
    for rep in range(repetitions):
        timing = sample_interleaved(
            stock_step, candidate_step, layer_set, torch.device("cuda"), stop, seed=rep
        )
        point, low, high = speedup_ci95(timing.stock_us, timing.candidate_us, seed=rep)
        runs.append(
            {
                "speedup": point,
                "ci95": [low, high],
                "pairs": len(timing.stock_us),
                "stock_us": median(timing.stock_us),
                "candidate_us": median(timing.candidate_us),
            }
        )
    return runs


def aa_experiment(name: str, layer_set: LayerSet, fn: Callable, repetitions: int) -> dict:
    # Two separately captured graphs of the same path: the arms are identical work.
    a = capture_graph(fn, layer_set).replay
    b = capture_graph(fn, layer_set).replay
    runs = repeat(a, b, layer_set, repetitions)
    covered = sum(r["ci95"][0] <= 1.0 <= r["ci95"][1] for r in runs)
    return {
        "experiment": f"A/A {name}",
        "repetitions": repetitions,
        "hits": covered,
        "rate": covered / repetitions,
        "target": ">= 0.95 contain 1.0",
        "median_us": median([r["stock_us"] for r in runs]),
        "runs": runs,
    }


def slower_experiment(bytes_per_layer: int, layers: int, slower: float, repetitions: int) -> dict:
    layer_set = copy_layers(bytes_per_layer, layers, slower)
    n = bytes_per_layer // 2
    base = capture_graph(copy_path(1.0, n), layer_set).replay
    slow = capture_graph(copy_path(1.0 + slower, n), layer_set).replay
    runs = repeat(base, slow, layer_set, repetitions)
    detected = sum(r["ci95"][1] < 1.0 for r in runs)
    return {
        "experiment": f"{slower:.0%} slower copy, {bytes_per_layer >> 20} MiB/layer",
        "repetitions": repetitions,
        "hits": detected,
        "rate": detected / repetitions,
        "target": ">= 0.95 detected slower",
        "median_us": median([r["stock_us"] for r in runs]),
        "median_speedup": median([r["speedup"] for r in runs]),
        "runs": runs,
    }


def event_vs_cupti(name: str, layer_set: LayerSet, fn: Callable) -> dict:
    step = capture_graph(fn, layer_set).replay
    layers = len(layer_set.args)
    stop = BENCH_STOP
    timing = sample_interleaved(step, step, layer_set, torch.device("cuda"), stop, seed=0)
    event_us = median(timing.stock_us)
    profile = profile_step(step, layers, torch.device("cuda"))
    gap = profile.kernel_us_per_layer / event_us - 1
    return {
        "experiment": f"event vs CUPTI {name}",
        "event_us_per_layer": event_us,
        "cupti_kernel_us_per_layer": profile.kernel_us_per_layer,
        "kernels_per_layer": profile.kernels_per_layer,
        "relative_gap": gap,
        "within_5pct": abs(gap) <= 0.05,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("timing_fidelity.json"))
    parser.add_argument("--repetitions", type=int, default=40)
    args = parser.parse_args()
    reps = args.repetitions
    results = []
    mib = 2**20
    results.append(
        aa_experiment(
            "copy 8 MiB x 16 layers", copy_layers(8 * mib, 16, 0.0), copy_path(1.0, 4 * mib), reps
        )
    )
    for batch in (1, 64):
        layer_set, fn = rmsnorm_layers(batch, 64)
        results.append(
            aa_experiment(f"stock add+RMSNorm batch {batch} x 64 layers", layer_set, fn, reps)
        )
    for slower in (0.03, 0.05):
        results.append(slower_experiment(8 * mib, 16, slower, reps))
    for size in (2, 8, 32):
        results.append(
            event_vs_cupti(
                f"copy {size} MiB x 16 layers",
                copy_layers(size * mib, 16, 0.0),
                copy_path(1.0, size * mib // 2),
            )
        )
    for batch in (1, 64):
        layer_set, fn = rmsnorm_layers(batch, 64)
        results.append(event_vs_cupti(f"stock add+RMSNorm batch {batch}", layer_set, fn))
    report = {
        "device": torch.cuda.get_device_name(0),
        "environment": fingerprint(detect_host("cuda")),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\ntiming fidelity on {report['device']}")
    print(f"{'experiment':52} {'result':>22} {'target':>26}")
    for r in results:
        if "rate" in r:
            result = f"{r['hits']}/{r['repetitions']} ({r['rate']:.0%})"
            print(f"{r['experiment']:52} {result:>22} {r['target']:>26}")
        else:
            result = (
                f"{r['event_us_per_layer']:.2f} vs {r['cupti_kernel_us_per_layer']:.2f} us"
                f" ({r['relative_gap']:+.1%})"
            )
            print(f"{r['experiment']:52} {result:>22} {'within 5%':>26}")


if __name__ == "__main__":
    main()
