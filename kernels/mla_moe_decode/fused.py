"""Candidate: the fused ("specialized") path for one MLA+MoE decode layer shard, and its guard.

Same contract and numerics class as stock.py (bf16 storage, fp32 accumulation, fp32 router
logits, the same routing rule), in 12 kernels per layer where the stock path runs dozens (10
above batch 4, where kernels 11 and 12 run as one and kernels 4 and 5 as one):

     1  input residual add + RMSNorm                          CuTe DSL   cute_kernels.add_rmsnorm
     2  fused_qkv_a_proj GEMV (q_a | kv_a stacked), split-K   Triton     triton_gemv
     3  q_a_layernorm, kv_a_layernorm, RoPE(k_pe) -> kv_new   Triton     triton_attention
     4  q_b_proj GEMV, split-K                                Triton     triton_gemv
     5  q_nope @ W_UK, RoPE(q_pe) -> latent query (B,H,576)   Triton     triton_attention
     6  split-KV latent attention (MQA over the cache)        Triton     triton_attention
     7  log-sum-exp combine of the splits + the new token     Triton     triton_attention
     8  o_lat @ W_UV per head                                 Triton     triton_attention
     9  o_proj GEMV and the router's logits before the norm   Triton     triton_gemv
    10  post-attention residual add + RMSNorm, then routing   Triton     triton_norm
    11  experts gate_up + SiLU*mul, active + shared experts   Triton     triton_moe
    12  experts down + routing weights + shared expert sum    Triton     triton_moe

Kernels 9 and 10 fold the router through the post-attention norm (LayerPlan.router_in_o_proj):
the norm scales each row by one number, so the router's logits before it are a GEMV over
o_proj's input and the layer's residual sum, run as more programs of o_proj's launch, and the
norm kernel, which finds the rms, divides and picks the experts (sigmoid, biased top-k,
weights). With router_in_o_proj off, o_proj, the norm, the router GEMV and the routing are
four kernels (14 per layer), as through the fortieth session.
Two more folds are built and off until a GPU measures them: LayerPlan.input_norm_in_qkv_a
(kernel 1 in kernel 2: qkv_a's GEMV over x + residual with the norm's weight folded in, its rms
divided out by kernel 3) and LayerPlan.w_uv_in_combine (kernels 7 and 8 as one): with both, 10
kernels at batch <= 4 and 8 above.
The GEMVs 2 and 4 (and o_proj, the router with the fold off) also exist in CuTe DSL
(cute_gemv: the same tiles and partial sums on mma.sync), which the plan takes on the GPU at
batch <= 8 (LayerPlan.gemv_cute); kernels 3 and 4 exist as one launch
(triton_attention.q_b_folded, LayerPlan.fold_latent_prep), off: measured slower. Above batch 4
kernels 11 and 12 are one kernel (triton_moe's _moe_stream_kernel, MoeBlocks.stream_programs):
the same items, claimed in turn, each down item waiting for its expert's gate_up items; and
kernels 4 and 5 are one GEMV over the query weight with W_UK absorbed (LayerPlan.absorb_q,
triton_attention.absorbed_q_weights), whose sums the split attention kernel finishes: 10
kernels per layer there.

Every weight byte is read once (the experts only where some token chose them, decided on the
device from the routing table), nothing synchronizes with the host, and no sum depends on the
order in which programs finish (the MoE's split items count their arrival on atomic counters,
but the last one adds every part in a fixed order): two runs give the same bits. Split-K
partial sums are added, in order, by the kernel that consumes them.

`supports` is the dispatch guard; `forward` re-checks the same scope on the tensors and runs
`stock.forward_compiled` (the manifest's baseline) outside it, so out of scope the result is the
baseline's exactly. Two architectures are in scope: the real Kimi-K2 TP8/EP8 shard on an H200 or
an H100, and CPU_TEST_CONFIG on the CPU, where the same kernels run under Triton's interpreter
(the CuTe DSL step then runs as its Triton stand-in). On a GPU without nvidia-cutlass-dsl
`forward` raises CuteUnavailableError rather than run the stand-in.

Decode context parallelism (`supports_context_parallel`, scopes/kimi-k2-mla-moe-decode-h200-cp):
on a rank of a CP group (harness.evaluation.ranks.cp_group) `kv_cache` is the rank's slice;
kernel 7 then merges this rank's splits into one, an all_gather brings the group's, and a second
combine adds the new token (triton_attention.mla_attention_cp): one kernel more, one
collective, and the copies that pack and unpack what it gathers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from types import MappingProxyType

import torch
import triton

from harness.evaluation.cases import Case
from harness.evaluation.environment import gpu_kind
from harness.evaluation.ranks import cp_group
from kernels.mla_moe_decode import cute_gemv, cute_kernels, stock
from kernels.mla_moe_decode.config import LayerConfig
from kernels.mla_moe_decode.triton_attention import (
    AttentionBlocks,
    DeferredNorm,
    UnfinishedQuery,
    absorbed_q_weights,
    latent_prep,
    mla_attention,
    mla_attention_cp,
    mla_attention_w_uv,
    q_absorb,
    q_b_folded,
    w_uv,
)
from kernels.mla_moe_decode.triton_common import derived_weight, k_splits, on_gpu
from kernels.mla_moe_decode.triton_gemv import (
    GemvBlocks,
    gemv_blocks,
    splitk_gemv,
    splitk_gemv_pair,
    summed_gemv,
)
from kernels.mla_moe_decode.triton_moe import MoeBlocks, fused_moe
from kernels.mla_moe_decode.triton_moe import route as route_experts
from kernels.mla_moe_decode.triton_norm import add_rmsnorm, add_rmsnorm_route

Tensors = dict[str, torch.Tensor]
MAX_BATCH = 64
GPU_CONTEXT = (1024, 32768)
# Both Hopper (sm_90a) parts with 132 SMs: the same kernels and plan. The plan's switches were
# measured on the H200; the H100 (less HBM bandwidth, 80 GB) runs them as they are, with claims
# of its own in the scope.
GPU_KINDS = ("H200", "H100")
# The small layer the CPU tests run under the interpreter: every size a masked tail somewhere
# (hidden 320, q_lora 96, moe_intermediate 96, top_k 6 are not powers of two), rank 2 so a path
# that assumes rank 0 fails.
CPU_TEST_CONFIG = MappingProxyType(
    {
        "hidden": 320,
        "heads": 2,
        "q_lora_rank": 96,
        "kv_lora_rank": 64,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "experts": 8,
        "experts_total": 64,
        "top_k": 6,
        "moe_intermediate": 96,
        "shared_intermediate": 32,
        "rank": 2,
    }
)
CPU_CONTEXT = (1, 256)
CP_GPUS = (2, 4, 8)
CP_DEGREES = (1, 2, 4, 8)
# Free in the guard: they change values, not shapes or the kernels' control flow.
_FREE_FIELDS = (
    "routed_scaling_factor",
    "norm_topk_prob",
    "rms_norm_eps",
    "rope_theta",
    "rank",
    "routing_tie_margin",  # the harness's near-tie rule, not a number the kernels use
)


def _architecture(c: LayerConfig) -> tuple[object, ...]:
    """The numbers the kernels are built for: every shape, and ungrouped routing (Kimi-K2's
    n_group = topk_group = 1; the routing kernel has no group limit)."""
    return tuple(getattr(c, f.name) for f in fields(c) if f.name not in _FREE_FIELDS)


_GPU_ARCH = _architecture(LayerConfig())
_CPU_ARCH = _architecture(LayerConfig.from_model_config(CPU_TEST_CONFIG))


def supports(case: Case) -> bool:
    """In scope: bf16, batch 1..64, cp 1, one GPU, and either the real shard's architecture on an
    H200 or H100 with context 1024..32768, or CPU_TEST_CONFIG on the CPU with context 1..256."""
    return case.cp == 1 and case.gpus == 1 and _supports_layer(case)


def supports_context_parallel(case: Case) -> bool:
    """The guard of the decode-CP scope: `supports`' layers and contexts (the whole context,
    before it is split) on 2, 4 or 8 GPUs, with CP 1, 2, 4 or 8 dividing the GPU count."""
    return (
        case.gpus in CP_GPUS
        and case.cp in CP_DEGREES
        and case.gpus % case.cp == 0
        and _supports_layer(case)
    )


def _supports_layer(case: Case) -> bool:
    try:
        config = LayerConfig.from_model_config(case.config)
    except (ValueError, TypeError):
        return False
    target = _target(case.gpu)
    if target is None or case.context is None:
        return False
    architecture, (low, high) = target
    return (
        _architecture(config) == architecture
        and case.dtype == "bfloat16"
        and 1 <= case.batch <= MAX_BATCH
        and low <= case.context <= high
    )


def _target(gpu: str) -> tuple[tuple[object, ...], tuple[int, int]] | None:
    if gpu in GPU_KINDS:
        return _GPU_ARCH, GPU_CONTEXT
    if gpu == "cpu":
        return _CPU_ARCH, CPU_CONTEXT
    return None


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    """The stock contract: x, residual (B, hidden); kv_cache (B, T, L+R); positions (B,) ->
    out, residual_out (B, hidden), kv_new (B, L+R). Fused kernels in scope, the compiled stock
    path (the baseline) outside it."""
    config = LayerConfig.from_tensor(weights["config"])
    if not _in_scope(config, weights, inputs, out):
        stock.forward_compiled(weights, inputs, out)
        return
    _fused_layer(config, weights, inputs, out)


def _in_scope(config: LayerConfig, weights: Tensors, inputs: Tensors, out: Tensors) -> bool:
    """`supports` read off the tensors: the device kind stands for case.gpu."""
    x, cache = inputs["x"], inputs["kv_cache"]
    target = _target(device_kind(x.device))
    if target is None:
        return False
    architecture, (low, high) = target
    # Under decode CP the cache is this rank's slice, whose length differs between the ranks
    # by one: a decision on it could send one rank to the fused kernels and its peer to the
    # stock path, each then waiting in a collective the other never calls. The guard checked
    # the whole context; here every rank decides on what the ranks share.
    context_ok = cp_group() is not None or low <= cache.shape[1] <= high
    tensors = [t for name, t in weights.items() if name != "config"]
    tensors += [*inputs.values(), *out.values()]
    return (
        _architecture(config) == architecture
        and x.dtype == torch.bfloat16
        and 1 <= x.shape[0] <= MAX_BATCH
        and context_ok
        and all(t.is_contiguous() and t.device == x.device for t in tensors)
    )


def device_kind(device: torch.device) -> str:
    """The kind a case names for this device: "cpu", or the engine's kind of the CUDA GPU (so
    `forward` and the guard agree on what `supports` accepted)."""
    if device.type == "cuda":
        return gpu_kind(_cuda_name(device.index))
    return device.type


@functools.lru_cache(maxsize=16)
def _cuda_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


# The plan: every kernel's tiles for one (architecture, batch, context), on GPU or CPU.


@dataclass(frozen=True)
class LayerPlan:
    qkv_a: GemvBlocks
    q_b: GemvBlocks
    o_proj: GemvBlocks
    router: GemvBlocks
    q_lat: GemvBlocks  # the absorbed query's GEMV (absorb_q): one K split, q_lat_blocks
    folded_router: GemvBlocks  # the router's part of o_proj's launch (router_in_o_proj)
    attention: AttentionBlocks
    moe: MoeBlocks
    # warps per program of the row-wise kernels, as first built (the 2026-12-04 sweeps in
    # docs/benchmarks.md changed none of them)
    prep_warps: int = 4  # latent_prep
    norm_warps: int | None = None  # the post-attention add + RMSNorm; None: add_rmsnorm's rule
    route_warps: int = 4
    route_method: str = "argmax"  # triton_moe.ROUTE_METHODS
    # the dense GEMVs (qkv_a, q_b, and o_proj and the router with router_in_o_proj off) as the
    # CuTe DSL kernel of cute_gemv, same tiles, on the GPU; the Triton kernel stands in on the
    # CPU. layer_plan turns it on at batch <= 8 (`--sweep-small-kernels`, "GEMVs in CuTe DSL",
    # 2026-12-05)
    gemv_cute: bool = False
    # kernels 3 and 4 in one launch (triton_attention.q_b_folded: q_a_layernorm's scale applied
    # by q_absorb), 13 kernels per layer. Off: 2-15% slower per layer on the H200
    # (`--sweep-small-kernels`, "latent_prep folded into q_b", 2026-12-05)
    fold_latent_prep: bool = False
    # kernels 4 and 5 as one GEMV over the absorbed query weight (W_UK folded into q_b_proj,
    # triton_attention.absorbed_q_weights), its sums finished (RoPE, rounding) by the split
    # attention kernel: one kernel fewer, 8.5 MB more weight read. layer_plan turns it on above
    # batch 4. Single-GPU only (the decode-CP path keeps q_absorb); fold_latent_prep, which folds
    # kernel 3 into q_b's GEMV, applies only without it
    absorb_q: bool = False
    # the router folded through the post-attention norm (triton_norm.add_rmsnorm_route): its
    # logits before the norm as more programs of o_proj's launch (the Triton GEMV pair, also
    # where gemv_cute is on), the routing done by the norm kernel: two kernels fewer. Against
    # the router GEMV and the routing kernel, on the same seed's quick validate on an H100:
    # 0.969-0.996 of the layer time at batch 1-8 (2.3-3.3 µs), 0.999-1.001 at 64
    # (docs/runs/2026-12-07-router-in-o-proj/)
    router_in_o_proj: bool = True
    # the input RMSNorm folded into qkv_a (input_norm_weight): its GEMV over x + residual,
    # which it sums and keeps, with the norm's weight in the GEMV's and the division by the rms
    # in latent_prep, which adds the GEMV's squares: kernel 1 gone (11 kernels at batch <= 4, 9
    # above). The CuTe DSL GEMV's summed mode where gemv_cute is on, else the Triton GEMV's.
    # Not with fold_latent_prep. Off until `--sweep-small-kernels` measures it
    input_norm_in_qkv_a: bool = False
    # the combine and w_uv as one kernel (triton_attention.combine_w_uv): each program merges
    # one token's head and multiplies it through W_UV, so o_lat never leaves it; W_UV is read
    # once per token (8 MB from L2 at batch 8), hence meant for small batches. One kernel
    # fewer. Single-GPU only (decode CP merges the ranks' splits first). Off until
    # `--sweep-small-kernels` measures it
    w_uv_in_combine: bool = False


@functools.lru_cache(maxsize=1024)
def layer_plan(
    c: LayerConfig,
    batch: int,
    context: int,
    on_gpu: bool,
    sm_count: int,
) -> LayerPlan:
    gemvs = {
        name: gemv_blocks(batch, n, k, on_gpu, sm_count) for name, (n, k) in gemv_shapes(c).items()
    }
    return LayerPlan(
        **gemvs,
        attention=_attention_blocks(c, batch, context, on_gpu, sm_count),
        moe=_moe_blocks(batch, on_gpu, sm_count),
        # The CuTe DSL GEMVs took 0.991-0.999 of the Triton ones' layer time at batch 1 and 8
        # and 1.007-1.011 at batch 64 (H200, 2026-12-05, docs/runs/2026-12-05-small-kernels/)
        gemv_cute=on_gpu and batch <= 8,
        # The absorbed query took 0.997-1.001 of the plan's layer time at batch 5, 8 and 16 and
        # 0.987-0.999 at 64 (12 µs at 64 x 1024), but 0.997-1.014 at batch 1, where q_absorb is
        # cheapest (H100, 2026-12-06, docs/runs/2026-12-06-absorbed-query/)
        absorb_q=on_gpu and batch > 4,
        q_lat=q_lat_blocks(c, batch, on_gpu),
        folded_router=folded_router_blocks(c, gemvs["o_proj"]),
    )


def q_lat_blocks(c: LayerConfig, batch: int, on_gpu: bool) -> GemvBlocks:
    """The absorbed query GEMV's tiles (absorb_q): the whole K in one split, since the split
    attention kernel, which finishes its sums, would otherwise add every split in each of its
    programs; 32 columns per program so that the grid stays wide (144 programs of 98 KB on the
    real shard). The Triton GEMV (the CuTe DSL one takes 64-column tiles only)."""
    n, k = c.heads * c.latent_dim, c.q_lora_rank
    block_m = max(16, triton.next_power_of_2(batch))
    if on_gpu:
        block_n, block_k, stages = 32, 128 if batch <= 16 else 64, 4
    else:
        block_n, block_k, stages = min(64, triton.next_power_of_2(n)), 64, 1
    k_per_split, splits = k_splits(k, 1, block_k)
    return GemvBlocks(block_m, block_n, block_k, k_per_split, splits, 4, stages)


def folded_router_blocks(c: LayerConfig, o_proj: GemvBlocks) -> GemvBlocks:
    """The router's part of o_proj's launch (router_in_o_proj): o_proj's tiles (one launch
    shares them) over K = H*V + hidden, in splits as long as o_proj's, so that each of its
    programs streams as much weight as one of o_proj's (96 programs of 64 KB on the real shard
    up to batch 16)."""
    k = c.heads * c.v_head_dim + c.hidden
    k_per_split, splits = k_splits(k, triton.cdiv(k, o_proj.k_per_split), o_proj.block_k)
    return replace(o_proj, k_per_split=k_per_split, splits=splits)


def folded_router_weight(
    gate: torch.Tensor, norm_weight: torch.Tensor, o_proj: torch.Tensor
) -> torch.Tensor:
    """The router folded through the post-attention norm's weight and o_proj: (E_total, H*V +
    hidden) bf16 = [(gate * norm_weight) @ o_proj | gate * norm_weight], multiplied in float64
    and rounded once. [o | x + residual] @ it.T is (gate * norm_weight) @ (o @ o_proj.T + x +
    residual): the router logits times the rms of the sum the norm normalizes."""
    through_norm = gate.double() * norm_weight.double()
    return torch.cat([through_norm @ o_proj.double(), through_norm], dim=1).to(gate.dtype)


def input_norm_weight(qkv_a: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """fused_qkv_a_proj with the input RMSNorm's weight folded in: (N, hidden) bf16 = qkv_a *
    norm_weight per column, multiplied in float64 and rounded once. (x + residual) @ it.T is
    the GEMV of the norm's output times the rms of x + residual, less the norm's rounding."""
    return (qkv_a.double() * norm_weight.double()[None, :]).to(qkv_a.dtype)


def gemv_shapes(c: LayerConfig) -> dict[str, tuple[int, int]]:
    """(N, K) of the layer's four projections (qkv_a, q_b, o_proj, the router), by their
    LayerPlan field."""
    return {
        "qkv_a": (c.q_lora_rank + c.latent_dim, c.hidden),
        "q_b": (c.heads * c.qk_head_dim, c.q_lora_rank),
        "o_proj": (c.hidden, c.heads * c.v_head_dim),
        "router": (c.experts_total, c.hidden),
    }


def _attention_blocks(
    c: LayerConfig, batch: int, context: int, on_gpu: bool, sm_count: int
) -> AttentionBlocks:
    block_m = max(16, triton.next_power_of_2(batch))
    block_h = max(16, triton.next_power_of_2(c.heads))
    context = max(context, 1)  # a decode-CP rank's empty slice: one split that holds no token
    if on_gpu:
        # From the H200 sweeps of 2026-12-03 (`--sweep-attention`, docs/mla_moe_notes.md).
        # Batch <= 8: 64-token tiles, 3 stages, about one (token, split) program per SM, and
        # (then) a combine of 32 columns that takes up to 128 splits per step: split + combine
        # in 7.9 / 10.7 / 18.5 µs at batch 1 and contexts 1k / 8k / 32k, 11.5 / 29.6 / 93.3
        # at batch 8.
        # Batch > 8: 32-token tiles, 3 stages, min(16, context / 128) splits per token (rounded
        # up, so a short context's splits may hold fewer than 4 tiles): from about 2k tokens
        # the program count grows with the batch (256 at 16, 1024 at 64), so the last wave is a
        # small part of the launch. The sweep's nearest variant (17 splits of 1952 tokens) took
        # 671 µs at batch 64 x 32768 (3.6 TB/s) against 939 for the earlier rule (two programs
        # per SM: 5 splits, 320 programs); run 6 of the validate timed this plan in the layer.
        # The combine and q_absorb programs from `--sweep-combine` (2026-12-04, each kernel
        # alone, docs/runs/2026-12-04-combine/): at batch 64 the combine took 11.6 / 14.2 /
        # 15.0 µs at 1k / 8k / 32k with 128 columns per program and 7.3 / 12.8 / 13.9 with
        # 256 (two heads x 128: 10.7 / 12.4 / 12.9, so 256 by its 3.4 µs at short contexts,
        # where the target is closest); at batch 8 (16 splits) 4.2 with 32 columns and 3.7
        # with 64 columns and 64 splits per step, while at batch 1 x 32k (128 splits) 32
        # columns stayed best (3.15 against 4.25). q_absorb at batch 64: 12.3 µs with 64
        # columns, 9.0 with 128; at batch 1 and 8, 64 stayed best.
        absorb_cols = 128 if batch > 32 else 64
        if batch <= 8:
            block_t, stages = 64, 3
            # at most one wave: cdiv here gave batch 8 17 splits (136 programs on 132 SMs),
            # a second wave that cost 0.59 of the floor at 8 x 20335 (run 7)
            splits = min(max(1, sm_count // batch), triton.cdiv(context, block_t))
            combine_cols, combine_splits = (64, 64) if splits <= 64 else (32, 128)
        else:
            block_t, stages, combine_cols, combine_splits = 32, 3, 256, 32
            splits = min(16, triton.cdiv(context, 4 * block_t))
        tokens = triton.cdiv(triton.cdiv(context, splits), block_t) * block_t
        return AttentionBlocks(
            block_m, block_h, block_t, triton.cdiv(context, tokens), tokens,
            combine_heads=1, combine_splits=combine_splits, combine_cols=combine_cols,
            absorb_cols=absorb_cols, uv_cols=32, split_warps=4, split_stages=stages,
            # Unmasked loads in every tile but the last took 0.94-1.01 of the masked ones' layer
            # time at batch 1 and 8 (0.988 on the geometric mean), the masked ones 0.971-0.995
            # of the unmasked at batch 64 (H200, 2026-12-05, docs/runs/2026-12-05-small-kernels/)
            mask_every_tile=batch > 8,
        )  # fmt: skip
    # The interpreter pays per program and per op: few, large programs, but still two context
    # splits and a two-step merge loop, so the CPU tests run every path of the GPU's kernels.
    lora = triton.next_power_of_2(c.kv_lora_rank)
    tokens = triton.cdiv(triton.cdiv(context, 2), 32) * 32
    return AttentionBlocks(
        block_m, block_h, 32, triton.cdiv(context, tokens), tokens,
        combine_heads=triton.next_power_of_2(c.heads), combine_splits=1, combine_cols=lora,
        absorb_cols=lora // 2, uv_cols=32, split_warps=4, split_stages=1,
    )  # fmt: skip


def _moe_blocks(batch: int, on_gpu: bool, sm_count: int) -> MoeBlocks:
    block_m = max(16, triton.next_power_of_2(batch))
    if not on_gpu:
        return MoeBlocks(block_m, 64, 128, 128, 64, num_warps=4, num_stages=1)
    # From `mla_moe_device_check.py --sweep-moe` on the H200 (docs/mla_moe_notes.md). Batch
    # <= 16: 32 features (64 weight rows) per gate_up program, 32 outputs per down program, K
    # steps of 128 (the down's 256 above batch 4, below), 4 stages: 82 / 175 µs at batch 1 / 8
    # in the 2026-12-03 sweep of 15 tilings, against 90 / 175 for 16 features and 6 stages (the
    # earlier pick), and 111-274 µs at batch 1 with every item split over K (so the routed
    # experts' items stay whole).
    # Batch <= 4: the shared expert's 8 tiles split 14 ways over the hidden dim (112 programs
    # of 64 KB). When no token chooses a local expert (a third of the layers at batch 1, one in
    # eight at batch 2) its tiles are the whole gate_up kernel, and unsplit they ran 8 programs
    # of 917 KB each: the MoE at batch 1 took 24.7 µs (445 GB/s), split 14 ways 10.6, and with
    # local experts chosen the same as unsplit (2026-12-04 sweep of 4-28 splits,
    # docs/runs/2026-12-04-shared-split/).
    if batch <= 4:
        return MoeBlocks(block_m, 32, 128, 32, 128, num_warps=4, num_stages=4, shared_splits=14)
    # Batch > 4, from the seventeenth and eighteenth sessions' sweeps
    # (docs/runs/2026-12-04-seventeenth/, docs/runs/2026-12-04-eighteenth/):
    # - the gate_up gathers each expert's tokens into tiles of 16 rows (token_rows): above
    #   batch 16 a local expert has a few tokens, and the batch-wide tile held the rest masked
    #   in shared memory and the MMA (4 stages of (64 + 64) x 128 bf16 at batch 64: 128 KB,
    #   one program per SM). With 16-row tiles and 4 stages: 819.7 / 725.9 µs at batch 64 /
    #   48 against 891.2 / 787.4 for the batch-wide tile and 3 stages;
    # - the down as work items (down_programs): 4 programs per SM loop over (tile, column
    #   block) items with the gate_up's 16-row tiles, K steps of 128. The down alone read
    #   4.06 / 3.90 TB/s at batch 64 / 32 (272 / 174 µs against 338 / 213 for run 18's expert
    #   walker); 3 per SM (396 programs) or K steps of 256 were slower. In the layer
    #   (`--sweep-moe-plan`): 4.3-7.3% less per layer at batch 32-64, 0.2-1.0% at 8-16;
    # - the gate_up's grid capped at 2 programs per SM at batch 5-8 only: one program per
    #   item ran the ~480 items of batch 8 as a wave and a part of one (161.2 µs against
    #   167.1 for the MoE alone); above, the cap measured within 1.6% either way in the layer.
    # Run 18 (the last validate before this plan) had the down walk the experts, K steps of
    # 256 up to 32 token rows, and the gate_up capped at every batch above 4.
    # Since the twenty-seventh session both run as one kernel (stream_programs): the same
    # items, claimed in turn by 2 programs per SM (its registers allow no more), the down's 64
    # columns wide. In the layer on an H100 (`--sweep-moe-plan`, docs/runs/2026-12-06-stream/):
    # 0.965-0.989 of the two kernels' time at batch 8-64, 0.995-1.005 at 5; the same bits.
    return MoeBlocks(
        block_m, 32, 128, 64, 128, num_warps=4, num_stages=4, token_rows=16,
        stream_programs=2 * sm_count,
    )  # fmt: skip


@functools.lru_cache(maxsize=16)
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=16)
def rope_turns(device: torch.device, rope_dim: int, theta: float) -> torch.Tensor:
    """(R/2,) fp64: each rotary frequency theta^(-2i/R) in turns per position (divided by 2 pi).
    A constant of the architecture, built on the first call (before any graph capture)."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim
    return (theta**-exponents / (2 * torch.pi)).to(device)


