"""The MLA+MoE decode problem and its stock path, on CPU at small sizes.

The stock path (absorbed MLA, sorted grouped experts) is checked against a float64 layer written
here independently: un-absorbed MLA with explicit per-head keys and values expanded from
kv_b_proj, RoPE through complex rotations, routing and experts one token at a time.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import MappingProxyType

import pytest
import torch

from harness.evaluation.cases import Case
from kernels.mla_moe_decode import stock
from kernels.mla_moe_decode.config import LayerConfig
from kernels.mla_moe_decode.problem import Problem, expected_local_experts
from scopes.manifest import load_manifest_file

Tensors = dict[str, torch.Tensor]
CPU = torch.device("cpu")
SMALL = {
    "hidden": 256,
    "heads": 2,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "experts": 8,
    "experts_total": 64,
    "top_k": 4,
    "moe_intermediate": 64,
    "shared_intermediate": 32,
    "rank": 2,  # local experts are 16..23: a path that assumes rank 0 fails
}
OUTPUTS = ("out", "residual_out", "kv_new")
SCOPE = Path(__file__).resolve().parents[2] / "scopes/kimi-k2-mla-moe-decode-h200.yaml"


def _problem(**overrides: object) -> Problem:
    return Problem({**SMALL, **overrides})


def _case(batch: int, context: int, dtype: str = "float32") -> Case:
    config = MappingProxyType(dict(SMALL))
    return Case(batch, context, cp=1, gpus=1, dtype=dtype, gpu="cpu", config=config)


def _setup(
    batch: int, context: int, dtype: str = "float32", seed: int = 0, **overrides: object
) -> tuple[Problem, Case, Tensors, Tensors]:
    problem, case = _problem(**overrides), _case(batch, context, dtype)
    weights = problem.make_weights(case, seed, CPU)
    return problem, case, weights, problem.make_inputs(case, seed + 1000, CPU)


def _stock(problem: Problem, case: Case, weights: Tensors, inputs: Tensors) -> Tensors:
    out = problem.make_outputs(case, CPU)
    for tensor in out.values():
        tensor.fill_(float("nan"))
    stock.forward(weights, inputs, out)
    return out


def _f64(tensors: Tensors) -> Tensors:
    return {k: v.double() if v.is_floating_point() else v for k, v in tensors.items()}


def _rel_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    diff = value.double() - reference
    return float(diff.norm() / reference.norm())


# The independent float64 layer.


def _ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def _ref_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Pairs (x[2i], x[2i+1]) as complex numbers times e^(i * position * theta^(-2i/R))."""
    rope = x.shape[-1]
    freqs = theta ** (-torch.arange(0, rope, 2, dtype=torch.float64) / rope)
    angles = positions.double()[..., None] * freqs
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], rope // 2, 2).contiguous())
    rotated = pairs * torch.polar(torch.ones_like(angles), angles)
    return torch.view_as_real(rotated).flatten(-2)


