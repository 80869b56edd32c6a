"""The layer's CuTe DSL kernels compiled for the H200 (sm_90a) without a GPU.

CI has no GPU, so this is where the CuTe DSL code of the fused layer meets its compiler there:
the input residual add + RMSNorm (cute_kernels) and the split-K GEMV (cute_gemv) for the tiles
of every H200 plan of the real shard. The GEMV's PTX is read for what the design says it is:
tensor-core MMAs (m16n8k16, bf16 in, fp32 out) fed by ldmatrix from a cp.async pipeline that
bypasses L1, and nothing spilled to local memory. Whether the results are right is for the
`gpu` tests (test_mla_moe_fused.py), which run them on an H200.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

# read when CuTe DSL is imported: compile for the H200, and keep the PTX out of the checkout
if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(prefix="pathgate-cute-"))
pytest.importorskip(
    "cutlass.cute", reason="nvidia-cutlass-dsl is not installed (it comes with .[dev] on Linux)"
)

from kernels.mla_moe_decode import cute_gemv, cute_kernels, fused
from kernels.mla_moe_decode.config import LayerConfig
from scopes.manifest import load_manifest_file

H200_SMS = 132
SCOPE = Path(__file__).resolve().parents[2] / "scopes" / "kimi-k2-mla-moe-decode-h200.yaml"


def test_the_input_norm_compiles_for_the_real_hidden_size() -> None:
    assert callable(cute_kernels._build(7168))


@pytest.mark.parametrize("batch", [1, 8, 37, 64])
def test_the_gemv_compiles_to_tensor_core_mmas_for_every_projection(batch: int) -> None:
    c = LayerConfig.from_model_config(dict(load_manifest_file(SCOPE).model.config))
    plan = fused.layer_plan(c, batch, 1024, True, H200_SMS)
    for name, (n, k) in fused.gemv_shapes(c).items():
        blocks = getattr(plan, name)
        key = (blocks.block_m, blocks.block_k, blocks.num_stages, n, k, blocks.k_per_split)
        ptx = cute_gemv.compile_kernel(*key, keep_ptx=True).__ptx__
        assert ".target sm_90a" in ptx
        # one K tile: each warp's 16 columns are two m16n8 MMAs per 16-deep step, per 16 rows
        per_tile = (blocks.block_k // 16) * 2 * (blocks.block_m // 16)
        mmas = len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx))
        assert mmas == per_tile, (key, mmas)
        assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx
        assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group" in ptx
        assert ".local" not in ptx  # no stack arrays: everything in registers or shared memory


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_the_summed_gemv_adds_the_residual_before_its_mmas(batch: int) -> None:
    """qkv_a's GEMV over x + residual (LayerPlan.input_norm_in_qkv_a): the same MMAs per K
    tile, the residual's tiles copied and read beside x's (ldmatrix x4 half again as many), the
    adds in bf16 pairs (one rounding of the exact sum, as fp32 then bf16 give for two bf16
    values), the squares reduced across the warp, nothing spilled."""
    c = LayerConfig.from_model_config(dict(load_manifest_file(SCOPE).model.config))
    blocks = fused.layer_plan(c, batch, 1024, True, H200_SMS).qkv_a
    n, k = fused.gemv_shapes(c)["qkv_a"]
    key = (blocks.block_m, blocks.block_k, blocks.num_stages, n, k, blocks.k_per_split)
    plain = cute_gemv.compile_kernel(*key, keep_ptx=True).__ptx__
    ptx = cute_gemv.compile_kernel(*key, keep_ptx=True, summed=True).__ptx__
    mma = r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32"
    assert len(re.findall(mma, ptx)) == len(re.findall(mma, plain))
    ldmatrix = "ldmatrix.sync.aligned.m8n8.x4.shared.b16"
    x_reads = (blocks.block_k // 16) * (blocks.block_m // 16)  # per K tile
    assert ptx.count(ldmatrix) == plain.count(ldmatrix) + x_reads
    assert "add.rn.bf16x2" in ptx or "add.bf16x2" in ptx
    assert "shfl.sync.bfly.b32" in ptx and ".local" not in ptx


def test_the_cute_kernels_wait_for_the_previous_kernel_under_dependent_launch() -> None:
    """With a PDL level (triton_common.dependent_launch "exit": 1, "early": 2) the GEMV waits
    (griddepcontrol.wait) before its first read of anything a kernel before it wrote, and at 2
    first releases its successor; at 0 neither. The input norm builds at each level too."""
    c = LayerConfig.from_model_config(dict(load_manifest_file(SCOPE).model.config))
    blocks = fused.layer_plan(c, 8, 1024, True, H200_SMS).qkv_a
    n, k = fused.gemv_shapes(c)["qkv_a"]
    key = (blocks.block_m, blocks.block_k, blocks.num_stages, n, k, blocks.k_per_split)
    for pdl in (0, 1, 2):
        ptx = cute_gemv.compile_kernel(*key, keep_ptx=True, summed=True, pdl=pdl).__ptx__
        assert ("griddepcontrol.wait" in ptx) == (pdl >= 1), pdl
        assert ("griddepcontrol.launch_dependents" in ptx) == (pdl >= 2), pdl
        assert callable(cute_kernels._build(7168, pdl=pdl))


@pytest.mark.parametrize(("block_m", "block_k"), [(16, 128), (64, 64)])
def test_the_gemv_indexes_its_partitions_as_the_kernel_assumes(block_m: int, block_k: int) -> None:
    """The kernel slices its thread partitions by mode: [..., tile] of the global K tiles,
    [..., stage] of the shared-memory stages, [..., k_block, stage] for ldmatrix. Here the same
    builders (cute_gemv's) partition identity tensors for each of the CTA's threads while CuTe
    DSL traces a probe, where the coordinates are static: each slice must hold exactly that
    tile, stage or 16-deep K block, every weight element must be read once and every x
    element once per warp, and the accumulators must hold every output element once."""
    import cutlass
    import cutlass.cute as cute

    bf16, block_n, stages, tiles = cutlass.BFloat16, cute_gemv.WARPS * 16, 2, 2
    counts: dict[str, Counter[tuple[int, ...]]] = defaultdict(Counter)

    def coordinates(partition: object) -> list[tuple[int, ...]]:
        return [tuple(int(v) for v in partition[i]) for i in range(cute.size(partition))]  # type: ignore[index]

    @cute.jit
    def probe():
        copy = cute_gemv.gmem_to_smem_copy(cute, bf16, block_k)
        mma = cute_gemv.tiled_mma(cute, cutlass)
        ldmatrix = cute_gemv.ldmatrix_atom(cute, bf16)
        x_global = cute.local_tile(
            cute.make_identity_tensor((block_m, tiles * block_k)), (block_m, block_k), (0, None)
        )
        x_shared = cute.make_identity_tensor((block_m, block_k, stages))
        w_shared = cute.make_identity_tensor((block_n, block_k, stages))
        out_tile = cute.make_identity_tensor((block_m, block_n))
        for thread in cutlass.range_constexpr(cute_gemv.WARPS * 32):
            source = copy.get_slice(thread).partition_S(x_global)
            target = copy.get_slice(thread).partition_D(x_shared)
            x_reads = cute.make_tiled_copy_A(ldmatrix, mma).get_slice(thread).partition_S(x_shared)
            w_reads = cute.make_tiled_copy_B(ldmatrix, mma).get_slice(thread).partition_S(w_shared)
            for tile in cutlass.range_constexpr(tiles):
                for _, k in coordinates(source[None, None, None, tile]):
                    counts["x source"][(k // block_k == tile,)] += 1
            for stage in cutlass.range_constexpr(stages):
                for _, _, s in coordinates(target[None, None, None, stage]):
                    counts["x target"][(s == stage,)] += 1
                for k_block in cutlass.range_constexpr(block_k // 16):
                    for reads, name in ((x_reads, "x read"), (w_reads, "w read")):
                        for row, k, s in coordinates(reads[None, None, k_block, stage]):
                            assert (k // 16, s) == (k_block, stage), (name, thread)
                            counts[name][(row, k, s)] += 1
            for row, col in coordinates(mma.get_slice(thread).partition_C(out_tile)):
                counts["out"][(row, col)] += 1

    cute.compile(probe)
    assert set(counts["x source"]) == {(True,)} and set(counts["x target"]) == {(True,)}
    assert counts["out"] == Counter({(r, c): 1 for r in range(block_m) for c in range(block_n)})
    for name, rows, times in (("x read", block_m, cute_gemv.WARPS), ("w read", block_n, 1)):
        cells = [(r, k, s) for r in range(rows) for k in range(block_k) for s in range(stages)]
        assert counts[name] == Counter(dict.fromkeys(cells, times)), name
