"""Candidates for the multi-rank engine tests: the stock MLA layer, wrong or failing on one rank.

Module-level functions: every spawned rank imports them by the manifest's entry-point names.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from kernels.mla_moe_decode import stock
from kernels.mla_moe_decode.problem import Problem

Tensors = dict[str, torch.Tensor]


def wrong_on_the_last_rank(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    stock.forward(weights, inputs, out)
    if dist.get_rank() == dist.get_world_size() - 1:
        out["out"].mul_(1.5)


def raises_on_rank_one(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    stock.forward(weights, inputs, out)


def hangs_on_rank_zero(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    if dist.get_rank() == 0:
        time.sleep(3600)
    stock.forward(weights, inputs, out)


def ignores_its_share(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    """Attends over its own slice alone, as if it were the whole context: wrong under CP."""
    from harness.evaluation import ranks

    saved = ranks._cp_group
    ranks._cp_group = None
    try:
        stock.forward(weights, inputs, out)
    finally:
        ranks._cp_group = saved


def always(case: object) -> bool:
    return True


def in_the_cp_test_scope(case: Any) -> bool:
    """The guard of tests/workers/test_runner.py's CP scope: batch 3, context 45, CP 1 or 2."""
    return (
        case.dtype == "bfloat16"
        and case.batch == 3
        and case.context == 45
        and case.cp in (1, 2)
        and case.gpus == 2
    )


class OverCapOnRankZeroOnce(Problem):
    """The MLA problem, calling every row ambiguous on rank 0 the first time it is asked: that
    rank alone wants fresh inputs for its first trial."""

    asked = 0

    def ambiguous_rows(self, weights: Tensors, inputs: Tensors) -> dict[str, torch.Tensor]:
        if dist.get_rank() == 0 and OverCapOnRankZeroOnce.asked == 0:
            OverCapOnRankZeroOnce.asked += 1
            batch = inputs["x"].shape[0]
            return {"out": torch.ones(batch, dtype=torch.bool, device=inputs["x"].device)}
        return super().ambiguous_rows(weights, inputs)


def tampers_on_ranks(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    """Replaces a watched harness function, only where it runs on ranks, and writes zeros."""
    from harness.evaluation import correctness

    if dist.is_initialized():
        correctness.output_error = lambda *args, **kwargs: None  # type: ignore[assignment]
    for tensor in out.values():
        tensor.zero_()