# The layer.


def route(weights: Tensors, inputs: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts `forward` picks for these inputs, as stock.route returns them: weights
    (B, top_k) float32 and global ids (B, top_k) int64. Runs the layer's kernels before the
    MoE."""
    config = LayerConfig.from_tensor(weights["config"])
    x = inputs["x"]
    scratch = {
        "out": torch.empty_like(x),
        "residual_out": torch.empty_like(x),
        "kv_new": x.new_empty(x.shape[0], config.latent_dim),
    }
    if not _in_scope(config, weights, inputs, scratch):
        return stock.route(weights, inputs)
    _, ids, routing = _attention_and_routing(config, weights, inputs, scratch)
    return routing, ids.long()


def _fused_layer(c: LayerConfig, w: Tensors, inputs: Tensors, out: Tensors) -> None:
    moe_in, ids, routing = _attention_and_routing(c, w, inputs, out)
    experts = (w["experts_w13"], w["experts_w2"], w["shared_gate_up"], w["shared_down"])
    plan = _plan(c, moe_in, inputs["kv_cache"].shape[1])
    fused_moe(moe_in, ids, routing, *experts, out["out"], c.expert_offset, plan.moe)


def _plan(c: LayerConfig, x: torch.Tensor, context: int) -> LayerPlan:
    gpu = on_gpu(x)
    sm_count = _sm_count(x.device.index) if gpu else 0
    return layer_plan(c, x.shape[0], context, gpu, sm_count)


def _attention_and_routing(
    c: LayerConfig, w: Tensors, inputs: Tensors, out: Tensors
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernels 1-10: writes out["kv_new"] and out["residual_out"]; returns the MoE input
    (B, hidden) bf16, the routing ids (B, top_k) int32 and weights (B, top_k) fp32."""
    x, positions, cache = inputs["x"], inputs["positions"], inputs["kv_cache"]
    batch, eps = x.shape[0], c.rms_norm_eps
    plan = _plan(c, x, cache.shape[1])
    turns = rope_turns(x.device, c.qk_rope_head_dim, c.rope_theta)
    absorb = plan.absorb_q and cp_group() is None
    fold_prep = plan.fold_latent_prep and not absorb
    if fold_prep and plan.input_norm_in_qkv_a:  # q_b_folded reads qkv_a's sums, not the rms
        raise ValueError("fold_latent_prep and input_norm_in_qkv_a: one or the other")
    # Kernel 1's bf16 sum of x and residual is read only by the folded router
    # (router_in_o_proj): the post-attention norm adds x and residual again in fp32, as the
    # compiled stock path does. A buffer of its own, not residual_out, which a caller may alias
    # with `residual` (vLLM updates the residual in place).
    input_sum = torch.empty_like(x)
    qkv_a, input_norm = _input_norm_and_qkv_a(c, w, plan, x, inputs["residual"], input_sum)
    norms = (w["q_a_layernorm"], w["kv_a_layernorm"])
    deferred = None
    q_lat = x.new_empty(batch, c.heads, c.latent_dim)
    nope, v_dim = c.qk_nope_head_dim, c.v_head_dim
    unfinished = None
    if fold_prep:
        q, deferred = q_b_folded(
            qkv_a, *norms, positions, turns, w["q_b_proj"], out["kv_new"], eps, plan.q_b
        )
    else:
        q_c = x.new_empty(batch, c.q_lora_rank)
        latent_prep(
            qkv_a, *norms, positions, turns, q_c, out["kv_new"], eps, plan.prep_warps, input_norm
        )
        if absorb:
            absorbed = absorbed_q_weights(w["q_b_proj"], w["kv_b_proj"], c.heads, nope, v_dim)
            # the Triton GEMV: the tiles are 32 columns wide (q_lat_blocks)
            unfinished = UnfinishedQuery(splitk_gemv(q_c, absorbed, plan.q_lat), positions, turns)
        else:
            q = dense_gemv(q_c, w["q_b_proj"], plan.q_b, plan)
    if unfinished is None:
        q_absorb(q, w["kv_b_proj"], positions, turns, q_lat, nope, v_dim, plan.attention, deferred)
    scale = c.qk_head_dim**-0.5  # the stock softmax scale (YaRN's mscale left out, as there)
    group = cp_group()
    o = x.new_empty(batch, c.heads * v_dim)
    if group is None and plan.w_uv_in_combine:
        mla_attention_w_uv(
            q_lat, cache, out["kv_new"], w["kv_b_proj"], o, nope, scale, plan.attention, unfinished
        )
        return _o_proj_and_routing(c, w, plan, o, inputs, input_sum, out)
    o_lat = x.new_empty(batch, c.heads, c.kv_lora_rank)
    if group is None:
        mla_attention(q_lat, cache, out["kv_new"], o_lat, scale, plan.attention, unfinished)
    else:  # decode CP: `cache` is this rank's slice; the ranks' partials merge exactly
        mla_attention_cp(q_lat, cache, out["kv_new"], o_lat, scale, plan.attention, group)
    w_uv(o_lat, w["kv_b_proj"], o, nope, plan.attention)
    return _o_proj_and_routing(c, w, plan, o, inputs, input_sum, out)


def _input_norm_and_qkv_a(
    c: LayerConfig,
    w: Tensors,
    plan: LayerPlan,
    x: torch.Tensor,
    residual: torch.Tensor,
    input_sum: torch.Tensor,
) -> tuple[torch.Tensor, DeferredNorm | None]:
    """Kernels 1 and 2: qkv_a's partial sums of the input RMSNorm's output, and the norm's
    rms still to divide by where the plan folds the norm into the GEMV (input_norm_in_qkv_a).
    Writes the bf16 sum x + residual into input_sum."""
    eps = c.rms_norm_eps
    if plan.input_norm_in_qkv_a:
        folded = derived_weight(input_norm_weight, (w["fused_qkv_a_proj"], w["input_layernorm"]))
        if plan.gemv_cute and on_gpu(x):
            parts, squares = cute_gemv.summed_gemv(x, residual, folded, plan.qkv_a, input_sum)
        else:
            parts, squares = summed_gemv(x, residual, folded, plan.qkv_a, input_sum)
        return parts, DeferredNorm(squares, c.hidden, eps)
    hidden = torch.empty_like(x)
    input_add_rmsnorm(x, residual, w["input_layernorm"], hidden, input_sum, eps)
    return dense_gemv(hidden, w["fused_qkv_a_proj"], plan.qkv_a, plan), None


def _o_proj_and_routing(
    c: LayerConfig,
    w: Tensors,
    plan: LayerPlan,
    o: torch.Tensor,
    inputs: Tensors,
    input_sum: torch.Tensor,
    out: Tensors,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernels 9 and 10 (four with router_in_o_proj off): o_proj, the post-attention add +
    RMSNorm (writes out["residual_out"]), the router and the routing; returns as
    _attention_and_routing."""
    x, eps = inputs["x"], c.rms_norm_eps
    moe_in = torch.empty_like(x)
    residuals = (x, inputs["residual"])
    norm = w["post_attention_layernorm"]
    rule = (w["e_score_correction_bias"], c.top_k, c.norm_topk_prob, c.routed_scaling_factor)
    if plan.router_in_o_proj:
        folded = derived_weight(folded_router_weight, (w["gate"], norm, w["o_proj"]))
        attn, before_norm = splitk_gemv_pair(
            o, w["o_proj"], plan.o_proj, input_sum, folded, plan.folded_router
        )
        ids, routing = add_rmsnorm_route(
            attn, residuals, norm, out["residual_out"], moe_in, eps, before_norm, *rule,
            plan.norm_warps, plan.route_method,
        )  # fmt: skip
        return moe_in, ids, routing
    attn = dense_gemv(o, w["o_proj"], plan.o_proj, plan)
    add_rmsnorm(attn, residuals, norm, out["residual_out"], moe_in, eps, plan.norm_warps)
    logits = dense_gemv(moe_in, w["gate"], plan.router, plan)
    ids, routing = route_experts(logits, *rule, plan.route_warps, plan.route_method)
    return moe_in, ids, routing


def dense_gemv(
    x: torch.Tensor, weight: torch.Tensor, blocks: GemvBlocks, plan: LayerPlan
) -> torch.Tensor:
    """The dense GEMVs: split-K partial sums of x @ weight.T, (splits, B, N) fp32. The
    CuTe DSL kernel where the plan asks for it on the GPU; the Triton kernel otherwise, which
    computes the same partial sums (the same tiles and K ranges; the MMAs may order a tile's
    products differently, so the last bit of a partial sum may differ)."""
    if plan.gemv_cute and on_gpu(x):  # a meta tensor too: sm90_compile.py records the call
        return cute_gemv.splitk_gemv(x, weight, blocks)
    return splitk_gemv(x, weight, blocks)


def input_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    residual_out: torch.Tensor,
    eps: float,
) -> None:
    """Kernel 1. On the GPU the CuTe DSL kernel (raises CuteUnavailableError without it).
    CPU STAND-IN: under the interpreter (CPU tensors) the Triton add+RMSNorm of triton_norm with x
    as its single "split" computes the same function; no GPU run ever takes this branch."""
    if x.is_cuda:
        cute_kernels.add_rmsnorm(x, residual, weight, out, residual_out, eps)
    else:
        add_rmsnorm(x[None], (residual,), weight, residual_out, out, eps)
