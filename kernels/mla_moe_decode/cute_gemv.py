"""CuTe DSL split-K skinny GEMM (decode GEMV) for M <= 64 rows, on the tensor cores: the layer's
dense projections (qkv_a, q_b, o_proj, router), with triton_gemv.splitk_gemv's contract.

    parts[s, m, n] = sum over k in split s of x[m, k] * weight[n, k]        (fp32)

The same tiles as the Triton kernel (triton_gemv.gemv_blocks): CTA (column block, split) owns a
(block_m, block_n) output tile and one K range, streams its block_n weight rows once and the
matching slice of x (small, from L2). Four warps side by side along N, each a 16-column strip
of mma.sync m16n8k16 (bf16 in, fp32 accumulators), repeated down M when block_m > 16.

Pipeline: `stages` shared-memory buffers filled by cp.async (16-byte copies that bypass L1,
.cg: every weight byte is read once), stages - 1 K tiles in flight while the warps multiply
the oldest (ldmatrix to registers, then the MMAs). Shared-memory tiles are K-major in 8-row
atoms of 64 elements (128 bytes), XOR-swizzled so that the 8 row addresses of one ldmatrix fall
in different bank groups.

Rows of x past M are never read: the copy's predicate zero-fills their shared-memory rows (and
they are zeroed once before the first copy), so they add nothing and are not stored. N, K and
the K range of each split are whole tiles (the host checks; the real shard's shapes are); the
last split may hold fewer tiles than the others (k_tiles is not always a multiple of the
splits).

Summed mode (`summed_gemv`, triton_gemv.summed_gemv's contract: qkv_a with the input RMSNorm
folded in, fused.LayerPlan.input_norm_in_qkv_a): the residual's tiles are copied beside x's and
added to them in registers after ldmatrix, rounded once, before the MMAs; while the first tiles
land, each row of the split's K range is summed again, stored (bf16) and its squares reduced by
one CTA of the split (column block c takes rows c, c + blocks, ...).

Compiled once per (tiles, N, K, K per split, mode); the batch M is a runtime argument, so one
compiled kernel serves every batch of one block_m. Launched with raw pointers on the current
torch stream, so a CUDA graph captures it (see cute_kernels, which this module shares its
lazy import with). On a machine without nvidia-cutlass-dsl the module imports and
`splitk_gemv` raises CuteUnavailableError.
"""

# No `from __future__ import annotations`: the DSL evaluates the kernel's annotations against
# the module globals, where cutlass (imported lazily, cute_kernels.import_cute) is not defined.
from collections.abc import Callable
from typing import Any

import torch

from kernels.mla_moe_decode import cute_kernels
from kernels.mla_moe_decode.triton_common import pdl_options
from kernels.mla_moe_decode.triton_gemv import GemvBlocks, refuse_overlap

WARPS = 4
VECTOR = 8  # bf16 elements per 16-byte copy
MMA_SHAPE = (16, 8, 16)  # mma.sync m16n8k16

_launchers: dict[tuple[int, ...], Callable[..., None]] = {}


