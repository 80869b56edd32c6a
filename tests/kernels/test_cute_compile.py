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
