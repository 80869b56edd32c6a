"""The fused MLA+MoE decode path on one H200: its kernels one by one, then the layer vs stock.

Part 1, kernels, at the real Kimi-K2 shard sizes (batch 1, 8 and 64; --quick: 1 and 64): each
CuTe DSL and Triton kernel of kernels/mla_moe_decode/fused.py on its own, against a torch
reference computed in fp32/fp64 from the same bf16 inputs (max abs and relative error), and its
time: the median of CUDA-graph replays holding one launch per copy of the operands it streams,
with enough copies that no launch is served from L2, and the GB/s that gives.

Part 2, the layer: fused vs stock eager vs stock compiled (stock.forward_compiled, the scope's
baseline) at batch 1, 8, 64 x context 1024, 8192, 32768 (--quick: batch 1 and 64 at 8192). Each
path is captured into one CUDA graph of 3 layers with distinct weights (3 x 4.3 GB, far past L2)
and replayed alternately with the compiled stock (the engine's timed_pairs): µs per layer;
kernels per layer from torch.profiler over one replay; the floor, Problem.floor_bytes of these
inputs over the measured read bandwidth, and each path's fraction of it; and the fused outputs'
relative difference to the compiled stock's (`out` may differ by a routing near-tie: see the
scope's tolerance comment).

Fails soft: a kernel or a path that raises prints its error and the run goes on. Prints a short
table last and writes JSON (default pathgate-out/benchmarks/mla_moe_device_check.json).

    python3 benchmarks/mla_moe_device_check.py                  # about 6-8 min on an H200
    python3 benchmarks/mla_moe_device_check.py --quick          # about 3 min
    python3 benchmarks/mla_moe_device_check.py --only-kernels   # part 1 only
    python3 benchmarks/mla_moe_device_check.py --profile-fused  # instead of parts 1 and 2:
        one replay of the fused 3-layer graph under torch.profiler (CUPTI) at batch 1 and 8:
        each kernel's duration and the idle gap before it, middle layer
    python3 benchmarks/mla_moe_device_check.py --sweep-moe-down  # instead of parts 1 and 2:
        the MoE pair and its down kernel alone, the plan's and each MOE_DOWN_ITEMS down
    python3 benchmarks/mla_moe_device_check.py --sweep-moe-rounds  # instead of parts 1 and 2:
        the MoE pair at batch 8 with exactly 4-12 local experts per launch, for each gate_up
        grid (the plan's cap, one program per item, 2 and 3 per SM)
    python3 benchmarks/mla_moe_device_check.py --sweep-attention  # instead of parts 1 and 2:
        the split-KV attention + combine alone at batch 1 and 8 in each ATTENTION_VARIANTS tiling
        (--batches 16 64: above batch 8, each ATTENTION_VARIANTS_LARGE tiling)
    python3 benchmarks/mla_moe_device_check.py --sweep-combine  # instead of parts 1 and 2:
        the attention combine alone (over real split partials) in each COMBINE_VARIANTS
        program shape, and q_absorb in each ABSORB_COLUMNS width, at batch 1, 8, 64
    python3 benchmarks/mla_moe_device_check.py --sweep-router   # instead of parts 1 and 2:
        the router GEMV + routing at batch 1, 8, 64 in each ROUTER_VARIANTS tiling
    python3 benchmarks/mla_moe_device_check.py --sweep-pdl      # instead of parts 1 and 2:
        the fused layer in each programmatic dependent launch mode
        (triton_common.dependent_launch), each against "off" in alternating replays, and
        whether they all give the same bits
    python3 benchmarks/mla_moe_device_check.py --sweep-small-kernels  # as --sweep-pdl: the
        layer with one small kernel's launch changed (each SMALL_KERNEL_VARIANTS entry) against
        the plan
    python3 benchmarks/mla_moe_device_check.py --sweep-moe-plan  # as --sweep-pdl: the layer
        with each MOE_PLAN_VARIANTS change of the MoE plan (the one-kernel MoE's down items 32
        columns wide; the MoE plans of runs 19 and 18 and from before the seventeenth
        session) against the plan
    python3 benchmarks/mla_moe_device_check.py --small --quick  # CPU smoke run of this script:
        test sizes under Triton's interpreter, the CuTe DSL step as its Triton stand-in, host
        clock instead of graphs, the eager stock standing in for the compiled one
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

if "--small" in sys.argv:  # before Triton is imported: the CPU runs its kernels interpreted
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.evaluation import bandwidth
from harness.evaluation.cases import Case
from harness.evaluation.profiling import profile_step
from harness.evaluation.stats import median
from harness.evaluation.timing import LayerSet, capture_graph, run_layers, timed_pairs
from kernels.mla_moe_decode import cute_gemv, cute_kernels, fused, stock, triton_common
from kernels.mla_moe_decode.config import LayerConfig
from kernels.mla_moe_decode.problem import EXPERT_WEIGHTS, Problem, activated_local_experts
from kernels.mla_moe_decode.triton_attention import (
    AttentionBlocks,
    _combine,
    _split_partials,
    latent_prep,
    mla_attention,
    q_absorb,
    w_uv,
)
from kernels.mla_moe_decode.triton_gemv import GemvBlocks, gemv_blocks, splitk_gemv
from kernels.mla_moe_decode.triton_moe import MoeBlocks, fused_moe, moe_down, moe_gate_up, route
from kernels.mla_moe_decode.triton_norm import add_rmsnorm

Tensors = dict[str, torch.Tensor]
BF16 = torch.bfloat16
LAYERS = 3
REPLAYS = 20  # kernel timing: graph replays, median
PAIRS = 30  # layer timing: alternating replay pairs per comparison
MAX_COPIES = 16
H200_L2_BYTES = 60 * 2**20
DEPENDENT_LAUNCH_DEFAULT = triton_common.dependent_launch


@dataclass(frozen=True)
class Target:
    device: torch.device
    small: bool  # CPU smoke run at fused.CPU_TEST_CONFIG

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def sm_count(self) -> int:
        return (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.on_gpu
            else 0
        )


@dataclass
class KernelRow:
    kernel: str
    language: str
    batch: int
    max_abs_error: float | None = None
    relative_error: float | None = None
    us: float | None = None
    gb_per_s: float | None = None
    note: str = ""
    error: str | None = None


@dataclass
class LayerRow:
    batch: int
    context: int
    fused_us: float | None = None
    eager_us: float | None = None
    compiled_us: float | None = None
    speedup_vs_compiled: float | None = None
    kernels_fused: float | None = None
    kernels_eager: float | None = None
    kernels_compiled: float | None = None
    floor_us: float | None = None
    fused_floor_fraction: float | None = None
    compiled_floor_fraction: float | None = None
    active_local_experts: list[int] = field(default_factory=list)
    fused_vs_compiled: dict[str, float] = field(default_factory=dict)  # relative difference
    errors: list[str] = field(default_factory=list)


# Part 1: kernels.


@dataclass
class KernelCheck:
    """One kernel at one batch. `run(operands)` launches it on one copy of the operands it
    streams; `errors()` gives (max abs, relative) of the first copy's run against the torch
    reference. `copies`: the operand copies the timing rotates over (default: clones of the
    first, enough that their bytes pass 4x L2)."""

    name: str
    language: str
    run: Callable[[Tensors], None]
    streamed: Tensors
    bytes_moved: int
    errors: Callable[[], tuple[float, float]]
    note: str = ""
    copies: list[Tensors] | None = None


Builder = Callable[[LayerConfig, Tensors, int, torch.Generator, Target], KernelCheck]


def kernel_builders(skip: tuple[str, ...] = ()) -> list[Builder]:
    """Every kernel's check; each is built and run on its own, so one that raises is alone.

    The CuTe DSL kernel comes last: on its first H200 launch (2026-12-02) it never returned, and
    a hang cannot be recovered in-process, so it must not hide the Triton rows before it."""
    gemvs = ("fused_qkv_a_proj", "q_b_proj", "o_proj", "gate")
    builders: list[Builder] = [
        _check_post_norm,
        *(partial(_check_gemv, name=name) for name in gemvs),
        _check_latent_prep,
        _check_q_absorb,
        *(partial(_check_attention, context=context) for context in (8192, 32768)),
        _check_w_uv,
        _check_route,
        _check_moe,
        # CuTe DSL last (see above): the GEMVs in cute_gemv, then the input norm
        *(partial(_check_gemv, name=name, language="CuTe DSL") for name in gemvs),
        _check_input_norm,
    ]
    return [b for b in builders if not any(name in _builder_name(b) for name in skip)]


def _builder_name(build: Builder) -> str:
    return getattr(build, "__name__", None) or getattr(build, "func", build).__name__


def _randn(
    shape: tuple[int, ...], gen: torch.Generator, t: Target, scale: float = 1.0
) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=t.device) * scale).to(BF16)


def _errors(value: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    diff = value.double() - reference.double()
    return float(diff.abs().max()), float(diff.norm() / reference.double().norm())


def _plan(c: LayerConfig, batch: int, context: int, t: Target) -> fused.LayerPlan:
    return fused.layer_plan(c, batch, context, t.on_gpu, t.sm_count())


def _check_input_norm(
    c: LayerConfig, w: Tensors, batch: int, gen: torch.Generator, t: Target
) -> KernelCheck:
    x, residual = _randn((batch, c.hidden), gen, t, 2.0), _randn((batch, c.hidden), gen, t, 2.0)
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    weight = w["input_layernorm"]

    def run(s: Tensors) -> None:
        # the CuTe DSL kernel on the GPU; its Triton stand-in in the CPU smoke run
        fused.input_add_rmsnorm(s["x"], s["residual"], weight, out, residual_out, c.rms_norm_eps)

    def errors() -> tuple[float, float]:
        expected, summed = stock._add_rms_norm(x, residual, weight, c.rms_norm_eps)
        assert torch.equal(residual_out, summed.to(BF16)), "residual_out differs from torch"
        return _errors(out, expected)

    language = "CuTe DSL" if t.on_gpu else "Triton (CPU stand-in)"
    moved = (4 * batch * c.hidden + c.hidden) * 2
    streamed = {"x": x, "residual": residual}
    note = "residual_out bit-exact vs torch"
    return KernelCheck("input add+RMSNorm", language, run, streamed, moved, errors, note)


def _check_post_norm(
    c: LayerConfig, w: Tensors, batch: int, gen: torch.Generator, t: Target
) -> KernelCheck:
    splits = _plan(c, batch, 1024, t).o_proj.splits
    parts = torch.randn(splits, batch, c.hidden, generator=gen, device=t.device)
    residuals = (_randn((batch, c.hidden), gen, t, 2.0), _randn((batch, c.hidden), gen, t, 2.0))
    out, residual_out = torch.empty_like(residuals[0]), torch.empty_like(residuals[0])
    weight = w["post_attention_layernorm"]

    def run(s: Tensors) -> None:
        add_rmsnorm(s["parts"], residuals, weight, residual_out, out, c.rms_norm_eps)

    def errors() -> tuple[float, float]:
        summed = parts.double().sum(0) + residuals[0].double() + residuals[1].double()
        return _errors(out, stock._rms_norm(summed, weight.double(), c.rms_norm_eps))

    moved = parts.nbytes + (4 * batch * c.hidden + c.hidden) * 2
    name = f"post add+RMSNorm ({splits} o_proj splits)"
    return KernelCheck(name, "Triton", run, {"parts": parts}, moved, errors)


def _check_gemv(
    c: LayerConfig,
    w: Tensors,
    batch: int,
    gen: torch.Generator,
    t: Target,
    name: str,
    language: str = "Triton",
) -> KernelCheck:
    """One GEMV in the Triton kernel or (language "CuTe DSL", on the GPU) cute_gemv's, with the
    same tiles: the two side by side say whether the plan's gemv_cute should be on."""
    weight = w[name]
    n, k = weight.shape
    blocks = gemv_blocks(batch, n, k, t.on_gpu, t.sm_count())
    x = _randn((batch, k), gen, t)
    result: Tensors = {}
    cute = language == "CuTe DSL"
    kernel = cute_gemv.splitk_gemv if cute and t.on_gpu else splitk_gemv
    if cute and not t.on_gpu:  # its Triton stand-in in the CPU smoke run, as the input norm's
        language = "Triton (CPU stand-in)"

    def run(s: Tensors) -> None:
        result["parts"] = kernel(x, s["weight"], blocks)

    def errors() -> tuple[float, float]:
        return _errors(result["parts"].sum(0), x.double() @ weight.double().T)

    column_blocks = triton.cdiv(n, blocks.block_n)
    note = f"{n}x{k}: {column_blocks} column blocks x {blocks.splits} K splits"
    moved = weight.nbytes + x.nbytes + blocks.splits * batch * n * 4
    return KernelCheck(f"GEMV {name}", language, run, {"weight": weight}, moved, errors, note)


