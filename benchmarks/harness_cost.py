"""Where the harness's time goes in one case: `engine.measure_case` with each step timed.

Timing every pair on inputs of its own (2026-12-07) took the H200 scope's full validate from
409 s (run 19) to 901 s (run 21), and 15 of its 72 cases to the 10 s sampling cap. Per pair the
harness now draws inputs until their routing does the timed work (the stock attention block per
draw), writes them, and after each batch runs the candidate's eager call on every pair's
inputs (one pair a batch is also held to the stock's timed result). This script runs the named
cases as a validate times them and prints, per case, the wall seconds of each of those steps
and how often each ran: which to make cheaper.

    python3 benchmarks/harness_cost.py scopes/kimi-k2-mla-moe-decode-h200.yaml --device cuda \\
        --cases 8:4096 64:8192 [--quick] [--eager-work] [--seed N] [--out $OUT/harness_cost.json]

Each step is timed by a wrapper put in the place the engine calls it from (cProfile lost the
compiled and captured steps on an H200: 0 calls, 2026-12-07). A step on the top level
synchronizes with the device on entry and exit, so it is charged its own device work; a nested
step does not (it would change the timed batches), so its seconds are the host's and whatever
waits it holds. The correctness trials of a validate are not run (they do not change with the
pairs' inputs); the first case's seconds include compiling both paths.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.evaluation import engine, timing
from harness.evaluation.cases import Case
from harness.evaluation.engine import default_stop_rule, measure_case
from harness.evaluation.environment import REPO_ROOT, detect_host, fingerprint, git_sha
from harness.evaluation.loading import load_path
from scopes.manifest import load_manifest_file

# measure_case's steps as the engine calls them, in order: (module, name, label). Each is
# replaced there by a timed wrapper for the case.
TOP_STEPS = [
    (engine, "build_layers", "layers built (weights, inputs, outputs)"),
    (engine, "step_runners", "both paths compiled and captured"),
    (engine, "refresh_inputs", "inputs refreshed (before and after timing)"),
    (engine, "pair_inputs", "timed work anchored (32 draws a layer)"),
    (engine, "_bytes_moved", "bytes moved"),
    (engine, "watched_replays", "replay check set up"),
    (engine, "sample_interleaved", "sampling, all of it"),
    (engine, "profile_step", "kernel profiles"),
    (engine, "wall_us_per_layer", "wall clock per layer"),
    (engine, "eager_us", "eager times"),
    (engine, "changed_weights", "weights compared with their seeds"),
    (engine, "replay_mismatches", "post-timing replay check"),
]
# Inside the sampling: (label, depth), in the order printed. They are wrapped on the objects
# pair_inputs and watched_replays return, and in the timing module's namespace.
NESTED_STEPS = [
    ("draws kept for the pairs", 1),
    ("their routing checked (floor_bytes)", 2),
    ("inputs drawn (every draw, also when written)", 2),
    ("pairs' inputs written", 1),
    ("timed pairs (events, poison, copies)", 1),
    ("outputs poisoned", 2),
    ("timed outputs copied", 2),
    ("timed replays checked after each batch", 1),
    ("candidate's eager calls (and near-tie rows, if inexact)", 2),
    ("near-tie rows for the check against the stock", 2),
]


class Stopwatch:
    """Calls and wall seconds per label, of the functions it wrapped."""

    def __init__(self, device: torch.device):
        self.device = device
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}

    def wrap(self, label: str, fn: Callable[..., Any], sync: bool = False) -> Callable[..., Any]:
        self.calls.setdefault(label, 0)
        self.seconds.setdefault(label, 0.0)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._sync(sync)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync(sync)
                self.calls[label] += 1
                self.seconds[label] += time.perf_counter() - started

        return timed

    def _sync(self, wanted: bool) -> None:
        if wanted and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@contextlib.contextmanager
def steps_timed(watch: Stopwatch) -> Iterator[None]:
    """Every step of TOP_STEPS and NESTED_STEPS timed into `watch` while inside."""
    with contextlib.ExitStack() as patches:
        for module, name, label in TOP_STEPS:
            wrapped = watch.wrap(label, getattr(module, name), sync=True)
            if name == "pair_inputs":
                wrapped = _then(wrapped, functools.partial(_time_pair_inputs, watch))
            elif name == "watched_replays":
                wrapped = _then(wrapped, functools.partial(_time_watched, watch))
            patches.enter_context(mock.patch.object(module, name, wrapped))
        timed_pairs = watch.wrap("timed pairs (events, poison, copies)", timing.timed_pairs)
        patches.enter_context(mock.patch.object(timing, "timed_pairs", timed_pairs))
        yield


def _then(fn: Callable[..., Any], after: Callable[[Any], None]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        after(result)
        return result

    return call


def _time_pair_inputs(watch: Stopwatch, inputs: timing.PairInputs) -> None:
    inputs.draw = watch.wrap("inputs drawn (every draw, also when written)", inputs.draw)
    if inputs.work is not None:
        inputs.work = watch.wrap("their routing checked (floor_bytes)", inputs.work)
    inputs.seeds_for_batch = watch.wrap("draws kept for the pairs", inputs.seeds_for_batch)  # type: ignore[method-assign]
    inputs.write = watch.wrap("pairs' inputs written", inputs.write)  # type: ignore[method-assign]


def _time_watched(watch: Stopwatch, watched: timing.WatchedReplays) -> None:
    watched.poison = watch.wrap("outputs poisoned", watched.poison)
    watched.copy = watch.wrap("timed outputs copied", watched.copy)  # type: ignore[method-assign]
    watched.copy_stock = watch.wrap("timed outputs copied", watched.copy_stock)  # type: ignore[method-assign]
    watched.disagreements = watch.wrap(  # type: ignore[method-assign]
        "timed replays checked after each batch", watched.disagreements
    )
    watched.yardstick = watch.wrap(
        "candidate's eager calls (and near-tie rows, if inexact)", watched.yardstick
    )
    watched.against_stock = watch.wrap(
        "near-tie rows for the check against the stock", watched.against_stock
    )


def profile_case(
    path, case: Case, seed: int, stop, device: torch.device, manifest, lead_cycles: int
) -> dict:
    watch = Stopwatch(device)
    started = time.perf_counter()
    sampling = functools.partial(timing.sample_interleaved, lead_cycles=lead_cycles)
    with mock.patch.object(engine, "sample_interleaved", sampling), steps_timed(watch):
        performance, stale, timing_ = measure_case(
            path, case, seed, stop, 64 if device.type == "cuda" else 2, device, manifest
        )
    total = time.perf_counter() - started
    return {
        "case": case.id,
        "seconds": total,
        "pairs": len(timing_.stock_us),
        "layers": timing_.layers,
        "stop_reason": timing_.stop_reason,
        "watched_replays": timing_.watched,
        "late_starts": timing_.late_starts,  # of timed_calls (timing._cuda_intervals)
        "timed_calls": timing_.timed_calls,
        "late_batches": timing_.late_batches,  # not sampled, each doubling the spin
        "lead_cycles": timing_.lead_cycles,  # the spin the sampling ended with
        "stock_us_median": performance.stock_us_median,
        "candidate_us_median": performance.candidate_us_median,
        # min, 10%, median, 90%, max per layer: how far the samples spread (a GPU that waits
        # for the host's launch inside the events widens them)
        "stock_us_spread": _spread(timing_.stock_us),
        "candidate_us_spread": _spread(timing_.candidate_us),
        "stale": stale,
        "steps": _steps(watch, total),
    }


def _spread(samples: list[float]) -> list[float]:
    ordered = sorted(samples)
    return [ordered[round(q * (len(ordered) - 1))] for q in (0.0, 0.1, 0.5, 0.9, 1.0)]


def _steps(watch: Stopwatch, total: float) -> list[dict]:
    """The rows printed: the top steps with the nested ones under the sampling, and what no
    step accounts for."""

    def row(label: str, depth: int) -> dict:
        return {
            "step": label,
            "depth": depth,
            "calls": watch.calls[label],
            "s": watch.seconds[label],
        }

    rows = []
    for _, _, label in TOP_STEPS:
        rows.append(row(label, 0))
        if label == "sampling, all of it":
            rows += [row(nested, depth) for nested, depth in NESTED_STEPS]
    rest = total - sum(watch.seconds[label] for _, _, label in TOP_STEPS)
    rows.append({"step": "no step (statistics, the rest)", "depth": 0, "calls": 1, "s": rest})
    return rows


def print_table(result: dict) -> None:
    print(
        f"\n{result['case']}: {result['seconds']:.1f} s, {result['pairs']} pairs, "
        f"{result['layers']} layers ({result['stop_reason']})"
    )
    print(
        f"calls that may have started late: {result['late_starts']} of {result['timed_calls']}"
        f" sampled; batches timed again: {result['late_batches']}, the spin ending at "
        f"{result['lead_cycles']:,} cycles"
    )
    for arm in ("stock", "candidate"):
        spread = ", ".join(f"{us:.1f}" for us in result[f"{arm}_us_spread"])
        print(f"{arm} µs per layer, min / 10% / median / 90% / max: {spread}")
    print("| step | calls | s | share |\n|---|---|---|---|")
    for row in result["steps"]:
        share = row["s"] / result["seconds"] if result["seconds"] else 0.0
        name = ". " * row["depth"] + row["step"]
        print(f"| {name} | {row['calls']} | {row['s']:.2f} | {share:.0%} |")


def parse_case(text: str) -> tuple[int, int | None]:
    batch, _, context = text.partition(":")
    return int(batch), int(context) if context else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scope", type=Path)
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--cases", nargs="+", required=True, help="BATCH:CONTEXT ...")
    parser.add_argument("--quick", action="store_true", help="the quick validate's stop rule")
    parser.add_argument("--seed", type=int, default=20261207)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--eager-work",
        action="store_true",
        help="check the pair draws by floor_bytes, one eager call each, not floor_counter",
    )
    parser.add_argument(
        "--lead-cycles",
        type=int,
        default=timing.LEAD_CYCLES,
        help="the GPU's spin before each timed call at first (0: none and never longer, as "
        "before 2026-12-07's fix)",
    )
    args = parser.parse_args(argv)

    manifest = load_manifest_file(args.scope)
    path = load_path(manifest)
    if args.eager_work:
        path.problem.floor_counter = None  # timing._work_counter then calls floor_bytes
    device = torch.device(args.device)
    host = detect_host(args.device)
    stop = default_stop_rule(device, args.quick)
    results = []
    for text in args.cases:
        batch, context = parse_case(text)
        case = Case(
            batch=batch,
            context=context,
            cp=1,
            gpus=1,
            dtype=manifest.model.dtype,
            gpu=host.gpu,
            config=MappingProxyType(dict(manifest.model.config)),
        )
        results.append(
            profile_case(path, case, args.seed, stop, device, manifest, args.lead_cycles)
        )
        print_table(results[-1])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "scope": str(args.scope),
            "quick": args.quick,
            "eager_work": args.eager_work,
            "lead_cycles": args.lead_cycles,
            "seed": args.seed,
            "environment": fingerprint(host, git_sha(REPO_ROOT)),
            "cases": results,
        }
        args.out.write_text(json.dumps(record, indent=1))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
