"""The stock layer's two latent-attention layouts, compiled, at aligned and odd contexts: scores
tokens-major (B, T, H) and heads-major (B, H, T). `stock._latent_attention` takes heads-major
where the context is a multiple of 8 and tokens-major elsewhere, so that the baseline has no
cliff at an odd context (run 7 of the validate: compiled stock 1079 µs per layer at 8 x 20335,
436 at 8 x 16384). Prints a table; writes JSON.

    python3 benchmarks/stock_attention_layout.py            # H200: about 30 s
    python3 benchmarks/stock_attention_layout.py --small    # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.evaluation.stats import median
from kernels.mla_moe_decode import stock

HEADS, LORA, ROPE = 8, 512, 64  # the Kimi-K2 TP8 shard's attention
SCALE = 192**-0.5
REPLAYS = 20


def _inputs(batch: int, context: int, device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(context)
    width = LORA + ROPE

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

    return randn(batch, HEADS, width), randn(batch, context, width), randn(batch, width)


def _us(fn, args: tuple[torch.Tensor, ...], on_gpu: bool) -> float:  # type: ignore[no-untyped-def]
    """Median µs of one call: CUDA graph replays on the GPU, host clock on the CPU."""
    if not on_gpu:
        started = time.perf_counter()
        fn(*args, LORA, SCALE)
        return 1e6 * (time.perf_counter() - started)
    for _ in range(2):  # compile and warm up outside the capture
        fn(*args, LORA, SCALE)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args, LORA, SCALE)
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(1e3 * start.elapsed_time(end))
    return median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="CPU smoke run")
    parser.add_argument(
        "--out", type=Path, default=Path("pathgate-out/benchmarks/stock_attention_layout.json")
    )
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available() and not args.small
    device = "cuda" if on_gpu else "cpu"
    torch._dynamo.config.recompile_limit = stock.RECOMPILE_LIMIT
    layouts = {
        "tokens-major": torch.compile(stock._attention_tokens_major, dynamic=False),
        "heads-major": torch.compile(stock._attention_heads_major, dynamic=False),
    }
    batches, contexts = ([8, 64], [16384, 16385, 20335, 20336, 32768]) if on_gpu else ([2], [33])
    rows = []
    for batch in batches:
        for context in contexts:
            args_ = _inputs(batch, context, device)
            outs = {name: fn(*args_, LORA, SCALE) for name, fn in layouts.items()}
            first, second = outs.values()
            difference = (first.float() - second.float()).abs().max().item()
            row = {"batch": batch, "context": context, "max_abs_difference": difference}
            row |= {name: _us(fn, args_, on_gpu) for name, fn in layouts.items()}
            rows.append(row)
            print(row, flush=True)
    environment = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "torch": torch.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"environment": environment, "is_gpu_evidence": on_gpu, "rows": rows}, indent=1)
    )
    names = list(layouts)
    print(f"\n{environment}\n| batch | context | {' µs | '.join(names)} µs | max abs difference |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['context']} | {r[names[0]]:.1f} | {r[names[1]]:.1f} "
            f"| {r['max_abs_difference']:.2g} |"
        )


if __name__ == "__main__":
    main()
