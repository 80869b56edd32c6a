"""How fast this GPU can read HBM, by method: is the floor's bandwidth the ceiling?

A case's floor fraction divides the bytes it must move by a measured bandwidth
(harness.evaluation.bandwidth). Until 2026-12-04 that was a device-to-device copy (bytes read
+ written per second), and the MLA+MoE layer's MoE kernels streamed at about that rate (4.0
TB/s at batch 8), so they looked "at the floor". This asks whether a read-only stream goes
faster than the copy (it does: the floor now takes the larger of the two), and whether the
MoE's access pattern (tiles of 64 weight rows x the hidden dim, a K step at a time, each step
one MMA against a 16-row token tile) costs anything against a flat stream:

- `copy (engine)`, `floor (engine)`: the engine's copy reading and floor bandwidth, as it
  takes them (bandwidth.copy_bytes_per_s, bandwidth.hbm_bytes_per_s);
- `copy`: the copy (512 MiB, read + written bytes), timed in the rounds;
- `sum`: a 1 GiB bf16 torch sum (the read bandwidth benchmarks used before);
- `stream`: the engine's read kernel (bandwidth.stream_sum_kernel) over 1 GiB, by programs /
  block / warps;
- `tiles`: the gate_up's pattern (pointer loads, software-pipelined), by programs / K step /
  stages;
- `tiles_packed`: the same with the weights stored so that each K step's tile is contiguous;
- `tiles_tma`: the same with the weight tiles loaded through a TMA tensor descriptor;
- `tiles_waves`: `tiles` over fewer tiles, one program each or persistent (WAVE_VARIANTS).

Each variant is compiled and checked (its kernel must read every byte it is credited with),
then timed once per round for ROUNDS rounds, every variant in each round, so that a drift of
the GPU's clocks moves them alike; a row reports the median and the slowest and fastest rounds.

    python3 benchmarks/read_bandwidth.py [--out pathgate-out/benchmarks/read_bandwidth.json]

Prints a table last and writes JSON. Needs a CUDA GPU (sm_90 for the TMA rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.evaluation.bandwidth import (
    FLUSH_BYTES,
    copy_bytes_per_s,
    flushed_seconds,
    hbm_bytes_per_s,
    stream_sum_kernel,
)
from kernels.mla_moe_decode.triton_common import mma

READ_BYTES = 2**30  # < 2**31 elements: int32 offsets hold
HIDDEN = 7168  # the layer's hidden dim: one weight row
TILE_ROWS = 64  # a gate_up program's weight rows (32 features x [gate, up])
TOKEN_ROWS = 16  # the MMA's least M: batch 8 padded
ROUNDS = 50  # each times every variant once (after its compile-and-check launch)

# (programs per SM, elements per block, warps)
STREAM_VARIANTS = [
    (2, 8192, 8),
    (3, 8192, 8),
    (4, 8192, 8),
    (6, 8192, 8),
    (8, 8192, 4),
    (4, 4096, 4),
    (8, 4096, 4),
    (4, 16384, 8),
]
# Waves: (tiles, programs), K steps of 128, 4 stages, 4 warps. The MoE's gate_up launches one
# program per work item, about 480 items of 64 rows at batch 8, of which 2-3 per SM fit at once
# (60-80 KB of shared memory each): a full wave and a partial one. Against whole
# waves and a persistent grid, this prices the partial wave.
WAVE_VARIANTS = [(480, 480), (396, 396), (792, 792), (480, 396), (1152, 396)]
# (programs per SM, K step, stages, warps): the plan at batch 8 is about (2, 128, 4, 4)
TILE_VARIANTS = [
    (2, 128, 4, 4),
    (1, 128, 4, 4),
    (3, 128, 4, 4),
    (2, 128, 6, 4),
    (2, 256, 3, 4),
    (2, 256, 4, 8),
    (1, 256, 6, 8),
    (2, 64, 8, 4),
]


@triton.jit
def _tiles_kernel(
    w,
    h_ptr,
    out_ptr,
    n_tiles,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    LAYOUT: tl.constexpr = "rows",
):
    """Each program takes tiles pid, pid + P, ...: (BLOCK_R rows of w) @ h.T over all of D, a
    K step at a time, as the MoE's gate_up kernel reads an expert's feature block. LAYOUT
    "rows": w points at the (R, D) matrix; "packed": at the same elements with each (tile, K
    step) block contiguous (pack_tiles), so a step reads one run of BLOCK_R x BLOCK_K elements;
    "tma": w is a TMA descriptor of the matrix with (BLOCK_R, BLOCK_K) blocks."""
    m, r = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_R)
    total = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for first in range(0, D, BLOCK_K):
            ks = first + tl.arange(0, BLOCK_K)
            h = tl.load(h_ptr + m[:, None] * D + ks[None, :])
            if LAYOUT == "tma":
                tile_k = w.load([tile * BLOCK_R, first])
            elif LAYOUT == "packed":
                block = w + (tile * (D // BLOCK_K) + first // BLOCK_K) * BLOCK_R * BLOCK_K
                tile_k = tl.load(block + r[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :])
            else:
                tile_k = tl.load(w + (tile * BLOCK_R + r)[:, None] * D + ks[None, :])
            acc = mma(h, tl.trans(tile_k), acc, DOT_F32)
        total += acc
    out_at = out_ptr + tl.program_id(0) * BLOCK_M * BLOCK_R + m[:, None] * BLOCK_R + r[None, :]
    tl.store(out_at, total)


def check_stream(sums: torch.Tensor, data: torch.Tensor) -> None:
    """The programs' sums add up to the data's: every block was read once (a block of 8192
    unit normals left out or read twice moves the total by about 90)."""
    torch.testing.assert_close(sums.double().sum(), data.double().sum(), rtol=0, atol=10.0)


def check_tiles(out: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor) -> None:
    """The programs' products add up to tokens @ (the sum of all tiles).T: every tile was
    read and multiplied once (one tile of unit normals more or less moves an entry by ~85)."""
    tiles = weights.double().view(-1, out.shape[2], weights.shape[1]).sum(0)
    expected = tokens.double() @ tiles.T
    torch.testing.assert_close(out.double().sum(0), expected, rtol=0, atol=5.0)


Runner = tuple[dict[str, object], Callable[[], object]]  # (the variant's fields, one launch)


def copy_runner() -> Runner:
    """The engine's copy reading's method (bandwidth.copy_bytes_per_s): 512 MiB copied, read +
    written bytes counted."""
    src = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    return {}, lambda: dst.copy_(src)


def sum_runner(data: torch.Tensor) -> Runner:
    return {}, lambda: data.sum(dtype=torch.float32)


def stream_runner(data: torch.Tensor, sms: int, per_sm: int, block: int, warps: int) -> Runner:
    programs = sms * per_sm
    out = torch.empty(programs, device=data.device)
    n_blocks = data.numel() // block

    def run() -> None:
        stream_sum_kernel()[(programs,)](data, out, n_blocks, BLOCK=block, num_warps=warps)

    run()
    check_stream(out, data)
    return {"programs": programs, "block": block, "warps": warps}, run


def pack_tiles(weights: torch.Tensor, tile_rows: int, k_step: int) -> torch.Tensor:
    """(R, D) -> the same elements with each (tile, K step) block contiguous, in tile-major,
    then K-step order: what _tiles_kernel reads with LAYOUT "packed"."""
    rows, hidden = weights.shape
    blocks = weights.view(rows // tile_rows, tile_rows, hidden // k_step, k_step)
    return blocks.permute(0, 2, 1, 3).contiguous()


def tile_runner(
    weights: torch.Tensor, sms: int, per_sm: int, k_step: int, stages: int, warps: int, layout: str
) -> Runner:
    return tiles_runner(weights, sms * per_sm, k_step, stages, warps, layout)


def wave_runner(weights: torch.Tensor, tiles: int, programs: int) -> Runner:
    fields, run = tiles_runner(weights[: tiles * TILE_ROWS], programs, 128, 4, 4, "rows")
    return {"tiles": tiles} | fields, run


def tiles_runner(
    weights: torch.Tensor, programs: int, k_step: int, stages: int, warps: int, layout: str
) -> Runner:
    tokens = torch.randn(TOKEN_ROWS, HIDDEN, device=weights.device, dtype=torch.bfloat16)
    out = torch.empty(programs, TOKEN_ROWS, TILE_ROWS, device=weights.device)
    n_tiles = weights.shape[0] // TILE_ROWS
    launch: dict[str, object] = {"num_warps": warps, "num_stages": stages, "LAYOUT": layout}
    source: object = weights
    if layout == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        source = TensorDescriptor.from_tensor(weights, [TILE_ROWS, k_step])
    elif layout == "packed":
        source = pack_tiles(weights, TILE_ROWS, k_step)

    def run() -> None:
        _tiles_kernel[(programs,)](
            source, tokens, out, n_tiles, HIDDEN, TOKEN_ROWS, TILE_ROWS, k_step, False, **launch
        )

    run()
    check_tiles(out, tokens, weights)
    return {"programs": programs, "k_step": k_step, "stages": stages, "warps": warps}, run


def build(method: str, nbytes: int, runner: Callable[..., Runner], *args: object) -> Runner:
    """A variant's row and launch, compiled and checked; a variant the compiler or the GPU
    refuses becomes a row with its error and no launch."""
    row: dict[str, object] = {"method": method, "bytes": nbytes}
    try:
        fields, run = runner(*args)
    except Exception as exc:
        row["error"] = traceback.format_exception(exc)[-1].strip()[-300:]
        print(row, flush=True)
        return row, lambda: None
    return row | fields, run


def time_in_rounds(variants: list[Runner], flush: torch.Tensor) -> None:
    """ROUNDS rounds, each timing every variant once, in order: a drift of the GPU's clocks or
    temperature then moves every variant alike. Each row gets its median and its slowest and
    fastest rounds' rates."""
    live = [(row, run) for row, run in variants if "error" not in row]
    seconds: list[list[float]] = [[] for _ in live]
    for _ in range(ROUNDS):
        for times, (_, run) in zip(seconds, live, strict=True):
            times.append(flushed_seconds(run, flush))
    for times, (row, _) in zip(seconds, live, strict=True):
        nbytes = float(row["bytes"])  # type: ignore[arg-type]
        row["seconds"] = statistics.median(times)
        row["tb_per_s"] = nbytes / row["seconds"] / 1e12
        row["tb_per_s_range"] = [nbytes / max(times) / 1e12, nbytes / min(times) / 1e12]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("pathgate-out/benchmarks/read_bandwidth.json")
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    data = torch.randn(READ_BYTES // 2, device="cuda", dtype=torch.bfloat16)
    rows_read = data.numel() // HIDDEN // TILE_ROWS * TILE_ROWS
    weights = data[: rows_read * HIDDEN].view(rows_read, HIDDEN)
    variants = [
        build("copy", 2 * 512 * 2**20, copy_runner),
        build("sum", READ_BYTES, sum_runner, data),
        *(build("stream", READ_BYTES, stream_runner, data, sms, *v) for v in STREAM_VARIANTS),
    ]
    for layout in ("rows", "packed", "tma"):
        name = "tiles" if layout == "rows" else f"tiles_{layout}"
        for v in TILE_VARIANTS:
            variants.append(build(name, weights.numel() * 2, tile_runner, weights, sms, *v, layout))
    for tiles, programs in WAVE_VARIANTS:
        nbytes = tiles * TILE_ROWS * HIDDEN * 2
        variants.append(build("tiles_waves", nbytes, wave_runner, weights, tiles, programs))
    flush = torch.ones(FLUSH_BYTES // 2, device="cuda", dtype=torch.bfloat16)
    time_in_rounds(variants, flush)
    rows = [row for row, _ in variants]
    # the engine's readings in this process, as it takes them: its copy, and the floor's
    # bandwidth (the larger of that copy and its read stream)
    rows[:0] = [
        {
            "method": "copy (engine)",
            "bytes": 2 * 512 * 2**20,
            "tb_per_s": copy_bytes_per_s() / 1e12,
        },
        {"method": "floor (engine)", "bytes": 0, "tb_per_s": hbm_bytes_per_s() / 1e12},
    ]
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}\n")
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    print("| method | programs | block / K step | stages | warps | TB/s (median) | rounds' range |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        shape = row.get("block", row.get("k_step", ""))
        if "tiles" in row:
            shape = f"{row['tiles']} tiles"
        if "tb_per_s_range" in row:
            low, high = row["tb_per_s_range"]
            rate, spread = f"{row['tb_per_s']:.3f}", f"{low:.2f}-{high:.2f}"
        elif "tb_per_s" in row:
            rate, spread = f"{row['tb_per_s']:.3f}", ""
        else:
            rate, spread = str(row.get("error", ""))[:60], ""
        print(
            f"| {row['method']} | {row.get('programs', '')} | {shape} | {row.get('stages', '')}"
            f" | {row.get('warps', '')} | {rate} | {spread} |"
        )


if __name__ == "__main__":
    main()
