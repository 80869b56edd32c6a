"""Stock path: the op sequence vLLM runs for one MLA+MoE decode layer shard, in torch's own ops.

One decode step for `batch` tokens (vLLM's DeepseekV2DecoderLayer, its MLA decode and FusedMoE):

    h, r1   = add_rmsnorm(x, residual)                        input_layernorm
    q_c | kv_c | k_pe = h @ fused_qkv_a_proj.T                  one GEMM, as vLLM fuses them
    q       = rmsnorm(q_c) @ q_b_proj.T                         (B, H, 128 + 64)
    q_pe, k_pe roped (GPT-J pairs); kv_new = [rmsnorm(kv_c), k_pe]      (B, 576)
    q_lat   = [q_nope @ W_UK, q_pe]                              absorbed query (B, H, 576)
    o_lat   = softmax(q_lat . [cache; kv_new] / sqrt(192)) @ [cache; kv_new][:, :512]
    attn    = (o_lat @ W_UV.T) @ o_proj.T                       (B, hidden), TP partial sum
    h2, r2  = add_rmsnorm(attn, r1)                             post_attention_layernorm
    route   = topk(sigmoid(h2 @ gate.T) + bias) -> weights from the unbiased sigmoid, renormalized,
              x routed_scaling_factor; only this GPU's experts compute
    out     = sum_k w_k * SwiGLU_k(h2) + SwiGLU_shared(h2)      EP/TP partial sum

Precision follows vLLM: GEMMs accumulate in fp32 and store bf16; norms, RoPE, SiLU-and-mul,
softmax and the expert combine compute in fp32 and round once; attention scores and router
logits stay fp32 (cuBLAS's fp32-output epilogue, `out_dtype`). Given float32 or float64 tensors
(the harness's reference runs this code on float64 copies) everything computes in that dtype.

Attention is plain batched GEMMs around an fp32 softmax, not F.scaled_dot_product_attention:
the latent head is 576/512 wide, past flash and cuDNN attention's 256 limit; memory-efficient
attention would run one thread block per sequence (no split over the context), and every SDPA
form needs the new token concatenated to the cache, a copy of the whole cache per layer. Here
the cache is read in place (once per GEMM) and the new token's score joins the softmax apart.

The routed experts follow vLLM's fused_moe data flow: (token, expert) pairs sorted by local
expert, one grouped GEMM per projection over the sorted rows (`torch._grouped_mm` in bf16; a
per-expert loop for other dtypes, which it lacks), then each token's weighted sum in fp32,
deterministic (no atomics). Pairs routed to other GPUs' experts sort past every group and add 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from harness.evaluation.ranks import cp_group
from kernels.mla_moe_decode.config import LayerConfig

Tensors = dict[str, torch.Tensor]
WIDE_DTYPES = (torch.float32, torch.float64)  # compute in these as given
# Every (batch, context) shape is one more compiled specialization (dynamic=False). Past
# Dynamo's default limit of 8 it would silently run eager: the baseline would change mid-plan.
RECOMPILE_LIMIT = 256


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    """x, residual (B, hidden); kv_cache (B, T, L+R); positions (B,) int -> out, residual_out
    (B, hidden), kv_new (B, L+R). Weights as Problem.make_weights builds them."""
    _layer(LayerConfig.from_tensor(weights["config"]), weights, inputs, out)


_compiled_layer: Callable[[LayerConfig, Tensors, Tensors, Tensors], None] | None = None


def forward_compiled(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    """`forward` compiled by Inductor (default mode, dynamic=False, one full graph), compiled on
    first use. Outside bf16 the experts' per-expert loop has data-dependent shapes that no full
    graph can hold, so those dtypes (the float64 reference) run the same ops eagerly."""
    config = LayerConfig.from_tensor(weights["config"])
    # On a CP rank the attention merges through a collective, which this full graph does not
    # hold: the CP stock runs eagerly (recorded where CP cases are measured).
    if not uses_grouped_mm(inputs["x"]) or cp_group() is not None:
        _layer(config, weights, inputs, out)
        return
    global _compiled_layer
    if _compiled_layer is None:
        dynamo_config = torch._dynamo.config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        _compiled_layer = torch.compile(_layer, dynamic=False, fullgraph=True)
    _compiled_layer(config, weights, inputs, out)


def route(weights: Tensors, inputs: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts `forward` picks for these inputs: weights (B, top_k) float32 or wider, and
    global expert ids (B, top_k) int64."""
    config = LayerConfig.from_tensor(weights["config"])
    kv_new = inputs["x"].new_empty(inputs["x"].shape[0], config.latent_dim)
    hidden, _ = _attention_block(config, weights, inputs, kv_new)
    logits = _mm_fp32(hidden, weights["gate"].T)
    return _select_experts(config, logits, weights["e_score_correction_bias"])


