"""Decode context parallelism for the latent MLA attention, on CPU (and, marked `gpu`, the fused
CP attention at the real sizes on one GPU).

The merged partials are compared with the stock latent attention (`stock._latent_attention`, the
code the layer runs) and with that same code on float64 copies (the reference); the
torch.distributed form runs on 2 and 4 gloo ranks and must give the single-process result.
Inputs: the problem's own latent cache (correlated latents, unit RMS) and an absorbed query
whose scaled logits have a std of ~2, as the problem's weights give (softmax weight on a few
percent of the context).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

import pytest
import torch

from harness.evaluation.cases import Case
from harness.evaluation.distributed import RanksFinished, run_on_ranks
from kernels.mla_moe_decode import stock
from kernels.mla_moe_decode.config import LayerConfig
from kernels.mla_moe_decode.context_parallel import (
    context_parallel_attention,
    distributed_latent_attention,
    holds_new_token,
    merge_partials,
    near_equal_sizes,
    partial_attention,
    rank_slice,
    slice_bounds,
)
from kernels.mla_moe_decode.problem import Problem

CPU = torch.device("cpu")
SMALL: dict[str, object] = {
    "heads": 4,
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
}
CONFIG = LayerConfig.from_model_config(SMALL)
LORA = CONFIG.kv_lora_rank
SCALE = CONFIG.qk_head_dim**-0.5  # the stock path's softmax scale
LOGIT_STD = 2.0


def _inputs(
    batch: int, context: int, seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_latent (B, H, L+R), kv_cache (B, T, L+R), kv_new (B, L+R) in `dtype`."""
    case = Case(batch, context, 1, 1, "float32", "cpu", config=MappingProxyType(SMALL))
    kv_cache = Problem(SMALL).make_inputs(case, seed, CPU)["kv_cache"]
    gen = torch.Generator().manual_seed(seed + 1)
    dim = CONFIG.latent_dim
    kv_new = kv_cache[:, -1] + 0.5 * torch.randn(batch, dim, generator=gen)
    q_std = LOGIT_STD / (SCALE * math.sqrt(dim))  # keys have unit RMS per channel
    q_latent = q_std * torch.randn(batch, CONFIG.heads, dim, generator=gen)
    return q_latent.to(dtype), kv_cache.to(dtype), kv_new.to(dtype)