def _ref_swiglu(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = (gate_up @ h).chunk(2)
    return down @ (gate * torch.sigmoid(gate) * up)


def _ref_route(c: LayerConfig, w: Tensors, h: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """One token: biased sigmoid scores choose (within the best groups), unbiased ones weigh."""
    scores = torch.sigmoid(w["gate"] @ h)
    choice = (scores + w["e_score_correction_bias"]).tolist()
    candidates = list(range(c.experts_total))
    if c.n_group > 1:
        size = c.experts_total // c.n_group
        group_score = [
            sum(sorted(choice[g * size : (g + 1) * size])[-2:]) for g in range(c.n_group)
        ]
        best = sorted(range(c.n_group), key=lambda g: -group_score[g])[: c.topk_group]
        candidates = [e for g in best for e in range(g * size, (g + 1) * size)]
    chosen = sorted(candidates, key=lambda e: -choice[e])[: c.top_k]
    weights = scores[chosen]
    if c.norm_topk_prob:
        weights = weights / weights.sum()
    return chosen, weights * c.routed_scaling_factor


def _ref_moe(c: LayerConfig, w: Tensors, h: torch.Tensor) -> torch.Tensor:
    chosen, weights = _ref_route(c, w, h)
    total = _ref_swiglu(h, w["shared_gate_up"], w["shared_down"])
    for expert, weight in zip(chosen, weights, strict=True):
        local = expert - c.rank * c.experts
        if 0 <= local < c.experts:
            total = total + weight * _ref_swiglu(h, w["experts_w13"][local], w["experts_w2"][local])
    return total


def _ref_attention(
    c: LayerConfig, w: Tensors, h: torch.Tensor, inputs: Tensors
) -> tuple[torch.Tensor, torch.Tensor]:
    """Un-absorbed MLA: every head's keys and values expanded from the latents. -> (attn, kv_new)"""
    nope, rope, lora = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
    batch, heads, eps, positions = h.shape[0], c.heads, c.rms_norm_eps, inputs["positions"]
    q_c, kv_c, k_pe = (h @ w["fused_qkv_a_proj"].T).split([c.q_lora_rank, lora, rope], -1)
    q = (_ref_rms_norm(q_c, w["q_a_layernorm"], eps) @ w["q_b_proj"].T).view(batch, heads, -1)
    q_pe = _ref_rope(q[..., nope:], positions[:, None], c.rope_theta)
    query = torch.cat([q[..., :nope], q_pe], -1)  # (B, H, N+R)
    latent = _ref_rms_norm(kv_c, w["kv_a_layernorm"], eps)
    kv_new = torch.cat([latent, _ref_rope(k_pe, positions, c.rope_theta)], -1)
    tokens = torch.cat([inputs["kv_cache"], kv_new[:, None]], 1)  # (B, T+1, L+R)
    kv_b = w["kv_b_proj"].view(heads, nope + c.v_head_dim, lora)
    k_nope = torch.einsum("btl,hnl->bthn", tokens[..., :lora], kv_b[:, :nope])
    values = torch.einsum("btl,hvl->bthv", tokens[..., :lora], kv_b[:, nope:])
    k_rope = tokens[:, :, None, lora:].expand(-1, -1, heads, -1)
    keys = torch.cat([k_nope, k_rope], -1)  # (B, T+1, H, N+R)
    probs = torch.softmax(torch.einsum("bhd,bthd->bht", query, keys) / math.sqrt(nope + rope), -1)
    o = torch.einsum("bht,bthv->bhv", probs, values).reshape(batch, -1)
    return o @ w["o_proj"].T, kv_new


def _ref_attention_block(
    c: LayerConfig, weights: Tensors, inputs: Tensors
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(MoE input h2, residual r2, kv_new), in float64."""
    w, x = _f64(weights), _f64(inputs)
    r1 = x["x"] + x["residual"]
    attn, kv_new = _ref_attention(c, w, _ref_rms_norm(r1, w["input_layernorm"], c.rms_norm_eps), x)
    r2 = attn + r1
    return _ref_rms_norm(r2, w["post_attention_layernorm"], c.rms_norm_eps), r2, kv_new


def _reference(c: LayerConfig, weights: Tensors, inputs: Tensors) -> Tensors:
    h2, r2, kv_new = _ref_attention_block(c, weights, inputs)
    out = torch.stack([_ref_moe(c, _f64(weights), token) for token in h2])
    return {"out": out, "residual_out": r2, "kv_new": kv_new}


def _reference_moe_inputs(c: LayerConfig, weights: Tensors, inputs: Tensors) -> torch.Tensor:
    return _ref_attention_block(c, weights, inputs)[0]


# Tests.


def test_shapes_dtypes_and_seeds() -> None:
    problem, case, weights, inputs = _setup(3, 5, "bfloat16")
    c = problem.config
    assert {k: tuple(v.shape) for k, v in inputs.items()} == {
        "x": (3, 256),
        "residual": (3, 256),
        "kv_cache": (3, 5, 48),
        "positions": (3,),
    }
    out = _stock(problem, case, weights, inputs)
    assert {k: (tuple(v.shape), v.dtype) for k, v in out.items()} == {
        "out": ((3, 256), torch.bfloat16),
        "residual_out": ((3, 256), torch.bfloat16),
        "kv_new": ((3, 48), torch.bfloat16),
    }
    assert all(v.isfinite().all() for v in out.values())
    assert weights["experts_w13"].shape == (8, 128, 256)
    assert weights["e_score_correction_bias"].dtype == torch.float32  # as vLLM keeps it
    assert inputs["positions"].dtype == torch.int64 and (inputs["positions"] >= 5).all()
    assert LayerConfig.from_tensor(weights["config"]) == c
    again = problem.make_weights(case, 0, CPU)
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    other = problem.make_inputs(case, 1001, CPU)
    assert not torch.equal(inputs["kv_cache"], other["kv_cache"])


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("context", [5, 17])
def test_absorbed_stock_equals_unabsorbed_reference_in_float64(batch: int, context: int) -> None:
    problem, _, weights, inputs = _setup(batch, context, seed=batch * 100 + context)
    expected = _reference(problem.config, weights, inputs)
    out = {k: torch.empty_like(v) for k, v in expected.items()}
    stock.forward(_f64(weights), _f64(inputs), out)
    for name in OUTPUTS:
        scale = expected[name].abs().max()
        assert (out[name] - expected[name]).abs().max() <= 1e-10 * scale, name


def test_grouped_topk_selects_within_the_best_groups() -> None:
    """DeepSeek-V3's group limit (16 groups of 4 here, the best 3 by their top-two sum)."""
    for seed in range(3):
        problem, case, weights, inputs = _setup(8, 5, seed=seed, n_group=16, topk_group=3)
        _, ids = stock.route(_f64(weights), _f64(inputs))
        assert max(len({int(e) // 4 for e in row}) for row in ids) <= 3
        hidden = _reference_moe_inputs(problem.config, weights, inputs)
        for b in range(8):
            expected = _ref_route(problem.config, _f64(weights), hidden[b])[0]
            assert sorted(ids[b].tolist()) == sorted(expected)
        out = {k: v.double() for k, v in problem.make_outputs(case, CPU).items()}
        stock.forward(_f64(weights), _f64(inputs), out)
        expected_out = _reference(problem.config, weights, inputs)["out"]
        assert _rel_error(out["out"], expected_out) < 1e-12


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_stock_is_close_to_the_reference(dtype: str, tolerance: float) -> None:
    """In bf16 a near-tie may route a token to another expert than exact math does; such
    tokens are left out of the `out` comparison and must be rare."""
    compared = flipped = 0
    for seed, (batch, context) in enumerate([(1, 5), (3, 17), (8, 17), (8, 5)]):
        problem, case, weights, inputs = _setup(batch, context, dtype, seed)
        out = _stock(problem, case, weights, inputs)
        expected = _reference(problem.config, weights, inputs)
        for name in ("residual_out", "kv_new"):
            assert _rel_error(out[name], expected[name]) < tolerance, name
        same = _same_routing(problem, weights, inputs)
        assert _rel_error(out["out"][same], expected["out"][same]) < tolerance
        compared, flipped = compared + batch, flipped + int((~same).sum())
    assert flipped <= compared // 10


def _same_routing(problem: Problem, weights: Tensors, inputs: Tensors) -> torch.Tensor:
    """(B,) bool: tokens whose experts the path's routing and exact routing agree on."""
    _, ids = stock.route(weights, inputs)
    exact = _f64(weights)
    hidden = _reference_moe_inputs(problem.config, weights, inputs)
    return torch.tensor(
        [
            sorted(ids[b].tolist()) == sorted(_ref_route(problem.config, exact, hidden[b])[0])
            for b in range(ids.shape[0])
        ]
    )


def test_bias_steers_the_choice_but_not_the_weights() -> None:
    problem, _, weights, inputs = _setup(8, 5, seed=3)
    c, favoured = problem.config, 40
    _, before = stock.route(weights, inputs)
    assert not (before == favoured).any(dim=1).all()
    weights["e_score_correction_bias"][favoured] += 1.0
    topk_weights, after = stock.route(weights, inputs)
    assert (after == favoured).any(dim=1).all()  # every token now picks it
    hidden = _reference_moe_inputs(c, weights, inputs)
    for b in range(8):
        chosen, expected = _ref_route(c, _f64(weights), hidden[b])
        order = [after[b].tolist().index(e) for e in chosen]
        torch.testing.assert_close(topk_weights[b, order].double(), expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tokens_routed_to_other_gpus_get_only_the_shared_expert(dtype: str) -> None:
    problem, case, weights, inputs = _setup(8, 17, dtype, seed=5)
    remote = [0, 1, 40, 63]  # outside this rank's 16..23
    weights["e_score_correction_bias"][remote] += 10.0
    # any read of a local expert would now show as NaN
    weights["experts_w13"].fill_(float("nan"))
    weights["experts_w2"].fill_(float("nan"))
    out = _stock(problem, case, weights, inputs)
    c = problem.config
    hidden = _reference_moe_inputs(c, weights, inputs)
    w = _f64(weights)
    shared = torch.stack([_ref_swiglu(h, w["shared_gate_up"], w["shared_down"]) for h in hidden])
    assert out["out"].isfinite().all()
    assert _rel_error(out["out"], shared) < (1e-5 if dtype == "float32" else 2e-2)


def test_floor_bytes_counts_exactly_the_activated_local_experts() -> None:
    problem, case, weights, inputs = _setup(8, 17, seed=9)
    c = problem.config
    per_expert = 3 * c.moe_intermediate * c.hidden * 4  # float32
    dense = sum(t.nbytes for k, t in weights.items() if k not in ("experts_w13", "experts_w2"))
    dense -= weights["config"].nbytes
    kv = 8 * 17 * 48 * 4
    io = 8 * (4 * 256 + 48) * 4 + 8 * 8  # x, residual, out, residual_out, kv_new; positions
    hidden = _reference_moe_inputs(c, weights, inputs)
    natural = {e - 16 for b in range(8) for e in _ref_route(c, _f64(weights), hidden[b])[0]}
    natural &= set(range(8))
    assert problem.floor_bytes(case, weights, inputs) == dense + kv + io + len(natural) * per_expert
    bias = weights["e_score_correction_bias"]
    bias[[0, 1, 40, 63]] += 10.0  # every token: only remote experts
    assert problem.floor_bytes(case, weights, inputs) == dense + kv + io
    bias[[1, 40]] -= 10.0
    bias[[17, 22]] += 10.0  # every token: local experts 1 and 6, plus remote ones
    assert problem.floor_bytes(case, weights, inputs) == dense + kv + io + 2 * per_expert


def test_floor_counter_counts_each_draw_as_floor_bytes_does() -> None:
    """The harness checks every pair draw through floor_counter: it must give floor_bytes' count
    for each, reading the layer's weights as they are now."""
    problem, case, weights, inputs = _setup(8, 17, seed=9)
    count = problem.floor_counter(case, weights, inputs)
    counts = set()
    for seed in range(12):
        values = problem.pair_inputs(case, seed, CPU)
        counts.add(count(values))
        assert count(values) == problem.floor_bytes(case, weights, {**inputs, **values})
    assert len(counts) > 1  # the draws route differently, and each count follows its own
    weights["e_score_correction_bias"][[17, 22]] += 10.0  # local experts 1 and 6 for every token
    values = problem.pair_inputs(case, 99, CPU)
    assert count(values) == problem.floor_bytes(case, weights, {**inputs, **values})


@pytest.mark.gpu
@pytest.mark.parametrize(("batch", "context"), [(1, 4096), (8, 2048), (64, 8192)])
def test_floor_counter_graph_counts_as_the_eager_floor_bytes_on_the_gpu(
    batch: int, context: int
) -> None:
    """On CUDA the counter replays a captured graph of the stock routing: on the real shard's
    sizes its count of every draw is the eager floor_bytes' (the timed work of a validate's
    pairs and the floor the fraction divides by come from these two)."""
    config = dict(load_manifest_file(SCOPE).model.config)
    problem, cuda = Problem(config), torch.device("cuda")
    case = Case(batch, context, 1, 1, "bfloat16", "gpu", config=MappingProxyType(config))
    weights = problem.make_weights(case, 3, cuda)
    inputs = problem.make_inputs(case, 4, cuda)
    count = problem.floor_counter(case, weights, inputs)
    counts = []
    for seed in range(40):
        values = problem.pair_inputs(case, seed, cuda)
        counts.append(count(values))
        assert counts[-1] == problem.floor_bytes(case, weights, {**inputs, **values}), seed
    assert batch == 1 or len(set(counts)) > 1
    del weights, inputs, count
    torch.cuda.empty_cache()


def test_bytes_moved_at_kimi_k2_shard_size() -> None:
    """The documented expectation, from the architecture numbers (no weights are built)."""
    problem = Problem({})
    case = Case(1, 8192, cp=1, gpus=1, dtype="bfloat16", gpu="H200")
    attention = 7168 * (1536 + 576) + 1536 * 8 * 192 + 8 * 256 * 512 + 7168 * 8 * 128
    norms = 7168 * 2 + 1536 + 512
    router_and_shared = 384 * 7168 + 3 * 7168 * 256
    dense = 2 * (attention + norms + router_and_shared) + 4 * 384
    per_expert = 2 * 3 * 2048 * 7168
    assert per_expert == 88_080_384
    assert expected_local_experts(problem.config, 1) == pytest.approx(1.0)
    kv = 8192 * 576 * 2
    io = (4 * 7168 + 576) * 2 + 8
    assert problem.bytes_moved(case) == round(dense + per_expert + kv + io)
    # decode CP: each rank reads its slice, the largest sets the pace (8193 = 2049 + 3 x 2048)
    at_cp4 = Case(1, 8193, cp=4, gpus=4, dtype="bfloat16", gpu="H200")
    assert problem.bytes_moved(at_cp4) == round(dense + per_expert + 2049 * 576 * 2 + io)
    # a given routing draw: none, or three of this GPU's experts
    assert problem.layer_bytes(case, 0) == dense + kv + io
    assert problem.layer_bytes(case, 3) == dense + 3 * per_expert + kv + io


def test_the_second_decode_step_sees_the_first_steps_token_in_its_window() -> None:
    problem, case = _problem(), _case(3, 5)
    weights = problem.make_weights(case, 11, CPU)
    state = problem.decode_state(case, 12, CPU)
    first_cache = state["kv_cache"]
    start = problem.make_inputs(case, 13, CPU)
    outputs = problem.make_outputs(case, CPU)
    stock.forward(weights, problem.step_inputs(state, start["x"], start["residual"]), outputs)
    hidden, residual = problem.step_finish(state, outputs)
    first_kv_new = outputs["kv_new"].clone()
    stock.forward(weights, problem.step_inputs(state, hidden, residual), outputs)
    shifted = {
        "x": hidden,
        "residual": residual,
        "kv_cache": torch.cat([first_cache[:, 1:], first_kv_new[:, None]], 1),
        "positions": torch.full((3,), 6),
    }
    direct = _stock(problem, case, weights, shifted)
    assert all(torch.equal(outputs[k], direct[k]) for k in OUTPUTS)
    # a sliding window: the case's shapes at every step
    assert state["kv_cache"].shape == (3, 5, 48) and state["positions"].tolist() == [6, 6, 6]


def test_forward_and_floor_bytes_leave_inputs_and_weights_untouched() -> None:
    problem, case, weights, inputs = _setup(8, 17, "bfloat16", seed=4)
    before = {k: v.clone() for k, v in (*weights.items(), *inputs.items())}
    _stock(problem, case, weights, inputs)
    problem.floor_bytes(case, weights, inputs)
    after = {**weights, **inputs}
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_grouped_gemm_route_equals_the_per_expert_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sorted grouped-GEMM flow (bf16's) against the loop, both in float32."""
    problem, case, weights, inputs = _setup(8, 17, seed=6)
    looped = _stock(problem, case, weights, inputs)
    monkeypatch.setattr(stock, "uses_grouped_mm", lambda x: True)
    grouped = _stock(problem, case, weights, inputs)
    torch.testing.assert_close(grouped["out"], looped["out"], rtol=1e-5, atol=1e-5)


def test_forward_compiled_runs_eagerly_outside_bfloat16() -> None:
    problem, case, weights, inputs = _setup(3, 5, seed=8)
    eager = _stock(problem, case, weights, inputs)
    compiled = problem.make_outputs(case, CPU)
    stock.forward_compiled(weights, inputs, compiled)
    assert all(torch.equal(eager[k], compiled[k]) for k in OUTPUTS)


def test_attention_reaches_the_outputs() -> None:
    """Another cache (same weights, same tokens) must move `out` well past bf16 rounding, or a
    broken attention could hide behind the residual stream."""
    problem, case, weights, inputs = _setup(8, 17, seed=10)
    out = _stock(problem, case, weights, inputs)
    other_cache = {**inputs, "kv_cache": problem.make_inputs(case, 77, CPU)["kv_cache"]}
    moved = _stock(problem, case, weights, other_cache)
    assert _rel_error(moved["out"], out["out"].double()) > 0.05
    assert _rel_error(moved["residual_out"], out["residual_out"].double()) > 0.01


def test_config_rejects_unknown_and_inconsistent_keys() -> None:
    with pytest.raises(ValueError, match=r"unknown model\.config keys"):
        Problem({"hiden": 256})
    with pytest.raises(ValueError, match="topk_group"):
        Problem({**SMALL, "n_group": 4, "topk_group": 5})
    with pytest.raises(ValueError, match="local experts"):
        Problem({**SMALL, "rank": 8})
    with pytest.raises(ValueError, match="context"):
        _problem().make_inputs(_case(1, 0), 0, CPU)


def test_ambiguous_rows_cover_the_tokens_a_tiny_perturbation_reroutes() -> None:
    """Tokens whose local expert set changes when the input moves by ~1.6% (a few bf16 ulps)
    are all among the few the problem calls near-ties; with no margin it calls none."""
    problem, _, weights, inputs = _setup(64, 17, "float32", seed=25)
    assert problem.ambiguous_rows(weights, inputs) == {}
    margined = Problem({**SMALL, "routing_tie_margin": 0.002})
    flagged = margined.ambiguous_rows(weights, inputs)["out"]
    assert 0 < int(flagged.sum()) <= 6  # within the harness's 10% cap
    _, ids = stock.route(weights, inputs)
    gen = torch.Generator().manual_seed(25)
    noise = torch.randn(inputs["x"].shape, generator=gen)
    _, nudged_ids = stock.route(weights, {**inputs, "x": inputs["x"] * (1 + 2**-6 * noise)})
    c = margined.config

    def local(ids_row: torch.Tensor) -> set[int]:
        return {int(e) for e in ids_row if c.expert_offset <= e < c.expert_offset + c.experts}

    rerouted = [i for i in range(64) if local(ids[i]) != local(nudged_ids[i])]
    assert rerouted  # the nudge does move some tokens to other local experts
    assert all(bool(flagged[i]) for i in rerouted), (rerouted, flagged.nonzero().flatten().tolist())


@pytest.mark.parametrize("context", [16, 21, 22])  # aligned, odd, even but not a multiple of 8
def test_both_stock_attention_layouts_compute_the_same_attention(
    context: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stock._latent_attention takes heads-major scores where the context is a multiple of 8 and
    tokens-major elsewhere (cuBLAS's aligned kernels): the same attention either way, both
    against float64 math, and the layout picked is the one for that context."""
    gen = torch.Generator().manual_seed(context)
    batch, heads, lora, rope = 3, 4, 32, 16
    q = torch.randn(batch, heads, lora + rope, generator=gen).to(torch.bfloat16)
    cache = torch.randn(batch, context, lora + rope, generator=gen).to(torch.bfloat16)
    new = torch.randn(batch, lora + rope, generator=gen).to(torch.bfloat16)
    scale = 0.1
    keys = torch.cat([cache, new[:, None]], 1).double()  # (B, T+1, L+R)
    probs = torch.softmax(torch.einsum("bhd,btd->bht", q.double(), keys) * scale, -1)
    expected = torch.einsum("bht,btl->bhl", probs, keys[..., :lora])
    # the probabilities' and the output's bf16 roundings: within one bf16 spacing of the
    # largest output (measured: 0.3-0.8 of it at these sizes)
    spacing = 2.0 ** (math.floor(math.log2(expected.abs().max().item())) - 7)
    outs = {}
    for layout in ("heads_major", "tokens_major"):
        outs[layout] = getattr(stock, f"_attention_{layout}")(q, cache, new, lora, scale)
        assert (outs[layout].double() - expected).abs().max() <= spacing
    # the same sums in the same order on the CPU (on the H200 cuBLAS's kernels differ: within
    # 2e-3 at the real shard's sizes, benchmarks/stock_attention_layout.py)
    assert torch.equal(outs["heads_major"], outs["tokens_major"])
    picked = "heads_major" if context % 8 == 0 else "tokens_major"
    calls: list[str] = []
    for layout in ("heads_major", "tokens_major"):
        original = getattr(stock, f"_attention_{layout}")
        monkeypatch.setattr(
            stock, f"_attention_{layout}", lambda *a, n=layout, f=original: calls.append(n) or f(*a)
        )
    stock._latent_attention(q, cache, new, lora, scale)
    assert calls == [picked]
