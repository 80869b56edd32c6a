"""Timing fidelity of pathgate's timer, on a GPU.

(a) A/A: the same path in both arms, repeated: the speedup's 95% CI must contain 1.0 in >= 95%
    of repetitions (a false "faster" or "slower" in at most 1 of 20).
(b) A path made slower on purpose (it copies 3% or 5% more bytes, same kernel count) must be
    found slower (CI entirely below 1.0) in >= 95% of repetitions.
(c) CUDA-event time of a graph replay vs the CUPTI kernel time: the summed kernel durations
    (busy time) and the span from the first kernel's start to the last one's end.
Also: the bias between separate captures of the same graph (why the engine rotates captures).

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
from harness.evaluation.environment import REPO_ROOT, detect_host, fingerprint, git_sha
from harness.evaluation.profiling import profile_step
from harness.evaluation.stats import median, speedup_ci95
from harness.evaluation.timing import (
    LayerSet,
    capture_graph,
    sample_interleaved,
    speedup_interval,
)

Tensors = dict[str, torch.Tensor]
# The engine's quick rule (CI narrower than 1%, at least 30 pairs) with a 1 s cap per repetition
# instead of 3 s, so 40 repetitions of every experiment fit one device call.
BENCH_STOP = replace(default_stop_rule(torch.device("cuda"), quick=True), max_seconds=1.0)


def copy_layers(bytes_per_layer: int, layers: int, extra: float) -> LayerSet:
    """Each layer copies its own buffer; `extra` > 0 leaves room to copy that fraction more."""
    n = bytes_per_layer // 2
    size = int(n * (1 + extra)) + 4096
    args = []
    for _ in range(layers):
        src = torch.randn(size, device="cuda", dtype=torch.bfloat16)
        args.append(({}, {"src": src}, {"dst": torch.empty_like(src)}))
    return LayerSet(args, layers * 2 * size * 2)


def copy_path(elements: int) -> Callable[[Tensors, Tensors, Tensors], None]:
    # A multiple of 4096 elements keeps the copy kernel on its vectorized path in both arms.
    count = elements // 4096 * 4096

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


def captures(fn: Callable, layer_set: LayerSet) -> list[Callable[[], None]]:
    return [capture_graph(fn, layer_set).replay for _ in range(BENCH_STOP.captures)]


def repeat(
    stock_fn: Callable, candidate_fn: Callable, layer_set: LayerSet, reps: int
) -> list[dict]:
    """Each repetition captures fresh graphs for both arms and times them as the engine does."""
    runs = []
    for rep in range(reps):
        stock_steps, candidate_steps = (
            captures(stock_fn, layer_set),
            captures(candidate_fn, layer_set),
        )
        timing = sample_interleaved(
            stock_steps, candidate_steps, layer_set, torch.device("cuda"), BENCH_STOP, seed=rep
        )
        point, ci, spread = speedup_interval(timing, seed=rep)
        _, *sampling = speedup_ci95(timing.stock_us, timing.candidate_us, seed=rep)
        runs.append(
            {
                "speedup": point,
                "ci95": list(ci),
                "ci95_sampling": sampling,
                "capture_spread": spread,
                "pairs": len(timing.stock_us),
                "stock_us": median(timing.stock_us),
                "candidate_us": median(timing.candidate_us),
            }
        )
        torch.cuda.empty_cache()
    return runs


def aa_experiment(name: str, layer_set: LayerSet, fn: Callable, reps: int) -> dict:
    runs = repeat(fn, fn, layer_set, reps)
    covered = sum(r["ci95"][0] <= 1.0 <= r["ci95"][1] for r in runs)
    covered_sampling = sum(r["ci95_sampling"][0] <= 1.0 <= r["ci95_sampling"][1] for r in runs)
    return {
        "experiment": f"A/A {name}",
        "repetitions": reps,
        "hits": covered,
        "rate": covered / reps,
        "hits_sampling_ci_only": covered_sampling,
        "target": ">= 0.95 contain 1.0",
        "median_us": median([r["stock_us"] for r in runs]),
        "runs": runs,
    }


def slower_experiment(mib: int, layers: int, slower: float, reps: int) -> dict:
    layer_set = copy_layers(mib * 2**20, layers, slower)
    n = mib * 2**20 // 2
    runs = repeat(copy_path(n), copy_path(int(n * (1 + slower))), layer_set, reps)
    detected = sum(r["ci95"][1] < 1.0 for r in runs)
    return {
        "experiment": f"{slower:.0%} more bytes copied, {mib} MiB/layer",
        "repetitions": reps,
        "hits": detected,
        "rate": detected / reps,
        "target": ">= 0.95 detected slower",
        "median_us": median([r["stock_us"] for r in runs]),
        "median_speedup": median([r["speedup"] for r in runs]),
        "runs": runs,
    }


def capture_bias(name: str, layer_set: LayerSet, fn: Callable, count: int = 6) -> dict:
    """Per-capture medians of `count` captures of the same path, against the first capture."""
    graphs = [capture_graph(fn, layer_set).replay for _ in range(count)]
    ratios = []
    for graph in graphs:
        timing = sample_interleaved(
            [graphs[0]],
            [graph],
            layer_set,
            torch.device("cuda"),
            replace(BENCH_STOP, captures=1),
            0,
        )
        ratios.append(median(timing.stock_us) / median(timing.candidate_us))
    return {"experiment": f"capture bias {name}", "ratios_vs_first_capture": ratios}


def event_vs_cupti(name: str, layer_set: LayerSet, fn: Callable) -> dict:
    step = capture_graph(fn, layer_set).replay
    layers = len(layer_set.args)
    stop = replace(BENCH_STOP, captures=1)
    timing = sample_interleaved([step], [step], layer_set, torch.device("cuda"), stop, seed=0)
    event_us = median(timing.stock_us)
    profile = profile_step(step, layers, torch.device("cuda"))
    return {
        "experiment": f"event vs CUPTI {name}",
        "event_us_per_layer": event_us,
        "cupti_busy_us_per_layer": profile.kernel_us_per_layer,
        "cupti_span_us_per_layer": profile.span_us_per_layer,
        "kernels_per_layer": profile.kernels_per_layer,
        "busy_gap": profile.kernel_us_per_layer / event_us - 1,
        "span_gap": profile.span_us_per_layer / event_us - 1,
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
            "copy 8 MiB x 16 layers", copy_layers(8 * mib, 16, 0.0), copy_path(4 * mib), reps
        )
    )
    for batch in (1, 64):
        layer_set, fn = rmsnorm_layers(batch, 64)
        results.append(capture_bias(f"stock add+RMSNorm batch {batch}", layer_set, fn))
        results.append(
            aa_experiment(f"stock add+RMSNorm batch {batch} x 64 layers", layer_set, fn, reps)
        )
    for slower in (0.03, 0.05):
        results.append(slower_experiment(32, 8, slower, reps))
    for size in (2, 8, 32):
        results.append(
            event_vs_cupti(
                f"copy {size} MiB x 16 layers",
                copy_layers(size * mib, 16, 0.0),
                copy_path(size * mib // 2),
            )
        )
    for batch in (1, 64, 512):
        layer_set, fn = rmsnorm_layers(batch, 64)
        results.append(event_vs_cupti(f"stock add+RMSNorm batch {batch}", layer_set, fn))
    report = {
        "device": torch.cuda.get_device_name(0),
        "environment": fingerprint(detect_host("cuda"), git_sha(REPO_ROOT)),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\ntiming fidelity on {report['device']}")
    for r in results:
        if "rate" in r:
            extra = ""
            if "hits_sampling_ci_only" in r:
                extra = f"; sampling CI alone {r['hits_sampling_ci_only']}/{r['repetitions']}"
            result = f"{r['hits']}/{r['repetitions']} ({r['rate']:.0%}){extra}"
            print(f"{r['experiment']:48} {result:>44}  target {r['target']}")
        elif "ratios_vs_first_capture" in r:
            ratios = " ".join(f"{x:.4f}" for x in r["ratios_vs_first_capture"])
            print(f"{r['experiment']:48} {ratios:>44}")
        else:
            result = (
                f"event {r['event_us_per_layer']:.2f} busy {r['cupti_busy_us_per_layer']:.2f}"
                f" ({r['busy_gap']:+.1%}) span {r['cupti_span_us_per_layer']:.2f}"
                f" ({r['span_gap']:+.1%})"
            )
            print(f"{r['experiment']:48} {result:>44}")


if __name__ == "__main__":
    main()
