"""A job's source: the in-tree code, or a git checkout of exactly the submitted SHA."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # at run time a checkout needs none of what the submissions module imports
    from harness.submissions import Source

REPO_ROOT = Path(__file__).resolve().parents[1]
GIT_TIMEOUT_S = 300
CHECKOUT_MAX_S = 3 * GIT_TIMEOUT_S  # checkout's three git steps, each bounded by GIT_TIMEOUT_S


class SourceError(Exception):
    pass


def prepare_source(source: Source, dest: Path) -> Path:
    """The folder the child imports the entry points from."""
    if source.kind == "in_tree":
        return REPO_ROOT
    assert source.url and source.sha
    return checkout(source.url, source.sha, dest)


def checkout(url: str, sha: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    steps = [
        ["git", "init", "-q", str(dest)],
        ["git", "-C", str(dest), "fetch", "-q", "--depth", "1", url, sha],
        ["git", "-C", str(dest), "checkout", "-q", "--detach", "FETCH_HEAD"],
    ]
    for step in steps:
        try:
            subprocess.run(step, capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=True)
        except subprocess.CalledProcessError as exc:
            raise SourceError(
                f"git {step[3] if len(step) > 3 else step[1]} failed for {url} "
                f"at {sha}: {exc.stderr.strip()[-500:]}"
            ) from None
        except subprocess.TimeoutExpired:
            raise SourceError(f"fetching {url} at {sha} took over {GIT_TIMEOUT_S} s") from None
    head = subprocess.run(
        ["git", "-C", str(dest), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if head != sha:
        raise SourceError(f"{url}: checked out {head}, expected {sha}")
    return dest
