"""A run's checkpoint: the cases measured so far, so an interrupted run can be finished.

A full validation of a large scope can outlast the machine it runs on (a lent GPU taken back,
a session's device time spent). `pathgate validate` writes `checkpoint.json` next to the
evidence after every case; `pathgate validate --resume` reads it and runs only the cases it
lacks. The plan is a function of the seed, so the resumed run has the same cases; a case found
in the checkpoint is taken as measured there. That is only sound when nothing that could change
a measurement changed in between: the same scope, seed, plan options, code and environment
(GPU, driver, library versions). Anything else refuses the resume.

The checkpoint holds the secret seed: it is written by the command line only (a person running
a scope on their own machine), never by the service's workers.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from harness.evaluation.evidence import CaseEvidence, Model
from harness.evaluation.plan import MAX_SEED

FILE_NAME = "checkpoint.json"
# Not part of the match: readings that change from one moment to the next on the same machine
# (clocks, and the hash over them), and the git revision, which also changes with a docs-only
# commit or an edited test; `code_digest` is the check on the code.
VOLATILE_ENVIRONMENT = {"fingerprint_hash", "sm_clock", "mem_clock", "harness_sha"}
# Not code a validation runs: environments, outputs, and the test suite (editing a test between
# the two halves of a run changes no measurement).
SKIPPED = {"venv", "site-packages", "node_modules", "pathgate-out", "__pycache__", "tests"}


class ResumeRefused(ValueError):
    """The checkpoint cannot be continued: missing, unreadable or from another setting."""


class Checkpoint(Model):
    scope: str
    manifest: dict[str, Any]
    seed: int = Field(ge=0, le=MAX_SEED)  # what --seed takes: the report's command must run
    device: str
    quick: bool
    gpus: int | None
    # the engine's options below --quick (None: its defaults); the CLI never sets them
    trials: int | None = None
    max_layers: int | None = None
    stop: dict[str, Any] | None = None
    environment: dict[str, Any]
    code_digest: str  # of every Python file under the repository: a dirty tree is still pinned
    started_at: str
    cases: list[CaseEvidence]


def write(path: Path, checkpoint: Checkpoint) -> None:
    """Replace the file in one step, on disk before it replaces the previous one: a machine
    lost mid-write leaves the previous checkpoint, never a partial one. The temporary file's
    name is unique, so two runs writing to one folder cannot move each other's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".checkpoint-", suffix=".json")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(checkpoint.model_dump_json())
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def read(path: Path) -> Checkpoint:
    if not path.exists():
        raise ResumeRefused(f"no checkpoint at {path}: nothing to resume")
    if not path.is_file():  # the run writes its checkpoint there: it must be free for a file
        raise ResumeRefused(f"{path} is not a file: move it away, or choose another --out")
    try:
        return Checkpoint.model_validate_json(path.read_text())
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(map(str, error["loc"]))
        detail = f"{where}: {error['msg']}" if where else error["msg"]
        raise ResumeRefused(
            f"{path} is not a pathgate checkpoint ({detail}); delete it to start over"
        ) from None
    except (OSError, ValueError) as exc:  # unreadable, or not UTF-8
        raise ResumeRefused(f"cannot read {path} ({exc}); delete it to start over") from None


def mismatches(checkpoint: Checkpoint, current: Checkpoint) -> list[str]:
    """Why the run `current` (no cases yet) may not continue `checkpoint`; empty if it may."""
    problems = []
    for name in ("scope", "seed", "device", "quick", "gpus", "trials", "max_layers", "stop"):
        if getattr(checkpoint, name) != getattr(current, name):
            problems.append(
                f"{name}: {getattr(checkpoint, name)!r} then, {getattr(current, name)!r} now"
            )
    if checkpoint.manifest != current.manifest:
        problems.append("the scope manifest changed")
    if checkpoint.code_digest != current.code_digest:
        problems.append("the code changed (a Python file under the repository or of the path)")
    keys = (checkpoint.environment.keys() | current.environment.keys()) - VOLATILE_ENVIRONMENT
    for key in sorted(keys):
        then, now = checkpoint.environment.get(key), current.environment.get(key)
        if then != now:
            problems.append(f"environment {key}: {then!r} then, {now!r} now")
    return problems


