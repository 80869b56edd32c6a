"""Decode context parallelism (CP) for the absorbed MLA attention over the latent cache.

The stock layer's attention (`stock._latent_attention`) lets every head of the absorbed query
attend to one latent sequence: the T cached tokens and the new token. Under CP the cache is split
along the context over `cp` ranks; each rank attends over its own slice only and returns a
partial output with its log-sum-exp, and the partials merge exactly:

    rank r:  s_r = q_lat . K_r^T * scale             (B, H, T_r)   fp32 scores (laid out
                                                     (B, T_r, H) where stock.tokens_major)
             lse_r = logsumexp(s_r)                  (B, H)        fp32; -inf for no tokens
             out_r = softmax(s_r) @ K_r[:, :, :L]    (B, H, L)     fp32, not rounded
    merge:   lse = logsumexp_r(lse_r);  out = sum_r exp(lse_r - lse) * out_r,  rounded once

Since softmax(s) over the union is exp(s - lse), and rank r's softmax is exp(s - lse_r), the
weight exp(lse_r - lse) restores each rank's share: the merge is exact, not an approximation.

Layout: rank r holds the contiguous cache slice [start_r, end_r) (`slice_bounds`); the sizes are
`near_equal_sizes` (the first `T % cp` ranks one token longer) or any given sizes summing to T,
zero included. The new token joins the softmax on exactly one rank, the last (`NEW_TOKEN_RANK`):
its position T follows the last slice's end, so that rank's tokens stay one contiguous run, and
the near-equal split gives the last rank a shorter slice (or an equal one), so with the new
token no rank handles more than ceil((T + 1) / cp) tokens: the best split of the T + 1. Every
rank computes kv_new itself (the layer's other ops are replicated across CP ranks), so the
choice costs no communication.

Precision follows the stock path: fp32 scores and softmax; the cached part of the output
multiplies probabilities rounded to the model dtype with the cache, accumulating in fp32 (as
FlashMLA does); the new token's part stays fp32. Partials stay fp32 up to the merge and the merged
output is rounded to the model dtype once, as stock rounds once. Given float32 or float64
tensors everything computes in that dtype. Only the probabilities' rounding sees a different
normalizer (each rank's own sum rather than the global one): a relative rounding of the same
size, so a bf16 CP result is as close to the float64 reference as stock's.

Two forms with the same numbers: `context_parallel_attention` splits and merges in one process
(no torch.distributed); `distributed_latent_attention` runs on each rank of an initialized
process group of size cp (gloo on CPU, NCCL on GPU), holding only its slice, and merges through
one all_gather. vLLM shards its decode CP cache round-robin over the ranks (interleaved, so a
growing cache stays balanced); attention is invariant to the order of keys, so the contiguous
slices here give the same result and the same per-rank work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.mla_moe_decode import stock

NEW_TOKEN_RANK = -1  # the last rank attends to the new token (see the module docstring)


@dataclass(frozen=True)
class Partial:
    """One rank's attention over its tokens, in the compute dtype (fp32 or float64)."""

    out: torch.Tensor  # (B, H, L) normalized over this rank's tokens; 0 where it has none
    lse: torch.Tensor  # (B, H) log-sum-exp of this rank's scaled scores; -inf where none


def near_equal_sizes(context: int, cp: int) -> tuple[int, ...]:
    """Slice lengths of `context` tokens over `cp` ranks: the first context % cp ranks hold one
    token more. Ranks past the context hold 0 tokens (context < cp)."""
    if cp < 1 or context < 0:
        raise ValueError(f"need cp >= 1 and context >= 0, got cp={cp}, context={context}")
    base, extra = divmod(context, cp)
    return tuple(base + 1 if rank < extra else base for rank in range(cp))


def slice_bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each rank's slice, in rank order."""
    if not sizes or min(sizes) < 0:
        raise ValueError(f"slice sizes must be one or more lengths >= 0, got {list(sizes)}")
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def rank_slice(kv_cache: torch.Tensor, sizes: Sequence[int], rank: int) -> torch.Tensor:
    """Rank `rank`'s view of kv_cache (B, T, L+R): (B, T_r, L+R), no copy."""
    _check_sizes(sizes, kv_cache.shape[1])
    start, end = slice_bounds(sizes)[rank]
    return kv_cache[:, start:end]


def holds_new_token(rank: int, cp: int) -> bool:
    return rank == NEW_TOKEN_RANK % cp


