"""The HBM bandwidth a case's floor divides by (`engine.hbm_fraction`).

The floor is the bytes a case must move over the fastest rate this GPU was measured to move
bytes at: the larger of a read stream's (bytes read per second) and a device-to-device copy's
(bytes read + written per second). The copy alone, which the engine used before 2026-12-04,
understates an H200's read rate: taken as the engine took it (no warm-up, no flush) it read
3.93-4.10 TB/s where a plain read stream in the same processes reached 4.42-4.49, so fractions
of a read-bound case were 9-13% too generous; a copy timed as below reads 5-6% under the read
(benchmarks/read_bandwidth.py, docs/benchmarks.md). Both are timed the same way: a warm-up, then
median of TIMED launches, each after reading a buffer larger than L2 (outside the timing), so
that no launch finds its data, or dirty lines to write back, in L2. The max is the strict
choice: a read-bound case is held to the read rate; a write-heavy one, which cannot beat the
copy, may look a little worse than it is.
"""

from __future__ import annotations

import functools
import statistics
import warnings
from collections.abc import Callable

import torch

READ_BYTES = 2**30  # < 2**31 bf16 elements: the kernel's int32 offsets hold
COPY_BYTES = 2**29  # copied, so twice that moved
FLUSH_BYTES = 2**28  # several times any current GPU's L2
STREAM_BLOCK = 8192  # bf16 elements a program sums per step
STREAM_PROGRAMS_PER_SM = 4  # with STREAM_BLOCK: the fastest of 8 shapes on the H200
WARM_UP, TIMED = 5, 12


@functools.cache
def stream_sum_kernel():  # type: ignore[no-untyped-def]
    """The read stream: each program sums blocks pid, pid + P, ... of `src` (bf16) in fp32, a
    flat read whose per-program sums let a caller check that every block was read once.
    Built on first use, not at import: the engine imports this module before it turns on
    Triton's interpreter for a CPU run, and triton.language imported before that breaks every
    interpreted kernel (its own jit helpers, tl.sum among them, stay compiled-mode)."""
    import triton
    import triton.language as tl

    @triton.jit
    def stream_sum(src_ptr, out_ptr, n_blocks, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        offsets = tl.arange(0, BLOCK)
        for block in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
            acc += tl.load(src_ptr + block * BLOCK + offsets).to(tl.float32)
        tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))

    return stream_sum


_fallbacks: dict[int, str] = {}  # device index -> why its floor is the copy alone


@functools.cache
def hbm_bytes_per_s(device_index: int = 0) -> float:
    """The floor's bandwidth on this GPU: max(read stream, copy), measured once per process.
    Where the read stream cannot run (no Triton for this GPU), the copy alone: a floor that is
    too generous, said so in the evidence (floor_warnings) rather than a failed evaluation."""
    copy = copy_bytes_per_s(device_index)
    try:
        return max(read_bytes_per_s(device_index), copy)
    except Exception as exc:  # any failure of the read stream: compile, launch or its check
        _fallbacks[device_index] = (
            f"HBM floor from the copy alone on cuda:{device_index}: the read stream failed "
            f"({str(exc)[:200]}); floor fractions are more generous than the read ceiling"
        )
        warnings.warn(_fallbacks[device_index], stacklevel=2)
        return copy


def floor_warnings() -> list[str]:
    """For the evidence: each GPU of this process whose floor fell back to the copy."""
    return [_fallbacks[index] for index in sorted(_fallbacks)]


def read_bytes_per_s(device_index: int = 0) -> float:
    """Bytes read per second by stream_sum_kernel over READ_BYTES."""
    device = torch.device("cuda", device_index)
    data = torch.ones(READ_BYTES // 2, dtype=torch.bfloat16, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = STREAM_PROGRAMS_PER_SM * sms
    sums = torch.empty(programs, device=device)
    n_blocks = data.numel() // STREAM_BLOCK
    kernel = stream_sum_kernel()

    def read() -> None:
        kernel[(programs,)](data, sums, n_blocks, BLOCK=STREAM_BLOCK, num_warps=8)

    seconds = _median_seconds(read, device)
    # all ones, exact in fp32: the last launch read as many blocks as there are (a count, not
    # a proof that none was read twice and another skipped; the CPU tests check the mapping)
    if sums.double().sum().item() != n_blocks * STREAM_BLOCK:
        raise RuntimeError("bandwidth: the read stream did not read every block once")
    return READ_BYTES / seconds


def copy_bytes_per_s(device_index: int = 0) -> float:
    """Bytes read + written per second by a torch copy of COPY_BYTES."""
    device = torch.device("cuda", device_index)
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / _median_seconds(lambda: dst.copy_(src), device)


def _median_seconds(call: Callable[[], object], device: torch.device) -> float:
    flush = torch.ones(FLUSH_BYTES // 2, dtype=torch.bfloat16, device=device)
    with torch.cuda.device(device):  # the events, the launches and the flush on one GPU
        times = [flushed_seconds(call, flush) for _ in range(WARM_UP + TIMED)]
    return statistics.median(times[WARM_UP:])


def flushed_seconds(call: Callable[[], object], flush: torch.Tensor) -> float:
    """One event-timed call on the current GPU, after reading `flush` (larger than L2, outside
    the timing): the call finds neither its data nor dirty lines to write back in L2."""
    flush.sum(dtype=torch.float32)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3
