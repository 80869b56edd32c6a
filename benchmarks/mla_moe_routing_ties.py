"""How close to the top-k boundary are the tokens whose expert choice differs between the bf16
stock path and its float64 reference? That distance sets kernels/mla_moe_decode's
`routing_tie_margin` (the near-tie rows the harness leaves out of the error).

    python benchmarks/mla_moe_routing_ties.py [--seeds 8] [--batch 64] [--context 1024]

For each seed: real-size weights and inputs, the routing of the bf16 stock path and of the
float64 reference; per token whose local expert set differs, its float64 margin (distance of the
k-th and (k+1)-th biased scores to their midpoint). Prints the margins and, per candidate margin,
the fraction of tokens it would call ambiguous. Writes JSON next to the other benchmarks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from harness.evaluation.cases import Case
from kernels.mla_moe_decode import stock
from kernels.mla_moe_decode.problem import Problem

MARGINS = (0.0005, 0.001, 0.002, 0.005, 0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument(
        "--out", type=Path, default=Path("pathgate-out/benchmarks/mla_moe_routing_ties.json")
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    flipped_margins: list[float] = []
    flagged = {m: 0 for m in MARGINS}
    tokens = 0
    for seed in range(args.seeds):
        problem = Problem({})
        case = Case(args.batch, args.context, 1, 1, "bfloat16", "H200")
        weights = problem.make_weights(case, 1000 + seed, device)
        inputs = problem.make_inputs(case, 2000 + seed, device)
        _, ids = stock.route(weights, inputs)
        upcast_w = {
            n: t.double()
            if t.is_floating_point() and not n.startswith(("experts_", "shared_"))
            else t
            for n, t in weights.items()
        }
        upcast_i = {n: t.double() if t.is_floating_point() else t for n, t in inputs.items()}
        choice = stock.expert_choice(upcast_w, upcast_i)
        c = problem.config
        top = choice.topk(c.top_k + 1, dim=-1).values
        margin = ((top[:, c.top_k - 1] - top[:, c.top_k]) / 2).cpu()
        ref_ids = choice.topk(c.top_k, dim=-1).indices
        lo, hi = c.expert_offset, c.expert_offset + c.experts
        for t in range(args.batch):
            mine = {int(e) for e in ids[t] if lo <= e < hi}
            ref = {int(e) for e in ref_ids[t] if lo <= e < hi}
            if mine != ref:
                flipped_margins.append(float(margin[t]))
        for m in MARGINS:
            margined = Problem({"routing_tie_margin": m})
            flagged[m] += int(margined.ambiguous_rows(weights, inputs)["out"].sum())
        tokens += args.batch
        del weights, inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result = {
        "tokens": tokens,
        "flipped": len(flipped_margins),
        "flipped_margins": sorted(flipped_margins),
        "flagged_fraction": {str(m): flagged[m] / tokens for m in MARGINS},
    }
    print(f"{result['flipped']} of {tokens} tokens route differently (bf16 stock vs float64)")
    print("their float64 margins:", [f"{m:.2e}" for m in sorted(flipped_margins)])
    for m in MARGINS:
        print(f"margin {m:g}: {flagged[m] / tokens:.1%} of tokens called ambiguous")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