def _rope_f64(x: torch.Tensor, positions: torch.Tensor, c: LayerConfig) -> torch.Tensor:
    """GPT-J pairs of x (..., R) rotated by exact angles; positions broadcast against x's
    leading dimensions."""
    rope = x.shape[-1]
    exponents = torch.arange(0, rope, 2, dtype=torch.float64, device=x.device) / rope
    angles = positions.double()[..., None] * c.rope_theta**-exponents
    even, odd = x.double().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = angles.cos(), angles.sin()
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)


def _check_latent_prep(
    c: LayerConfig, w: Tensors, batch: int, gen: torch.Generator, t: Target
) -> KernelCheck:
    splits = _plan(c, batch, 1024, t).qkv_a.splits
    width = c.q_lora_rank + c.latent_dim
    parts = torch.randn(splits, batch, width, generator=gen, device=t.device)
    positions = torch.randint(1024, 32832, (batch,), generator=gen, device=t.device)
    turns = fused.rope_turns(t.device, c.qk_rope_head_dim, c.rope_theta)
    q_c = torch.empty(batch, c.q_lora_rank, dtype=BF16, device=t.device)
    kv_new = torch.empty(batch, c.latent_dim, dtype=BF16, device=t.device)
    norms = (w["q_a_layernorm"], w["kv_a_layernorm"])

    def run(s: Tensors) -> None:
        latent_prep(s["parts"], *norms, positions, turns, q_c, kv_new, c.rms_norm_eps)

    def errors() -> tuple[float, float]:
        sizes = [c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim]
        q_a, kv_c, k_pe = parts.sum(0).to(BF16).split(sizes, -1)
        latent = stock._rms_norm(kv_c, norms[1], c.rms_norm_eps)
        expected_kv = torch.cat([latent.double(), _rope_f64(k_pe, positions, c)], -1)
        q_errors = _errors(q_c, stock._rms_norm(q_a, norms[0], c.rms_norm_eps))
        kv_errors = _errors(kv_new, expected_kv)
        return max(q_errors[0], kv_errors[0]), max(q_errors[1], kv_errors[1])

    moved = parts.nbytes + q_c.nbytes + kv_new.nbytes
    return KernelCheck("q/kv norms + RoPE(k)", "Triton", run, {"parts": parts}, moved, errors)


def _check_q_absorb(
    c: LayerConfig,
    w: Tensors,
    batch: int,
    gen: torch.Generator,
    t: Target,
    blocks: AttentionBlocks | None = None,
) -> KernelCheck:
    """`blocks`: column blocks other than the fused path's plan."""
    plan = _plan(c, batch, 1024, t)
    if blocks is not None:
        plan = replace(plan, attention=blocks)
    heads, nope, rope, lora = c.heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
    width = heads * c.qk_head_dim
    parts = torch.randn(plan.q_b.splits, batch, width, generator=gen, device=t.device)
    positions = torch.randint(1024, 32832, (batch,), generator=gen, device=t.device)
    turns = fused.rope_turns(t.device, rope, c.rope_theta)
    q_lat = torch.empty(batch, heads, c.latent_dim, dtype=BF16, device=t.device)
    kv_b = w["kv_b_proj"]

    def run(s: Tensors) -> None:
        q_absorb(parts, s["kv_b"], positions, turns, q_lat, nope, c.v_head_dim, plan.attention)

    def errors() -> tuple[float, float]:
        q_nope, q_pe = parts.sum(0).to(BF16).view(batch, heads, -1).split([nope, rope], -1)
        w_uk = kv_b.view(heads, nope + c.v_head_dim, lora)[:, :nope]
        absorbed = torch.einsum("bhn,hnl->bhl", q_nope.double(), w_uk.double())
        return _errors(q_lat, torch.cat([absorbed, _rope_f64(q_pe, positions[:, None], c)], -1))

    moved = kv_b.nbytes // 2 + parts.nbytes + q_lat.nbytes
    note = f"{plan.attention.absorb_cols} latent columns per program"
    name = "q_nope @ W_UK + RoPE(q)"
    return KernelCheck(name, "Triton", run, {"kv_b": kv_b}, moved, errors, note)


def _attention_scale(c: LayerConfig) -> float:
    return float(c.qk_head_dim**-0.5)


def _attention_operands(
    c: LayerConfig, batch: int, context: int, gen: torch.Generator, t: Target
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Callable[[], tuple[float, float]]
]:
    """q_lat, cache, kv_new, the o_lat to write, and errors(): o_lat against the stock path's
    latent attention in fp32."""
    q_lat = _randn((batch, c.heads, c.latent_dim), gen, t, 2.0)
    cache = _randn((batch, context, c.latent_dim), gen, t)
    kv_new = _randn((batch, c.latent_dim), gen, t)
    o_lat = torch.empty(batch, c.heads, c.kv_lora_rank, dtype=BF16, device=t.device)

    def errors() -> tuple[float, float]:
        wide_q, wide_cache, wide_new = (x.float() for x in (q_lat, cache, kv_new))
        expected = stock._latent_attention(
            wide_q, wide_cache, wide_new, c.kv_lora_rank, _attention_scale(c)
        )
        return _errors(o_lat, expected)

    return q_lat, cache, kv_new, o_lat, errors


def _check_attention(
    c: LayerConfig,
    w: Tensors,
    batch: int,
    gen: torch.Generator,
    t: Target,
    context: int,
    blocks: AttentionBlocks | None = None,
) -> KernelCheck:
    """`blocks`: tiles and splits other than the fused path's plan."""
    context = min(context, fused.CPU_CONTEXT[1]) if t.small else context
    plan = blocks or _plan(c, batch, context, t).attention
    q_lat, cache, kv_new, o_lat, errors = _attention_operands(c, batch, context, gen, t)

    def run(s: Tensors) -> None:
        mla_attention(q_lat, s["cache"], kv_new, o_lat, _attention_scale(c), plan)

    note = f"{plan.splits} context splits of {plan.tokens_per_split} tokens"
    name = f"MLA split-KV + combine (T={context}, 2 kernels)"
    return KernelCheck(name, "Triton", run, {"cache": cache}, cache.nbytes, errors, note)


def _check_combine(
    c: LayerConfig,
    w: Tensors,
    batch: int,
    gen: torch.Generator,
    t: Target,
    context: int,
    blocks: AttentionBlocks,
) -> KernelCheck:
    """The combine kernel alone, over the split kernel's real partials (computed once)."""
    q_lat, cache, kv_new, o_lat, errors = _attention_operands(c, batch, context, gen, t)
    scale = _attention_scale(c)
    stats, partial = _split_partials(q_lat, cache, c.kv_lora_rank, scale, blocks)

    def run(s: Tensors) -> None:
        _combine(s["stats"], s["partial"], q_lat, kv_new, o_lat, None, scale, blocks)

    moved = stats.nbytes + partial.nbytes + o_lat.nbytes
    note = (
        f"{blocks.splits} splits; {blocks.combine_heads} heads x {blocks.combine_cols} columns "
        f"per program, {blocks.combine_splits} splits per step"
    )
    name = f"MLA combine (T={context})"
    streamed = {"stats": stats, "partial": partial}
    return KernelCheck(name, "Triton", run, streamed, moved, errors, note)


def _check_w_uv(
    c: LayerConfig, w: Tensors, batch: int, gen: torch.Generator, t: Target
) -> KernelCheck:
    plan = _plan(c, batch, 1024, t).attention
    heads, nope, v_dim, lora = c.heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    o_lat = _randn((batch, heads, lora), gen, t)
    o = torch.empty(batch, heads * v_dim, dtype=BF16, device=t.device)
    kv_b = w["kv_b_proj"]

    def run(s: Tensors) -> None:
        w_uv(o_lat, s["kv_b"], o, nope, plan)

    def errors() -> tuple[float, float]:
        w_uv_ref = kv_b.view(heads, nope + v_dim, lora)[:, nope:]
        expected = torch.einsum("bhl,hvl->bhv", o_lat.double(), w_uv_ref.double())
        return _errors(o, expected.reshape(batch, -1))

    moved = kv_b.nbytes // 2 + o_lat.nbytes + o.nbytes
    return KernelCheck("o_lat @ W_UV", "Triton", run, {"kv_b": kv_b}, moved, errors)


def _check_route(
    c: LayerConfig, w: Tensors, batch: int, gen: torch.Generator, t: Target
) -> KernelCheck:
    splits = _plan(c, batch, 1024, t).router.splits
    parts = torch.randn(splits, batch, c.experts_total, generator=gen, device=t.device) / 2
    bias = w["e_score_correction_bias"]
    result: Tensors = {}

    def run(s: Tensors) -> None:
        ids, weights = route(s["parts"], bias, c.top_k, c.norm_topk_prob, c.routed_scaling_factor)
        result.update(ids=ids, weights=weights)

    def errors() -> tuple[float, float]:
        expected_weights, expected_ids = stock._select_experts(c, parts.sum(0), bias)
        assert torch.equal(result["ids"].long(), expected_ids), "top-k ids differ from torch's"
        return _errors(result["weights"], expected_weights)

    name, note = "routing (sigmoid, biased top-k)", "ids equal torch.topk's"
    return KernelCheck(name, "Triton", run, {"parts": parts}, parts.nbytes, errors, note)


