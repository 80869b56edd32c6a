"""Replay one correctness trial of the MLA+MoE scope and show which tokens of `out` are off.

A validate report names a failed trial by its case and seed; this reruns exactly that trial
(harness.evaluation.correctness.run_trial: the same weights, inputs and checks) and then, per
token, the relative error of `out` for the candidate and the stock path against the float64
reference, and for the worst tokens the float64 routing around the top-k boundary (biased
scores of the 12 best experts, which are this GPU's, and the gap between the k-th and the
k+1-th). A token whose local expert set flips at a gap wider than the scope's
routing_tie_margin is a near-tie the margin does not cover; a wrong token with a wide gap is a
bug.

    python3 benchmarks/mla_moe_trial_probe.py --batch 9 --context 1024 \
        --seed 2598110848698320876 [--device cuda] [--scope scopes/kimi-k2-mla-moe-decode-h200.yaml]
    python3 benchmarks/mla_moe_trial_probe.py --small --batch 9 --context 64 --seed 1

Prints a short report last and writes JSON (default pathgate-out/benchmarks/trial_probe.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

if "--small" in sys.argv:  # before Triton is imported: the CPU runs its kernels interpreted
    os.environ["TRITON_INTERPRET"] = "1"

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.evaluation.cases import Case
from harness.evaluation.correctness import run_trial, upcast
from harness.evaluation.loading import load_path
from harness.evaluation.plan import derive_seed
from kernels.mla_moe_decode import fused, stock
from scopes.manifest import load_manifest_file

WORST_TOKENS = 3
SHOWN_EXPERTS = 12


def main() -> None:
    args = _parse_args()
    device = torch.device("cpu" if args.small else args.device)
    manifest = load_manifest_file(args.scope)
    path = load_path(manifest)
    config = dict(manifest.model.config)
    if args.small:  # CPU smoke run of this script at the tests' sizes
        config = dict(fused.CPU_TEST_CONFIG)
        path = replace(path, problem=type(path.problem)(config))
    gpu = manifest.hardware.gpu[0] if device.type == "cuda" else "cpu"
    case = Case(args.batch, args.context, 1, 1, "bfloat16", gpu, "probe", config)
    trial = run_trial(path, case, args.seed, manifest.tolerance, device)
    print(f"trial {args.seed}: reasons {trial.reasons or 'none'}; notes {trial.notes}")
    tokens = _token_errors(path, case, args.seed, device)
    result = {"case": case.id, "seed": args.seed, "reasons": trial.reasons, "tokens": tokens}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    _print_report(tokens, path.problem.config.routing_tie_margin)


def _token_errors(path, case: Case, seed: int, device: torch.device) -> list[dict[str, object]]:
    """Per token: `out`'s relative error (candidate, stock) vs float64, and the float64 routing."""
    problem = path.problem
    weights = problem.make_weights(case, derive_seed(seed, "weights"), device)
    inputs = problem.make_inputs(case, derive_seed(seed, "inputs"), device)
    outputs = {}
    for name, fn in (("candidate", path.candidate), ("stock", path.baseline)):
        out = problem.make_outputs(case, device)
        fn(weights, inputs, out)
        outputs[name] = out["out"].double()
    wide, wide_inputs = upcast(weights), upcast(inputs)
    reference = problem.make_outputs(case, device)
    reference = {n: t.double() for n, t in reference.items()}
    path.reference_fn(wide, wide_inputs, reference)
    expected = reference["out"]
    choice = stock.expert_choice(wide, wide_inputs)  # (B, experts_total) float64
    c = problem.config
    tokens = []
    for row in range(case.batch):
        norm = float(expected[row].norm())
        scores, ids = choice[row].topk(SHOWN_EXPERTS)
        tokens.append(
            {
                "token": row,
                "candidate_error": float((outputs["candidate"][row] - expected[row]).norm()) / norm,
                "stock_error": float((outputs["stock"][row] - expected[row]).norm()) / norm,
                "boundary_gap": float(scores[c.top_k - 1] - scores[c.top_k]),
                "best_experts": [
                    {"id": int(i), "biased_score": float(s), "local": _local(c, int(i))}
                    for s, i in zip(scores.tolist(), ids.tolist(), strict=True)
                ],
            }
        )
    return tokens


def _local(c, expert: int) -> bool:
    return c.expert_offset <= expert < c.expert_offset + c.experts


def _print_report(tokens: list[dict[str, object]], margin: float) -> None:
    print(f"\n| token | candidate error | stock error | gap k / k+1 (margin {margin:.1e}) |")
    print("|---|---|---|---|")
    for t in tokens:
        print(
            f"| {t['token']} | {t['candidate_error']:.3e} | {t['stock_error']:.3e} "
            f"| {t['boundary_gap']:.2e} |"
        )
    for t in sorted(tokens, key=lambda t: -float(t["candidate_error"]))[:WORST_TOKENS]:  # type: ignore[arg-type]
        ranked = ", ".join(
            f"{e['id']}{'*' if e['local'] else ''}:{e['biased_score']:.5f}"
            for e in t["best_experts"]  # type: ignore[union-attr]
        )
        print(f"token {t['token']} (error {t['candidate_error']:.3e}), * = local: {ranked}")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--scope", type=Path, default=Path("scopes/kimi-k2-mla-moe-decode-h200.yaml")
    )
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="CPU smoke run at the tests' sizes")
    parser.add_argument(
        "--out", type=Path, default=Path("pathgate-out/benchmarks/trial_probe.json")
    )
    return parser.parse_args()


if __name__ == "__main__":
    main()
