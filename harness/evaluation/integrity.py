"""Tamper detection: the harness keeps its own references to what it measures and judges with,
and checks after the submitted code is imported (and after every case) that none was replaced.

A candidate that swaps `time.perf_counter`, `torch.cuda.Event.elapsed_time`, a graph's replay or
one of the engine's own functions would otherwise decide its own timings or verdict.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

# (module, dotted attribute) pairs whose identity must not change during an evaluation.
WATCHED = (
    ("time", "perf_counter"),
    ("time", "monotonic"),
    ("torch.cuda", "synchronize"),
    ("torch.cuda", "Stream"),
    ("torch.cuda", "current_stream"),
    ("torch.cuda", "Event"),
    ("torch.cuda", "Event.elapsed_time"),
    ("torch.cuda", "Event.record"),
    ("torch.cuda", "CUDAGraph"),
    ("torch.cuda", "CUDAGraph.replay"),
    ("torch.cuda", "graph"),
    ("torch", "equal"),
    ("torch", "isnan"),
    ("torch.linalg", "vector_norm"),
    ("torch.profiler", "profile"),
    ("torch", "Tensor.clone"),
    ("torch", "Tensor.fill_"),
    ("harness.evaluation.timing", "timed_pairs"),
    ("harness.evaluation.timing", "_cuda_intervals"),
    ("harness.evaluation.timing", "_host_intervals"),
    ("harness.evaluation.timing", "sample_interleaved"),
    ("harness.evaluation.timing", "refresh_inputs"),
    ("harness.evaluation.timing", "replay_mismatches"),
    ("harness.evaluation.timing", "wall_us_per_layer"),
    ("harness.evaluation.timing", "cross_check_flags"),
    ("harness.evaluation.stats", "speedup_ci95"),
    ("harness.evaluation.correctness", "check_case"),
    ("harness.evaluation.correctness", "run_trial"),
    ("harness.evaluation.correctness", "output_error"),
    ("harness.evaluation.correctness", "relative_error"),
    ("harness.evaluation.guard", "check_probe"),
    ("harness.evaluation.profiling", "profile_step"),
    ("harness.evaluation.verdict", "check_claim"),
    ("harness.evaluation.verdict", "decide"),
    ("harness.evaluation.verdict", "review_reasons"),
    ("harness.evaluation.engine", "run_case"),
    ("harness.evaluation.engine", "measure_case"),
    ("harness.evaluation.engine", "still_correct_after_timing"),
)


@dataclass(frozen=True)
class Snapshot:
    # the objects themselves (not ids): held here, they cannot be freed and their ids reused
    objects: dict[str, object]

    @classmethod
    def take(cls) -> Snapshot:
        return cls({f"{m}.{a}": _resolve(m, a) for m, a in WATCHED})

    def replaced(self) -> list[str]:
        """Names whose object is no longer the one the snapshot saw."""
        now = Snapshot.take().objects
        return [name for name, obj in self.objects.items() if now.get(name) is not obj]


def _resolve(module: str, attribute: str) -> object:
    target: object = importlib.import_module(module)
    for part in attribute.split("."):
        target = getattr(target, part, None)
    return target
