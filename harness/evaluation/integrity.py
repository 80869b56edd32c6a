"""Tamper detection: the harness keeps its own references to what it measures and judges with,
and checks after the submitted code is imported (and after every case) that none was replaced.

A candidate that swaps `time.perf_counter`, `torch.cuda.Event.elapsed_time`, a graph's replay or
one of the engine's own functions (or its code object) would otherwise decide its own timings or
verdict; one that changes the stock path's code, the yardstick itself. Watched: the stdlib and
torch names below; in the evaluation modules and in the problem's and baseline's modules, every
function and class they define or import by name, the methods of the classes they define, and
their UPPER_CASE constants (a verdict threshold such as REVIEW_SPEEDUP_ABOVE), private ones
included; and of each watched function its code and defaults. What was replaced is put back
once recorded (`Snapshot.restore`), so the verdict is the harness's own.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext

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
    ("harness.evaluation.timing", "watched_replays"),
    ("harness.evaluation.timing", "_judge_watched"),
    ("harness.evaluation.timing", "_first_disagreement"),
    ("random", "SystemRandom.randrange"),
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
        return cls(objects, _function_parts(objects))

    def replaced(self) -> list[str]:
        """Names whose object is no longer the one the snapshot saw, or whose code or defaults
        were swapped in place."""
        names = [name for name, obj in self.objects.items() if _current(name) is not obj]
        for name, parts in self.function_parts.items():
            now = _parts(_function_of(self.objects[name]))
            names += [
                f"{name}.{part}"
                for part, before, after in zip(FUNCTION_PARTS, parts, now, strict=True)
                if after is not before
            ]
        return names

    def including(self, module_names: list[str] | tuple[str, ...], roots: list[Path]) -> Snapshot:
        """This snapshot and the definitions of those of these modules whose file lies under
        one of `roots` (the harness's tree, a submission's checkout: not third-party modules,
        which may set their own globals lazily), as they are now: the problem's and the
        baseline's, taken right after they load, before the candidate is imported. What this
        snapshot already holds keeps its first record."""
        objects: dict[str, object] = {}
        for name in module_names:
            module = sys.modules.get(name)
            file = getattr(module, "__file__", None)
            if module is not None and file and any(_under(file, root) for root in roots):
                objects.update(_definitions(name, module))
        objects.update(self.objects)
        parts = _function_parts(objects)
        parts.update(self.function_parts)
        return Snapshot(objects, parts)

    def restore(self) -> None:
        """Put back what was replaced or swapped in place: the engine goes on to use these very
        names and function objects (the verdict among them), so once the tampering is recorded
        they must be the harness's own again."""
        for name, obj in self.objects.items():
            if _current(name) is not obj:
                _put_back(name, obj)
        for name, parts in self.function_parts.items():
            function = _function_of(self.objects[name])
            for part, value in zip(FUNCTION_PARTS, parts, strict=True):
                if getattr(function, part, None) is not value:
                    setattr(function, part, value)


def _function_parts(objects: dict[str, object]) -> dict[str, tuple[object, ...]]:
    """FUNCTION_PARTS of each watched object that is or wraps a function."""
    return {
        name: _parts(_function_of(obj))
        for name, obj in objects.items()
        if _function_of(obj) is not None
    }


def _parts(function: object) -> tuple[object, ...]:
    return tuple(getattr(function, part, None) for part in FUNCTION_PARTS)


def _is_harness(module_name: str) -> bool:
    return any(module_name == p or module_name.startswith(p + ".") for p in HARNESS_PACKAGES)


def _definitions(module_name: str, module: object) -> dict[str, object]:
    """A module's functions and classes, its own and those it imported by name (rebinding the
    engine's `decide` is as good as replacing verdict's), the methods of the classes it defines,
    and its UPPER_CASE constants; not its mutable state (lower_case)."""
    found: dict[str, object] = {}
    for name, value in vars(module).items():
        if callable(value) and not inspect.ismodule(value):  # functools.cache wrappers too
            found[f"{module_name}.{name}"] = value
        if inspect.isclass(value) and getattr(value, "__module__", None) == module_name:
            for attribute, member in vars(value).items():
                if not attribute.startswith("__") and _function_of(member) is not None:
                    found[f"{module_name}.{name}.{attribute}"] = member
        elif name.lstrip("_").isupper() and not inspect.ismodule(value):
            found[f"{module_name}.{name}"] = value
    return found


def _function_of(member: object) -> object | None:
    """The function a class member runs: itself, or what a staticmethod, classmethod or
    property wraps."""
    if inspect.isfunction(member):
        return member
    if isinstance(member, (staticmethod, classmethod)):
        return member.__func__
    if isinstance(member, property):
        return member.fget
    return None


def _resolve(module: str, attribute: str) -> object:
    target: object = importlib.import_module(module)
    for part in attribute.split("."):
        target = getattr(target, part, None)
    return target


def _put_back(name: str, obj: object) -> None:
    """Set `name` (module.attribute[.attribute]) to obj again, on the object that holds it;
    where that holder is gone too, nothing (the tampering is recorded either way)."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:split]))
        if module is not None:
            holder: object = module
            for part in parts[split:-1]:
                holder = getattr(holder, part, None)
            with contextlib.suppress(AttributeError, TypeError):
                setattr(holder, parts[-1], obj)
            return


def _under(file: str, root: Path) -> bool:
    return Path(os.path.abspath(file)).is_relative_to(root)


def _current(name: str) -> object:
    """The object `name` (module.attribute[.attribute]) names now, by the longest module
    prefix that is loaded."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:split]))
        if module is not None:
            target: object = module
            for part in parts[split:]:
                # a class's own entry, not what its descriptor makes of it (a classmethod
                # would be a new bound method on every lookup)
                lookup = inspect.getattr_static if inspect.isclass(target) else getattr
                target = lookup(target, part, None)
                if target is None:
                    return None
            return target
    return None


# The tensor types the harness accepts in what it hands submitted code and reads back. A tensor
# whose class the submission changed (`t.__class__ = Sub`, Sub defining __torch_function__), or a
# torch function or dispatch mode it left active, runs the submission's code inside every torch
# operation the harness then makes on that tensor: the copy of a timed replay's outputs, a
# comparison, a norm (2026-12-06 review: a candidate timed doing nothing did its work lazily
# when the harness cloned its outputs, and passed).
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class TamperedTensors(RuntimeError):
    pass


def require_plain_tensors(*groups: Mapping[str, object], when: str) -> None:
    """Raise TamperedTensors if a tensor of these groups is not a plain tensor, or a torch
    function or dispatch mode is active; `when` says after what."""
    found = [
        f"'{name}' is a {type(value).__module__}.{type(value).__qualname__}"
        for group in groups
        for name, value in group.items()
        if isinstance(value, torch.Tensor) and type(value) not in PLAIN_TENSOR_TYPES
    ]
    modes = [type(m) for m in _get_current_function_mode_stack()]
    if any(mode is not DeviceContext for mode in modes):  # torch.set_default_device's is benign
        found.append(
            f"a torch function mode is active ({', '.join(m.__qualname__ for m in modes)})"
        )
    if torch._C._len_torch_dispatch_stack():
        found.append("a torch dispatch mode is active")
    if found:
        raise TamperedTensors(
            f"tampering {when}: {'; '.join(found[:3])} (its own code would run inside the "
            "harness's operations on the tensors)"
        )
