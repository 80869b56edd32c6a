"""A job's git source: exactly the submitted SHA, over the transports the service allows."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.github.conftest import git_repo
from workers import workspace
from workers.workspace import SourceError, checkout, git_protocol


@pytest.mark.parametrize(
    ("url", "protocol"),
    [
        ("https://github.com/a/b.git", "https"),
        ("HTTP://example.com/b.git", "http"),
        ("file:///srv/b.git", "file"),
        ("ssh://git@host/b.git", "ssh"),
        ("git@github.com:a/b.git", "ssh"),
        ("/srv/b.git", "file"),
    ],
)
def test_git_protocol_is_gits_own_name_for_the_transport(url: str, protocol: str) -> None:
    assert git_protocol(url) == protocol


def test_checkout_fetches_the_sha_over_an_allowed_protocol_only(tmp_path: Path) -> None:
    url, sha = git_repo(tmp_path / "origin", {"kernels/x.py": "X = 1\n"})
    with pytest.raises(SourceError, match="git file URLs are not allowed here"):
        checkout(url, sha, tmp_path / "refused", ["https"])
    assert not (tmp_path / "refused").exists()  # refused before anything was fetched
    dest = checkout(url, sha, tmp_path / "fetched", ["https", "file"])
    assert (dest / "kernels" / "x.py").read_text() == "X = 1\n"


def test_git_itself_refuses_a_transport_outside_the_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The list also reaches git (`protocol.allow`), which applies it to whatever the URL leads
    to (a redirect, a submodule): with pathgate's own check fooled, git still says no."""
    url, sha = git_repo(tmp_path / "origin", {"a.py": ""})
    monkeypatch.setattr(workspace, "git_protocol", lambda url: "https")
    with pytest.raises(SourceError, match=r"git fetch failed .*transport 'file' not allowed"):
        workspace.checkout(url, sha, tmp_path / "dest", ["https"])


def test_what_an_earlier_run_planted_at_the_path_never_runs(tmp_path: Path) -> None:
    """A child may write into the folder a later job checks out to (2026-12-05 review: it
    planted .git/hooks/post-checkout, which the worker's git then ran with the worker's
    secrets). The checkout starts from an empty folder and runs no hook."""
    url, sha = git_repo(tmp_path / "origin", {"kernels/x.py": "X = 1\n"})
    dest = tmp_path / "dest"
    marker = tmp_path / "hook-ran"
    for hook in ("post-checkout", "reference-transaction", "post-index-change"):
        planted = dest / ".git" / "hooks" / hook
        planted.parent.mkdir(parents=True, exist_ok=True)
        planted.write_text(f"#!/bin/sh\necho {hook} >> {marker}\n")
        planted.chmod(0o755)
    (dest / "planted.py").write_text("PLANTED = True\n")
    checkout(url, sha, dest, ["https", "file"])
    assert not marker.exists(), marker.read_text()
    assert not (dest / "planted.py").exists()
    assert (dest / "kernels" / "x.py").read_text() == "X = 1\n"


def test_after_a_run_only_its_log_stays_and_links_are_not_followed(tmp_path: Path) -> None:
    from workers.tasks import clear_workspace

    workdir, outside = tmp_path / "job-1-attempt-1", tmp_path / "outside"
    (workdir / "src" / "kernels").mkdir(parents=True)
    (workdir / "tmp").mkdir()
    (workdir / "big.bin").write_bytes(b"x" * 1000)
    (workdir / "child.log").write_text("the run's output\n")
    outside.mkdir()
    (outside / "keep.txt").write_text("not the run's\n")
    (workdir / "link-to-outside").symlink_to(outside, target_is_directory=True)
    (workdir / "tmp" / "locked").mkdir()
    (workdir / "tmp" / "locked" / "f").write_text("x")
    (workdir / "tmp" / "locked").chmod(0o000)
    (workdir / "tmp").chmod(0o000)
    clear_workspace(workdir)
    assert sorted(p.name for p in workdir.iterdir()) == ["child.log"]
    assert (outside / "keep.txt").read_text() == "not the run's\n"
    clear_workspace(tmp_path / "never-made")  # nothing to clear is no error


def test_a_runs_log_keeps_its_last_part_whatever_the_child_left_at_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers import runner

    monkeypatch.setattr(runner, "LOG_KEEP_BYTES", 10)
    path, elsewhere = tmp_path / "child.log", tmp_path / "elsewhere.txt"
    elsewhere.write_text("not the log\n")
    with open(path, "w+b") as log:
        log.write(b"0123456789" * 3 + b"last line\n")
        log.flush()
        path.unlink()
        path.symlink_to(elsewhere)  # what a child could do to the path
        runner._keep_log(log, path)
    assert not path.is_symlink()
    assert path.read_text() == "[the first 30 bytes of this log were cut]\nlast line\n"
    assert elsewhere.read_text() == "not the log\n"