def supported(m: int, n: int, k: int, blocks: GemvBlocks) -> str | None:
    """Why this kernel cannot run these shapes and tiles (None: it can). The columns, the
    hidden size and each split's K range must be whole tiles; each warp takes 16 columns."""
    if blocks.block_m not in (16, 32, 64) or not 1 <= m <= blocks.block_m:
        return f"{m} rows in a tile of {blocks.block_m} (16, 32 or 64)"
    if blocks.block_n != WARPS * 16 or n % blocks.block_n:
        return f"{n} columns in blocks of {blocks.block_n} (must be {WARPS * 16})"
    if blocks.block_k % 64 or k % blocks.block_k or blocks.k_per_split % blocks.block_k:
        return f"K {k} in steps of {blocks.block_k} (a multiple of 64) by {blocks.k_per_split}"
    if -(-k // blocks.k_per_split) != blocks.splits:
        return f"K {k} is not {blocks.splits} splits of {blocks.k_per_split}"
    if blocks.num_stages < 2:
        return f"{blocks.num_stages} pipeline stages (at least 2)"
    return None


def splitk_gemv(x: torch.Tensor, weight: torch.Tensor, blocks: GemvBlocks) -> torch.Tensor:
    """x (M, K) bf16 contiguous, weight (N, K) bf16 contiguous -> partial sums (splits, M, N)
    fp32 whose sum over splits is x @ weight.T. Compiles on the first call for these tiles."""
    _check(x, weight, blocks)
    m, k = x.shape
    parts = torch.empty(blocks.splits, m, weight.shape[0], device=x.device, dtype=torch.float32)
    _launch(x.device, blocks, weight.shape[0], k, False)(x, weight, parts, x, x, parts)
    return parts


def summed_gemv(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    blocks: GemvBlocks,
    summed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """triton_gemv.summed_gemv's contract: the GEMV over bf16(x + residual), the sum written
    into `summed` (M, K) bf16 and returned with each split's sum of its squares (splits, M)."""
    _check(x, weight, blocks, residual, summed)
    refuse_overlap(summed, x, residual)
    m, k = x.shape
    parts = torch.empty(blocks.splits, m, weight.shape[0], device=x.device, dtype=torch.float32)
    squares = torch.empty(blocks.splits, m, device=x.device, dtype=torch.float32)
    _launch(x.device, blocks, weight.shape[0], k, True)(x, weight, parts, residual, summed, squares)
    return parts, squares


def _check(x: torch.Tensor, weight: torch.Tensor, blocks: GemvBlocks, *more: torch.Tensor) -> None:
    if not (x.is_cuda and weight.is_cuda):
        raise ValueError("CuTe DSL GEMV: runs on the GPU only (the Triton kernel stands in)")
    why = supported(x.shape[0], weight.shape[0], x.shape[1], blocks)
    if why is not None:
        raise ValueError(f"CuTe DSL GEMV: {why}")
    for name, t in (("x", x), ("weight", weight), *(("x's peers", t) for t in more)):
        if t.dtype != torch.bfloat16 or not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"CuTe DSL GEMV: {name} must be bf16, contiguous, 16-byte aligned")
    if any(t.shape != x.shape for t in more):
        raise ValueError("CuTe DSL GEMV: the residual and the sum must have x's shape")


def _launch(
    device: torch.device, blocks: GemvBlocks, n: int, k: int, summed: bool
) -> Callable[..., None]:
    pdl = int(pdl_options(device)["PDL"])
    key = (blocks.block_m, blocks.block_k, blocks.num_stages, n, k, blocks.k_per_split)
    launcher = _launchers.get((*key, summed, pdl))
    if launcher is None:
        compiled = compile_kernel(*key, summed=summed, pdl=pdl)
        launcher = _launchers[(*key, summed, pdl)] = _launcher(compiled)
    return launcher


def compile_kernel(
    block_m: int,
    block_k: int,
    stages: int,
    n: int,
    k: int,
    k_per_split: int,
    keep_ptx: bool = False,
    summed: bool = False,
    pdl: int = 0,
) -> Any:
    """The compiled kernel for these tiles and shapes (CuTe DSL's executor; with keep_ptx its
    `__ptx__` is the PTX, and CuTe DSL also writes it to CUTE_DSL_DUMP_DIR, by default the
    working directory); `summed`: summed_gemv's; `pdl`: the kernel's level of programmatic
    dependent launch (triton_common.pdl_options: 0 none, 1 wait, 2 release then wait). Compiles
    without a GPU when CUTE_DSL_ARCH names the target (sm_90a for the H200)."""
    cuda_driver, cutlass, cute, _ = cute_kernels.import_cute()
    launch = _define(block_m, block_k, stages, n, k, k_per_split, summed, pdl)
    compile_ = cute.compile[cute.KeepPTX] if keep_ptx else cute.compile
    return compile_(
        launch,
        *(_pointer(dtype, 16) for dtype in _operand_types(cutlass)),
        cutlass.Int32(1),
        cute_kernels.current_stream(cuda_driver),
    )


def _operand_types(cutlass: Any) -> tuple[Any, ...]:
    """The element types of the launch's pointers: x, weight, parts, residual, summed,
    squares (the last three read or written only by a summed kernel)."""
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    return (bf16, bf16, f32, bf16, bf16, f32)


def _launcher(compiled: Any) -> Callable[..., None]:
    """Runs the compiled kernel on tensors in _operand_types' order."""
    cuda_driver, cutlass, _, _ = cute_kernels.import_cute()
    dtypes = _operand_types(cutlass)

    def run(*tensors: torch.Tensor) -> None:
        compiled(
            *(_pointer(dtype, t.data_ptr()) for dtype, t in zip(dtypes, tensors, strict=True)),
            cutlass.Int32(tensors[0].shape[0]),
            cute_kernels.current_stream(cuda_driver),
        )

    return run


def _pointer(dtype: Any, address: int) -> Any:
    _, _, cute, make_ptr = cute_kernels.import_cute()
    return make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=16)


