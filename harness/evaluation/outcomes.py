"""Typed outcomes of a case or a check: never a bare boolean."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal


@dataclass(frozen=True)
class Passed:
    status: ClassVar[Literal["passed"]] = "passed"


@dataclass(frozen=True)
class Mismatch:
    reasons: tuple[str, ...]
    status: ClassVar[Literal["failed"]] = "failed"


@dataclass(frozen=True)
class Unsupported:
    why: str
    status: ClassVar[Literal["unsupported"]] = "unsupported"


@dataclass(frozen=True)
class Crashed:
    error: str
    status: ClassVar[Literal["crashed"]] = "crashed"


@dataclass(frozen=True)
class TimedOut:
    after_s: float
    detail: str = ""  # e.g. which ranks of a multi-rank case had not finished
    status: ClassVar[Literal["timed_out"]] = "timed_out"


@dataclass(frozen=True)
class NotRun:
    why: str
    status: ClassVar[Literal["not_run"]] = "not_run"


# What submitted code may raise that must become a Crashed outcome, not end the evaluation:
# sys.exit() too. KeyboardInterrupt still stops the run.
SUBMITTED_CODE_ERRORS = (Exception, SystemExit)

Outcome = Passed | Mismatch | Unsupported | Crashed | TimedOut | NotRun


def reasons_of(outcome: Outcome) -> list[str]:
    match outcome:
        case Passed():
            return []
        case Mismatch(reasons=reasons):
            return list(reasons)
        case Unsupported(why=why) | NotRun(why=why):
            return [why]
        case Crashed(error=error):
            return [f"crashed: {error}"]
        case TimedOut(after_s=after_s, detail=detail):
            return [f"timed out after {after_s:.0f} s" + (f": {detail}" if detail else "")]
    raise TypeError(f"not an outcome: {outcome!r}")
