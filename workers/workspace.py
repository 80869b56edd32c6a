"""A job's source: the in-tree code, or a git checkout of exactly the submitted SHA."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # at run time a checkout needs none of what the submissions module imports
    from harness.submissions import Source

REPO_ROOT = Path(__file__).resolve().parents[1]
GIT_TIMEOUT_S = 300
CHECKOUT_MAX_S = 3 * GIT_TIMEOUT_S  # checkout's three git steps, each bounded by GIT_TIMEOUT_S
# The worker's git runs no hook from the checkout it makes (only git's own code runs in the
# worker, never a submission's), and no fsmonitor program.
NO_HOOKS = ("-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false")


class SourceError(Exception):
    pass


def prepare_source(source: Source, dest: Path, protocols: Sequence[str]) -> Path:
    """The folder the child imports the entry points from."""
    if source.kind == "in_tree":
        return REPO_ROOT
    assert source.url and source.sha
    return checkout(source.url, source.sha, dest, protocols)


def git_protocol(url: str) -> str:
    """The git transport a URL uses, by git's own name for it (`protocol.<name>.allow`)."""
    scheme, separator, _ = url.partition("://")
    if separator:
        return scheme.lower()
    return "ssh" if ":" in url else "file"  # git@host:path is ssh; a bare path is local


def checkout(url: str, sha: str, dest: Path, protocols: Sequence[str]) -> Path:
    """Fetch exactly `sha` into `dest`. git itself refuses any transport outside `protocols`,
    for the URL and for anything it would follow from it (a redirect, a submodule)."""
    if git_protocol(url) not in protocols:
        raise SourceError(f"git {git_protocol(url)} URLs are not allowed here: {url}")
    # Always a new folder: whatever an earlier job's child left at this path (a planted .git
    # with hooks or config) must not reach the worker's git.
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    allow = ["-c", "protocol.allow=never"]
    for protocol in protocols:
        allow += ["-c", f"protocol.{protocol}.allow=always"]
    steps = {
        "init": ["init", "-q", "--template=", str(dest)],
        "fetch": [*allow, "-C", str(dest), "fetch", "-q", "--depth", "1", url, sha],
        "checkout": ["-C", str(dest), "checkout", "-q", "--detach", "FETCH_HEAD"],
    }
    for verb, arguments in steps.items():
        try:
            subprocess.run(
                ["git", *NO_HOOKS, *arguments],
                capture_output=True,
                text=True,
                timeout=GIT_TIMEOUT_S,
                check=True,
            )
        except subprocess.CalledProcessError as exc:
            raise SourceError(
                f"git {verb} failed for {url} at {sha}: {exc.stderr.strip()[-500:]}"
            ) from None
        except subprocess.TimeoutExpired:
            raise SourceError(f"fetching {url} at {sha} took over {GIT_TIMEOUT_S} s") from None
    head = subprocess.run(
        ["git", *NO_HOOKS, "-C", str(dest), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if head != sha:
        raise SourceError(f"{url}: checked out {head}, expected {sha}")
    return dest
