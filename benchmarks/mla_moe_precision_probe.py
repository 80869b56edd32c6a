"""How far each path of the MLA+MoE layer sits from the float64 reference: the fused path, the
compiled stock path (the scope's baseline) and the eager stock path, output by output.

The layer check judges the fused path by its error over the compiled stock's. On the H200 that
ratio was 1.2-1.44 on every output, also on kv_new, which no routing touches, while on the CPU
(against eager stock) it was 0.97-1.01. This tells the two possible causes apart: the compiled
stock being more accurate than eager (Inductor keeps some intermediates in fp32), or the fused
kernels losing accuracy on the GPU. Each trial is the harness's own (run_trial): the same
weights, inputs, reference and error measure as a validate. Then the scope's model-level decode
check (its full settings, as a validate runs it) on --decode-seeds seeds: each path's KL from
the float64 reference model and the verdict.

    python3 benchmarks/mla_moe_precision_probe.py [--device cuda] [--batches 1 16 64] \
        [--context 1024] [--seeds 3] [--decode-seeds 3]
    python3 benchmarks/mla_moe_precision_probe.py --small   # CPU smoke run, tests' sizes

Prints a table last and writes JSON (default pathgate-out/benchmarks/precision_probe.json).
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

from harness.evaluation import decode_check
from harness.evaluation.cases import Case
from harness.evaluation.correctness import run_trial
from harness.evaluation.loading import load_path
from kernels.mla_moe_decode import fused, stock
from scopes.manifest import load_manifest_file


def main() -> None:
    args = _parse_args()
    device = torch.device("cpu" if args.small else args.device)
    manifest = load_manifest_file(Path(args.scope))
    path = load_path(manifest)
    config = dict(manifest.model.config)
    if args.small:
        config = dict(fused.CPU_TEST_CONFIG)
        path = replace(path, problem=type(path.problem)(config))
    gpu = manifest.hardware.gpu[0] if device.type == "cuda" else "cpu"
    eager = replace(path, candidate=stock.forward)  # judged against the same compiled baseline
    rows = []
    for batch in args.batches:
        case = Case(batch, args.context, 1, 1, "bfloat16", gpu, "probe", config)
        for seed in range(1, args.seeds + 1):
            fused_trial = run_trial(path, case, seed, manifest.tolerance, device)
            eager_trial = run_trial(eager, case, seed, manifest.tolerance, device)
            for f, e in zip(fused_trial.outputs, eager_trial.outputs, strict=True):
                rows.append(
                    {
                        "batch": batch,
                        "seed": seed,
                        "output": f.name,
                        "compiled": f.stock_error,
                        "eager": e.candidate_error,
                        "fused": f.candidate_error,
                    }
                )
    decode_rows = []
    check_case = replace(decode_check.check_case(manifest, gpu, 1), config=config)
    settings = manifest.model_check
    if args.small:  # the fused guard's CPU range, and short: the interpreter is slow
        check_case = replace(check_case, batch=2, context=args.context)
        settings = settings.model_copy(update={"steps": 4, "layers": 2})
    for seed in range(1, args.decode_seeds + 1):
        evidence = decode_check.run_decode_check(path, check_case, settings, seed, device)
        decode_rows.append({"seed": seed, **evidence.model_dump()})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"device": str(device), "context": args.context, "rows": rows, "decode": decode_rows}
    out.write_text(json.dumps(record))
    print(f"relative error from float64 (context {args.context}); JSON: {out}")
    print("| batch | seed | output | eager | compiled | fused | fused/compiled | fused/eager |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['seed']} | {r['output']} | {r['eager']:.5f} | "
            f"{r['compiled']:.5f} | {r['fused']:.5f} | {r['fused'] / r['compiled']:.3f} | "
            f"{r['fused'] / r['eager']:.3f} |"
        )
    print(f"\ndecode check ({check_case.id}): KL from the float64 reference model")
    print("| seed | status | token match | KL(stock, fused) | stock | fused |")
    print("|---|---|---|---|---|---|")
    for d in decode_rows:
        print(
            f"| {d['seed']} | {d['status']} | {d['token_match']} | {d['mean_kl']} | "
            f"{d['stock_kl_from_reference']} | {d['candidate_kl_from_reference']} |"
        )


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scope", default="scopes/kimi-k2-mla-moe-decode-h200.yaml")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--decode-seeds", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="CPU, the tests' config")
    parser.add_argument("--out", default="pathgate-out/benchmarks/precision_probe.json")
    args = parser.parse_args()
    if args.small:
        args.batches, args.context, args.seeds, args.decode_seeds = [2], 64, 1, 1
    return args


if __name__ == "__main__":
    main()