def _define(
    block_m: int,
    block_k: int,
    stages: int,
    n: int,
    k: int,
    k_per_split: int,
    summed: bool,
    pdl: int,
) -> Callable[..., None]:
    """The kernel and its host-side launch function (a @cute.jit) for these tiles and shapes."""
    cuda_driver, cutlass, cute, _ = cute_kernels.import_cute()
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    block_n = WARPS * 16
    threads = WARPS * 32
    splits = -(-k // k_per_split)
    tiles_per_split = k_per_split // block_k
    k_tiles = k // block_k
    num_k_blocks = block_k // MMA_SHAPE[2]
    side_per_thread = -(-k_per_split // threads)  # summed: a row's K range over the threads

    @cute.kernel
    def kernel(
        m_x: cute.Tensor,
        m_w: cute.Tensor,
        m_parts: cute.Tensor,
        rows: cutlass.Int32,
        m_r: cute.Tensor,  # summed: the residual, (rows, k)
        m_sum: cute.Tensor,  # summed: out, bf16(x + residual), (rows, k)
        m_squares: cute.Tensor,  # summed: out, (rows, splits) fp32
    ):
        cute_kernels.wait_for_previous_kernel(cute, pdl)
        tidx, _, _ = cute.arch.thread_idx()
        column_block, split, _ = cute.arch.block_idx()
        first_tile = split * tiles_per_split
        tile_count = cutlass.min(tiles_per_split, k_tiles - first_tile)

        smem = cutlass.utils.SmemAllocator()
        s_x = smem.allocate_tensor(bf16, smem_layout(cute, block_m, block_k, stages), 16)
        s_w = smem.allocate_tensor(bf16, smem_layout(cute, block_n, block_k, stages), 16)
        if cutlass.const_expr(summed):  # the residual's tiles beside x's
            s_r = smem.allocate_tensor(bf16, smem_layout(cute, block_m, block_k, stages), 16)
            warp_sums = smem.allocate_tensor(f32, cute.make_layout(WARPS), 16)

        # Global tiles: (rows, block_k, k tiles) of x (all rows) and of this CTA's weight rows;
        # the identity tensor of x gives each copied row's index, for the rows < M predicate.
        g_x = cute.local_tile(m_x, tiler=(block_m, block_k), coord=(0, None))
        g_w = cute.local_tile(m_w, tiler=(block_n, block_k), coord=(column_block, None))
        c_x = cute.local_tile(
            cute.make_identity_tensor(m_x.shape), tiler=(block_m, block_k), coord=(0, None)
        )

        g2s = gmem_to_smem_copy(cute, bf16, block_k)
        thr_g2s = g2s.get_slice(tidx)
        t_gx, t_sx = thr_g2s.partition_S(g_x), thr_g2s.partition_D(s_x)
        t_gw, t_sw = thr_g2s.partition_S(g_w), thr_g2s.partition_D(s_w)
        t_cx = thr_g2s.partition_S(c_x)
        if cutlass.const_expr(summed):
            g_r = cute.local_tile(m_r, tiler=(block_m, block_k), coord=(0, None))
            t_gr, t_sr = thr_g2s.partition_S(g_r), thr_g2s.partition_D(s_r)
        # one predicate per copied row of x (each copy is 8 elements of one row)
        x_row_ok = cute.make_rmem_tensor(
            cute.make_layout(
                (t_gx.shape[0][1], cute.size(t_gx, mode=[1]), cute.size(t_gx, mode=[2])),
                stride=(cute.size(t_gx, mode=[1]), 1, 0),
            ),
            cutlass.Boolean,
        )
        for v in cutlass.range_constexpr(x_row_ok.shape[0]):
            for r in cutlass.range_constexpr(x_row_ok.shape[1]):
                x_row_ok[v, r, 0] = cute.elem_less(t_cx[(0, v), r, 0, 0][0], rows)

        # The padding rows of x stay zero in every stage: zero them before any copy lands.
        t_sx.fill(0)
        if cutlass.const_expr(summed):
            t_sr.fill(0)
        cute.arch.sync_threads()

        # Prologue: tiles 0 .. stages - 2 in flight, one commit group each (an empty group past
        # the split's last tile keeps the group count, and so the wait below, the same).
        for stage in cutlass.range_constexpr(stages - 1):
            if stage < tile_count:
                tile = first_tile + stage
                cute.copy(g2s, t_gx[None, None, None, tile], t_sx[None, None, None, stage],
                          pred=x_row_ok)  # fmt: skip
                if cutlass.const_expr(summed):
                    cute.copy(g2s, t_gr[None, None, None, tile], t_sr[None, None, None, stage],
                              pred=x_row_ok)  # fmt: skip
                cute.copy(g2s, t_gw[None, None, None, tile], t_sw[None, None, None, stage])
            cute.arch.cp_async_commit_group()

        if cutlass.const_expr(summed):
            # While the first tiles land: the sum and its squares over this split's K range,
            # each row by one CTA of the split (column block c takes rows c, c + blocks, ...).
            # The values are the ones the MMAs take (the same fp32 add, rounded to nearest).
            # A thread's loads are unconditional (past the range it reads the last column
            # again) and all come before its stores, which might alias them as far as the
            # compiler knows: they are in flight together, one round trip a row.
            k_start = first_tile * block_k
            k_len = tile_count * block_k
            for row in cutlass.range(column_block, rows, n // block_n):
                xs = cute.make_rmem_tensor(cute.make_layout(side_per_thread), bf16)
                rs = cute.make_rmem_tensor(cute.make_layout(side_per_thread), bf16)
                for i in cutlass.range_constexpr(side_per_thread):
                    column = k_start + cutlass.min(tidx + i * threads, k_len - 1)
                    xs[i] = m_x[row, column]
                    rs[i] = m_r[row, column]
                square_sum = f32(0.0)
                for i in cutlass.range_constexpr(side_per_thread):
                    value = (xs[i].to(f32) + rs[i].to(f32)).to(bf16)
                    in_range = tidx + i * threads < k_len
                    square = value.to(f32) * value.to(f32)
                    square_sum = square_sum + f32(cutlass.select_(in_range, square, f32(0.0)))
                    if in_range:
                        m_sum[row, k_start + tidx + i * threads] = value
                for step in cutlass.range_constexpr(5):  # butterfly: offsets 16, 8, 4, 2, 1
                    square_sum = square_sum + cute.arch.shuffle_sync_bfly(
                        square_sum, offset=16 >> step
                    )
                # every lane stores its warp's sum, and every thread the row's (the same bits):
                # no divergent branch near a barrier (cute_kernels.add_rmsnorm says why)
                warp_sums[cute.arch.warp_idx()] = square_sum
                cute.arch.sync_threads()
                total = f32(0.0)
                for warp in cutlass.range_constexpr(WARPS):
                    total = total + warp_sums[warp]
                m_squares[row, split] = total
                cute.arch.sync_threads()  # warp_sums is the next row's

        # smem -> registers (ldmatrix x4) in the layouts the MMA wants.
        mma = tiled_mma(cute, cutlass)
        thr_mma = mma.get_slice(tidx)
        r_x = mma.make_fragment_A(thr_mma.partition_A(s_x)[None, None, None, 0])
        r_w = mma.make_fragment_B(thr_mma.partition_B(s_w)[None, None, None, 0])
        s2r_x = cute.make_tiled_copy_A(ldmatrix_atom(cute, bf16), mma).get_slice(tidx)
        s2r_w = cute.make_tiled_copy_B(ldmatrix_atom(cute, bf16), mma).get_slice(tidx)
        t_sx_read, t_rx = s2r_x.partition_S(s_x), s2r_x.retile(r_x)
        t_sw_read, t_rw = s2r_w.partition_S(s_w), s2r_w.retile(r_w)
        if cutlass.const_expr(summed):
            r_r = mma.make_fragment_A(thr_mma.partition_A(s_r)[None, None, None, 0])
            t_sr_read, t_rr = s2r_x.partition_S(s_r), s2r_x.retile(r_r)

        g_out = cute.local_tile(
            m_parts[None, None, split], tiler=(block_m, block_n), coord=(0, column_block)
        )
        acc = mma.make_fragment_C(thr_mma.partition_C(g_out))
        acc.fill(0.0)

        for t in cutlass.range(tile_count):
            # tile t has landed (at most stages - 2 younger groups still pending), and every
            # warp is done with iteration t - 1's stage, which the copy below refills
            cute.arch.cp_async_wait_group(stages - 2)
            cute.arch.sync_threads()
            stage = t % stages
            for kb in cutlass.range_constexpr(num_k_blocks):
                cute.copy(s2r_x, t_sx_read[None, None, kb, stage], t_rx[None, None, kb])
                cute.copy(s2r_w, t_sw_read[None, None, kb, stage], t_rw[None, None, kb])
                if cutlass.const_expr(summed):  # x + residual, rounded, is the MMA's operand
                    cute.copy(s2r_x, t_sr_read[None, None, kb, stage], t_rr[None, None, kb])
                    a, b = r_x[None, None, kb], r_r[None, None, kb]
                    a.store((a.load().to(f32) + b.load().to(f32)).to(bf16))
                cute.gemm(mma, acc, r_x[None, None, kb], r_w[None, None, kb], acc)
            ahead = t + stages - 1
            if ahead < tile_count:
                refill = ahead % stages
                cute.copy(g2s, t_gx[None, None, None, first_tile + ahead],
                          t_sx[None, None, None, refill], pred=x_row_ok)  # fmt: skip
                if cutlass.const_expr(summed):
                    cute.copy(g2s, t_gr[None, None, None, first_tile + ahead],
                              t_sr[None, None, None, refill], pred=x_row_ok)  # fmt: skip
                cute.copy(g2s, t_gw[None, None, None, first_tile + ahead],
                          t_sw[None, None, None, refill])  # fmt: skip
            cute.arch.cp_async_commit_group()

        # Epilogue: each accumulator of a real row straight to parts[split] (fp32, no rounding).
        c_out = cute.local_tile(
            cute.make_identity_tensor((rows, n)), tiler=(block_m, block_n), coord=(0, column_block)
        )
        t_out, t_cout = thr_mma.partition_C(g_out), thr_mma.partition_C(c_out)
        for i in cutlass.range_constexpr(cute.size(acc)):
            if cute.elem_less(t_cout[i][0], rows):
                t_out[i] = acc[i]

    @cute.jit
    def launch(
        x_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        parts_ptr: cute.Pointer,
        r_ptr: cute.Pointer,
        sum_ptr: cute.Pointer,
        squares_ptr: cute.Pointer,
        rows: cutlass.Int32,
        stream: cuda_driver.CUstream,
    ):
        by_row = cute.make_layout((rows, k), stride=(k, 1))
        m_x = cute.make_tensor(x_ptr, by_row)
        m_w = cute.make_tensor(w_ptr, cute.make_layout((n, k), stride=(k, 1)))
        m_parts = cute.make_tensor(
            parts_ptr, cute.make_layout((rows, n, splits), stride=(n, 1, rows * n))
        )
        m_squares = cute.make_tensor(
            squares_ptr, cute.make_layout((rows, splits), stride=(1, rows))
        )
        m_r, m_sum = cute.make_tensor(r_ptr, by_row), cute.make_tensor(sum_ptr, by_row)
        kernel(m_x, m_w, m_parts, rows, m_r, m_sum, m_squares).launch(
            grid=[n // block_n, splits, 1], block=[threads, 1, 1], stream=stream, use_pdl=pdl > 0
        )

    return launch


# The kernel's layouts, built while CuTe DSL traces it (tests/kernels/test_cute_compile.py
# traces them per thread on the CPU: the slices the kernel's loops take hold the tile, stage
# and K block they assume, and the copies and the MMA cover every tile element).


def smem_layout(cute: Any, rows: int, block_k: int, stages: int) -> Any:
    """(rows, block_k, stages) bf16 in shared memory, K-major, in 8 x 64 atoms (128-byte rows)
    XOR-swizzled so that the 8 row addresses of one ldmatrix fall in different bank groups."""
    atom = cute.make_composed_layout(
        cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
    )
    return cute.tile_to_shape(atom, (rows, block_k, stages), (0, 1, 2))


def gmem_to_smem_copy(cute: Any, bf16: Any, block_k: int) -> Any:
    """16-byte cp.async (.cg, past L1) over the CTA's threads, one row of a K tile across
    block_k / 8 of them."""
    atom = cute.make_copy_atom(
        cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
        bf16,
        num_bits_per_copy=VECTOR * 16,
    )
    copy_cols = block_k // VECTOR
    threads = WARPS * 32
    return cute.make_tiled_copy_tv(
        atom,
        cute.make_layout((threads // copy_cols, copy_cols), stride=(copy_cols, 1)),
        cute.make_layout((1, VECTOR)),
    )


def tiled_mma(cute: Any, cutlass: Any) -> Any:
    """mma.sync m16n8k16 (bf16 in, fp32 out), WARPS warps side by side along N, 16 columns each
    (two n8 atoms), repeated down M over the tile."""
    return cute.make_tiled_mma(
        cute.nvgpu.warp.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, MMA_SHAPE),
        cute.make_layout((1, WARPS, 1)),
        permutation_mnk=(MMA_SHAPE[0], WARPS * 16, MMA_SHAPE[2]),
    )


def ldmatrix_atom(cute: Any, bf16: Any) -> Any:
    """ldmatrix x4, not transposed: both operands are K-major in shared memory."""
    return cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), bf16)
