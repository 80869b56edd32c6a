"""Tamper detection: the harness keeps its own references to what it measures and judges with,
and checks after the submitted code is imported (and after every case) that none was replaced.

A candidate that swaps `time.perf_counter`, `torch.cuda.Event.elapsed_time`, a graph's replay or
one of the engine's own functions (or its code object) would otherwise decide its own timings or
verdict. Watched:
the stdlib and torch names below, and everything the evaluation modules define: their
functions and classes, the methods of those classes, and their UPPER_CASE constants (a
verdict threshold such as REVIEW_SPEEDUP_ABOVE), private ones included.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass

# The packages whose own definitions a submission must not replace.
HARNESS_PACKAGES = ("harness.evaluation", "scopes")

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


# A function can be changed without being replaced: its code and defaults are writable.
FUNCTION_PARTS = ("__code__", "__defaults__", "__kwdefaults__")


@dataclass(frozen=True)
class Snapshot:
    # the objects themselves (not ids): held here, they cannot be freed and their ids reused
    objects: dict[str, object]
    # each watched function's FUNCTION_PARTS as they were
    function_parts: dict[str, tuple[object, ...]]

    @classmethod
    def take(cls) -> Snapshot:
        objects = {f"{m}.{a}": _resolve(m, a) for m, a in WATCHED}
        for name, module in list(sys.modules.items()):
            if module is not None and _is_harness(name):
                objects.update(_definitions(name, module))
        parts = {name: _parts(obj) for name, obj in objects.items() if inspect.isfunction(obj)}
        return cls(objects, parts)

    def replaced(self) -> list[str]:
        """Names whose object is no longer the one the snapshot saw, or whose code or defaults
        were swapped in place."""
        names = [name for name, obj in self.objects.items() if _current(name) is not obj]
        for name, parts in self.function_parts.items():
            now = _parts(self.objects[name])
            names += [
                f"{name}.{part}"
                for part, before, after in zip(FUNCTION_PARTS, parts, now, strict=True)
                if after is not before
            ]
        return names

    def restore_code(self) -> None:
        """Put back code and defaults swapped in place: the engine holds these very function
        objects (the verdict among them), so after a swap is recorded they must run as written."""
        for name, parts in self.function_parts.items():
            function = self.objects[name]
            for part, value in zip(FUNCTION_PARTS, parts, strict=True):
                if getattr(function, part, None) is not value:
                    setattr(function, part, value)


def _parts(function: object) -> tuple[object, ...]:
    return tuple(getattr(function, part, None) for part in FUNCTION_PARTS)


def _is_harness(module_name: str) -> bool:
    return any(module_name == p or module_name.startswith(p + ".") for p in HARNESS_PACKAGES)


def _definitions(module_name: str, module: object) -> dict[str, object]:
    """What a harness module defines: its functions and classes (and their methods), and its
    UPPER_CASE constants; not what it imported, and not its mutable state (lower_case)."""
    found: dict[str, object] = {}
    for name, value in vars(module).items():
        defined_here = getattr(value, "__module__", None) == module_name
        if inspect.isfunction(value) and defined_here:
            found[f"{module_name}.{name}"] = value
        elif inspect.isclass(value) and defined_here:
            found[f"{module_name}.{name}"] = value
            for attribute, member in vars(value).items():
                if not attribute.startswith("__") and inspect.isfunction(member):
                    found[f"{module_name}.{name}.{attribute}"] = member
        elif name.lstrip("_").isupper() and not inspect.ismodule(value):
            found[f"{module_name}.{name}"] = value
    return found


def _resolve(module: str, attribute: str) -> object:
    target: object = importlib.import_module(module)
    for part in attribute.split("."):
        target = getattr(target, part, None)
    return target


def _current(name: str) -> object:
    """The object `name` (module.attribute[.attribute]) names now, by the longest module
    prefix that is loaded."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:split]))
        if module is not None:
            target: object = module
            for part in parts[split:]:
                target = getattr(target, part, None)
                if target is None:
                    return None
            return target
    return None