def _check_moe(
    c: LayerConfig,
    w: Tensors,
    batch: int,
    gen: torch.Generator,
    t: Target,
    blocks: MoeBlocks | None = None,
    shared_only: bool = False,
    part: str = "both",
    local_experts: int | None = None,
) -> KernelCheck:
    """Routing drawn uniformly (each token top_k of all experts; one local expert forced for
    the first token); each timing copy draws its own, so consecutive launches read different
    experts, as different layers would. `local_experts`: instead, every copy chooses exactly
    that many of this GPU's experts (_ids_with_local_experts). `blocks`: tiles other than the
    fused path's plan.
    `shared_only`: every token routed to other GPUs' experts, so only the shared expert runs
    (a third of the layers at batch 1). `part`: "both" kernels, or only the "gate_up" or the
    "down" timed (each copy's act made beforehand), with that kernel's bytes: which of the two
    reads below the HBM's rate."""
    plan = blocks or _plan(c, batch, 1024, t).moe
    h = _randn((batch, c.hidden), gen, t)
    routing = torch.rand(batch, c.top_k, generator=gen, device=t.device) / 2
    out = torch.empty_like(h)
    experts = (w["experts_w13"], w["experts_w2"], w["shared_gate_up"], w["shared_down"])

    def draw() -> Tensors:
        if local_experts is not None:
            return {"ids": _ids_with_local_experts(c, batch, local_experts, gen, t.device)}
        pool = c.experts_total - c.experts if shared_only else c.experts_total
        rows = [torch.randperm(pool, generator=gen, device=t.device) for _ in h]
        ids = torch.stack(rows)[:, : c.top_k].contiguous()
        if shared_only:  # skip this GPU's range of global ids
            return {"ids": torch.where(ids >= c.expert_offset, ids + c.experts, ids).int()}
        forced = torch.randint(c.experts, (1,), generator=gen, device=t.device)
        ids[0, 0] = c.expert_offset + forced[0]
        return {"ids": ids.int()}

    copies = [draw() for _ in range(MAX_COPIES if t.on_gpu else 2)]
    w13, w2, shared_gate_up, shared_down = experts

    def gate_up(s: Tensors) -> None:
        s["act"] = moe_gate_up(h, s["ids"], w13, shared_gate_up, c.expert_offset, plan)

    def down(s: Tensors) -> None:
        moe_down(s["act"], s["ids"], routing, w2, shared_down, out, c.expert_offset, plan)

    def both(s: Tensors) -> None:
        fused_moe(h, s["ids"], routing, *experts, out, c.expert_offset, plan)

    run = {"both": both, "gate_up": gate_up, "down": down}[part]
    if part != "both":  # the act each copy's down reads; the gate_up's errors go through it
        for copy in copies:
            gate_up(copy)

    def errors() -> tuple[float, float]:
        if part == "gate_up":
            gate_up(copies[0])
        if part != "both":
            down(copies[0])
        return _errors(out, _moe_reference(c, w, h, copies[0]["ids"].long(), routing))

    active = [_local_experts(c, copy["ids"]) for copy in copies]
    kernels = {"both": ("w13", "w2"), "gate_up": ("w13",), "down": ("w2",)}[part]
    per_expert = sum(w[f"experts_{name}"][0].nbytes for name in kernels)
    shared = sum(w[f"shared_{n}"].nbytes for n in ("gate_up", "down") if part in ("both", n))
    moved = round(median([float(n) for n in active]) * per_expert) + shared
    note = f"active local experts per launch {min(active)}-{max(active)}"
    name = {
        "both": "MoE gate_up+SiLU, down+combine (2 kernels)",
        "gate_up": "MoE gate_up+SiLU alone",
        "down": "MoE down+combine alone",
    }[part]
    return KernelCheck(name, "Triton", run, copies[0], moved, errors, note, copies=copies)