def partial_attention(
    q_latent: torch.Tensor,  # (B, H, L+R)
    kv_slice: torch.Tensor,  # (B, T_r, L+R), T_r >= 0
    kv_new: torch.Tensor | None,  # (B, L+R) on the rank that holds the new token, else None
    lora: int,
    scale: float,
) -> Partial:
    """Attention of every head over this rank's tokens, normalized over them alone. The scores'
    token axis is where the stock puts it for this many tokens (stock.tokens_major: a ragged
    slice's odd length would otherwise cost the CP stock cuBLAS's aligned kernels)."""
    cached = kv_slice.shape[1]
    axis = 1 if stock.tokens_major(cached) else 2  # scores (B, T_r, H) or (B, H, T_r)

    def scores_of(keys: torch.Tensor) -> torch.Tensor:  # keys (B, T, L+R)
        if axis == 1:
            return stock._bmm_fp32(keys, q_latent.transpose(1, 2)) * scale
        return stock._bmm_fp32(q_latent, keys.transpose(1, 2)) * scale

    scores = scores_of(kv_slice)
    if kv_new is not None:
        scores = torch.cat([scores, scores_of(kv_new[:, None])], axis)
    if scores.shape[axis] == 0:
        return _empty_partial(q_latent, lora, scores.dtype)
    # exp(s - max) / sum, as torch.softmax computes it: at cp=1 this is the stock softmax
    peak = scores.amax(axis, keepdim=True)
    weights = torch.exp(scores - peak)
    total = weights.sum(axis, keepdim=True)
    probs = weights / total  # the T_r [+1] tokens on `axis`
    cached_probs = probs.narrow(axis, 0, cached).to(q_latent.dtype)
    values = kv_slice[..., :lora]
    if axis == 1:
        out = stock._bmm_fp32(values.transpose(1, 2), cached_probs).transpose(1, 2)
    else:
        out = stock._bmm_fp32(cached_probs, values)
    if kv_new is not None:
        new_prob = probs.narrow(axis, cached, 1)
        out = out + (new_prob.transpose(1, 2) if axis == 1 else new_prob) * kv_new[:, None, :lora]
    return Partial(out, (peak + total.log()).squeeze(axis))


def _empty_partial(q_latent: torch.Tensor, lora: int, dtype: torch.dtype) -> Partial:
    """A rank with no tokens: weight exp(-inf - lse) = 0 in the merge; zeros, not 0/0 = NaN,
    because 0 * NaN would still poison the sum."""
    batch, heads = q_latent.shape[:2]
    out = torch.zeros(batch, heads, lora, dtype=dtype, device=q_latent.device)
    lse = torch.full((batch, heads), float("-inf"), dtype=dtype, device=q_latent.device)
    return Partial(out, lse)


def merge_partials(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> torch.Tensor:
    """out = sum_r exp(lse_r - lse) * out_r with lse = logsumexp_r(lse_r); outs (B, H, L) and
    lses (B, H) per rank, in the compute dtype; returns (B, H, L) in that dtype. At least one
    rank must hold a token for every (token, head)."""
    lse_per_rank = torch.stack(list(lses))  # (cp, B, H)
    lse = torch.logsumexp(lse_per_rank, 0)  # (B, H)
    weights = torch.exp(lse_per_rank - lse)  # (cp, B, H); 0 for a rank with no tokens
    return (weights[..., None] * torch.stack(list(outs))).sum(0)


def context_parallel_attention(
    q_latent: torch.Tensor,  # (B, H, L+R)
    kv_cache: torch.Tensor,  # (B, T, L+R)
    kv_new: torch.Tensor,  # (B, L+R)
    lora: int,
    scale: float,
    sizes: Sequence[int],
) -> torch.Tensor:
    """The stock latent attention computed as `len(sizes)` ranks would, in one process:
    (B, H, L) in q_latent's dtype."""
    cp = len(sizes)
    partials = [
        partial_attention(
            q_latent,
            rank_slice(kv_cache, sizes, rank),
            kv_new if holds_new_token(rank, cp) else None,
            lora,
            scale,
        )
        for rank in range(cp)
    ]
    merged = merge_partials([p.out for p in partials], [p.lse for p in partials])
    return merged.to(q_latent.dtype)


def distributed_latent_attention(
    q_latent: torch.Tensor,  # (B, H, L+R), the same on every rank
    kv_slice: torch.Tensor,  # (B, T_r, L+R), this rank's slice only
    kv_new: torch.Tensor,  # (B, L+R), the same on every rank; counted on one rank
    lora: int,
    scale: float,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """This rank's partial, all-gathered and merged: every rank returns the full attention
    (B, H, L) in q_latent's dtype, equal to `context_parallel_attention` with the ranks' slice
    sizes. Collective: every rank of `group` must call it."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    partial = partial_attention(
        q_latent, kv_slice, kv_new if holds_new_token(rank, cp) else None, lora, scale
    )
    # The lse rides as one more column: one collective per layer instead of two, which
    # matters at decode, where each collective costs latency rather than bandwidth.
    packed = torch.cat([partial.out, partial.lse[..., None]], -1).contiguous()  # (B, H, L+1)
    gathered = [torch.empty_like(packed) for _ in range(cp)]
    # the list form: the same call on every torch version this runs on (torch 2.13 deprecates
    # all_gather_into_tensor for all_gather_single, which older versions lack)
    dist.all_gather(gathered, packed, group=group)
    merged = merge_partials([g[..., :lora] for g in gathered], [g[..., lora] for g in gathered])
    return merged.to(q_latent.dtype)


def _check_sizes(sizes: Sequence[int], context: int) -> None:
    if sum(sizes) != context:
        raise ValueError(f"slice sizes {list(sizes)} sum to {sum(sizes)}, not context {context}")
    slice_bounds(sizes)  # validates the lengths themselves