def _reference(q: torch.Tensor, kv: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return stock._latent_attention(q.double(), kv.double(), new.double(), LORA, SCALE)


def _relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    return float((got.double() - reference).norm() / reference.norm())


RAGGED = [
    (1, 40),  # a rank with a single token
    (40, 1),
    (3, 17, 21),
    (1, 1, 39),
    (13, 0, 27, 1),  # an empty rank among them
    (0, 0, 0, 41),  # every cached token on the rank that also holds the new one
    (41, 0, 0, 0),  # the new token alone on its rank
]


def test_near_equal_sizes_split_the_context_in_rank_order() -> None:
    assert near_equal_sizes(10, 4) == (3, 3, 2, 2)
    assert near_equal_sizes(8, 4) == (2, 2, 2, 2)
    assert near_equal_sizes(2, 4) == (1, 1, 0, 0)
    assert near_equal_sizes(7, 1) == (7,)
    assert slice_bounds((3, 3, 2, 2)) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    for context in (1, 7, 8, 9, 1023):
        for cp in (1, 2, 3, 4, 8):
            sizes = near_equal_sizes(context, cp)
            with_new = [size + holds_new_token(r, cp) for r, size in enumerate(sizes)]
            assert sum(sizes) == context
            assert max(with_new) == math.ceil((context + 1) / cp)  # the best split of T + 1
    with pytest.raises(ValueError):
        near_equal_sizes(5, 0)


def test_rank_slices_are_views_that_tile_the_cache() -> None:
    _, kv, _ = _inputs(2, 11, seed=0, dtype=torch.float32)
    sizes = (4, 0, 6, 1)
    slices = [rank_slice(kv, sizes, rank) for rank in range(len(sizes))]
    assert [s.shape[1] for s in slices] == list(sizes)
    assert all(
        s.data_ptr() == kv[:, start].data_ptr()
        for s, (start, end) in zip(slices, slice_bounds(sizes), strict=True)
        if end > start
    )
    assert torch.equal(torch.cat(slices, 1), kv)
    with pytest.raises(ValueError, match="sum to 10"):
        rank_slice(kv, (4, 6), 0)
    with pytest.raises(ValueError, match=">= 0"):
        rank_slice(kv, (12, -1), 0)


def test_only_the_last_rank_holds_the_new_token() -> None:
    for cp in (1, 2, 3, 4, 8):
        assert [r for r in range(cp) if holds_new_token(r, cp)] == [cp - 1]


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("context", [1, 9, 41, 300])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_merged_partials_equal_unsplit_attention(batch: int, context: int, cp: int) -> None:
    q, kv, new = _inputs(batch, context, seed=batch * 1000 + context, dtype=torch.float32)
    sizes = near_equal_sizes(context, cp)
    got = context_parallel_attention(q, kv, new, LORA, SCALE, sizes)
    stock_out = stock._latent_attention(q, kv, new, LORA, SCALE)
    assert got.shape == stock_out.shape == (batch, CONFIG.heads, LORA)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, stock_out, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(got.double(), _reference(q, kv, new), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("sizes", RAGGED)
@pytest.mark.parametrize("batch", [1, 5])
def test_ragged_splits_merge_exactly(sizes: tuple[int, ...], batch: int) -> None:
    context = sum(sizes)
    q, kv, new = _inputs(batch, context, seed=len(sizes) + batch, dtype=torch.float64)
    got = context_parallel_attention(q, kv, new, LORA, SCALE, sizes)
    # float64: the split changes only the order of the sums
    torch.testing.assert_close(got, _reference(q, kv, new), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("context", [64, 63])  # the stock's heads-major and tokens-major layouts
def test_cp1_is_the_stock_computation_bit_for_bit_in_bf16(context: int) -> None:
    q, kv, new = _inputs(5, context, seed=3, dtype=torch.bfloat16)
    got = context_parallel_attention(q, kv, new, LORA, SCALE, (context,))
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, stock._latent_attention(q, kv, new, LORA, SCALE))


@pytest.mark.parametrize("sizes", [(16, 16, 16, 16), (1, 40, 2, 21), (50, 14)])
def test_bf16_split_is_as_accurate_as_stock(sizes: tuple[int, ...]) -> None:
    """Each rank rounds its own probabilities to bf16 (a different normalizer than stock's):
    the error against the float64 reference must stay that of the stock path."""
    for seed in range(4):
        q, kv, new = _inputs(5, sum(sizes), seed=seed, dtype=torch.bfloat16)
        reference = _reference(q, kv, new)
        got = context_parallel_attention(q, kv, new, LORA, SCALE, sizes)
        stock_error = _relative_error(stock._latent_attention(q, kv, new, LORA, SCALE), reference)
        assert 0 < _relative_error(got, reference) <= 1.25 * stock_error


def test_partials_are_fp32_with_their_log_sum_exp() -> None:
    q, kv, new = _inputs(3, 20, seed=5, dtype=torch.bfloat16)
    part = partial_attention(q, kv[:, :8], None, LORA, SCALE)
    assert part.out.dtype == part.lse.dtype == torch.float32
    assert part.out.shape == (3, CONFIG.heads, LORA) and part.lse.shape == (3, CONFIG.heads)
    scores = torch.einsum("bhd,btd->bht", q.double(), kv[:, :8].double()) * SCALE
    torch.testing.assert_close(part.lse.double(), scores.logsumexp(-1), rtol=1e-5, atol=1e-5)
    empty = partial_attention(q, kv[:, :0], None, LORA, SCALE)
    assert torch.equal(empty.out, torch.zeros_like(empty.out))
    assert bool((empty.lse == float("-inf")).all())
    alone = partial_attention(q, kv[:, :0], new, LORA, SCALE)  # the new token only: weight 1
    torch.testing.assert_close(alone.out, new[:, None, :LORA].float().expand_as(alone.out))


def test_merge_weighs_each_rank_by_its_share_of_the_softmax() -> None:
    # two ranks holding one token each, with values 1 and 3 and scores 0 and log 3:
    # softmax weights 1/4 and 3/4, so the output is 1/4 * 1 + 3/4 * 3
    outs = [torch.full((1, 1, 2), 1.0), torch.full((1, 1, 2), 3.0)]
    lses = [torch.zeros(1, 1), torch.full((1, 1), math.log(3.0))]
    torch.testing.assert_close(merge_partials(outs, lses), torch.full((1, 1, 2), 2.5))
    with_empty = merge_partials(
        [*outs, torch.zeros(1, 1, 2)], [*lses, torch.full((1, 1), -math.inf)]
    )
    torch.testing.assert_close(with_empty, torch.full((1, 1, 2), 2.5))


# --- the torch.distributed form, one gloo process per rank ---

CpCases = list[tuple[int, int, tuple[int, ...]]]  # (batch, context, slice sizes)
DISTRIBUTED_CASES: dict[int, CpCases] = {
    2: [(1, 33, (17, 16)), (5, 40, (1, 39)), (5, 9, (9, 0))],
    4: [(5, 41, (11, 10, 10, 10)), (1, 23, (1, 5, 0, 17)), (5, 30, (27, 1, 1, 1))],
}
DTYPES = ("float32", "bfloat16")


def cp_rank(
    rank: int, world_size: int, cases: CpCases
) -> dict[tuple[int, str], tuple[int, torch.Tensor]]:
    """Per (case, dtype): (the length of this rank's slice, the attention it got). Every rank
    builds the inputs from the seed, as the engine builds them per rank, and keeps its slice."""
    results = {}
    for index, (batch, context, sizes) in enumerate(cases):
        for dtype_name in DTYPES:
            q, kv, new = _inputs(batch, context, batch + context, getattr(torch, dtype_name))
            own = rank_slice(kv, sizes, rank).clone()
            del kv  # from here on this rank sees its slice only
            out = distributed_latent_attention(q, own, new, LORA, SCALE)
            results[index, dtype_name] = (own.shape[1], out)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_distributed_attention_equals_the_single_process_form(world_size: int) -> None:
    cases = DISTRIBUTED_CASES[world_size]
    outcome = run_on_ranks(cp_rank, world_size, "gloo", 120.0, (cases,))
    assert isinstance(outcome, RanksFinished), outcome
    for index, (batch, context, sizes) in enumerate(cases):
        for dtype_name in DTYPES:
            q, kv, new = _inputs(batch, context, batch + context, getattr(torch, dtype_name))
            expected = context_parallel_attention(q, kv, new, LORA, SCALE, sizes)
            per_rank = [outcome.results[r][index, dtype_name] for r in range(world_size)]
            assert [slice_length for slice_length, _ in per_rank] == list(sizes)
            for _, got in per_rank:  # every rank holds the merged result
                assert got.dtype == expected.dtype
                torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
        q, kv, new = _inputs(batch, context, batch + context, torch.float32)
        root = outcome.root[index, "float32"][1]
        torch.testing.assert_close(root.double(), _reference(q, kv, new), rtol=2e-5, atol=2e-6)


# --- the fused path's Triton attention under CP (kernels/mla_moe_decode/triton_attention.py) ---


def fused_cp_rank(rank: int, world_size: int, cases: CpCases) -> dict[int, torch.Tensor]:
    """Per case: the attention `mla_attention_cp` gives this rank, holding its slice only."""
    import torch.distributed as dist

    from kernels.mla_moe_decode.fused import layer_plan
    from kernels.mla_moe_decode.triton_attention import mla_attention_cp

    results = {}
    for index, (batch, context, sizes) in enumerate(cases):
        q, kv, new = _inputs(batch, context, batch + context, torch.bfloat16)
        own = rank_slice(kv, sizes, rank).contiguous()
        del kv
        blocks = layer_plan(CONFIG, batch, own.shape[1], False, 0).attention
        out = torch.empty(batch, CONFIG.heads, LORA, dtype=torch.bfloat16)
        mla_attention_cp(q, own, new, out, SCALE, blocks, dist.group.WORLD)
        results[index] = out
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_fused_cp_attention_equals_the_fused_attention_over_the_whole_cache(
    world_size: int,
) -> None:
    """Every rank gets the one-process fused result up to fp32 regrouping (one bf16 rounding at
    most), as close to the float64 reference; empty slices included."""
    from kernels.mla_moe_decode.fused import layer_plan
    from kernels.mla_moe_decode.triton_attention import mla_attention

    cases = DISTRIBUTED_CASES[world_size]
    outcome = run_on_ranks(fused_cp_rank, world_size, "gloo", 300.0, (cases,))
    assert isinstance(outcome, RanksFinished), outcome
    for index, (batch, context, sizes) in enumerate(cases):
        q, kv, new = _inputs(batch, context, batch + context, torch.bfloat16)
        whole = torch.empty(batch, CONFIG.heads, LORA, dtype=torch.bfloat16)
        mla_attention(
            q, kv, new, whole, SCALE, layer_plan(CONFIG, batch, context, False, 0).attention
        )
        reference = _reference(q, kv, new)
        for rank in range(world_size):
            got = outcome.results[rank][index]
            torch.testing.assert_close(got, whole, rtol=2**-7, atol=1e-3)
            assert _relative_error(got, reference) <= 1.1 * _relative_error(whole, reference)
        # the one-device form that benchmarks/cp_one_gpu.py times gives rank 0's bits
        assert torch.equal(_cp_on_one_device(q, kv, new, sizes), outcome.results[0][index])


def _cp_on_one_device(
    q: torch.Tensor, kv: torch.Tensor, new: torch.Tensor, sizes: tuple[int, ...]
) -> torch.Tensor:
    from benchmarks.cp_one_gpu import cp_attention_one_device
    from kernels.mla_moe_decode.fused import layer_plan

    slices = [rank_slice(kv, sizes, rank).contiguous() for rank in range(len(sizes))]
    plans = [layer_plan(CONFIG, q.shape[0], part.shape[1], False, 0).attention for part in slices]
    out = torch.empty(q.shape[0], CONFIG.heads, LORA, dtype=torch.bfloat16)
    cp_attention_one_device(q, slices, new, out, SCALE, plans)
    return out


def test_the_one_device_cp_benchmark_checks_every_case(tmp_path: Path) -> None:
    """benchmarks/cp_one_gpu.py --small: every (batch, context, CP degree) it promises, each
    correct against the whole-cache attention and float64, with its three timings."""
    out = tmp_path / "cp.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "cp_one_gpu.py"
    done = subprocess.run(
        [sys.executable, str(script), "--small", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert report["is_gpu_evidence"] is False
    assert [(r["batch"], r["cp"]) for r in rows] == [(b, cp) for b in (1, 3) for cp in (1, 2, 4)]
    for r in rows:
        assert r["error"] is None and r["correct"] is True
        assert r["whole_us"] > 0 and r["rank_us"] > 0 and r["combine_us"] > 0
        assert r["largest_slice"] == -(-r["context"] // r["cp"])
        assert r["relative_error"] <= 1.1 * r["whole_relative_error"]


@pytest.mark.gpu
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_fused_cp_attention_on_one_gpu_matches_the_whole_cache_at_real_size(cp: int) -> None:
    """On the H200 at the real shard's sizes (batch 8, an odd context): the ranks' shares run in
    turn and merged give the whole-cache attention within one bf16 rounding, as close to the
    float64 attention. The collective itself needs two GPUs (test_ranks.py)."""
    from benchmarks.cp_one_gpu import measure_case
    from benchmarks.mla_moe_device_check import Target

    real = LayerConfig.from_model_config({})
    timed = cp == 8  # the timed path once (its plans and copies), as the benchmark runs it
    row = measure_case(real, 8, 5001, cp, Target(torch.device("cuda"), False), timed=timed)
    assert row.correct, row
    if timed:
        assert row.whole_us and row.rank_us and row.combine_us and row.speedup, row