def code_digest(root: Path, entry_modules: Sequence[str] = ()) -> str:
    """sha256 over the path and bytes of every .py file under `root`, outside hidden folders,
    virtual environments and test suites, and of the files of `entry_modules` (the path's entry
    points, which may live elsewhere on sys.path or in a test suite). The git revision alone
    would not do: it says nothing about uncommitted edits, and a copied tree (a GPU worker's)
    may have no .git at all."""
    digest = hashlib.sha256()
    for path in sorted(_python_files(root)):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    for module in sorted(set(entry_modules)):
        source = module_file(module)
        if source is not None:
            digest.update(module.encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def module_file(module: str) -> Path | None:
    """The source file `import module` would load, found without running any module's code (a
    package's __init__ may be submitted code, not to run before the harness is ready): the
    top-level package through the import system's finders (sys.path, and the finder an editable
    install registers), the rest as files under it."""
    top, *rest = module.split(".")
    spec = _top_level_spec(top)
    if spec is None:
        return None
    if not rest:
        return Path(spec.origin) if spec.origin and Path(spec.origin).is_file() else None
    for location in spec.submodule_search_locations or []:
        base = Path(location).joinpath(*rest)
        suffixes = importlib.machinery.EXTENSION_SUFFIXES  # a compiled module: torch._C
        compiled = [base.with_name(base.name + suffix) for suffix in suffixes]
        for candidate in (base.with_suffix(".py"), base / "__init__.py", *compiled):
            if candidate.is_file():
                return candidate
    return None


def module_found(module: str) -> bool:
    """Whether `import module` would find it, found as module_file finds it: a file, or a
    top-level module built into the interpreter, which has none (sys; os, frozen)."""
    if module_file(module) is not None:
        return True
    spec = _top_level_spec(module)  # a dotted name: None
    return spec is not None and spec.origin in ("built-in", "frozen")


def _top_level_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    if "." in name:
        return None
    try:
        return importlib.util.find_spec(name)  # a top-level name: finds, executes nothing
    except (ImportError, ValueError):
        return None


def _python_files(root: Path) -> list[Path]:
    found = []
    for folder, subfolders, files in os.walk(root):
        # pruned in place: os.walk then never descends into a virtual environment
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in SKIPPED]
        found += [Path(folder) / name for name in files if name.endswith(".py")]
    return found


def check_cases(checkpoint: Checkpoint, planned: Sequence[tuple[str, str]]) -> None:
    """Refuse a checkpoint whose cases are not the plan's (case id, origin) pairs, each once:
    the same seed and scope give the same plan, so a stray or repeated case means the file was
    edited or comes from elsewhere, and carrying it over would lose or double a measurement."""
    plan = set(planned)
    seen: set[tuple[str, str]] = set()
    for case in checkpoint.cases:
        key = (case.id, case.origin)
        if key not in plan:
            raise ResumeRefused(
                f"cannot resume: the checkpoint's case {case.id} ({case.origin}) "
                "is not in this run's plan; delete the checkpoint to start over"
            )
        if key in seen:
            raise ResumeRefused(
                f"cannot resume: the checkpoint holds case {case.id} "
                f"({case.origin}) twice; delete the checkpoint to start over"
            )
        seen.add(key)


def resume_note(checkpoint: Checkpoint, resumed_at: str) -> str:
    return (
        f"resumed: {len(checkpoint.cases)} case(s) carried over from the run started at "
        f"{checkpoint.started_at} (same seed, scope, code and environment); the rest measured "
        f"from {resumed_at}"
    )
