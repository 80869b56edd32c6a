"""What a chain of dependent kernels costs in a CUDA graph when they move (almost) nothing.

The batch-1 target of the MLA+MoE decode layer (70% of the HBM floor, docs/mla_moe_notes.md)
leaves little room for fixed costs: at batch 1 the floor is ~40 µs, so every kernel boundary
counts. This measures that cost directly. A graph holds N launches of one tiny Triton kernel,
each reading the value the previous one wrote (a true dependency), with G programs each (1, and
one per SM as the layer's kernels have); its replay time over N is the cost of one dependent
kernel. Repeated with programmatic dependent launch ("exit": released as programs exit;
"early": released at the start), and as one persistent kernel whose N phases are separated by
grid-wide barriers ("barrier": each program reads, after the barrier, what another program
wrote before it), which is what a persistent layer would pay per phase instead of a kernel
boundary. Then the bound it implies for a layer of K kernels:

    best time = floor bytes / read bandwidth + (K - 1) x per-kernel cost

    python3 benchmarks/launch_floor.py [--out pathgate-out/benchmarks/launch_floor.json]

Prints a table last and writes JSON. Needs a CUDA GPU (sm_90 for the PDL rows).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.mla_moe_device_check import Target, bandwidths
from harness.evaluation.cases import Case
from harness.evaluation.stats import median
from harness.evaluation.timing import timed_pairs
from kernels.mla_moe_decode.problem import Problem
from kernels.mla_moe_decode.triton_common import wait_for_previous_kernel

CHAIN_LENGTHS = (1, 8, 16, 32)
LAYER_KERNELS = (14, 8, 4)  # the fused layer now; what fewer kernels would allow
MODES = {"off": 0, "exit": 1, "early": 2}
PAIRS = 30


@triton.jit
def grid_barrier(counter_ptr, arrivals):
    """Wait until `arrivals` programs in all have called this since the counter was zeroed: a
    release add of one, then acquire reads until the count is there. The bar.sync before it
    makes this program's stores part of what the release publishes. Every program of the grid
    must be resident at once, or the first ones spin forever: launch at most one per SM."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while arrived < arrivals:
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _phases_kernel(buffers_ptr, counter_ptr, PHASES: tl.constexpr):
    """PHASES dependent steps in one launch: in each, program p adds one to what program p + 1
    stored in the previous step (the other half of `buffers`), after a grid barrier."""
    program, programs = tl.program_id(0), tl.num_programs(0)
    for phase in range(PHASES):
        src = buffers_ptr + (phase % 2) * programs
        dst = buffers_ptr + ((phase + 1) % 2) * programs
        value = tl.load(src + (program + 1) % programs, volatile=True)
        tl.store(dst + program, value + 1.0)
        grid_barrier(counter_ptr, (phase + 1) * programs)


def phases_graph(length: int, programs: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A graph of one persistent launch of `length` phases (the counter zeroed before it);
    returns it with the buffers, whose live half holds `length` everywhere after a replay."""
    buffers = torch.zeros(2, programs, device="cuda")
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)

    def run() -> None:
        buffers.zero_()
        counter.zero_()
        _phases_kernel[(programs,)](buffers, counter, PHASES=length)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph, buffers


def per_barrier_us(programs: int) -> dict[str, float]:
    """As per_kernel_us, for the phases of one persistent launch; fails if a replay's values
    show that some program read before its neighbour had written (a broken barrier)."""
    graphs = {n: phases_graph(n, programs) for n in CHAIN_LENGTHS}
    for n, (graph, buffers) in graphs.items():
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(buffers[n % 2], torch.full_like(buffers[0], float(n))):
            raise RuntimeError(
                f"grid barrier: {n} phases of {programs} programs gave the wrong sums"
            )
    return chain_slope({n: graph.replay for n, (graph, _) in graphs.items()})


@triton.jit
def _step_kernel(src_ptr, dst_ptr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    value = tl.load(src_ptr + tl.program_id(0))
    tl.store(dst_ptr + tl.program_id(0), value + 1.0)


def chain_graph(length: int, programs: int, level: int) -> torch.cuda.CUDAGraph:
    buffers = [torch.zeros(programs, device="cuda") for _ in range(2)]
    launch = {"launch_pdl": True} if level else {}

    def run() -> None:
        for i in range(length):
            src, dst = buffers[i % 2], buffers[(i + 1) % 2]
            _step_kernel[(programs,)](src, dst, PDL=level, **launch)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def per_kernel_us(programs: int, level: int) -> dict[str, float]:
    graphs = {n: chain_graph(n, programs, level) for n in CHAIN_LENGTHS}
    return chain_slope({n: graph.replay for n, graph in graphs.items()})


def chain_slope(replays: dict[int, Callable[[], None]]) -> dict[str, float]:
    """Replay µs of the shortest and the longest chain, timed in alternating pairs, and the
    slope between them: the cost one more dependent step adds."""
    short, long = CHAIN_LENGTHS[0], CHAIN_LENGTHS[-1]
    pairs = timed_pairs(replays[long], replays[short], PAIRS, torch.device("cuda"))
    long_us, short_us = median([a for a, _ in pairs]), median([b for _, b in pairs])
    return {
        f"chain_{short}_us": short_us,
        f"chain_{long}_us": long_us,
        "per_kernel_us": (long_us - short_us) / (long - short),
    }


def layer_bounds(per_kernel: float, read_bw: float) -> list[dict[str, float]]:
    """The best floor fraction a K-kernel layer can reach at batch 1, per context."""
    problem = Problem({})
    rows = []
    for context in (1024, 8192, 32768):
        case = Case(1, context, 1, 1, "bfloat16", "H200", config={})
        floor_us = 1e6 * problem.bytes_moved(case) / read_bw
        for kernels in LAYER_KERNELS:
            best = floor_us + (kernels - 1) * per_kernel
            rows.append(
                {"context": context, "kernels": kernels, "floor_us": floor_us,
                 "best_us": best, "best_fraction": floor_us / best}
            )  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("pathgate-out/benchmarks/launch_floor.json")
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    pdl = torch.cuda.get_device_capability()[0] >= 9
    chains = []
    for programs in (1, sm_count):
        for mode, level in MODES.items():
            if level and not pdl:
                continue
            row = {"programs": programs, "mode": mode, **per_kernel_us(programs, level)}
            chains.append(row)
            print(row, flush=True)
        row = {"programs": programs, "mode": "barrier", **per_barrier_us(programs)}
        chains.append(row)
        print(row, flush=True)
    _, read_bw = bandwidths(Target(torch.device("cuda"), small=False))
    plain = next(r for r in chains if r["programs"] == sm_count and r["mode"] == "off")
    bounds = layer_bounds(plain["per_kernel_us"], read_bw)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "read_bytes_per_s": read_bw,
        "chains": chains,
        "batch_1_bounds": bounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"read bandwidth {read_bw / 1e12:.3f} TB/s; wrote {args.out}")
    print("\n| programs | mode | µs per dependent kernel (barrier: per phase) |\n|---|---|---|")
    for row in chains:
        print(f"| {row['programs']} | {row['mode']} | {row['per_kernel_us']:.2f} |")
    print(
        "\n| context | kernels | floor µs | best µs | best floor fraction |\n|---|---|---|---|---|"
    )
    for b in bounds:
        print(
            f"| {b['context']} | {b['kernels']} | {b['floor_us']:.1f} | {b['best_us']:.1f} "
            f"| {b['best_fraction']:.2f} |"
        )


if __name__ == "__main__":
    main()
