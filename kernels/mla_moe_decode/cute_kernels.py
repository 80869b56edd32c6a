"""CuTe DSL kernel of the fused MLA+MoE decode layer: the input residual add + RMSNorm.

    residual_out = bf16(x + residual)
    out          = bf16((x + residual) * rsqrt(mean((x + residual)^2) + eps) * weight)

The sum and the statistics are fp32, and each output is rounded once, as the compiled stock path
rounds inside its Inductor kernel (eager PyTorch also rounds the normalized value before the
weight; see ROUNDING in triton_common.py).

Layout: one CTA per token row, THREADS threads. The row (D = 7168 bf16 on the real shard) is cut
into 128-bit vectors of 8 elements; thread t owns vectors t, t + THREADS, t + 2 THREADS, ...
(REPS of them), so one repetition of a warp reads 512 contiguous bytes with 16-byte loads
(coalesced LDG.128), and D = THREADS * 8 * REPS exactly (7168 = 128 * 8 * 7): no predicates.
Reduction of the sum of squares: per thread in registers, a butterfly shuffle across the warp,
one value per warp through shared memory (every lane stores it: no divergent branch before the
barrier), then every thread adds the warps' values in the same
order (identical bits in every thread, no second barrier, deterministic).

Compiled once per hidden size (the batch is a runtime argument) and launched with raw pointers on
the current torch stream, so a CUDA graph can capture it: after the first call there is no
compilation, allocation or host synchronization. cutlass (nvidia-cutlass-dsl >= 4.2) is imported
only when the kernel is first built, so this module imports on a machine without it; the fused
path's CPU runs use the Triton stand-in (triton_norm.add_rmsnorm) instead.
"""

# No `from __future__ import annotations`: the DSL evaluates the kernels' annotations against
# the module globals, where cutlass (imported lazily, in _build) is not defined.
from collections.abc import Callable
from typing import Any

import torch

from kernels.mla_moe_decode.triton_common import pdl_options

VECTOR = 8  # bf16 elements per 128-bit access
WARP = 32

_launchers: dict[tuple[int, int], Callable[..., None]] = {}


class CuteUnavailableError(RuntimeError):
    """nvidia-cutlass-dsl cannot be imported: the fused path cannot run its CuTe DSL kernel."""


def threads_for(hidden: int) -> int:
    """Threads per CTA: the most (of 256, 128, 64, 32) whose 8-wide vectors tile the row exactly."""
    for threads in (256, 128, 64, WARP):
        if hidden % (threads * VECTOR) == 0:
            return threads
    raise ValueError(f"hidden {hidden} is not a multiple of {WARP * VECTOR}: no exact tiling")


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    residual_out: torch.Tensor,
    eps: float,
) -> None:
    """x, residual (B, D) bf16 contiguous, 16-byte aligned; weight (D,) bf16 -> out and
    residual_out (B, D) bf16. Builds and compiles the kernel on the first call for this D."""
    hidden = x.shape[1]
    pdl = int(pdl_options(x.device)["PDL"])
    launcher = _launchers.get((hidden, pdl))
    if launcher is None:
        launcher = _launchers[(hidden, pdl)] = _build(hidden, pdl=pdl)
    launcher(x, residual, weight, out, residual_out, eps)


def import_cute() -> tuple[Any, Any, Any, Any]:
    try:
        import cuda.bindings.driver as cuda_driver
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_ptr
    except ImportError as exc:
        raise CuteUnavailableError(
            "the fused MLA+MoE path runs its residual add + RMSNorm as a CuTe DSL kernel on the "
            f"GPU and cannot import it ({exc}); install nvidia-cutlass-dsl>=4.2 (pathgate[gpu])"
        ) from exc
    return cuda_driver, cutlass, cute, make_ptr


