"""The stock MLA+MoE decode layer (Kimi-K2 shard, TP8/EP8) on one GPU, against its HBM floor.

For each batch and context: `layers` layers with distinct weights (3 x ~4.3 GB at real size, far
past 2x L2) and their own inputs; eager stock and torch.compile'd stock each captured into one
CUDA graph of all layers, replayed alternately between CUDA events (the engine's `timed_pairs`);
kernels per layer from torch.profiler over one replay; the floor is the exact bytes this input
must move (`Problem.floor_bytes`: dense weights, the local experts its routing activates, one
KV-cache read, inputs and outputs) over the larger of the measured read and copy bandwidths,
as the engine's hbm_fraction uses since 2026-12-04 (the copy alone before: bytes read +
written per second). Prints a table; writes JSON.

    python3 benchmarks/mla_moe_stock.py                      # H200: 3 x 3 cases, ~5-10 min
    python3 benchmarks/mla_moe_stock.py --batches 1 --contexts 8192
    python3 benchmarks/mla_moe_stock.py --small              # CPU smoke run at test sizes

Memory at real size: weights 4.3 GB per layer; the KV cache 1152 bytes per token per sequence
(2.4 GB per layer at batch 64 x 32k); both graphs' intermediates are a few hundred MB.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.evaluation import bandwidth
from harness.evaluation.cases import Case
from harness.evaluation.profiling import profile_step
from harness.evaluation.stats import median
from harness.evaluation.timing import LayerSet, capture_graph, eager_us, run_layers, timed_pairs
from kernels.mla_moe_decode import stock
from kernels.mla_moe_decode.problem import Problem, activated_local_experts

Tensors = dict[str, torch.Tensor]
SMALL_CONFIG: dict[str, object] = {
    "hidden": 256,
    "heads": 2,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "experts": 8,
    "experts_total": 64,
    "top_k": 4,
    "moe_intermediate": 64,
    "shared_intermediate": 32,
}
PAIRS_PER_BATCH = 10  # replay pairs enqueued between two host syncs


@dataclass
class Row:
    batch: int
    context: int
    eager_graph_us: float  # per layer, eager op sequence replayed from a CUDA graph
    compiled_graph_us: float  # per layer, Inductor's kernels replayed from a CUDA graph
    eager_launch_us: float  # per layer, plain eager calls: host launch overhead included
    kernels_eager: float  # per layer
    kernels_compiled: float
    kernel_busy_eager_us: float  # summed kernel time per layer (CUPTI)
    kernel_busy_compiled_us: float
    floor_bytes: float  # mean over the layers (routing differs per layer)
    expected_bytes: int  # Problem.bytes_moved: uniform-routing expectation
    active_local_experts: list[int]  # per layer
    floor_us: float
    eager_floor_fraction: float  # floor_us / eager_graph_us
    compiled_floor_fraction: float
    top_kernels_eager: list[tuple[str, float]]  # (name, µs per layer), the costliest first
    top_kernels_compiled: list[tuple[str, float]]


def main() -> None:
    args = _parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    problem = Problem(SMALL_CONFIG if args.small else {})
    copy_bw, read_bw = _bandwidths(device)
    bandwidths = f"copy {copy_bw / 1e12:.3f} TB/s (read + write), floor {read_bw / 1e12:.3f} TB/s"
    print(f"{_device_name(device)}: {bandwidths}; {args.layers} layers", flush=True)
    weights = [problem.make_weights(_case(1, 1), seed, device) for seed in range(args.layers)]
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            case = _case(batch, context)
            rows.append(_measure(problem, weights, case, args.pairs, max(copy_bw, read_bw)))
            _print_row(rows[-1])
    _write_json(args.out, device, problem, args, copy_bw, read_bw, rows)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="test-sized layer (CPU smoke run)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when visible)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--contexts", type=int, nargs="+")
    parser.add_argument("--pairs", type=int, default=50, help="eager/compiled replay pairs")
    parser.add_argument(
        "--out", type=Path, default=Path("pathgate-out/benchmarks/mla_moe_stock.json")
    )
    args = parser.parse_args()
    args.batches = args.batches or ([1, 8] if args.small else [1, 8, 64])
    args.contexts = args.contexts or ([16, 128] if args.small else [1024, 8192, 32768])
    if args.small:
        args.pairs = min(args.pairs, 10)
    return args


def _case(batch: int, context: int) -> Case:
    return Case(batch, context, cp=1, gpus=1, dtype="bfloat16", gpu="bench")


def _measure(
    problem: Problem, weights: list[Tensors], case: Case, pairs: int, bytes_per_s: float
) -> Row:
    device = weights[0]["gate"].device
    print(f"batch {case.batch} context {case.context}: building inputs", flush=True)
    layer_set = _layer_set(problem, weights, case, device)
    layers = len(layer_set.args)
    # the step moves every layer's own floor: routing, hence active experts, differ per layer
    floor_bytes = sum(problem.floor_bytes(case, w, x) for w, x, _ in layer_set.args) / layers
    active = [len(activated_local_experts(problem.config, w, x)) for w, x, _ in layer_set.args]
    started = time.perf_counter()
    eager_step = _step(stock.forward, layer_set, device)
    compiled_step = _step(stock.forward_compiled, layer_set, device)
    print(f"  captured both in {time.perf_counter() - started:.0f} s", flush=True)
    eager, compiled = _sample(eager_step, compiled_step, pairs, device)
    eager_us_layer, compiled_us_layer = median(eager) / layers, median(compiled) / layers
    floor_us = 1e6 * floor_bytes / bytes_per_s
    row = Row(
        batch=case.batch,
        context=case.context or 0,
        eager_graph_us=eager_us_layer,
        compiled_graph_us=compiled_us_layer,
        eager_launch_us=eager_us(stock.forward, layer_set, device),
        **_kernel_fields(eager_step, compiled_step, layers, device),
        floor_bytes=floor_bytes,
        expected_bytes=problem.bytes_moved(case),
        active_local_experts=active,
        floor_us=floor_us,
        eager_floor_fraction=floor_us / eager_us_layer,
        compiled_floor_fraction=floor_us / compiled_us_layer,
    )
    del layer_set, eager_step, compiled_step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _kernel_fields(
    eager_step: Callable[[], None],
    compiled_step: Callable[[], None],
    layers: int,
    device: torch.device,
) -> dict[str, Any]:
    eager, compiled = (
        profile_step(eager_step, layers, device),
        profile_step(compiled_step, layers, device),
    )
    return {
        "kernels_eager": eager.kernels_per_layer,
        "kernels_compiled": compiled.kernels_per_layer,
        "kernel_busy_eager_us": eager.kernel_us_per_layer,
        "kernel_busy_compiled_us": compiled.kernel_us_per_layer,
        "top_kernels_eager": _top_kernels(eager_step, layers, device),
        "top_kernels_compiled": _top_kernels(compiled_step, layers, device),
    }


def _layer_set(
    problem: Problem, weights: list[Tensors], case: Case, device: torch.device
) -> LayerSet:
    args = [
        (w, problem.make_inputs(case, 1000 + layer, device), problem.make_outputs(case, device))
        for layer, w in enumerate(weights)
    ]
    size = sum(t.nbytes for group in args for tensors in group for t in tensors.values())
    return LayerSet(args, size)


def _step(
    fn: Callable[[Tensors, Tensors, Tensors], None], layer_set: LayerSet, device: torch.device
) -> Callable[[], None]:
    """One call that runs every layer: a graph replay on CUDA, eager calls on CPU."""
    if device.type == "cuda":
        return capture_graph(fn, layer_set).replay
    run_layers(fn, layer_set)  # compile and warm up outside the timing
    return lambda: run_layers(fn, layer_set)


def _sample(
    eager: Callable[[], None], compiled: Callable[[], None], pairs: int, device: torch.device
) -> tuple[list[float], list[float]]:
    """Per-step µs of each arm, alternating A B, B A, ... as the engine times."""
    eager_us_list: list[float] = []
    compiled_us_list: list[float] = []
    while len(eager_us_list) < pairs:
        for eager_us_step, compiled_us_step in timed_pairs(
            eager, compiled, PAIRS_PER_BATCH, device
        ):
            eager_us_list.append(eager_us_step)
            compiled_us_list.append(compiled_us_step)
    return eager_us_list, compiled_us_list


def _top_kernels(
    step: Callable[[], None], layers: int, device: torch.device, count: int = 8
) -> list[tuple[str, float]]:
    """GPU time per layer by kernel name over one step: where the time goes (CUDA only)."""
    if device.type != "cuda":
        return []
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    per_name: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            per_name[event.name[:120]] += event.time_range.elapsed_us() / layers
    return sorted(per_name.items(), key=lambda item: -item[1])[:count]


def _bandwidths(device: torch.device) -> tuple[float, float]:
    """(copy bytes read + written per second, the floor's bytes per second): on the GPU the
    engine's copy reading and its floor bandwidth (harness.evaluation.bandwidth), on the CPU a
    copy and a sum."""
    if device.type == "cuda":
        index = device.index or 0
        return bandwidth.copy_bytes_per_s(index), bandwidth.hbm_bytes_per_s(index)
    src = torch.ones(2**24, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), device)
    return 2 * src.nbytes / copy_s, _read_bytes_per_s(device, 2**26)


def _read_bytes_per_s(device: torch.device, nbytes: int) -> float:
    data = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    return nbytes / _best_seconds(lambda: data.sum(dtype=torch.float32), device)


def _best_seconds(call: Callable[[], object], device: torch.device, repeats: int = 10) -> float:
    """Median seconds of `call` after two warm-ups."""
    times = []
    for _ in range(repeats + 2):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
    return median(times[2:])


HEADER = (
    "| batch | context | eager µs/layer | compiled µs/layer | kernels eager / compiled "
    "| local experts | floor µs | floor / eager | floor / compiled |"
)


def _print_row(row: Row) -> None:
    if not getattr(_print_row, "printed_header", False):
        print(HEADER + "\n" + "|---" * 9 + "|")
        _print_row.printed_header = True  # type: ignore[attr-defined]
    experts = "/".join(str(n) for n in row.active_local_experts)
    print(
        f"| {row.batch} | {row.context} | {row.eager_graph_us:.1f} | {row.compiled_graph_us:.1f} "
        f"| {row.kernels_eager:.0f} / {row.kernels_compiled:.0f} | {experts} "
        f"| {row.floor_us:.1f} | {row.eager_floor_fraction:.3f} "
        f"| {row.compiled_floor_fraction:.3f} |",
        flush=True,
    )


def _write_json(
    path: Path,
    device: torch.device,
    problem: Problem,
    args: argparse.Namespace,
    copy_bw: float,
    read_bw: float,
    rows: list[Row],
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "device": _device_name(device),
        "torch": torch.__version__,
        "is_gpu_evidence": device.type == "cuda",
        "config": asdict(problem.config),
        "layers": args.layers,
        "pairs": args.pairs,
        "copy_bytes_per_s": copy_bw,
        "read_bytes_per_s": read_bw,
        # read_bytes_per_s: on the GPU the engine's floor bandwidth (bandwidth.hbm_bytes_per_s)
        "floor_bandwidth": "max(copy_bytes_per_s, read_bytes_per_s)",
        "rows": [asdict(row) for row in rows],
    }
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    main()
