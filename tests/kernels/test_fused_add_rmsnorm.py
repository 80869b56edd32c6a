"""The fused add+RMSNorm problem: shapes, the stock path against float64 math, the guard, and the
Triton candidate (under Triton's interpreter on CPU, compiled on a GPU)."""

from __future__ import annotations

from types import MappingProxyType

import pytest
import torch

from harness.evaluation.cases import Case
from kernels.fused_add_rmsnorm import fused, stock
from kernels.fused_add_rmsnorm.problem import Problem

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(batch: int, hidden: int = 256, dtype: str = "bfloat16", cp: int = 1) -> Case:
    return Case(
        batch=batch,
        context=None,
        cp=cp,
        gpus=1,
        dtype=dtype,
        gpu="cpu",
        config=MappingProxyType({"hidden": hidden}),
    )


def _float64_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x.double() + residual.double()
    rms = torch.sqrt((summed * summed).mean(dim=-1, keepdim=True) + stock.EPS)
    return summed / rms * weight.double(), summed


def test_problem_shapes_and_dtypes() -> None:
    problem = Problem({"hidden": 384})
    case = _case(5, hidden=384)
    inputs = problem.make_inputs(case, seed=1, device=DEVICE)
    outputs = problem.make_outputs(case, DEVICE)
    weights = problem.make_weights(case, seed=1, device=DEVICE)
    assert {k: tuple(v.shape) for k, v in inputs.items()} == {"x": (5, 384), "residual": (5, 384)}
    assert {k: tuple(v.shape) for k, v in outputs.items()} == {
        "out": (5, 384),
        "residual_out": (5, 384),
    }
    assert weights["weight"].shape == (384,)
    assert all(t.dtype == torch.bfloat16 for t in [*inputs.values(), *outputs.values()])
    assert problem.bytes_moved(case) == (4 * 5 * 384 + 384) * 2


def test_inputs_are_seeded_and_vary_in_scale() -> None:
    problem = Problem({"hidden": 256})
    a = problem.make_inputs(_case(4), seed=1, device=DEVICE)["x"]
    b = problem.make_inputs(_case(4), seed=1, device=DEVICE)["x"]
    stds = {
        round(float(problem.make_inputs(_case(4), s, DEVICE)["x"].float().std()), 1)
        for s in range(6)
    }
    assert torch.equal(a, b)
    assert len(stds) > 3


def test_stock_matches_float64_math() -> None:
    problem = Problem({"hidden": 256})
    case = _case(7, dtype="float32")
    weights = problem.make_weights(case, 2, DEVICE)
    inputs = {k: v.double() for k, v in problem.make_inputs(case, 2, DEVICE).items()}
    out = {k: v.double() for k, v in problem.make_outputs(case, DEVICE).items()}
    stock.forward({"weight": weights["weight"].double()}, inputs, out)
    expected_out, expected_sum = _float64_reference(
        inputs["x"], inputs["residual"], weights["weight"]
    )
    torch.testing.assert_close(out["out"], expected_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out["residual_out"], expected_sum, rtol=0, atol=0)


def test_stock_bf16_error_is_rounding_only() -> None:
    problem = Problem({"hidden": 256})
    case = _case(16)
    weights, inputs = problem.make_weights(case, 3, DEVICE), problem.make_inputs(case, 3, DEVICE)
    out = problem.make_outputs(case, DEVICE)
    stock.forward(weights, inputs, out)
    expected, _ = _float64_reference(inputs["x"], inputs["residual"], weights["weight"])
    error = (out["out"].double() - expected).norm() / expected.norm()
    assert 1e-4 < float(error) < 1e-2


@pytest.mark.parametrize("batch", [1, 3, 17, 64])
def test_fused_matches_stock(batch: int) -> None:
    problem = Problem({"hidden": 320})  # not a power of two: the masked tail is exercised
    case = _case(batch, hidden=320)
    weights, inputs = problem.make_weights(case, 4, DEVICE), problem.make_inputs(case, 4, DEVICE)
    want, got = problem.make_outputs(case, DEVICE), problem.make_outputs(case, DEVICE)
    for tensor in got.values():
        tensor.fill_(float("nan"))
    stock.forward(weights, inputs, want)
    fused.forward(weights, inputs, got)
    assert torch.equal(got["residual_out"], want["residual_out"])
    torch.testing.assert_close(got["out"], want["out"], rtol=1e-2, atol=1e-2)
    differing = (got["out"] != want["out"]).float().mean()
    assert differing < 0.02  # only reduction-order ties round differently


def test_guard() -> None:
    assert fused.supports(_case(1))
    assert fused.supports(_case(fused.MAX_BATCH))
    assert not fused.supports(_case(fused.MAX_BATCH + 1))
    assert not fused.supports(_case(4, dtype="float16"))
    assert not fused.supports(_case(4, cp=2))
    assert not fused.supports(_case(4, hidden=fused.MAX_HIDDEN * 2))


def test_out_of_scope_falls_back_to_exact_stock() -> None:
    problem = Problem({"hidden": 256})
    case = _case(fused.MAX_BATCH + 1)
    weights, inputs = problem.make_weights(case, 5, DEVICE), problem.make_inputs(case, 5, DEVICE)
    want, got = problem.make_outputs(case, DEVICE), problem.make_outputs(case, DEVICE)
    stock.forward(weights, inputs, want)
    fused.forward(weights, inputs, got)
    assert all(torch.equal(got[k], want[k]) for k in want)
