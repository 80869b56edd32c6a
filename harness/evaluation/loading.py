"""Resolve a manifest's entry points (`package.module:attr`) into callables."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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
    # The modules imported to load the problem and the baseline: what defines right and fast
    judge_modules: tuple[str, ...] = ()

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
    """The problem and the baseline load first, so the modules they import are known apart
    from the candidate's (`judge_modules`)."""
    before = set(sys.modules)
    problem_class = load_entry_point(manifest.path.problem)
    entries = {"baseline": load_entry_point(manifest.path.baseline)}
    judge_modules = tuple(sorted(set(sys.modules) - before))
    for name in ("candidate", "supports"):
        entries[name] = load_entry_point(getattr(manifest.path, name))
    for name, entry in entries.items():
        if not callable(entry):
            raise EntryPointError(f"path.{name} ({getattr(manifest.path, name)}) is not callable")
    try:
        problem = problem_class(dict(manifest.model.config))
    except SUBMITTED_CODE_ERRORS as exc:
        raise EntryPointError(f"building the problem from model.config failed: {exc!r}") from None
    return LoadedPath(
        problem,
        entries["baseline"],
        entries["candidate"],
        entries["supports"],
        judge_modules=judge_modules,
    )


def submitted_judges(path: LoadedPath, source: Path | None, trusted_root: Path) -> list[str]:
    """The problem (inputs, reference) and the baseline (what a speedup is measured against)
    decide what the verdict means. Where the path imports from a submission's checkout
    (`source`), every file of theirs that comes from the checkout must be byte for byte the
    trusted tree's; one the submission adds or changes goes to a reviewer: a slower or wrong
    stock path would otherwise pass a wrong or slow candidate (2026-12-05 review)."""
    if source is None:
        return []
    source = source.resolve()
    reasons = []
    for name in path.judge_modules:
        file = getattr(sys.modules.get(name), "__file__", None)
        if not file or not Path(file).resolve().is_relative_to(source):
            continue
        relative = Path(file).resolve().relative_to(source)
        trusted = trusted_root / relative
        if trusted.is_file() and trusted.read_bytes() == (source / relative).read_bytes():
            continue
        how = "changes" if trusted.is_file() else "adds"
        reasons.append(
            f"the problem or baseline imports {relative} ({name}), which the submission {how}: "
            "a reviewer must accept it as the reference and the stock path before this passes"
        )
    return reasons
