"""Problem: one decode step of a Kimi-K2-class MLA+MoE layer, one GPU's shard at TP8/EP8.

Inputs (dtype of the case unless noted):
    x (B, hidden)              the previous layer's output (vLLM's `hidden_states`)
    residual (B, hidden)       the residual stream before this layer's input_layernorm
    kv_cache (B, T, L+R)       T = context cached tokens: normalized latent (L) | roped key (R)
    positions (B,) int64       each sequence's position of the new token
Outputs:
    out (B, hidden)            MoE output: routed + shared experts (partial sum, pre-all-reduce)
    residual_out (B, hidden)   residual after the attention add (input to the next layer's norm)
    kv_new (B, L+R)            the new token's cache entry; the path must not write kv_cache
Weights (`weight_shapes` lists them): vLLM's runtime layouts, (out, in) matrices; the experts
stacked as w13 (E, 2I, hidden) = [gate; up] and w2 (E, hidden, I); the router bias float32;
`config` the LayerConfig numbers (float64, on the CPU).

The convention is vLLM's DeepseekV2DecoderLayer with a residual: the layer starts with the fused
residual add + RMSNorm and hands (out, residual_out) to the next layer. Communication (the TP
all-reduce after o_proj and after the MoE, the EP dispatch) is not part of the problem: the
outputs are this GPU's partial sums. model.config keys: the LayerConfig fields (config.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from harness.evaluation.cases import Case
from kernels.mla_moe_decode import stock
from kernels.mla_moe_decode.config import LayerConfig
from kernels.mla_moe_decode.context_parallel import near_equal_sizes, rank_slice

Tensors = dict[str, torch.Tensor]
NORM_WEIGHT_STD = 0.1  # norm weights ~ N(1, 0.1)
BIAS_STD = 0.02  # router correction bias: steers near-ties, far below the sigmoid scores' spread
# q_b_proj drawn this much above N(0, 1/sqrt(fan_in)) so scaled attention logits have a std of
# ~2 (softmax weight concentrates on a few percent of the context) rather than ~0.8 (near uniform).
Q_GAIN = 2.5
POSITION_SPREAD = 64  # positions[b] in [context, context + 64): per-sequence rotations differ
EXPERT_WEIGHTS = ("experts_w13", "experts_w2")


class Problem:
    def __init__(self, config: dict[str, object]) -> None:
        self.config = LayerConfig.from_model_config(config)

    def make_weights(self, case: Case, seed: int, device: torch.device) -> Tensors:
        """Drawn on `device` with its own generator: the same seed gives the same values on the
        same kind of device. Matrices ~ N(0, 1/sqrt(fan_in)) keep activations O(1)."""
        gen = torch.Generator(device=device).manual_seed(seed)
        dtype = _dtype(case)
        weights = {"config": self.config.to_tensor()}
        for name, shape in weight_shapes(self.config).items():
            weights[name] = _draw_weight(name, shape, gen, device, _weight_dtype(name, dtype))
        return weights

    def make_inputs(self, case: Case, seed: int, device: torch.device) -> Tensors:
        """x and residual with a seed-dependent scale and offset (a path right only for
        standard-normal data fails); the cache and positions as `_kv_cache` and
        POSITION_SPREAD describe."""
        context = _context(case)
        gen = torch.Generator(device=device).manual_seed(seed)
        hidden = self._hidden_states(case, seed, gen, device)
        kv_cache = _kv_cache(self.config, case.batch, context, gen, device, _dtype(case))
        jitter = torch.randint(0, POSITION_SPREAD, (case.batch,), generator=gen, device=device)
        return {**hidden, "kv_cache": kv_cache, "positions": context + jitter}

    def pair_inputs(self, case: Case, seed: int, device: torch.device) -> Tensors:
        """A new hidden state for one timed pair (the harness's `timing.PairInputs`): x and
        residual drawn as make_inputs draws them. The cache and positions, nearly all of the
        inputs' bytes, stay; the harness redraws until the routing activates as many local
        experts as on the timed inputs (`floor_bytes`), so every pair does the same work."""
        gen = torch.Generator(device=device).manual_seed(seed)
        return self._hidden_states(case, seed, gen, device)

    def _hidden_states(
        self, case: Case, seed: int, gen: torch.Generator, device: torch.device
    ) -> Tensors:
        host = torch.Generator().manual_seed(seed)
        scale = float(torch.empty(1).uniform_(0.5, 4.0, generator=host))
        # An offset shared by every token also pulls their routing together; in units of the
        # scale it stays a minor part of each hidden state, so tokens still spread over experts.
        offset = scale * float(torch.empty(1).uniform_(-0.5, 0.5, generator=host))
        dtype, shape = _dtype(case), (case.batch, self.config.hidden)
        x = _normal(shape, gen, device, dtype).mul_(scale).add_(offset)
        residual = _normal(shape, gen, device, dtype).mul_(scale)
        return {"x": x, "residual": residual}

    def shard_inputs(self, case: Case, inputs: Tensors, cp_rank: int) -> Tensors:
        """Decode CP: rank `cp_rank` of case.cp holds its contiguous slice of the cache
        (context_parallel.near_equal_sizes); x, residual and positions are the whole batch's."""
        sizes = near_equal_sizes(inputs["kv_cache"].shape[1], case.cp)
        return {**inputs, "kv_cache": rank_slice(inputs["kv_cache"], sizes, cp_rank).contiguous()}

    def make_outputs(self, case: Case, device: torch.device) -> Tensors:
        dtype, batch, c = _dtype(case), case.batch, self.config
        return {
            "out": torch.empty(batch, c.hidden, device=device, dtype=dtype),
            "residual_out": torch.empty(batch, c.hidden, device=device, dtype=dtype),
            "kv_new": torch.empty(batch, c.latent_dim, device=device, dtype=dtype),
        }

    def bytes_moved(self, case: Case) -> int:
        """Expected fewest bytes per layer: `layer_bytes` with the local experts that uniformly
        spread routing activates on average (`expected_local_experts`). `floor_bytes` is the
        exact count for given inputs."""
        return round(self.layer_bytes(case, expected_local_experts(self.config, case.batch)))

    def layer_bytes(self, case: Case, local_experts: float) -> float:
        """Fewest bytes per layer when routing activates `local_experts` of this GPU's experts:
        every dense weight, those experts, one read of the KV cache (under decode CP, of the
        largest rank's slice), the inputs and outputs."""
        c, dtype = self.config, _dtype(case)
        dense, per_expert = _weight_bytes(c, dtype)
        # under decode CP a rank reads its slice; the largest (near_equal_sizes) sets the pace
        slice_tokens = -(-_context(case) // case.cp)
        kv_bytes = case.batch * slice_tokens * c.latent_dim * _itemsize(dtype)
        return dense + local_experts * per_expert + kv_bytes + _io_bytes(c, case.batch, dtype)

    def floor_bytes(self, case: Case, weights: Tensors, inputs: Tensors) -> int:
        """The bytes any path must read or write for these inputs: every dense weight, each
        local expert the stock routing activates (once, however many tokens chose it), the KV
        cache, the inputs and the outputs."""
        active = len(activated_local_experts(self.config, weights, inputs))
        return self._bytes_but_experts(case, weights, inputs) + active * _expert_bytes(weights)

    def floor_counter(
        self, case: Case, weights: Tensors, inputs: Tensors
    ) -> Callable[[Tensors], int]:
        """`floor_bytes(case, weights, {**inputs, **values})` for many `values` (x and
        residual, as pair_inputs draws them) on one layer's weights and held inputs: the
        harness checks thousands of pair draws this way. Each eager count launched ~150 ops and
        took 2.2-2.6 ms on an H200 at any batch, a quarter of a batch-8 case's seconds
        (benchmarks/harness_cost.py, 2026-12-07); on CUDA the stock routing and the count run
        as one captured graph instead, reading the values from buffers of its own (0.30-0.84
        ms a count on an H100, 2.14 eager on the same machine)."""
        fixed = self._bytes_but_experts(case, weights, inputs)
        per_expert = _expert_bytes(weights)
        count = functools.partial(_local_expert_count, self.config, weights)
        if inputs["x"].device.type == "cuda":
            counted = _captured(count, {**inputs})
        else:
            counted = lambda values: count({**inputs, **values})  # noqa: E731
        return lambda values: fixed + per_expert * int(counted(values))

    def _bytes_but_experts(self, case: Case, weights: Tensors, inputs: Tensors) -> int:
        dense = sum(t.nbytes for n, t in weights.items() if n not in (*EXPERT_WEIGHTS, "config"))
        small = sum(inputs[n].nbytes for n in ("x", "residual", "positions"))
        outputs = sum(t.nbytes for t in self.make_outputs(case, torch.device("meta")).values())
        return dense + inputs["kv_cache"].nbytes + small + outputs

    def ambiguous_rows(self, weights: Tensors, inputs: Tensors) -> dict[str, torch.Tensor]:
        """Tokens of `out` whose local expert set hangs on a near-tie: in float64, two or more
        experts score within routing_tie_margin of the top-k boundary and one of them is local
        (another GPU's expert contributes nothing here). Two correct bf16 paths may route such a
        token differently, moving its output by a whole expert; the harness leaves these rows out
        of the error (at most 10% of them) and records how many."""
        c = self.config
        if c.routing_tie_margin <= 0:
            return {}
        # only what the router needs, upcast: the experts' gigabytes stay as they are
        upcast = {
            name: t.double()
            if t.is_floating_point() and not name.startswith(("experts_", "shared_"))
            else t
            for name, t in weights.items()
        }
        choice = stock.expert_choice(
            upcast, {n: t.double() if t.is_floating_point() else t for n, t in inputs.items()}
        )
        top = choice.topk(c.top_k + 1, dim=-1).values
        boundary = (top[:, c.top_k - 1] + top[:, c.top_k]) / 2
        near = (choice - boundary[:, None]).abs() < c.routing_tie_margin
        local = torch.zeros(c.experts_total, dtype=torch.bool, device=choice.device)
        local[c.expert_offset : c.expert_offset + c.experts] = True
        return {"out": (near.sum(-1) >= 2) & (near & local).any(-1)}

    # Decode-stack hooks: one layer's persistent state across decode steps.

    def decode_state(self, case: Case, seed: int, device: torch.device) -> Tensors:
        """A cache prefilled with `context` tokens; the next token sits at position `context`."""
        context = _context(case)
        gen = torch.Generator(device=device).manual_seed(seed)
        kv_cache = _kv_cache(self.config, case.batch, context, gen, device, _dtype(case))
        positions = torch.full((case.batch,), context, device=device, dtype=torch.int64)
        return {"kv_cache": kv_cache, "positions": positions}

    def step_inputs(self, state: Tensors, hidden: torch.Tensor, residual: torch.Tensor) -> Tensors:
        return {
            "x": hidden,
            "residual": residual,
            "kv_cache": state["kv_cache"],
            "positions": state["positions"],
        }

    def step_finish(self, state: Tensors, outputs: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
        """Append kv_new to the cache and drop its oldest token, advance positions; the next
        layer's (x, residual), copied so the caller may reuse its output buffers.

        A sliding window: the cache keeps the case's length, so every decode step has the case's
        shapes and a compiled path (or a CUDA graph) never meets a new shape mid-check.
        """
        kv_cache = state["kv_cache"]
        state["kv_cache"] = torch.cat([kv_cache[:, 1:], outputs["kv_new"][:, None]], 1)
        state["positions"] = state["positions"] + 1
        return outputs["out"].clone(), outputs["residual_out"].clone()


def weight_shapes(c: LayerConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor weight of the layer, in make_weights' generation order (experts last)."""
    heads, lora, rope = c.heads, c.kv_lora_rank, c.qk_rope_head_dim
    return {
        "input_layernorm": (c.hidden,),
        "fused_qkv_a_proj": (c.q_lora_rank + lora + rope, c.hidden),  # [q_a_proj; kv_a_proj]
        "q_a_layernorm": (c.q_lora_rank,),
        "q_b_proj": (heads * c.qk_head_dim, c.q_lora_rank),
        "kv_a_layernorm": (lora,),
        "kv_b_proj": (heads * (c.qk_nope_head_dim + c.v_head_dim), lora),
        "o_proj": (c.hidden, heads * c.v_head_dim),
        "post_attention_layernorm": (c.hidden,),
        "gate": (c.experts_total, c.hidden),
        "e_score_correction_bias": (c.experts_total,),
        "shared_gate_up": (2 * c.shared_intermediate, c.hidden),
        "shared_down": (c.hidden, c.shared_intermediate),
        "experts_w13": (c.experts, 2 * c.moe_intermediate, c.hidden),
        "experts_w2": (c.experts, c.hidden, c.moe_intermediate),
    }


def _expert_bytes(weights: Tensors) -> int:
    """The bytes of one local expert's weights."""
    return sum(weights[n][0].nbytes for n in EXPERT_WEIGHTS)


def expected_local_experts(c: LayerConfig, batch: int) -> float:
    """Distinct local experts activated by `batch` tokens when each picks top_k of
    experts_total uniformly: experts * (1 - (1 - top_k / experts_total) ** batch)."""
    return c.experts * (1.0 - (1.0 - c.top_k / c.experts_total) ** batch)


def activated_local_experts(c: LayerConfig, weights: Tensors, inputs: Tensors) -> list[int]:
    """Local expert indices (0-based on this GPU) the stock routing picks for these inputs."""
    _, topk_ids = stock.route(weights, inputs)
    local = topk_ids.flatten() - c.expert_offset
    return sorted(int(e) for e in local[(local >= 0) & (local < c.experts)].unique().tolist())


def _local_expert_count(c: LayerConfig, weights: Tensors, inputs: Tensors) -> torch.Tensor:
    """len(activated_local_experts(...)) as a 0-d tensor, with no sync: capturable."""
    _, topk_ids = stock.route(weights, inputs)
    chosen = torch.zeros(c.experts_total, dtype=torch.bool, device=topk_ids.device)
    chosen.index_fill_(0, topk_ids.flatten(), True)  # `chosen[ids] = True` copies from the host
    return chosen[c.expert_offset : c.expert_offset + c.experts].sum()


def _captured(
    count: Callable[[Tensors], torch.Tensor], held: Tensors
) -> Callable[[Tensors], torch.Tensor]:
    """`count` as one CUDA graph over `held`: a call copies its x and residual into the
    graph's own buffers and replays it (the other inputs are read where `held` keeps them)."""
    drawn = {name: held[name].clone() for name in ("x", "residual")}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # cuBLAS's handles and workspaces made outside the capture
        count({**held, **drawn})
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = count({**held, **drawn})

    def replay(values: Tensors) -> torch.Tensor:
        if values.keys() - drawn.keys():  # the graph reads the rest where `held` keeps them
            raise ValueError(f"a captured count takes x and residual, not {sorted(values)}")
        for name, buffer in drawn.items():
            buffer.copy_(values[name])
        graph.replay()
        return result

    return replay


def _draw_weight(
    name: str,
    shape: tuple[int, ...],
    gen: torch.Generator,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    weight = torch.empty(shape, device=device, dtype=dtype)
    if name == "e_score_correction_bias":
        return weight.normal_(0.0, BIAS_STD, generator=gen)
    if len(shape) == 1:  # the RMSNorm weights
        return weight.normal_(1.0, NORM_WEIGHT_STD, generator=gen)
    gain = Q_GAIN if name == "q_b_proj" else 1.0
    return weight.normal_(0.0, gain / math.sqrt(shape[-1]), generator=gen)


def _kv_cache(
    c: LayerConfig,
    batch: int,
    context: int,
    gen: torch.Generator,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """(B, T, L+R) cached tokens shaped like kv_a_layernorm outputs: each latent is a
    per-sequence mean direction plus per-token noise (real latents are strongly correlated
    across tokens; without the mean, attention outputs would average towards 0 at long
    context), scaled to unit RMS and by per-channel gains near 1; rotary keys ~ N(0, 1)."""
    lora = c.kv_lora_rank
    cache = _normal((batch, context, c.latent_dim), gen, device, dtype)
    latent = cache[..., :lora]
    latent.add_(_normal((batch, 1, lora), gen, device, dtype))
    # the norm accumulates in fp32 without an fp32 copy of the cache (2.4 GB at B=64, T=32k)
    wide = torch.promote_types(dtype, torch.float32)
    norm = torch.linalg.vector_norm(latent, dim=-1, keepdim=True, dtype=wide)
    latent.mul_((math.sqrt(lora) / norm).to(dtype))
    gains = _normal((lora,), gen, device, dtype).mul_(NORM_WEIGHT_STD).add_(1.0)
    latent.mul_(gains)
    return cache


def _normal(
    shape: tuple[int, ...], gen: torch.Generator, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    return torch.empty(shape, device=device, dtype=dtype).normal_(generator=gen)


def _weight_bytes(c: LayerConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(all dense weights, one expert's w13 and w2) in bytes."""
    dense = per_expert = 0
    for name, shape in weight_shapes(c).items():
        size = math.prod(shape) * _itemsize(_weight_dtype(name, dtype))
        if name in EXPERT_WEIGHTS:
            per_expert += size // c.experts
        else:
            dense += size
    return dense, per_expert


def _io_bytes(c: LayerConfig, batch: int, dtype: torch.dtype) -> int:
    """x, residual, positions read; out, residual_out, kv_new written."""
    return batch * ((4 * c.hidden + c.latent_dim) * _itemsize(dtype) + 8)


def _weight_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    # vLLM keeps the correction bias in float32 whatever the model dtype
    if name == "e_score_correction_bias":
        return torch.promote_types(dtype, torch.float32)
    return dtype


def _context(case: Case) -> int:
    if case.context is None or case.context < 1:
        raise ValueError(f"the MLA decode problem needs a context >= 1, got {case.context}")
    return case.context


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _dtype(case: Case) -> torch.dtype:
    return getattr(torch, case.dtype)  # type: ignore[no-any-return]
