"""Resolve a manifest's entry points (`package.module:attr`) into callables."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.evaluation.outcomes import SUBMITTED_CODE_ERRORS
from scopes.manifest import ScopeManifest

Tensors = dict[str, Any]
PathFn = Callable[[Tensors, Tensors, Tensors], None]


class EntryPointError(Exception):
    """An entry point that cannot be imported or is not what the manifest says it is."""


@dataclass(frozen=True)
class LoadedPath:
    problem: Any  # an instance of the problem class, built from model.config
    baseline: PathFn
    candidate: PathFn
    supports: Callable[[Any], bool]
    # What computes the upcast reference: the baseline unless a multi-rank case runs the
    # baseline on one rank's share of the inputs (then the whole-input baseline, on one process)
    reference: PathFn | None = None

    @property
    def reference_fn(self) -> PathFn:
        return self.reference or self.baseline


def load_entry_point(spec: str) -> Any:
    module_name, attr = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EntryPointError(f"cannot import {module_name!r} for {spec!r}: {exc}") from None
    except SUBMITTED_CODE_ERRORS as exc:  # submitted module code raising at import time
        raise EntryPointError(f"importing {module_name!r} raised {exc!r}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise EntryPointError(f"{module_name!r} has no attribute {attr!r}") from None


def use_triton_interpreter() -> None:
    """On CPU, Triton kernels run under its interpreter; it must be chosen before they import."""
    os.environ["TRITON_INTERPRET"] = "1"


def load_path(manifest: ScopeManifest) -> LoadedPath:
    problem_class = load_entry_point(manifest.path.problem)
    entries = {
        name: load_entry_point(getattr(manifest.path, name))
        for name in ("baseline", "candidate", "supports")
    }
    for name, entry in entries.items():
        if not callable(entry):
            raise EntryPointError(f"path.{name} ({getattr(manifest.path, name)}) is not callable")
    try:
        problem = problem_class(dict(manifest.model.config))
    except SUBMITTED_CODE_ERRORS as exc:
        raise EntryPointError(f"building the problem from model.config failed: {exc!r}") from None
    return LoadedPath(problem, entries["baseline"], entries["candidate"], entries["supports"])