def expert_choice(weights: Tensors, inputs: Tensors) -> torch.Tensor:
    """The biased scores `forward` ranks experts by (group limit applied), (B, experts_total),
    computed by the same code; called on float64 copies to find near-tie decisions."""
    config = LayerConfig.from_tensor(weights["config"])
    kv_new = inputs["x"].new_empty(inputs["x"].shape[0], config.latent_dim)
    hidden, _ = _attention_block(config, weights, inputs, kv_new)
    choice = _mm_fp32(hidden, weights["gate"].T).sigmoid() + weights["e_score_correction_bias"]
    if config.n_group > 1:
        choice = _keep_top_groups(choice, config.n_group, config.topk_group)
    return choice


def uses_grouped_mm(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16


def _layer(c: LayerConfig, w: Tensors, inputs: Tensors, out: Tensors) -> None:
    hidden, residual = _attention_block(c, w, inputs, out["kv_new"])
    out["residual_out"].copy_(residual)  # rounds the fp32 sum once
    _moe(c, w, hidden, out["out"])


def _attention_block(
    c: LayerConfig, w: Tensors, inputs: Tensors, kv_new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes kv_new (B, L+R); returns the MoE input (B, hidden) and the residual sum r2 in the
    compute dtype (B, hidden)."""
    x = inputs["x"]
    hidden, summed = _add_rms_norm(x, inputs["residual"], w["input_layernorm"], c.rms_norm_eps)
    attn = _mla_decode(c, w, hidden, inputs["kv_cache"], inputs["positions"], kv_new)
    residual = summed.to(x.dtype)  # vLLM carries the residual in the model dtype
    return _add_rms_norm(attn, residual, w["post_attention_layernorm"], c.rms_norm_eps)


def _mla_decode(
    c: LayerConfig,
    w: Tensors,
    hidden: torch.Tensor,  # (B, hidden)
    kv_cache: torch.Tensor,  # (B, T, L+R)
    positions: torch.Tensor,  # (B,)
    kv_new: torch.Tensor,  # (B, L+R), written
) -> torch.Tensor:
    batch = hidden.shape[0]
    heads, nope, rope, lora = c.heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
    q_c, kv_c, k_pe = F.linear(hidden, w["fused_qkv_a_proj"]).split([c.q_lora_rank, lora, rope], -1)
    q = F.linear(_rms_norm(q_c, w["q_a_layernorm"], c.rms_norm_eps), w["q_b_proj"])
    q_nope, q_pe = q.view(batch, heads, c.qk_head_dim).split([nope, rope], -1)  # (B, H, N|R)
    cos, sin = _rope_cos_sin(positions, rope, c.rope_theta, _compute_dtype(hidden))  # (B, R/2)
    q_pe = _rotate_pairs(q_pe, cos[:, None], sin[:, None])
    kv_c = _rms_norm(kv_c, w["kv_a_layernorm"], c.rms_norm_eps)
    torch.cat([kv_c, _rotate_pairs(k_pe, cos, sin)], -1, out=kv_new)
    # kv_b_proj holds per head [W_UK (N rows); W_UV (V rows)] of width L: views, no copies
    kv_b = w["kv_b_proj"].view(heads, nope + c.v_head_dim, lora)
    w_uk, w_uv = kv_b.split([nope, c.v_head_dim], 1)  # (H, N, L), (H, V, L)
    ql_nope = torch.bmm(q_nope.transpose(0, 1), w_uk)  # (H, B, L): q_nope absorbed through W_UK
    q_latent = torch.cat([ql_nope.transpose(0, 1), q_pe], -1)  # (B, H, L+R)
    o_latent = _attention(q_latent, kv_cache, kv_new, lora, c.qk_head_dim**-0.5)
    o = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2))  # (H, B, V)
    return F.linear(o.transpose(0, 1).reshape(batch, heads * c.v_head_dim), w["o_proj"])


def _attention(
    q_latent: torch.Tensor, kv_cache: torch.Tensor, kv_new: torch.Tensor, lora: int, scale: float
) -> torch.Tensor:
    """On one process: attention over the whole cache. On a rank of a decode-CP group (pathgate
    runs a cp > 1 case on N ranks and names the group, as vLLM's get_dcp_group does): kv_cache
    is this rank's slice, and the partials of the group merge exactly (context_parallel)."""
    group = cp_group()
    if group is None:
        return _latent_attention(q_latent, kv_cache, kv_new, lora, scale)
    from kernels.mla_moe_decode.context_parallel import distributed_latent_attention

    return distributed_latent_attention(q_latent, kv_cache, kv_new, lora, scale, group)


def _latent_attention(
    q_latent: torch.Tensor,  # (B, H, L+R)
    kv_cache: torch.Tensor,  # (B, T, L+R)
    kv_new: torch.Tensor,  # (B, L+R)
    lora: int,
    scale: float,
) -> torch.Tensor:
    """All heads attend to one latent sequence (MQA): the T cached tokens and the new one. The
    latent part of each token is also its value. Returns (B, H, L)."""
    # cuBLAS needs rows of 16 bytes' multiple for its fast kernels. Heads-major scores (B, H, T)
    # have rows T long: at an odd context the compiled stock took 1079 µs per layer at 8 x 20335
    # against 436 at 8 x 16384 (run 7), a cliff vLLM's paged FlashMLA does not have. Tokens-major
    # (B, T, H) rows are H long whatever T is, but 6-19% slower at batch 8 when T is aligned, and
    # within 2% at batch 64 (benchmarks/stock_attention_layout.py): an aligned context takes
    # heads-major, any other tokens-major.
    if tokens_major(kv_cache.shape[1]):
        return _attention_tokens_major(q_latent, kv_cache, kv_new, lora, scale)
    return _attention_heads_major(q_latent, kv_cache, kv_new, lora, scale)


def tokens_major(context: int) -> bool:
    """Whether attention over `context` cached tokens lays its scores out (B, T, H) rather than
    (B, H, T): where T is not a multiple of 8, heads-major rows miss cuBLAS's alignment.
    Tokens-major rows are H wide: aligned for the real shard's 8 heads (16 bytes in bf16)."""
    return context % 8 != 0


def _attention_heads_major(
    q_latent: torch.Tensor, kv_cache: torch.Tensor, kv_new: torch.Tensor, lora: int, scale: float
) -> torch.Tensor:
    context = kv_cache.shape[1]
    scores_cache = _bmm_fp32(q_latent, kv_cache.transpose(1, 2))  # (B, H, T)
    scores_new = _bmm_fp32(q_latent, kv_new[:, :, None])  # (B, H, 1)
    probs = torch.softmax(torch.cat([scores_cache, scores_new], -1) * scale, -1)  # (B, H, T+1)
    # FlashMLA multiplies bf16 probabilities with the bf16 cache, accumulating in fp32
    o = _bmm_fp32(probs[..., :context].to(q_latent.dtype), kv_cache[..., :lora])  # (B, H, L)
    o = o + probs[..., context:] * kv_new[:, None, :lora]
    return o.to(q_latent.dtype)


def _attention_tokens_major(
    q_latent: torch.Tensor, kv_cache: torch.Tensor, kv_new: torch.Tensor, lora: int, scale: float
) -> torch.Tensor:
    """The same math as _attention_heads_major, scores and probabilities (B, T, H)."""
    context = kv_cache.shape[1]
    q_t = q_latent.transpose(1, 2)  # (B, L+R, H), a view
    scores_cache = _bmm_fp32(kv_cache, q_t)  # (B, T, H)
    scores_new = _bmm_fp32(kv_new[:, None, :], q_t)  # (B, 1, H)
    probs = torch.softmax(torch.cat([scores_cache, scores_new], 1) * scale, 1)  # (B, T+1, H)
    cached = probs[:, :context].to(q_latent.dtype)  # (B, T, H)
    o = _bmm_fp32(kv_cache[..., :lora].transpose(1, 2), cached)  # (B, L, H)
    o = o + kv_new[:, :lora, None] * probs[:, context:]
    return o.transpose(1, 2).to(q_latent.dtype)  # (B, H, L), strided: its one reader is a bmm


def _rope_cos_sin(
    positions: torch.Tensor, rope_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain RoPE angles (DeepSeek's YaRN scaling left out): (B, R/2) each."""
    exponents = torch.arange(0, rope_dim, 2, device=positions.device, dtype=dtype) / rope_dim
    angles = positions.to(dtype)[:, None] * torch.pow(theta, -exponents)[None, :]
    return angles.cos(), angles.sin()


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) by angle i, as vLLM's rotary op with
    is_neox_style=False does for DeepSeek; cos, sin broadcast against (..., R/2)."""
    pairs = x.to(cos.dtype).unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1)
    return rotated.flatten(-2).to(x.dtype)


def _moe(c: LayerConfig, w: Tensors, hidden: torch.Tensor, out: torch.Tensor) -> None:
    logits = _mm_fp32(hidden, w["gate"].T)  # (B, E_total); vLLM's router GEMM outputs fp32
    topk_weights, topk_ids = _select_experts(c, logits, w["e_score_correction_bias"])
    routed = _routed_experts(c, w, hidden, topk_weights, topk_ids)
    shared = _swiglu(hidden, w["shared_gate_up"], w["shared_down"])
    torch.add(routed, shared, out=out)


def _select_experts(
    c: LayerConfig, logits: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's grouped_topk with sigmoid scoring: the correction bias steers the choice only;
    the weights are the unbiased scores of the chosen experts. (B, top_k) each."""
    scores = logits.sigmoid()
    choice = scores + bias
    if c.n_group > 1:
        choice = _keep_top_groups(choice, c.n_group, c.topk_group)
    topk_ids = torch.topk(choice, c.top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if c.norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
    return topk_weights * c.routed_scaling_factor, topk_ids


def _keep_top_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V3 group limit: rank groups by the sum of their two best biased scores and mask
    every expert outside the best topk_group groups to -inf."""
    batch = choice.shape[0]
    grouped = choice.view(batch, n_group, -1)  # (B, G, E/G)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (B, G)
    top_groups = group_scores.topk(topk_group, dim=-1).indices  # (B, topk_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(batch, -1)


def _routed_experts(
    c: LayerConfig,
    w: Tensors,
    hidden: torch.Tensor,  # (B, hidden)
    topk_weights: torch.Tensor,  # (B, k)
    topk_ids: torch.Tensor,  # (B, k) global expert ids
) -> torch.Tensor:
    """Weighted sum over each token's local experts, (B, hidden) in the model dtype."""
    batch, top_k = topk_ids.shape
    local = topk_ids - c.expert_offset
    is_local = (local >= 0) & (local < c.experts)  # (B, k)
    # Sort (token, slot) pairs by local expert; other GPUs' experts get key E and sort last,
    # past every group's end, so no GEMM reads or writes them.
    key = torch.where(is_local, local, c.experts).flatten()  # (P,) with P = B * k
    sorted_key, order = torch.sort(key, stable=True)
    experts = torch.arange(c.experts, device=key.device)
    group_ends = torch.searchsorted(sorted_key, experts, right=True, out_int32=True)  # (E,)
    rows = hidden[order // top_k]  # (P, hidden): each pair's token
    gate_up = _grouped_linear(rows, w["experts_w13"], group_ends)  # (P, 2I)
    down = _grouped_linear(_silu_and_mul(gate_up), w["experts_w2"], group_ends)  # (P, hidden)
    per_pair = down[torch.argsort(order)].view(batch, top_k, -1)  # back to (token, slot) order
    # where, not a multiply by 0: rows past the last group are never written and may hold NaN
    weighted = torch.where(is_local[..., None], per_pair * topk_weights[..., None], 0.0)
    return weighted.sum(1).to(hidden.dtype)


def _grouped_linear(
    rows: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor
) -> torch.Tensor:
    """rows (P, K); weight (E, N, K); group e is rows [group_ends[e-1], group_ends[e]).
    Returns (P, N): rows[group e] @ weight[e].T; rows past group_ends[-1] are unspecified."""
    if uses_grouped_mm(rows):
        return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=group_ends)
    return _grouped_linear_loop(rows, weight, group_ends)


def _grouped_linear_loop(
    rows: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor
) -> torch.Tensor:
    """The same as one GEMM per expert that has rows; reads the group bounds on the host."""
    out = rows.new_zeros(rows.shape[0], weight.shape[1])
    start = 0
    for expert, end in enumerate(group_ends.tolist()):
        if end > start:
            out[start:end] = F.linear(rows[start:end], weight[expert])
        start = end
    return out


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(_silu_and_mul(F.linear(x, gate_up)), down)


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over [gate | up] (., 2I) -> (., I), in fp32 and rounded once, as vLLM's
    SiluAndMul kernel."""
    gate, up = gate_up.to(_compute_dtype(gate_up)).chunk(2, -1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def _add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's native fused_add_rms_norm: (normalized (B, hidden), x + residual unrounded)."""
    compute = _compute_dtype(x)
    summed = x.to(compute) + residual.to(compute)
    return _normalize(summed, weight, eps, x.dtype), summed


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _normalize(x.to(_compute_dtype(x)), weight, eps, x.dtype)


def _normalize(
    x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(dtype) * weight  # rounded before the weight, as vLLM's native RMSNorm


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with a float32 (or wider) result."""
    if a.dtype in WIDE_DTYPES:
        return torch.mm(a, b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)  # vLLM's cuBLAS router GEMM
    return torch.mm(a.float(), b.float())  # the CPU has no bf16 -> fp32 kernel


def _bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched a @ b with a float32 (or wider) result."""
    if a.dtype in WIDE_DTYPES:
        return torch.bmm(a, b)
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)
