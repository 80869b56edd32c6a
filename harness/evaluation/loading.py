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


@dataclass(frozen=True)
class Judges:
    """The problem class and the baseline: what right and fast mean, loaded before the candidate
    so the modules they import (`modules`) are known apart from the candidate's."""

    problem_class: Any
    baseline: PathFn
    modules: tuple[str, ...]


def load_judges(manifest: ScopeManifest) -> Judges:
    """Their own modules and every module importing them brought in (the ones already
    imported, by this process or an earlier evaluation in it, are their own modules only)."""
    before = set(sys.modules)
    problem_class = load_entry_point(manifest.path.problem)
    baseline = load_entry_point(manifest.path.baseline)
    own = {spec.split(":")[0] for spec in (manifest.path.problem, manifest.path.baseline)}
    return Judges(problem_class, baseline, tuple(sorted(own | (set(sys.modules) - before))))


def load_path(manifest: ScopeManifest, judges: Judges | None = None) -> LoadedPath:
    """The whole path; the judges as loaded already (the engine watches them before the
    candidate is imported), or loaded first here."""
    judges = judges or load_judges(manifest)
    problem_class = judges.problem_class
    entries: dict[str, Any] = {"baseline": judges.baseline}
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
        judge_modules=judges.modules,
    )


def submitted_judges(path: LoadedPath, source: Path | None, trusted_root: Path) -> list[str]:
    """The problem (inputs, reference) and the baseline (what a speedup is measured against)
    decide what the verdict means. Where the path imports from a submission's checkout
    (`source`), every file of theirs that comes from the checkout must be byte for byte the
    trusted tree's, and a real file there, not a link; one the submission adds or changes goes
    to a reviewer: a slower or wrong stock path would otherwise pass a wrong or slow candidate
    (2026-12-05 review). Where a module came from is its import spec's origin, as the import
    system recorded it (a module can delete its own `__file__`)."""
    if source is None:
        return []
    source = Path(os.path.abspath(source))
    reasons = []
    for name in path.judge_modules:
        problem = _judge_file_problem(sys.modules.get(name), source, trusted_root)
        if problem:
            reasons.append(
                f"the problem or baseline imports {name}, {problem}: a reviewer must accept it "
                "as the reference and the stock path before this passes"
            )
    return reasons


def _judge_file_problem(module: Any, source: Path, trusted_root: Path) -> str | None:
    """Why this module of the judges cannot be taken as the trusted tree's, or None."""
    spec = getattr(module, "__spec__", None)
    if spec is None:
        return "which has no import spec to tell where it came from"
    if not spec.has_location or not spec.origin:
        return None  # built in, frozen, or a namespace package: no file of code
    origin = Path(os.path.abspath(spec.origin))
    if not origin.is_relative_to(source):
        return None  # the installed environment's, not the submission's
    relative = origin.relative_to(source)
    linked = [p for p in [origin, *origin.parents] if p.is_relative_to(source) and p.is_symlink()]
    if linked:
        return f"from {relative} in the submission, through a symbolic link"
    trusted = trusted_root / relative
    if not trusted.is_file():
        return f"from {relative}, which the submission adds"
    if trusted.read_bytes() != origin.read_bytes():
        return f"from {relative}, which the submission changes"
    return None
