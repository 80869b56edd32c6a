"""Probe the CuTe DSL residual add + RMSNorm (kernels/mla_moe_decode/cute_kernels.py) on a GPU.

Its first launch on the H200 hung (2026-12-02: torch.cuda.synchronize() did not return). A hung
GPU cannot be recovered in-process, so every probe runs in a child process under a timeout and
prints a marker after each stage (built, launched, synced, checked): the last marker a probe
printed says where it stopped. Probes, in order, from the least machinery to the kernel as built:

    threads=32   one warp per row: no shared memory, no barrier (the warp butterfly alone)
    threads=N    the kernel as the fused path builds it (threads_for(hidden), shared-memory sum)

each at batch 1, 8 and 64 of the real hidden size (7168), against torch in float32. Exits 1
unless every probe finished.

    python3 benchmarks/cute_norm_probe.py              # on a GPU with nvidia-cutlass-dsl
    python3 benchmarks/cute_norm_probe.py --sanitize   # and the built kernel under
                                                       # compute-sanitizer memcheck, synccheck
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = 7168
EPS = 1e-6


def child(threads: int | None, batches: list[int]) -> None:
    """One probe: build, launch, synchronize and check, printing a marker after each stage."""
    sys.path.insert(0, str(ROOT))
    import torch

    from kernels.mla_moe_decode import cute_kernels

    def mark(stage: str, **extra: object) -> None:
        print(json.dumps({"stage": stage, "threads": threads, **extra}), flush=True)

    gen = torch.Generator(device="cuda").manual_seed(0)
    started = time.perf_counter()
    run = cute_kernels._build(HIDDEN, threads)
    mark("built", seconds=round(time.perf_counter() - started, 1))
    weight = torch.rand(HIDDEN, generator=gen, device="cuda").to(torch.bfloat16) + 0.5
    for batch in batches:
        x, residual = (
            torch.randn(batch, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
            for _ in range(2)
        )
        out, residual_out = torch.empty_like(x), torch.empty_like(x)
        run(x, residual, weight, out, residual_out, EPS)
        mark("launched", batch=batch)
        torch.cuda.synchronize()
        mark("synced", batch=batch)
        summed = x.float() + residual.float()
        rstd = torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + EPS)
        expected = ((summed * rstd).to(torch.bfloat16).float() * weight.float()).to(torch.bfloat16)
        mark(
            "checked",
            batch=batch,
            residual_out_max_abs=float((residual_out.float() - summed).abs().max()),
            out_max_abs=float((out.float() - expected.float()).abs().max()),
            out_mismatches=int((out != expected).sum()),
        )


def run_probe(args: list[str], timeout: float, prefix: list[str] | None = None) -> dict:
    command = [*(prefix or []), sys.executable, __file__, "--child", *args]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        status, output = f"exit {done.returncode}", done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        status = f"TIMEOUT after {timeout:.0f} s"
        output = _text(exc.stdout) + _text(exc.stderr)
    result = {
        "probe": " ".join([*(prefix or [])[:2], *args]),
        "status": status,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(f"== {result['probe']}: {status}\n{output[-3000:]}", flush=True)
    return result


def _text(value: str | bytes | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--timeout", type=float, default=90)
    parser.add_argument("--sanitize", action="store_true")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        child(args.threads or None, batches)
        return
    results = [
        run_probe(["--threads", "32", "--batches", args.batches], args.timeout),
        run_probe(["--batches", args.batches], args.timeout),
    ]
    if args.sanitize:
        for tool in ("memcheck", "synccheck"):
            prefix = ["compute-sanitizer", f"--tool={tool}"]
            results.append(run_probe(["--batches", "1"], 3 * args.timeout, prefix))
    print("\n| probe | status | seconds |\n|---|---|---|")
    for r in results:
        print(f"| {r['probe']} | {r['status']} | {r['seconds']} |")
    sys.exit(0 if all(r["status"] == "exit 0" for r in results) else 1)


if __name__ == "__main__":
    main()