def _build(hidden: int, threads: int | None = None, pdl: int = 0) -> Callable[..., None]:
    """Define, compile and wrap the kernel for rows of `hidden` elements (`threads` per CTA:
    threads_for(hidden) unless a probe asks for another exact tiling; `pdl`: its level of
    programmatic dependent launch, as wait_for_previous_kernel takes it)."""
    cuda_driver, cutlass, cute, make_ptr = import_cute()
    threads = threads or threads_for(hidden)
    if hidden % (threads * VECTOR):
        raise ValueError(f"{threads} threads of {VECTOR}-wide vectors do not tile {hidden}")
    warps = threads // WARP
    bf16, f32 = cutlass.BFloat16, cutlass.Float32

    @cute.kernel
    def kernel(
        m_x: cute.Tensor,  # (B, D)
        m_residual: cute.Tensor,  # (B, D)
        m_weight: cute.Tensor,  # (D,)
        m_out: cute.Tensor,  # (B, D)
        m_residual_out: cute.Tensor,  # (B, D)
        eps: cutlass.Float32,
    ):
        wait_for_previous_kernel(cute, pdl)
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), bf16, num_bits_per_copy=128)
        tiled_copy = cute.make_tiled_copy_tv(
            atom, cute.make_layout(threads), cute.make_layout(VECTOR)
        )  # tile of THREADS x 8 elements, thread-major vectors
        thr_copy = tiled_copy.get_slice(tidx)

        tile, coord = (1, hidden), (row, 0)  # this CTA's row of each (B, D) tensor: (D,)
        g_x = cute.local_tile(m_x, tiler=tile, coord=coord)[0, None]
        g_residual = cute.local_tile(m_residual, tiler=tile, coord=coord)[0, None]
        g_out = cute.local_tile(m_out, tiler=tile, coord=coord)[0, None]
        g_residual_out = cute.local_tile(m_residual_out, tiler=tile, coord=coord)[0, None]
        t_x = thr_copy.partition_S(g_x)  # (VECTOR, REPS)
        t_residual = thr_copy.partition_S(g_residual)
        t_weight = thr_copy.partition_S(m_weight)
        t_out = thr_copy.partition_D(g_out)
        t_residual_out = thr_copy.partition_D(g_residual_out)

        r_x = cute.make_fragment_like(t_x)  # registers, (VECTOR, REPS) bf16
        r_residual = cute.make_fragment_like(t_residual)
        r_weight = cute.make_fragment_like(t_weight)
        cute.copy(atom, t_x, r_x)
        cute.copy(atom, t_residual, r_residual)
        cute.copy(atom, t_weight, r_weight)

        summed = r_x.load().to(f32) + r_residual.load().to(f32)
        r_sum = cute.make_fragment_like(t_residual_out)
        r_sum.store(summed.to(bf16))
        cute.copy(atom, r_sum, t_residual_out)

        square_sum = (summed * summed).reduce(cute.ReductionOp.ADD, f32(0.0), 0)
        for step in cutlass.range_constexpr(5):  # butterfly: offsets 16, 8, 4, 2, 1
            square_sum = square_sum + cute.arch.shuffle_sync_bfly(square_sum, offset=16 >> step)
        smem = cutlass.utils.SmemAllocator()
        warp_sums = smem.allocate_tensor(f32, cute.make_layout(warps), byte_alignment=16)
        # Every lane stores its warp's (identical) sum: no lane-divergent branch before the
        # barrier. With `if lane == 0` the first H200 launch of 4 warps never finished: bar.sync
        # is warp-aligned, and a warp that has not reconverged may arrive at it twice.
        warp_sums[cute.arch.warp_idx()] = square_sum
        cute.arch.barrier()
        total = f32(0.0)
        for warp in cutlass.range_constexpr(warps):
            total = total + warp_sums[warp]
        rstd = cute.math.rsqrt(total / hidden + eps)

        r_out = cute.make_fragment_like(t_out)
        r_out.store((summed * rstd * r_weight.load().to(f32)).to(bf16))
        cute.copy(atom, r_out, t_out)

    @cute.jit
    def launch(
        x_ptr: cute.Pointer,
        residual_ptr: cute.Pointer,
        weight_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        residual_out_ptr: cute.Pointer,
        batch: cutlass.Int32,
        eps: cutlass.Float32,
        stream: cuda_driver.CUstream,
    ):
        rows = cute.make_layout((batch, hidden), stride=(hidden, 1))
        kernel(
            cute.make_tensor(x_ptr, rows),
            cute.make_tensor(residual_ptr, rows),
            cute.make_tensor(weight_ptr, cute.make_layout(hidden)),
            cute.make_tensor(out_ptr, rows),
            cute.make_tensor(residual_out_ptr, rows),
            eps,
        ).launch(grid=[batch, 1, 1], block=[threads, 1, 1], stream=stream, use_pdl=pdl > 0)

    def pointer(address: int) -> Any:
        return make_ptr(bf16, address, cute.AddressSpace.gmem, assumed_align=16)

    compiled = cute.compile(
        launch,
        *(pointer(16) for _ in range(5)),
        cutlass.Int32(1),
        f32(1e-6),
        current_stream(cuda_driver),
    )

    def run(
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        out: torch.Tensor,
        residual_out: torch.Tensor,
        eps: float,
    ) -> None:
        tensors = (x, residual, weight, out, residual_out)
        compiled(
            *(pointer(t.data_ptr()) for t in tensors),
            cutlass.Int32(x.shape[0]),
            f32(eps),
            current_stream(cuda_driver),
        )

    return run


def wait_for_previous_kernel(cute: Any, pdl: int) -> None:
    """triton_common.wait_for_previous_kernel for a CuTe DSL kernel, traced at the start of
    its body (`pdl` is a Python int: the branches are decided while tracing). With the launch
    attribute (use_pdl) the kernel may start before the one before it has finished."""
    if pdl >= 2:
        cute.arch.griddepcontrol_launch_dependents()
    if pdl >= 1:
        cute.arch.griddepcontrol_wait()


def current_stream(cuda_driver: Any) -> Any:
    """The current torch stream as a CUstream: under graph capture, the capturing stream. The
    null stream where torch has no CUDA: a compile-only build (benchmarks/sm90_compile.py)."""
    if not torch.cuda.is_available():
        return cuda_driver.CUstream(0)
    return cuda_driver.CUstream(torch.cuda.current_stream().cuda_stream)