def _ids_with_local_experts(
    c: LayerConfig, batch: int, n: int, gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    """(batch, top_k) expert ids that choose exactly n distinct local experts, one token each
    (the usual case at batch <= 8): local expert j goes to token j % batch, slot j // batch;
    every other slot is another GPU's expert, distinct within its token."""
    if not 0 <= n <= min(c.experts, batch * c.top_k):
        shard = f"this shard has {c.experts}, batch x top_k is {batch * c.top_k}"
        raise ValueError(f"{n} local experts: {shard}")
    others = c.experts_total - c.experts
    rows = [torch.randperm(others, generator=gen, device=device)[: c.top_k] for _ in range(batch)]
    ids = torch.stack(rows)
    ids = torch.where(ids >= c.expert_offset, ids + c.experts, ids)  # step over the local range
    local = torch.randperm(c.experts, generator=gen, device=device)[:n] + c.expert_offset
    # (top_k, batch): flat index j is token j % batch, slot j // batch
    by_slot = ids.t().contiguous()
    by_slot.view(-1)[:n] = local
    return by_slot.t().contiguous().int()


def _local_experts(c: LayerConfig, ids: torch.Tensor) -> int:
    local = ids.long() - c.expert_offset
    return int(local[(local >= 0) & (local < c.experts)].unique().numel())


def _moe_reference(
    c: LayerConfig, w: Tensors, h: torch.Tensor, ids: torch.Tensor, routing: torch.Tensor
) -> torch.Tensor:
    """Per (token, local expert) in fp32 with the kernels' one bf16 rounding, of the activation
    (the down GEMM's operand); the shared expert for every token; summed in fp64."""

    def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        gate, up = (x.float() @ gate_up.float().T).chunk(2, -1)
        act = (gate * torch.sigmoid(gate) * up).to(BF16).float()
        return (act @ down.float().T).double()

    total = swiglu(h, w["shared_gate_up"], w["shared_down"])
    local = ids - c.expert_offset
    for token, slot in ((local >= 0) & (local < c.experts)).nonzero().tolist():
        expert = int(local[token, slot])
        down = swiglu(h[token : token + 1], w["experts_w13"][expert], w["experts_w2"][expert])
        total[token] += float(routing[token, slot]) * down[0]
    return total


def run_kernel_check(check: KernelCheck, batch: int, t: Target) -> KernelRow:
    row = KernelRow(check.name, check.language, batch, note=check.note)
    copies = check.copies or _clones(check.streamed, t)
    check.run(copies[0])
    _sync(t)
    row.max_abs_error, row.relative_error = check.errors()
    row.us = _us_per_launch(check.run, copies, t)
    row.gb_per_s = check.bytes_moved / (row.us * 1e3)
    return row


def _clones(streamed: Tensors, t: Target, max_copies: int = MAX_COPIES) -> list[Tensors]:
    """The operands and clones of them: together more than 4x L2, so no launch hits L2 (up to
    max_copies in all)."""
    size = max(1, sum(x.nbytes for x in streamed.values()))
    count = min(max_copies, max(1, math.ceil(4 * H200_L2_BYTES / size))) if t.on_gpu else 1
    return [streamed] + [{k: v.clone() for k, v in streamed.items()} for _ in range(count - 1)]


def _us_per_launch(run: Callable[[Tensors], None], copies: list[Tensors], t: Target) -> float:
    """Median over replays of one CUDA graph holding one launch per copy, per launch (host
    clock of direct calls in the CPU smoke run)."""
    if not t.on_gpu:
        started = time.perf_counter()
        for copy in copies:
            run(copy)
        return 1e6 * (time.perf_counter() - started) / len(copies)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture: compilation, first-call setup
        for copy in copies:
            run(copy)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for copy in copies:
            run(copy)
    times = []
    for _ in range(REPLAYS + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(1e3 * start.elapsed_time(end) / len(copies))
    return median(times[2:])


def part_kernels(
    problem: Problem, batches: list[int], t: Target, skip: tuple[str, ...] = ()
) -> list[KernelRow]:
    weights = problem.make_weights(_case(1, 1024, t), 0, t.device)
    rows = []
    for batch in batches:
        gen = torch.Generator(device=t.device).manual_seed(batch)
        for build in kernel_builders(skip):
            # named before it runs: a kernel that hangs the GPU is then the last line printed
            print(f"  {_builder_name(build)} batch {batch} ...", flush=True)
            rows.append(_soft_kernel(build, problem.config, weights, batch, gen, t))
            _print_kernel_row(rows[-1])
    del weights
    _empty_cache(t)
    return rows


def _soft_kernel(
    build: Builder, c: LayerConfig, w: Tensors, batch: int, gen: torch.Generator, t: Target
) -> KernelRow:
    name = getattr(build, "__name__", None) or getattr(build, "func", build).__name__
    try:
        check = build(c, w, batch, gen, t)
        name = check.name
        return run_kernel_check(check, batch, t)
    except Exception as exc:  # fail soft: report and go on
        _sync(t)
        return KernelRow(name, "", batch, error=_describe(exc))


# --sweep-moe: the MoE kernels' tiles, timed as part 1 times them.

# (gate_up_cols, gate_up_k, down_cols, down_k, num_warps, num_stages[, gate_up_splits,
# down_splits[, gate_up_programs[, shared_splits[, token_rows]]]]): MoeBlocks' fields after
# block_m, which follows the batch
# Earlier sweeps' variants and what they showed are in docs/mla_moe_notes.md and the JSONs named
# there (2026-12-03: wider gate_up programs won at batch 1, split K lost 111-274 µs against 90;
# 2026-12-04: the shared expert split 4-28 ways, the down kernel's shape, 3 stages); the list
# keeps the plan, the closest of them, and the seventeenth session's question, the gate_up's grid.
# 4 stages of (64 + 16) x 128 bf16 leave 2-3 gate_up programs per SM, and about 480 items at
# batch 8 then run as a full wave and a partial one (read_bandwidth.py's tiles_waves: 3.59 TB/s
# for 480 such tiles one program each, 4.34 for 1152 looped over by 396). A capped grid loops
# over the items: 132 / 198 / 264 / 330 are 1 / 1.5 / 2 / 2.5 programs per H200 SM.
MOE_TILES_SMALL = [
    (32, 128, 32, 128, 4, 4),  # the plan for batch 5-16 until the seventeenth session
    (32, 128, 32, 128, 4, 4, 1, 1, 0, 14),  # the plan at batch <= 4
    (16, 128, 32, 128, 4, 6),
    (64, 128, 32, 128, 4, 4),
    (32, 128, 32, 256, 4, 4),  # down K steps of 256: 1-2.5% faster at batch 8 and 16
    (32, 128, 32, 128, 4, 4, 1, 2),
    # (..., gate_up splits, down splits, at most this many gate_up programs[, shared splits])
    (32, 128, 32, 128, 4, 4, 1, 1, 198),
    (32, 128, 32, 128, 4, 4, 1, 1, 264),
    (32, 128, 32, 128, 4, 4, 1, 1, 330),
    (32, 128, 32, 128, 4, 4, 1, 1, 264, 14),
    (32, 128, 32, 256, 4, 4, 1, 1, 264),  # the plan at batch 5-16 since (264: 2 per H200 SM)
    (32, 128, 32, 128, 4, 4, 1, 2, 264),
    (16, 128, 32, 128, 4, 6, 1, 1, 396),  # 3 per SM
    (64, 128, 32, 128, 4, 4, 1, 1, 132),  # 1 per SM (4 stages of (128 + 16) x 128)
    (64, 128, 32, 128, 4, 3, 1, 1, 264),
]
# Above batch 16 the 2026-12-03 sweeps (docs/runs/2026-12-03-worklist/moe.json.gz) had the plan
# within 2% of every other gate_up tiling, and narrower down programs 38% slower. The ninth
# session's profile had the down kernel at about 0.7 of the gate_up's bandwidth at batch 64,
# so the rest vary the down kernel: its K split over 2 or 4 programs (each sums its share of
# every expert; the last to finish adds the partials in order), its K step and stages.
# None beat the plan at 64. The tenth session tried a down kernel with one flat loop over
# (expert, K step): 28-39% slower at batch 8-64 and removed (docs/mla_moe_notes.md).
MOE_TILES_LARGE = [
    (32, 128, 32, 128, 4, 3),  # the plan for batch > 16 until the seventeenth session
    (32, 128, 32, 256, 4, 3),
    (32, 128, 32, 128, 4, 3, 1, 1, 264),
    # each expert's tokens gathered into tiles of 16 or 32 rows (token_rows): at batch 64 a
    # local expert has one or two tokens, and the 64-row tile held the rest masked, in shared
    # memory (3 stages of (64 + 64) x 128 for the gate_up) and in the MMA
    (32, 128, 32, 128, 4, 3, 1, 1, 0, 1, 16),
    (32, 128, 32, 128, 4, 4, 1, 1, 0, 1, 16),
    (32, 128, 32, 128, 4, 4, 1, 1, 264, 1, 16),  # the plan at batch 33-64 since
    (32, 128, 32, 256, 4, 4, 1, 1, 264, 1, 16),  # the plan at batch 17-32 since
    (32, 128, 32, 256, 4, 4, 1, 1, 0, 1, 16),
    (32, 128, 32, 128, 4, 4, 1, 2, 264, 1, 16),
    (32, 128, 16, 128, 4, 4, 1, 1, 264, 1, 16),
    (32, 128, 32, 128, 4, 4, 1, 1, 264, 1, 32),
    (32, 128, 32, 256, 4, 3, 1, 1, 264, 1, 32),
    (16, 128, 32, 128, 4, 6, 1, 1, 396, 1, 16),
    (64, 128, 32, 128, 4, 4, 1, 1, 132, 1, 16),
]


def sweep_moe(problem: Problem, batches: list[int], t: Target) -> list[KernelRow]:
    weights = problem.make_weights(_case(1, 1024, t), 0, t.device)
    rows = []
    for batch in batches:
        # the plan's two kernels, each timed alone with its own bytes, then the tilings
        for part in ("gate_up", "down"):
            gen = torch.Generator(device=t.device).manual_seed(batch)
            build = partial(_check_moe, part=part)
            rows.append(_soft_kernel(build, problem.config, weights, batch, gen, t))
            _print_kernel_row(rows[-1])
        block_m = max(16, triton.next_power_of_2(batch))
        for tiles in MOE_TILES_SMALL if batch <= 16 else MOE_TILES_LARGE:
            # at batch 1 also with the shared expert alone: its few programs are then the
            # whole critical path (docs/mla_moe_notes.md, sixth session)
            for shared_only in (False, True) if batch == 1 else (False,):
                blocks = MoeBlocks(block_m, *tiles)
                gen = torch.Generator(device=t.device).manual_seed(batch)
                build = partial(_check_moe, blocks=blocks, shared_only=shared_only)
                row = _soft_kernel(build, problem.config, weights, batch, gen, t)
                row.note = f"tiles {tiles}; {row.note}"
                rows.append(row)
                _print_kernel_row(row)
    return rows


# --sweep-moe-down: the down as work items (MoeBlocks.down_programs) against the plan's down,
# which walks every chosen expert in one program per 32 output columns (224 programs). Timed
# alone, that down read at 3.76 / 3.25 TB/s at batch 8 / 64 where the gate_up read 4.41 /
# 4.61 (2026-12-04, docs/runs/2026-12-04-eighteenth/moe-split.json.gz): each program holds
# 3 weight tiles in flight (4 stages of 32 x 128 bf16 at batch 64, 8 KB each; its 64-row act
# tile, masked, takes twice that shared memory again, so 2 fit on an SM) and refills its
# pipeline at each of ~35 experts. As items, a tile is one expert's tokens gathered 16 at a
# time, so a stage is (16 + columns) x K, and several programs per SM overlap their refills.
# (down_cols, down_k, down_programs), on the batch's plan; 132 SMs on the H200:
MOE_DOWN_ITEMS = [
    (32, 128, 528),  # 4 stages of (16 + 32) x 128: 48 KB, 4 programs per SM
    (32, 128, 396),  # 3 per SM
    (32, 256, 264),  # 96 KB: 2 per SM, twice the bytes in flight each
    (64, 128, 264),  # 80 KB: 2 per SM
    (32, 64, 792),  # 24 KB: 6 per SM, smaller steps
]


def sweep_moe_down(problem: Problem, batches: list[int], t: Target) -> list[KernelRow]:
    """The plan's MoE and each MOE_DOWN_ITEMS down, each as the pair and the down alone."""
    weights = problem.make_weights(_case(1, 1024, t), 0, t.device)
    rows = []
    for batch in batches:
        plan = _plan(problem.config, batch, 1024, t).moe
        variants = [plan] + [
            replace(plan, down_cols=cols, down_k=k, down_programs=programs)
            for cols, k, programs in MOE_DOWN_ITEMS
        ]
        for blocks in variants:
            for part in ("both", "down"):
                gen = torch.Generator(device=t.device).manual_seed(batch)
                build = partial(_check_moe, blocks=blocks, part=part)
                row = _soft_kernel(build, problem.config, weights, batch, gen, t)
                down = (blocks.down_cols, blocks.down_k, blocks.down_programs)
                row.note = f"down (cols, K, programs) {down}; {row.note}"
                rows.append(row)
                _print_kernel_row(row)
    return rows


# --sweep-moe-rounds: the MoE pair with exactly n local experts per launch, for each gate_up
# grid. Capped at 2 programs per SM (264 on the H200, the plan at batch 5-8), the gate_up's
# items (each local expert's 64 feature blocks, and the shared expert's 8) fall into rounds: 8
# experts make 520 items, under two rounds of 264; 9 make 584, and 56 programs run a third
# item while most SMs wait. Batch 8's validates ran 15-30 µs per layer above their floor at
# some contexts and not at others with the same mean expert count (docs/benchmarks.md, run 19):
# whether the rounds do that is what this measures, against one program per item and 3 per
# SM (as many as fit: 60 KB and 149 registers under Triton 3.6).
MOE_ROUNDS_EXPERTS = range(4, 13)


def sweep_moe_rounds(problem: Problem, batches: list[int], t: Target) -> list[KernelRow]:
    c = problem.config
    weights = problem.make_weights(_case(1, 1024, t), 0, t.device)
    sms = max(t.sm_count(), 4)
    counts = MOE_ROUNDS_EXPERTS if t.on_gpu else range(2, 4)
    rows = []
    for batch in batches:
        plan = _plan(c, batch, 1024, t).moe
        caps = dict.fromkeys([plan.gate_up_programs, 0, 2 * sms, 3 * sms])
        for n in counts:
            for cap in caps:
                gen = torch.Generator(device=t.device).manual_seed(batch * 100 + n)
                blocks = replace(plan, gate_up_programs=cap)
                build = partial(_check_moe, blocks=blocks, local_experts=n)
                row = _soft_kernel(build, c, weights, batch, gen, t)
                grid = f"gate_up grid {cap or 'one per item'}"
                if cap == plan.gate_up_programs:
                    grid += " (plan)"
                row.note = f"{n} local experts; {grid}; {row.note}"
                rows.append(row)
                _print_kernel_row(row)
    return rows


# --sweep-attention: the split-KV attention's splits and tiles, timed as part 1.

# (cached tokens per tile, (token, split) programs per SM, least tiles per split, warps,
# stages, latent columns per combine program, splits per combine step); the first is the plan
# at batch <= 8 since the 2026-12-03 sweep, the second the plan above 8 until the next sweep
# (their combine shapes are the old plan's: `--sweep-combine` chose the plan's since 2026-12-04)
ATTENTION_VARIANTS = [
    (64, 1, 1, 4, 3, 32, 128),
    (32, 2, 2, 4, 2, 128, 32),
    (32, 1, 2, 4, 3, 128, 32),
    (32, 4, 2, 4, 2, 128, 32),
    (64, 1, 1, 4, 3, 128, 32),
    (64, 2, 1, 4, 2, 128, 32),
    (32, 2, 4, 4, 3, 128, 32),
    (32, 2, 2, 8, 2, 128, 32),
    (32, 2, 2, 4, 2, 64, 64),
    (32, 1, 4, 4, 3, 64, 64),
    (32, 2, 2, 4, 2, 32, 128),  # combine: 4x the programs, every split in one step
    (32, 1, 2, 4, 3, 64, 128),
    (32, 2, 2, 4, 2, 32, 256),  # every split of 32k in one combine step
    (64, 2, 1, 4, 3, 32, 256),
]
# Above batch 8 (not swept before 2026-12-03's sixth session): more programs per SM, so that
# the last wave of (token, split) programs is a small part of the launch (batch 64 x 32768 ran
# 320 programs on 132 SMs at 2.4-2.6 TB/s), and the small-batch plan's 64-token tiles.
# The plan since then (16 splits of at least 4 tiles, fused._attention_blocks) is not of this
# form; the first two come closest at batch 16 and 64 (17 splits where it takes 16).
ATTENTION_VARIANTS_LARGE = [
    (32, 2, 4, 4, 3, 128, 32),
    (32, 8, 4, 4, 3, 128, 32),
    (32, 2, 2, 4, 2, 128, 32),  # the plan above batch 8 before
    (64, 1, 1, 4, 3, 32, 128),  # the plan's tiles at batch <= 8
    (64, 2, 1, 4, 3, 128, 32),
    (64, 4, 1, 4, 3, 128, 32),
    (64, 8, 1, 4, 3, 128, 32),
    (64, 16, 1, 4, 3, 128, 32),
    (64, 4, 1, 8, 3, 128, 32),
    (64, 8, 1, 8, 3, 128, 32),
    (64, 4, 1, 4, 2, 128, 32),
    (32, 4, 2, 4, 3, 128, 32),
    (32, 8, 2, 4, 3, 128, 32),
    (32, 16, 2, 4, 3, 128, 32),
    (32, 4, 2, 4, 4, 128, 32),
    (32, 8, 2, 8, 4, 128, 32),
]


def attention_variant(
    plan: AttentionBlocks, context: int, batch: int, sm_count: int, variant: tuple[int, ...]
) -> AttentionBlocks:
    """The plan with one variant's tiles, and its splits chosen by the plan's rule: split until
    every SM has `per_sm` (token, split) programs, keeping `least_tiles` tiles per split."""
    block_t, per_sm, least_tiles, warps, stages, combine_cols, combine_splits = variant
    splits = min(triton.cdiv(per_sm * sm_count, batch), triton.cdiv(context, least_tiles * block_t))
    tokens = triton.cdiv(triton.cdiv(context, splits), block_t) * block_t
    return replace(
        plan,
        block_t=block_t,
        splits=triton.cdiv(context, tokens),
        tokens_per_split=tokens,
        combine_cols=combine_cols,
        combine_splits=combine_splits,
        split_warps=warps,
        split_stages=stages,
    )


def sweep_attention(
    problem: Problem, batches: list[int], contexts: list[int], t: Target
) -> list[KernelRow]:
    c = problem.config
    rows = []
    for batch in batches:
        for context in contexts:
            plan = _plan(c, batch, context, t).attention
            variants = ATTENTION_VARIANTS if batch <= 8 else ATTENTION_VARIANTS_LARGE
            sms = max(t.sm_count(), 4)
            tilings = [("plan", plan)] + [
                (f"variant {v}", attention_variant(plan, context, batch, sms, v))
                for v in (variants if t.on_gpu else variants[:2])
            ]
            for name, blocks in tilings:
                gen = torch.Generator(device=t.device).manual_seed(batch)
                build = partial(_check_attention, context=context, blocks=blocks)
                row = _soft_kernel(build, c, {}, batch, gen, t)
                row.note = f"{name}; {blocks.splits} splits of {blocks.tokens_per_split}"
                rows.append(row)
                _print_kernel_row(row)
    return rows


# --sweep-combine: the combine's and q_absorb's programs, timed as part 1. Both are small
# kernels that took 10.5 and 11.9 µs at batch 64 x 1024 in the ninth session's profile, for a
# few MB: the combine ran one program per (token, head, 128 columns), 2048 at batch 64, each a
# chain of dependent loads. (heads, latent columns, splits per step) per combine program; the
# first two were the plans at batch <= 8 and above before this sweep's first run (2026-12-04).
COMBINE_VARIANTS = [
    (1, 32, 128),
    (1, 128, 32),
    (1, 64, 64),
    (1, 256, 32),
    (2, 128, 16),
    (4, 128, 8),
    (4, 64, 32),
    (8, 128, 8),
    (8, 64, 16),
    (8, 32, 32),
]
ABSORB_COLUMNS = [64, 32, 128, 256]  # the first was the plan at every batch until 2026-12-04


def sweep_combine(
    problem: Problem, batches: list[int], contexts: list[int], t: Target
) -> list[KernelRow]:
    c = problem.config
    weights = {"kv_b_proj": problem.make_weights(_case(1, 1024, t), 0, t.device)["kv_b_proj"]}
    rows = []
    for batch in batches:
        for context in contexts:
            plan = _plan(c, batch, context, t).attention
            for heads, cols, per_step in COMBINE_VARIANTS if t.on_gpu else COMBINE_VARIANTS[:2]:
                blocks = replace(
                    plan, combine_heads=heads, combine_cols=cols, combine_splits=per_step
                )
                gen = torch.Generator(device=t.device).manual_seed(batch)
                build = partial(_check_combine, context=context, blocks=blocks)
                rows.append(_soft_kernel(build, c, {}, batch, gen, t))
                _print_kernel_row(rows[-1])
        plan = _plan(c, batch, 1024, t).attention
        for cols in ABSORB_COLUMNS if t.on_gpu else ABSORB_COLUMNS[:2]:
            gen = torch.Generator(device=t.device).manual_seed(batch)
            build = partial(_check_q_absorb, blocks=replace(plan, absorb_cols=cols))
            rows.append(_soft_kernel(build, c, weights, batch, gen, t))
            _print_kernel_row(rows[-1])
    return rows


# --sweep-router: the router GEMV's tiles and K splits, timed together with the routing kernel
# that adds its partial sums. At batch 1 the plan splits K 28 ways (6 column blocks of 64 rows
# need that many programs to stream the 5.5 MB weight), and routing then waits 28 partials
# in groups of 4 (5.8 µs alone, docs/mla_moe_notes.md): narrower column blocks give the same
# programs with fewer splits.

# (rows per column block, K per step, K splits wanted, warps, stages); block_m follows the
# batch. None: the plan's tiles.
ROUTER_VARIANTS = [
    None,
    (64, 128, 14, 4, 4),
    (32, 128, 14, 4, 4),
    (32, 128, 8, 4, 4),
    (16, 128, 8, 4, 4),
    (16, 128, 4, 4, 4),
    (16, 256, 4, 4, 3),
    (32, 256, 7, 4, 3),
]


def _check_router(
    c: LayerConfig,
    w: Tensors,
    batch: int,
    gen: torch.Generator,
    t: Target,
    variant: tuple[int, ...] | None = None,
) -> KernelCheck:
    weight, bias = w["gate"], w["e_score_correction_bias"]
    n, k = weight.shape
    blocks = _plan(c, batch, 1024, t).router
    if variant is not None:
        block_n, block_k, wanted, warps, stages = variant
        k_per_split, splits = triton_common.k_splits(k, wanted, block_k)
        blocks = GemvBlocks(blocks.block_m, block_n, block_k, k_per_split, splits, warps, stages)
    x = _randn((batch, k), gen, t)
    result: Tensors = {}

    def run(s: Tensors) -> None:
        parts = splitk_gemv(x, s["weight"], blocks)
        ids, weights = route(parts, bias, c.top_k, c.norm_topk_prob, c.routed_scaling_factor)
        result.update(parts=parts, ids=ids, weights=weights)

    def errors() -> tuple[float, float]:
        # torch's selection from the same partial sums (added in its own order: a near-tie
        # could still flip, and would show here as a large error)
        expected_weights, _ = stock._select_experts(c, result["parts"].sum(0), bias)
        return _errors(result["weights"], expected_weights)

    note = f"{triton.cdiv(n, blocks.block_n)} column blocks x {blocks.splits} K splits"
    moved = weight.nbytes + 2 * blocks.splits * batch * n * 4  # the partials, written and read
    name = "router GEMV + routing (2 kernels)"
    return KernelCheck(name, "Triton", run, {"weight": weight}, moved, errors, note)


def sweep_router(problem: Problem, batches: list[int], t: Target) -> list[KernelRow]:
    weights = problem.make_weights(_case(1, 1024, t), 0, t.device)
    rows = []
    for batch in batches:
        for variant in ROUTER_VARIANTS if t.on_gpu else ROUTER_VARIANTS[:2]:
            gen = torch.Generator(device=t.device).manual_seed(batch)
            build = partial(_check_router, variant=variant)
            row = _soft_kernel(build, problem.config, weights, batch, gen, t)
            row.note = f"variant {variant or 'plan'}; {row.note}"
            rows.append(row)
            _print_kernel_row(row)
    return rows


# Part 2: the layer.


def part_layer(
    problem: Problem, cases: list[tuple[int, int]], read_bw: float, t: Target
) -> list[LayerRow]:
    measure = partial(_measure_layer, read_bw=read_bw)
    return _each_case(problem, cases, t, LayerRow, measure, _print_layer_row)


def _each_case(
    problem: Problem,
    cases: list[tuple[int, int]],
    t: Target,
    new_row: Callable[[int, int], Any],
    measure: Callable[..., None],
    show: Callable[[Any], None],
) -> list[Any]:
    """One row per (batch, context) over the same 3 layers' weights: `measure(problem, weights,
    case, row, t)` fills it; an exception is recorded in row.errors and the run goes on."""
    weights = [problem.make_weights(_case(1, 1024, t), seed, t.device) for seed in range(LAYERS)]
    rows = []
    for batch, context in cases:
        row = new_row(batch, context)
        try:
            measure(problem, weights, _case(batch, context, t), row=row, t=t)
        except Exception as exc:  # fail soft: report and go on
            row.errors.append(_describe(exc))
        _sync(t)
        _empty_cache(t)
        rows.append(row)
        show(row)
    return rows


def _measure_layer(
    problem: Problem, weights: list[Tensors], case: Case, row: LayerRow, t: Target, read_bw: float
) -> None:
    inputs = [problem.make_inputs(case, 1000 + layer, t.device) for layer in range(LAYERS)]
    pairs = list(zip(weights, inputs, strict=True))
    row.active_local_experts = [
        len(activated_local_experts(problem.config, w, x)) for w, x in pairs
    ]
    floor_bytes = sum(problem.floor_bytes(case, w, x) for w, x in pairs) / LAYERS
    row.floor_us = 1e6 * floor_bytes / read_bw
    # the CPU smoke run has no Inductor build: the eager stock stands in for the compiled one
    compiled = stock.forward_compiled if t.on_gpu else stock.forward
    paths = {"fused": fused.forward, "eager": stock.forward, "compiled": compiled}
    steps, outputs = {}, {}
    for name, fn in paths.items():
        try:
            layer_set, outputs[name] = _layers(problem, pairs, case, t)
            steps[name] = _step(fn, layer_set, t)
            kernels = profile_step(steps[name], LAYERS, t.device).kernels_per_layer
            setattr(row, f"kernels_{name}", kernels)
        except Exception as exc:  # one path failing leaves the others measured
            row.errors.append(f"{name}: {_describe(exc)}")
            steps.pop(name, None)
    _time_paths(steps, row, t)
    if "fused" in steps and "compiled" in steps:
        row.fused_vs_compiled = _differences(outputs["fused"], outputs["compiled"])


def _layers(
    problem: Problem, pairs: list[tuple[Tensors, Tensors]], case: Case, t: Target
) -> tuple[LayerSet, list[Tensors]]:
    outputs = [problem.make_outputs(case, t.device) for _ in pairs]
    args = [(w, x, out) for (w, x), out in zip(pairs, outputs, strict=True)]
    size = sum(x.nbytes for group in args for tensors in group for x in tensors.values())
    return LayerSet(args, size), outputs


def _step(
    fn: Callable[[Tensors, Tensors, Tensors], None], layer_set: LayerSet, t: Target
) -> Callable[[], None]:
    """One call that runs every layer: a graph replay on the GPU, eager calls on the CPU."""
    if t.on_gpu:
        return capture_graph(fn, layer_set).replay
    run_layers(fn, layer_set)
    return lambda: run_layers(fn, layer_set)


def _time_paths(steps: dict[str, Callable[[], None]], row: LayerRow, t: Target) -> None:
    """Each path alternating with the compiled stock (the baseline), as the engine samples."""
    if "compiled" not in steps:
        return
    count = PAIRS if t.on_gpu else 2
    compiled_samples: list[float] = []
    for name in ("fused", "eager"):
        if name not in steps:
            continue
        samples = timed_pairs(steps[name], steps["compiled"], count, t.device)
        setattr(row, f"{name}_us", median([a for a, _ in samples]) / LAYERS)
        compiled_samples += [b for _, b in samples]
    row.compiled_us = median(compiled_samples) / LAYERS if compiled_samples else None
    if row.fused_us and row.compiled_us and row.floor_us:
        row.speedup_vs_compiled = row.compiled_us / row.fused_us
        row.fused_floor_fraction = row.floor_us / row.fused_us
        row.compiled_floor_fraction = row.floor_us / row.compiled_us


def _differences(got: list[Tensors], expected: list[Tensors]) -> dict[str, float]:
    """Largest relative difference over the layers, per output."""
    result: dict[str, float] = {}
    for mine, theirs in zip(got, expected, strict=True):
        for name, value in mine.items():
            reference = theirs[name].double()
            relative = float((value.double() - reference).norm() / reference.norm())
            result[name] = max(result.get(name, 0.0), relative)
    return result


# --profile-fused: where a fused layer's time goes, kernel by kernel, inside its CUDA graph.


# The MoE's kernels (one stream kernel above batch 4, gate_up and down below): their time
# against the MoE's own bytes splits the time above the floor between the MoE and the rest.
MOE_KERNELS = ("_moe_stream_kernel", "_gate_up_kernel", "_down_kernel", "_down_items_kernel")


@dataclass
class ProfileRow:
    batch: int
    context: int
    layer_us: float | None = None  # first kernel start to last kernel end, per layer
    kernels: list[dict[str, object]] = field(default_factory=list)  # one layer, launch order
    # the middle layer's floor (Problem.floor_bytes / the read bandwidth, but with the experts
    # the fused routing chose: they differ from the stock routing's only on a near-tie) and
    # its MoE part: the shared expert and those local experts
    floor_us: float | None = None
    moe_floor_us: float | None = None  # of the experts the fused routing chose (what it read)
    active_local_experts: int | None = None  # chosen by the stock routing (the floor's)
    fused_local_experts: int | None = None  # chosen by the fused path's own routing
    errors: list[str] = field(default_factory=list)


def profile_fused(
    problem: Problem, cases: list[tuple[int, int]], read_bw: float, t: Target
) -> list[ProfileRow]:
    """CUPTI kernel records of one replay of the 3-layer fused graph: per kernel of the middle
    layer its duration and the idle gap before it (launch latency between dependent kernels),
    and that layer's floor with its MoE part."""
    measure = partial(_profile_case, read_bw=read_bw)
    return _each_case(problem, cases, t, ProfileRow, measure, print_profile_row)


def _moe_bytes(weights: Tensors, active: int) -> int:
    shared = weights["shared_gate_up"].nbytes + weights["shared_down"].nbytes
    return shared + active * sum(weights[n][0].nbytes for n in EXPERT_WEIGHTS)


def _profile_case(
    problem: Problem,
    weights: list[Tensors],
    case: Case,
    row: ProfileRow,
    t: Target,
    read_bw: float,
) -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    inputs = [problem.make_inputs(case, 1000 + layer, t.device) for layer in range(LAYERS)]
    middle_w, middle_x = weights[1], inputs[1]
    row.active_local_experts = len(activated_local_experts(problem.config, middle_w, middle_x))
    row.floor_us = 1e6 * problem.floor_bytes(case, middle_w, middle_x) / read_bw
    # a near-tie may route the two paths to different experts: the MoE's kernels read the
    # fused routing's, so their part of the floor counts those (the rest is the same bytes)
    row.fused_local_experts = _local_experts(problem.config, fused.route(middle_w, middle_x)[1])
    moe_bytes = _moe_bytes(middle_w, row.fused_local_experts)
    row.moe_floor_us = 1e6 * moe_bytes / read_bw
    stock_moe_bytes = _moe_bytes(middle_w, row.active_local_experts)
    row.floor_us += 1e6 * (moe_bytes - stock_moe_bytes) / read_bw
    layer_set, _ = _layers(problem, list(zip(weights, inputs, strict=True)), case, t)
    step = _step(fused.forward, layer_set, t)
    for _ in range(3):
        step()
    _sync(t)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if t.on_gpu else [])
    with profile(activities=activities) as prof:
        step()
        _sync(t)
    wanted = DeviceType.CUDA if t.on_gpu else DeviceType.CPU
    events = sorted(
        (e for e in prof.events() if e.device_type == wanted and e.cpu_parent is None),
        key=lambda e: e.time_range.start,
    )
    per_layer = len(events) // LAYERS
    if per_layer == 0:
        raise RuntimeError("the profiler recorded no kernels")
    row.layer_us = (events[-1].time_range.end - events[0].time_range.start) / LAYERS
    middle = events[per_layer : 2 * per_layer]
    previous_end = events[per_layer - 1].time_range.end
    for event in middle:
        row.kernels.append(
            {
                "name": event.name[:60],
                "us": event.time_range.elapsed_us(),
                "gap_before_us": event.time_range.start - previous_end,
            }
        )
        previous_end = event.time_range.end


def print_profile_row(row: ProfileRow) -> None:
    if row.errors:
        print(f"batch {row.batch} context {row.context}: error {'; '.join(row.errors)[:300]}")
        return
    busy = sum(float(k["us"]) for k in row.kernels)  # type: ignore[arg-type]
    gaps = sum(float(k["gap_before_us"]) for k in row.kernels)  # type: ignore[arg-type]
    print(
        f"\nbatch {row.batch} context {row.context}: {row.layer_us:.1f} µs per layer "
        f"(middle layer: kernels {busy:.1f} µs busy, {gaps:.1f} µs of gaps)"
    )
    print("| # | kernel | µs | gap before µs |\n|---|---|---|---|")
    for i, k in enumerate(row.kernels[:40]):  # the CPU smoke run records host ops: many
        print(f"| {i} | {k['name']} | {float(k['us']):.2f} | {float(k['gap_before_us']):.2f} |")  # type: ignore[arg-type]
    split = above_floor_split(row)
    if split:
        print(
            f"above the floor ({row.fused_local_experts} local experts): the MoE "
            f"{split['moe_above_us']:.1f} µs ({split['moe_us']:.1f} against "
            f"{row.moe_floor_us:.1f}), the rest {split['rest_above_us']:.1f} µs "
            f"({split['rest_us']:.1f} with its gaps against {split['rest_floor_us']:.1f})"
        )


def above_floor_split(row: ProfileRow) -> dict[str, float] | None:
    """The middle layer's time above its floor, split between the MoE's kernels (their µs
    against the MoE's bytes) and everything else (the other kernels and every gap, against
    the rest of the floor). None where the profile holds no MoE kernel (the CPU run)."""
    moe = [k for k in row.kernels if str(k["name"]).startswith(MOE_KERNELS)]
    if not moe or row.floor_us is None or row.moe_floor_us is None:
        return None
    moe_us = sum(float(k["us"]) for k in moe)  # type: ignore[arg-type]
    spans = sum(float(k["us"]) + float(k["gap_before_us"]) for k in row.kernels)  # type: ignore[arg-type]
    rest_floor_us = row.floor_us - row.moe_floor_us
    return {
        "moe_us": moe_us,
        "moe_above_us": moe_us - row.moe_floor_us,
        "rest_us": spans - moe_us,
        "rest_floor_us": rest_floor_us,
        "rest_above_us": spans - moe_us - rest_floor_us,
    }


# Programmatic dependent launch: the same fused layer, launched three ways.


@dataclass
class PdlRow:
    batch: int
    context: int
    us: dict[str, float] = field(default_factory=dict)  # mode -> µs per layer
    off_us: dict[str, float] = field(default_factory=dict)  # mode -> "off" in the same pairs
    same_bits: dict[str, bool] = field(default_factory=dict)  # mode -> outputs equal to "off"
    errors: list[str] = field(default_factory=list)


def _compare_pdl_modes(
    problem: Problem, weights: list[Tensors], case: Case, row: PdlRow, t: Target
) -> None:
    def use(mode: str) -> None:
        triton_common.dependent_launch = mode  # read at capture: the graph keeps its launches

    try:
        variants = {mode: partial(use, mode) for mode in triton_common.DEPENDENT_LAUNCH_MODES}
        _compare_variants(problem, weights, case, row, t, variants)
    finally:
        triton_common.dependent_launch = DEPENDENT_LAUNCH_DEFAULT


# The small kernels' launch shapes: each change alone against the plan. The first sweep
# (2026-12-04, docs/benchmarks.md) tried 1, 2 and 8 warps for latent_prep, the combine and w_uv,
# 2 and 8 for q_absorb, 4 and 8 for the post-attention norm, 1 and 2 for routing: none won by
# more than 1%, and fewer warps lost up to 8.5%.
# A value of None flips the plan's own switch, for the switches the plan sets per batch.
SMALL_KERNEL_VARIANTS: dict[str, tuple[str, Any]] = {
    "prep 8 warps": ("prep_warps", 8),  # latent_prep (plan: 4)
    "prep 16 warps": ("prep_warps", 16),
    "route 8 warps": ("route_warps", 8),  # the routing kernel (plan: 4)
    "route 16 warps": ("route_warps", 16),
    "route weights in loop": ("route_method", "argmax, weights in loop"),  # its first build
    # every expert's rank at once, no arg-max rounds (triton_moe._route_by_rank)
    "route by rank": ("route_method", "rank"),
    "norm 32 warps": ("norm_warps", 32),  # the post-attention add + RMSNorm (plan: 16 here)
    "norm 4 warps": ("norm_warps", 4),  # measured 2026-12-07 with the router in it, H100
    "norm 8 warps": ("norm_warps", 8),
    "absorb 8 warps": ("absorb_warps", 8),  # q_absorb (plan: 4)
    # the split-KV attention's token masks in every tile or only the last (the plan: every tile
    # above batch 8); the 2026-12-05 sweep ran it as "attention masks every tile"
    "attention masks the other way": ("mask_every_tile", None),
    # the four GEMVs in the other language: CuTe DSL (cute_gemv, same tiles) or Triton (the
    # plan: CuTe DSL at batch <= 8); the 2026-12-05 sweep ran it as "GEMVs in CuTe DSL"
    "GEMVs in the other language": ("gemv_cute", None),
    # latent_prep folded into q_b's GEMV (13 kernels; not the same bits: q_c is not rounded)
    "latent_prep folded into q_b": ("fold_latent_prep", True),
    # q_b's GEMV over the absorbed query weight, q_absorb gone (the split attention finishes
    # the query), or not (the plan: absorbed above batch 4); not the same bits. The 2026-12-06
    # sweep ran it as "query absorbed"
    "query absorbed the other way": ("absorb_q", None),
    # the router folded through the post-attention norm (its GEMV in o_proj's launch, the
    # routing in the norm kernel; the plan since 2026-12-07) or not (the router GEMV and the
    # routing kernel, two kernels more); not the same bits: the fold's logits do not round the
    # norm's output first. The 2026-12-07 sweep ran it as "router in o_proj"
    "router in o_proj the other way": ("router_in_o_proj", None),
    # the input RMSNorm folded into qkv_a's GEMV (its sum, squares and the norm's weight there,
    # the division in latent_prep): kernel 1 gone; not the same bits (the norm's output is
    # never rounded)
    "input norm in qkv_a": ("input_norm_in_qkv_a", True),
    # the combine and w_uv as one kernel (triton_attention.combine_w_uv); o_lat never stored
    "w_uv in the combine": ("w_uv_in_combine", True),
    # the same with one program per (token, head) over all of V: half the partials' reads,
    # half the programs (64 at batch 8)
    "w_uv in the combine, 128 columns": ("w_uv_in_combine+combine_uv_cols", (True, 128)),
    # both, the layer two kernels shorter
    "input norm in qkv_a, w_uv in the combine": ("input_norm_in_qkv_a+w_uv_in_combine", True),
}


def with_plan_value(plan: fused.LayerPlan, field_name: str, value: Any) -> fused.LayerPlan:
    """The plan with one small kernel's launch field changed (None: the plan's switch flipped);
    fields joined by "+" are each changed so, or each to its own value of a tuple."""
    if "+" in field_name:
        names = field_name.split("+")
        values = value if isinstance(value, tuple) else (value,) * len(names)
        for one, one_value in zip(names, values, strict=True):
            plan = with_plan_value(plan, one, one_value)
        return plan
    owner: Any = plan.attention if hasattr(plan.attention, field_name) else plan
    change = {field_name: not getattr(owner, field_name) if value is None else value}
    if owner is plan.attention:
        return replace(plan, attention=replace(plan.attention, **change))
    return replace(plan, **change)


def _compare_small_kernels(
    problem: Problem,
    weights: list[Tensors],
    case: Case,
    row: PdlRow,
    t: Target,
    only: tuple[str, ...] = (),
) -> None:
    """The plan ("off") and each SMALL_KERNEL_VARIANTS change (those named in `only`, if any)."""
    changes = {
        name: partial(with_plan_value, field_name=field_name, value=value)
        for name, (field_name, value) in SMALL_KERNEL_VARIANTS.items()
        if not only or name in only
    }
    _compare_plans(problem, weights, case, row, t, changes)


def run19_moe_plan(plan: fused.LayerPlan, batch: int) -> fused.LayerPlan:
    """The MoE plan of runs 19 and 20, the last validates before the MoE became one kernel:
    the gate_up and the down as items in two kernels, the down's 32 columns wide over 4
    programs per H200 SM, the gate_up's grid capped at 2 per SM at batch 5-8. Batch <= 4 as
    it is (the plan there did not change)."""
    if batch <= 4:
        return plan
    return _with_moe(
        plan, stream_programs=0, down_cols=32, down_programs=4 * 132,
        gate_up_programs=2 * 132 if batch <= 8 else 0,
    )  # fmt: skip


def run18_moe_plan(plan: fused.LayerPlan, batch: int) -> fused.LayerPlan:
    """The MoE plan of run 18, the validate before the down became work items: the down walking
    the experts (K steps of 256 while the batch-wide token tile is at most 32 rows, 128
    above), and the gate_up's grid capped at 2 programs per H200 SM at every batch above 4.
    Batch <= 4 as it is (the plan there did not change)."""
    if batch <= 4:
        return plan
    down_k = 256 if plan.moe.block_m <= 32 else 128
    two_kernels = run19_moe_plan(plan, batch)
    return _with_moe(two_kernels, down_programs=0, down_k=down_k, gate_up_programs=2 * 132)


def moe_before_seventeenth(plan: fused.LayerPlan, batch: int) -> fused.LayerPlan:
    """The plan with the MoE as it was before the seventeenth session (2026-12-04): one gate_up
    program per item, the batch-wide token tile, the down walking the experts, K steps of 128,
    3 stages above batch 16. Batch <= 4 kept its plan. Meant for the GPU plan: on the CPU's it
    changes tiles and stages too, which only the smoke run uses."""
    if batch <= 4:
        return plan
    stages = 4 if plan.moe.block_m <= 16 else 3
    return _with_moe(
        run19_moe_plan(plan, batch), gate_up_programs=0, token_rows=0, down_k=128,
        num_stages=stages, down_programs=0,
    )  # fmt: skip


def _with_moe(plan: fused.LayerPlan, **change: int) -> fused.LayerPlan:
    return replace(plan, moe=replace(plan.moe, **change))


def stream_down_columns(plan: fused.LayerPlan, batch: int, down_cols: int) -> fused.LayerPlan:
    """The one-kernel MoE with the down's items down_cols wide; the plan elsewhere (the batch
    is the plan's already; taken as the other variants take it)."""
    if not plan.moe.stream_programs:
        return plan
    return _with_moe(plan, down_cols=down_cols)


# --sweep-moe-plan: against the plan (the MoE as one kernel above batch 4), the one kernel with
# 32-column down items, and (per case, as they depend on the batch) the MoE plans of runs 19,
# 18 and before the seventeenth session, each in the whole layer
MOE_PLAN_VARIANTS: dict[str, Callable[[fused.LayerPlan, int], fused.LayerPlan]] = {
    "stream, down 32 columns": partial(stream_down_columns, down_cols=32),
    "run 19": run19_moe_plan,
    "run 18": run18_moe_plan,
    "moe before": moe_before_seventeenth,
}


def _compare_moe_plans(
    problem: Problem,
    weights: list[Tensors],
    case: Case,
    row: PdlRow,
    t: Target,
    only: tuple[str, ...] = (),
) -> None:
    """The plan ("off") and each MOE_PLAN_VARIANTS change and run 18's MoE, in the layer, or
    only the variants named."""
    changes = {
        name: partial(change, batch=case.batch)
        for name, change in MOE_PLAN_VARIANTS.items()
        if not only or name in only
    }
    _compare_plans(problem, weights, case, row, t, changes)


def _compare_plans(
    problem: Problem,
    weights: list[Tensors],
    case: Case,
    row: PdlRow,
    t: Target,
    changes: Mapping[str, Callable[[fused.LayerPlan], fused.LayerPlan]],
) -> None:
    """The plan ("off") and each change of it: fused.layer_plan is replaced, for the whole
    comparison, by one that applies the current variant's change."""
    planned = fused.layer_plan
    current: list[Callable[[fused.LayerPlan], fused.LayerPlan]] = []  # none for "off"

    def changed(*key: Any) -> fused.LayerPlan:
        plan = planned(*key)
        return current[0](plan) if current else plan

    def use(change: Callable[[fused.LayerPlan], fused.LayerPlan] | None) -> None:
        current[:] = [change] if change else []

    variants = {"off": partial(use, None)}
    variants |= {name: partial(use, change) for name, change in changes.items()}
    with mock.patch.object(fused, "layer_plan", changed):  # read at capture, as PDL's mode
        _compare_variants(problem, weights, case, row, t, variants)


def _compare_variants(
    problem: Problem,
    weights: list[Tensors],
    case: Case,
    row: PdlRow,
    t: Target,
    variants: Mapping[str, Callable[[], None]],
) -> None:
    """Each variant (set up by its function, then captured) against "off" in alternating
    replays: µs per layer, and whether it gives "off"'s bits."""
    inputs = [problem.make_inputs(case, 1000 + layer, t.device) for layer in range(LAYERS)]
    pairs = list(zip(weights, inputs, strict=True))
    steps, outputs = {}, {}
    for name, set_up in variants.items():
        set_up()
        layer_set, outputs[name] = _layers(problem, pairs, case, t)
        step = _step(fused.forward, layer_set, t)
        step()
        # a graph keeps what was set up at its capture; eager calls (the CPU) read it each time
        steps[name] = step if t.on_gpu else _after(set_up, step)
    _sync(t)
    for name in [v for v in variants if v != "off"]:
        row.same_bits[name] = all(
            torch.equal(mine[key], theirs[key])
            for mine, theirs in zip(outputs[name], outputs["off"], strict=True)
            for key in mine
        )
        samples = timed_pairs(steps[name], steps["off"], PAIRS if t.on_gpu else 2, t.device)
        row.us[name] = median([a for a, _ in samples]) / LAYERS
        row.off_us[name] = median([b for _, b in samples]) / LAYERS


def _after(set_up: Callable[[], None], step: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        set_up()
        step()

    return run


def print_pdl_table(rows: list[PdlRow]) -> None:
    """µs per layer of each mode (each variant); each / "off" from their own alternating
    pairs."""
    modes = [m for m in dict.fromkeys(m for row in rows for m in row.us) if m != "off"]
    print(
        "\n| batch | context | off µs | "
        + " | ".join(f"{m} µs (/ off)" for m in modes)
        + " | same bits |"
    )
    print("|---|---|---|" + "---|" * len(modes) + "---|")
    for row in rows:
        if row.errors:
            print(f"| {row.batch} | {row.context} | error: {'; '.join(row.errors)[:200]} |")
            continue
        off = median(list(row.off_us.values()))
        cells = [f"{row.us[m]:.1f} ({row.us[m] / row.off_us[m]:.3f})" for m in modes]
        same = all(row.same_bits.values())
        print(f"| {row.batch} | {row.context} | {off:.1f} | " + " | ".join(cells) + f" | {same} |")


# Shared helpers and output.


def _case(batch: int, context: int, t: Target) -> Case:
    return Case(batch, context, cp=1, gpus=1, dtype="bfloat16", gpu=fused.device_kind(t.device))


def _sync(t: Target) -> None:
    if t.on_gpu:
        torch.cuda.synchronize()


def _empty_cache(t: Target) -> None:
    if t.on_gpu:
        torch.cuda.empty_cache()


def bandwidths(t: Target) -> tuple[float, float]:
    """(copy bytes read + written per second, the floor's bytes per second): on the GPU the
    engine's copy reading and its floor bandwidth (harness.evaluation.bandwidth: the larger of
    its read stream and the copy), on the CPU a bf16 sum (and twice it for the copy)."""
    if t.on_gpu:
        index = t.device.index or 0
        return bandwidth.copy_bytes_per_s(index), bandwidth.hbm_bytes_per_s(index)
    nbytes = 2**26
    data = torch.ones(nbytes // 2, dtype=BF16, device=t.device)
    times = []
    for _ in range(12):
        started = time.perf_counter()
        data.sum(dtype=torch.float32)
        times.append(time.perf_counter() - started)
    read = nbytes / median(times[2:])
    return 2 * read, read


def _describe(exc: BaseException) -> str:
    return traceback.format_exception(exc)[-1].strip()[-600:]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print_kernel_row(row: KernelRow) -> None:
    if row.error:
        print(f"  {row.kernel} batch {row.batch}: ERROR {row.error}", flush=True)
        return
    print(
        f"  {row.kernel} [{row.language}] batch {row.batch}: max abs {row.max_abs_error:.3g}, "
        f"rel {row.relative_error:.3g}, {row.us:.2f} µs, {row.gb_per_s:.0f} GB/s; {row.note}",
        flush=True,
    )


def _print_layer_row(row: LayerRow) -> None:
    print(f"  batch {row.batch} context {row.context}: {json.dumps(asdict(row))}", flush=True)


def print_tables(kernel_rows: list[KernelRow], layer_rows: list[LayerRow]) -> None:
    print("\n| kernel | language | batch | max abs err | rel err | µs | GB/s | note |")
    print("|---" * 8 + "|")
    for k in kernel_rows:
        error = f" ERROR: {k.error[:100]}" if k.error else ""
        print(
            f"| {k.kernel} | {k.language} | {k.batch} | {_fmt(k.max_abs_error, '.2g')} "
            f"| {_fmt(k.relative_error, '.2g')} | {_fmt(k.us, '.2f')} "
            f"| {_fmt(k.gb_per_s, '.0f')} | {k.note} |{error}"
        )
    if not layer_rows:
        return
    print(
        "\n| batch | context | fused µs | eager µs | compiled µs | speedup vs compiled "
        "| kernels fused / eager / compiled | floor µs | floor / fused | floor / compiled "
        "| local experts |"
    )
    print("|---" * 11 + "|")
    for r in layer_rows:
        counts = (r.kernels_fused, r.kernels_eager, r.kernels_compiled)
        kernels = " / ".join(_fmt(k, ".0f") for k in counts)
        experts = "/".join(str(n) for n in r.active_local_experts)
        errors = f" ERRORS: {'; '.join(r.errors)[:200]}" if r.errors else ""
        print(
            f"| {r.batch} | {r.context} | {_fmt(r.fused_us, '.1f')} | {_fmt(r.eager_us, '.1f')} "
            f"| {_fmt(r.compiled_us, '.1f')} | {_fmt(r.speedup_vs_compiled, '.2f')} | {kernels} "
            f"| {_fmt(r.floor_us, '.1f')} | {_fmt(r.fused_floor_fraction, '.3f')} "
            f"| {_fmt(r.compiled_floor_fraction, '.3f')} | {experts} |{errors}"
        )


def _triton_input_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    residual_out: torch.Tensor,
    eps: float,
) -> None:
    """--input-norm triton: the post-attention norm's Triton add+RMSNorm (x as its one split) as
    kernel 1."""
    add_rmsnorm(x[None], (residual,), weight, residual_out, out, eps)


def _environment(t: Target) -> dict[str, str]:
    environment = {
        "device": torch.cuda.get_device_name(t.device) if t.on_gpu else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    try:
        import cutlass

        environment["nvidia-cutlass-dsl"] = str(getattr(cutlass, "__version__", "unknown"))
    except ImportError as exc:
        environment["nvidia-cutlass-dsl"] = f"not importable: {exc}"
    return environment


def main() -> None:
    args = _parse_args()
    t = Target(torch.device("cpu" if args.small else "cuda"), args.small)
    started = time.perf_counter()
    problem = Problem(dict(fused.CPU_TEST_CONFIG) if args.small else {})
    copy_bw, read_bw = bandwidths(t)
    environment = _environment(t)
    if args.input_norm == "triton":
        cute_kernels.add_rmsnorm = _triton_input_norm
        environment["fused_input_norm"] = "Triton add+RMSNorm standing in for the CuTe DSL kernel"
    print(f"{environment}; copy {copy_bw / 1e12:.3f} TB/s, floor {read_bw / 1e12:.3f} TB/s")
    batches = [1, 4, 64] if args.quick else [1, 8, 64]
    contexts = args.contexts or ([8192] if args.quick else [1024, 8192, 32768])
    if args.small:
        contexts = [min(context // 128, fused.CPU_CONTEXT[1]) for context in contexts]
    if args.sweep_pdl or args.sweep_small_kernels or args.sweep_moe_plan:
        compare = (
            _compare_pdl_modes
            if args.sweep_pdl
            else partial(_compare_small_kernels, only=tuple(args.variants))
            if args.sweep_small_kernels
            else partial(_compare_moe_plans, only=tuple(args.variants))
        )
        print(f"== {getattr(compare, 'func', compare).__name__}", flush=True)
        cases = [(b, c) for b in args.batches or batches for c in contexts]
        pdl_rows = _each_case(
            problem, cases, t, PdlRow, compare, lambda row: print(asdict(row), flush=True)
        )
        _write(
            args.out,
            {
                "environment": environment,
                "is_gpu_evidence": t.on_gpu,
                "layers_per_graph": LAYERS,
                "pdl": [asdict(r) for r in pdl_rows],
            },
        )
        print_pdl_table(pdl_rows)
        return
    if args.profile_fused:
        print("== the fused layer, kernel by kernel", flush=True)
        small_batches = args.batches or ([1, 4, 8] if t.on_gpu else [1])
        cases = [(b, c) for b in small_batches for c in contexts]
        profile_rows = profile_fused(problem, cases, read_bw, t)
        _write(
            args.out,
            {
                "environment": environment,
                "is_gpu_evidence": t.on_gpu,
                "layers_per_graph": LAYERS,
                "read_bytes_per_s": read_bw,
                "profile": [
                    {**asdict(r), "above_floor": above_floor_split(r)} for r in profile_rows
                ],
            },
        )
        return
    if args.sweep_moe:
        print("== MoE tiles", flush=True)
        kernel_rows = sweep_moe(problem, args.batches or batches, t)
        args.only_kernels = True
    elif args.sweep_moe_down:
        print("== MoE down as items", flush=True)
        kernel_rows = sweep_moe_down(problem, args.batches or batches, t)
        args.only_kernels = True
    elif args.sweep_moe_rounds:
        print("== MoE rounds: n local experts per launch, each gate_up grid", flush=True)
        kernel_rows = sweep_moe_rounds(problem, args.batches or [8], t)
        args.only_kernels = True
    elif args.sweep_router:
        print("== router GEMV + routing", flush=True)
        kernel_rows = sweep_router(problem, args.batches or [1, 8, 64], t)
        args.only_kernels = True
    elif args.sweep_combine:
        print("== combine and q_absorb programs", flush=True)
        kernel_rows = sweep_combine(problem, args.batches or [1, 8, 64], contexts, t)
        args.only_kernels = True
    elif args.sweep_attention:
        print("== split-KV attention", flush=True)
        small_batches = args.batches or ([1, 8] if t.on_gpu else [1, 2])
        kernel_rows = sweep_attention(problem, small_batches, contexts, t)
        args.only_kernels = True
    else:
        print("== part 1: kernels", flush=True)
        kernel_rows = part_kernels(problem, args.batches or batches, t, tuple(args.skip))
    layer_rows: list[LayerRow] = []
    if not args.only_kernels:
        print("== part 2: the layer (fused, stock eager, stock compiled)", flush=True)
        cases = [(batch, context) for batch in batches for context in contexts]
        layer_rows = part_layer(problem, cases, read_bw, t)
    elapsed = time.perf_counter() - started
    result = {
        "environment": environment,
        "is_gpu_evidence": t.on_gpu,
        "copy_bytes_per_s": copy_bw,
        "read_bytes_per_s": read_bw,
        # since 2026-12-04 (before: a torch sum's read rate)
        "floor_bandwidth": "read_bytes_per_s: bandwidth.hbm_bytes_per_s on the GPU",
        "layers_per_graph": LAYERS,
        "elapsed_s": elapsed,
        "kernels": [asdict(row) for row in kernel_rows],
        "layer": [asdict(row) for row in layer_rows],
    }
    _write(args.out, result)
    print(f"wrote {args.out} after {elapsed:.0f} s")
    print_tables(kernel_rows, layer_rows)


def _write(path: Path, result: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 1, 4 and 64, context 8192")
    parser.add_argument("--only-kernels", action="store_true", help="part 1 only")
    parser.add_argument("--small", action="store_true", help="CPU smoke run at test sizes")
    parser.add_argument(
        "--sweep-moe", action="store_true", help="instead of parts 1 and 2: the MoE's tiles"
    )
    parser.add_argument(
        "--sweep-moe-down",
        action="store_true",
        help="instead of parts 1 and 2: the MoE with the down as items (MOE_DOWN_ITEMS)",
    )
    parser.add_argument(
        "--sweep-moe-rounds",
        action="store_true",
        help="instead of parts 1 and 2: the MoE pair with 4-12 local experts per launch, each "
        "gate_up grid (--batches, default 8)",
    )
    parser.add_argument(
        "--profile-fused",
        action="store_true",
        help="instead of parts 1 and 2: the fused layer's kernels timed inside its graph",
    )
    parser.add_argument(
        "--sweep-attention",
        action="store_true",
        help="instead of parts 1 and 2: the split-KV attention's splits and tiles (--batches)",
    )
    parser.add_argument(
        "--sweep-combine",
        action="store_true",
        help="instead of parts 1 and 2: the attention combine's and q_absorb's programs",
    )
    parser.add_argument(
        "--sweep-router",
        action="store_true",
        help="instead of parts 1 and 2: the router GEMV's tiles and K splits with the routing",
    )
    parser.add_argument(
        "--batches",
        type=int,
        nargs="+",
        help="the batches of part 1, the sweeps and --profile-fused (on the GPU by default: "
        "attention 1 8; router and combine 1 8 64; profile 1 4 8; part 1, the MoE sweeps and "
        "the layer comparisons the part-2 batches); part 2 ignores it",
    )
    parser.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        help="the contexts of every run instead of 1024 8192 32768 (--quick: 8192); --small "
        "divides them by 128 (at most the CPU test context)",
    )
    parser.add_argument(
        "--sweep-pdl",
        action="store_true",
        help="instead of parts 1 and 2: the fused layer, dependent launch off / wait / prefetch",
    )
    parser.add_argument(
        "--sweep-small-kernels",
        action="store_true",
        help="instead of parts 1 and 2: the fused layer with one small kernel's launch "
        "changed, each change against the plan (as --sweep-pdl compares)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[],
        choices=[*SMALL_KERNEL_VARIANTS, *MOE_PLAN_VARIANTS],
        metavar="NAME",
        help="with --sweep-small-kernels or --sweep-moe-plan: only these of its variants "
        "(SMALL_KERNEL_VARIANTS, MOE_PLAN_VARIANTS; default: all)",
    )
    parser.add_argument(
        "--sweep-moe-plan",
        action="store_true",
        help="instead of parts 1 and 2: the fused layer with each MOE_PLAN_VARIANTS change of "
        "the MoE plan against the plan (as --sweep-pdl compares)",
    )
    parser.add_argument(
        "--skip", nargs="*", default=[], help="kernel checks to leave out, e.g. input_norm"
    )
    parser.add_argument(
        "--input-norm",
        choices=("cute", "triton"),
        default="cute",
        help="kernel 1 of the fused layer: the CuTe DSL kernel, or (a measurement aid while it "
        "is debugged, marked in the JSON) the Triton add+RMSNorm",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("pathgate-out/benchmarks/mla_moe_device_check.json")
    )
    args = parser.parse_args(argv)
    if not args.small and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (an H200: the fused path's guard accepts no other)")
    return args


if __name__ == "__main__":
    main()
