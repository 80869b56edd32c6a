"""The child-process runner: a candidate that hangs, crashes, lies or snoops cannot take the
worker down, outlive its run, read the worker's secrets or forge the result.

Every test is a real child (`python -m workers.child`) evaluating a small add+RMSNorm scope on
CPU (hidden 256, batch 1..64, quick) with a candidate from tests/fixtures/hostile_paths.py.
Each child imports torch, so each run takes a few seconds.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from harness.config import get_settings
from tests.fixtures import hostile_paths
from tests.fixtures.hostile_paths import forged_evidence_json
from tests.service_fixtures import use_database
from workers.child import message_mac
from workers.runner import (
    ChildCrashed,
    ChildTimedOut,
    Finished,
    RunOutcome,
    RunRequest,
    authenticated_message,
    isolation,
    run_in_child,
    service_files,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
HOSTILE = "tests.fixtures.hostile_paths"
HONEST_SUPPORTS = "tests.fixtures.bad_paths:honest_supports"
SEED = 20240611
HANG_TIMEOUT_S = 15.0
GONE_WAIT_S = 5.0
GIB = 1024**3

CONTRIB_MODULE = '''\
"""A contributed path from a git checkout: the stock path, dispatching on the tests' scope."""
from harness.evaluation.cases import Case
from kernels.fused_add_rmsnorm import stock


def supports(case: Case) -> bool:
    return case.dtype == "bfloat16" and 1 <= case.batch <= 64 and case.cp == 1 and case.gpus == 1


def forward(weights, inputs, out):
    stock.forward(weights, inputs, out)
'''
SHADOW_MODULE = 'raise RuntimeError("a checkout must not shadow the installed harness")\n'


def manifest_yaml(candidate: str, supports: str = HONEST_SUPPORTS) -> str:
    """The rmsnorm scope of tests/evaluation/test_engine_catches.py, as submitted YAML text."""
    manifest = {
        "name": "fused-add-rmsnorm-test",
        "summary": "Test scope for the child-process runner",
        "path": {
            "problem": "kernels.fused_add_rmsnorm.problem:Problem",
            "baseline": "kernels.fused_add_rmsnorm.stock:forward",
            "candidate": candidate,
            "supports": supports,
        },
        "model": {"id": "test/rmsnorm", "dtype": "bfloat16", "config": {"hidden": 256}},
        "hardware": {"gpu": ["cpu", "H200"], "gpus": [1]},
        "workload": {"phase": "decode", "batch": {"min": 1, "max": 64}, "context_parallel": [1]},
        "tolerance": {"error_budget": 2.0, "min_cosine": 0.9999},
        "claims": [],
    }
    return yaml.safe_dump(manifest, sort_keys=False)


def run(
    candidate: str,
    workdir: Path,
    supports: str = HONEST_SUPPORTS,
    source_dir: Path = REPO_ROOT,
    timeout_s: float = 120.0,
) -> RunOutcome:
    request = RunRequest(
        manifest_yaml=manifest_yaml(candidate, supports),
        source_dir=source_dir,
        device="cpu",
        quick=True,
        seed=SEED,
        timeout_s=timeout_s,
        workdir=workdir,
    )
    return run_in_child(request)


def hostile(name: str) -> str:
    return f"{HOSTILE}:{name}"


def processes_where(matches: Callable[[Path], bool]) -> list[int]:
    """Host pids of live (not zombie) processes whose /proc entry matches."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            alive = stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, not yet reaped
            if alive and matches(entry):
                found.append(int(entry.name))
        except OSError:
            continue  # gone while we looked, or not ours to read
    return found


def command_line_holds(marker: str) -> Callable[[Path], bool]:
    return lambda entry: marker in (entry / "cmdline").read_bytes().decode(errors="replace")


def works_in(folder: Path) -> Callable[[Path], bool]:
    return lambda entry: (entry / "cwd").resolve() == folder.resolve()


def wait_until(condition: Callable[[], bool], timeout_s: float = GONE_WAIT_S) -> bool:
    """Poll until the condition holds (a SIGKILLed process takes a moment to die)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


def parent_hard(name: str) -> int:
    hard = resource.getrlimit(getattr(resource, name))[1]
    return sys.maxsize if hard == resource.RLIM_INFINITY else hard


def test_honest_in_tree_path_finishes_with_pass(tmp_path: Path) -> None:
    outcome = run("tests.fixtures.bad_paths:honest_forward", tmp_path / "work")
    assert isinstance(outcome, Finished), outcome
    assert outcome.evidence.verdict == "PASS", outcome.evidence.verdict_reasons
    assert outcome.evidence.run.seed == SEED and outcome.evidence.run.device == "cpu"
    assert isinstance(outcome.log_tail, str)


def test_hanging_path_is_killed_with_its_grandchildren(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    outcome = run(hostile("hangs_forward"), workdir, timeout_s=HANG_TIMEOUT_S)
    assert isinstance(outcome, ChildTimedOut), outcome
    assert HANG_TIMEOUT_S <= outcome.after_s < HANG_TIMEOUT_S + 10
    assert isinstance(outcome.log_tail, str)
    marker = json.loads((workdir / hostile_paths.PIDS_FILE).read_text())["grandchild_marker"]
    grandchild = command_line_holds(marker)
    assert wait_until(lambda: not processes_where(grandchild)), "the grandchild outlived the run"
    assert wait_until(lambda: not processes_where(works_in(workdir))), "the child outlived it"


def test_path_that_exits_is_a_crash_with_its_exit_code(tmp_path: Path) -> None:
    outcome = run(hostile("exits_forward"), tmp_path / "work")
    assert isinstance(outcome, ChildCrashed), outcome
    assert outcome.exit_code == hostile_paths.EXIT_CODE
    assert "authenticated" in outcome.error


def test_path_that_crashes_natively_is_a_crash_with_the_signal(tmp_path: Path) -> None:
    outcome = run(hostile("segfaults_forward"), tmp_path / "work")
    assert isinstance(outcome, ChildCrashed), outcome
    assert outcome.exit_code == -signal.SIGSEGV


def test_forged_verdict_on_stdout_and_garbage_on_fds_never_pass(tmp_path: Path) -> None:
    outcome = run(hostile("forges_output_forward"), tmp_path / "work")
    assert isinstance(outcome, Finished | ChildCrashed), outcome
    if isinstance(outcome, Finished):
        assert outcome.evidence.verdict == "FAIL"
        assert any("forged a verdict" in r for r in outcome.evidence.verdict_reasons)
    assert '"verdict": "PASS"' in outcome.log_tail  # the forgery only reached the log


def test_an_evaluation_that_raises_gives_its_summary_and_logs_its_traceback(
    tmp_path: Path,
) -> None:
    """The error is the job's reason, shown in reports and on the pull request: one line, not
    the worker's traceback (which stays in the log tail)."""
    request = RunRequest(
        manifest_yaml="name: not-a-whole-manifest\n",
        source_dir=REPO_ROOT,
        device="cpu",
        quick=True,
        seed=SEED,
        timeout_s=60.0,
        workdir=tmp_path / "work",
    )
    outcome = run_in_child(request)
    assert isinstance(outcome, ChildCrashed), outcome
    assert outcome.error.startswith("ManifestError: summary: Field required; path: ")
    assert "\n" not in outcome.error and "Traceback" not in outcome.error
    assert "Traceback (most recent call last)" in outcome.log_tail


def test_result_message_with_a_wrong_mac_is_rejected(tmp_path: Path) -> None:
    outcome = run(hostile("forges_result_forward"), tmp_path / "work")
    assert isinstance(outcome, ChildCrashed), outcome
    assert outcome.error.startswith("no authenticated result"), outcome.error
    assert outcome.exit_code == 0


def test_child_gets_only_the_allow_listed_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATHGATE_DATABASE_URL", "postgresql://secret")
    monkeypatch.setenv("PATHGATE_SECRET_TOKEN", "secret-token")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-key")
    workdir = tmp_path / "work"
    outcome = run(hostile("dumps_environment_forward"), workdir)
    assert isinstance(outcome, Finished), outcome
    assert outcome.evidence.verdict == "PASS", outcome.evidence.verdict_reasons
    env = json.loads((workdir / hostile_paths.ENV_FILE).read_text())
    assert not [k for k in env if k.startswith("PATHGATE_")]
    assert not [k for k, v in env.items() if "secret" in k.lower() or "secret" in v.lower()]
    assert env["HOME"] == str(workdir.resolve())
    assert Path(env["TMPDIR"]).parent == Path(env["TRITON_CACHE_DIR"]).parent == workdir.resolve()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT)


def test_child_cannot_read_other_processes_environments(tmp_path: Path) -> None:
    if not isolation().processes:
        pytest.skip("this OS does not allow a new PID namespace (unshare --pid)")
    secret = f"secret-{os.urandom(8).hex()}"
    # A process of the same user holding a secret in its environment, like the worker itself.
    holder = subprocess.Popen(["sleep", "60"], env={"PATHGATE_SECRET_TOKEN": secret})
    try:
        environ = Path(f"/proc/{holder.pid}/environ")
        assert wait_until(lambda: secret in environ.read_text())  # readable from here
        workdir = tmp_path / "work"
        outcome = run(hostile("snoops_processes_forward"), workdir)
    finally:
        holder.kill()
        holder.wait()
    assert isinstance(outcome, Finished), outcome
    seen = json.loads((workdir / hostile_paths.PROCESSES_FILE).read_text())
    assert not [env for env in seen["environments"] if secret in env]
    # the child's own namespace: itself and what it started
    assert len(seen["visible"]) <= 3, seen["visible"]


def what_the_child_reads(workdir: Path, targets: list[Path]) -> dict[str, str]:
    """Run reads_service_files_forward on these paths: {path: the text it read, or the error}."""
    workdir.mkdir()
    (workdir / hostile_paths.TARGETS_FILE).write_text(json.dumps([str(p) for p in targets]))
    outcome = run(hostile("reads_service_files_forward"), workdir)
    assert isinstance(outcome, Finished), outcome
    seen: dict[str, str] = json.loads((workdir / hostile_paths.SEEN_FILES_FILE).read_text())
    return seen


def test_child_cannot_read_or_uncover_the_services_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's SQLite database and its .env: a submission that read them would see every
    token hash and secret, and could write itself a maintainer's token."""
    if not isolation().processes:
        pytest.skip("this OS does not allow a mount namespace of the child's own (unshare)")
    service = tmp_path / "service"
    service.mkdir()
    secret = f"secret-{os.urandom(8).hex()}"
    database, dotenv = service / "pathgate.db", service / ".env"
    database.write_text(f"database holding {secret}")
    dotenv.write_text(f"PATHGATE_GITHUB_TOKEN={secret}")
    monkeypatch.chdir(service)  # where `pathgate serve` keeps the embedded defaults
    use_database(monkeypatch, "sqlite:///pathgate.db")
    assert [str(p) for p in service_files(get_settings())] == [str(dotenv), str(database)]
    seen = what_the_child_reads(tmp_path / "work", [database, dotenv])
    assert set(seen) == {str(database), str(dotenv)}
    assert not [text for text in seen.values() if secret in text], seen
    assert database.read_text() == f"database holding {secret}"  # the worker's view is intact


def test_child_writes_only_its_own_folder(tmp_path: Path) -> None:
    """A submission that could write outside its scratch folder could plant files in another
    job's workspace (2026-12-05 review: git hooks the worker then ran) or change the worker's
    own harness for every later submission. Only its workdir and /dev/shm are writable."""
    if not isolation().processes:
        pytest.skip("this OS does not allow a mount namespace of the child's own (unshare)")
    workdir = tmp_path / "work"
    workdir.mkdir()
    sibling = tmp_path / "job-2-attempt-1" / "src"
    sibling.mkdir(parents=True)
    shm = Path("/dev/shm") / f"pathgate-test-{os.urandom(4).hex()}"
    targets = {
        "sibling": sibling / "planted.py",
        "harness": REPO_ROOT / "harness" / f"planted_{os.urandom(4).hex()}.py",
        "own": workdir.resolve() / "own.txt",
        "shm": shm,
    }
    (workdir / hostile_paths.TARGETS_FILE).write_text(
        json.dumps([str(p) for p in targets.values()])
    )
    try:
        outcome = run(hostile("writes_outside_forward"), workdir)
        assert isinstance(outcome, Finished), outcome
        written = json.loads((workdir / hostile_paths.WRITES_FILE).read_text())
        assert written[str(targets["own"])] == "written", written
        assert written[str(targets["shm"])] == "written", written
        assert not shm.exists()  # the run's /dev/shm is its own, gone with it
        for name in ("sibling", "harness"):
            assert "Read-only file system" in written[str(targets[name])], written
            assert not targets[name].exists()
        assert "read-only but its workdir" in outcome.log_tail, outcome.log_tail
    finally:
        targets["harness"].unlink(missing_ok=True)
        shm.unlink(missing_ok=True)


def test_the_checkout_in_the_workdir_stays_as_fetched(tmp_path: Path) -> None:
    """The judges' files are compared with the worker's tree after the run: submitted code must
    not be able to rewrite its own checkout to match them meanwhile."""
    if not isolation().processes:
        pytest.skip("this OS does not allow a mount namespace of the child's own (unshare)")
    workdir = tmp_path / "work"
    checkout = workdir / "src"
    checkout.mkdir(parents=True)
    (checkout / "contrib_paths.py").write_text(CONTRIB_MODULE)
    targets = [checkout / "contrib_paths.py", workdir.resolve() / "own.txt"]
    (workdir / hostile_paths.TARGETS_FILE).write_text(json.dumps([str(p) for p in targets]))
    outcome = run(hostile("writes_outside_forward"), workdir, source_dir=checkout)
    assert isinstance(outcome, Finished), outcome
    written = json.loads((workdir / hostile_paths.WRITES_FILE).read_text())
    assert "Read-only file system" in written[str(targets[0])], written
    assert written[str(targets[1])] == "written", written
    assert (checkout / "contrib_paths.py").read_text() == CONTRIB_MODULE


def test_child_cannot_read_the_workers_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's ssh keys and git credentials (an ssh fetch uses them) sit in its home,
    readable by its user; the child sees none of it: the whole home is covered where the run
    needs nothing in it (as here), else the credential files and folders."""
    if not isolation().processes:
        pytest.skip("this OS does not allow a mount namespace of the child's own (unshare)")
    home = tmp_path / "worker-home"
    secret = f"secret-{os.urandom(8).hex()}"
    key, credentials = home / ".ssh" / "id_ed25519", home / ".git-credentials"
    key.parent.mkdir(parents=True)
    key.write_text(secret)
    credentials.write_text(f"https://user:{secret}@github.com")
    monkeypatch.setenv("HOME", str(home))
    seen = what_the_child_reads(tmp_path / "work", [key, credentials])
    assert not [text for text in seen.values() if secret in text], seen
    assert key.read_text() == secret  # the worker's view is intact


def test_a_child_that_cannot_be_confined_runs_no_submitted_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fail closed: a confinement step that does not take (here a credential path that is
    neither file nor folder, so nothing can cover it) ends the run with the reason before any
    submitted code is imported."""
    if not isolation().processes:
        pytest.skip("this OS does not allow a mount namespace of the child's own (unshare)")
    fifo = tmp_path / "credential-fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr("workers.runner.home_paths", lambda workdir, source: [fifo])
    workdir = tmp_path / "work"
    outcome = run(hostile("writes_outside_forward"), workdir)
    assert isinstance(outcome, ChildCrashed), outcome
    assert "could not confine the evaluation: 0 of 1 service files" in outcome.error
    assert not (workdir / hostile_paths.WRITES_FILE).exists()  # the candidate never ran


def test_child_runs_under_resource_limits(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    outcome = run(hostile("dumps_environment_forward"), workdir)
    assert isinstance(outcome, Finished), outcome
    limits = json.loads((workdir / hostile_paths.LIMITS_FILE).read_text())
    # soft == hard everywhere: the candidate cannot raise them again
    assert limits["RLIMIT_CORE"] == [0, 0]
    assert limits["RLIMIT_FSIZE"] == [min(4 * GIB, parent_hard("RLIMIT_FSIZE"))] * 2
    assert limits["RLIMIT_NOFILE"] == [min(4096, parent_hard("RLIMIT_NOFILE"))] * 2
    assert limits["RLIMIT_NPROC"] == [min(4096, parent_hard("RLIMIT_NPROC"))] * 2


def test_only_a_line_signed_with_the_run_key_is_accepted() -> None:
    key, other_key = b"k" * 32, b"o" * 32
    evidence = forged_evidence_json()

    def line(kind: str, payload: str, signing_key: bytes) -> bytes:
        mac = message_mac(signing_key, kind, payload)
        return b"\n" + json.dumps({kind: payload, "mac": mac}).encode() + b"\n"

    garbage = b"\x00garbage{" + line("evidence", evidence, other_key)
    assert authenticated_message(garbage + line("evidence", evidence, key), key) == (
        "evidence",
        evidence,
    )
    assert authenticated_message(garbage, key) is None
    # an error text signed by the child cannot be replayed as evidence
    error_mac = message_mac(key, "error", evidence)
    replayed = json.dumps({"evidence": evidence, "mac": error_mac}).encode()
    assert authenticated_message(replayed, key) is None


def test_checkout_imports_its_own_module_but_cannot_shadow_the_harness(tmp_path: Path) -> None:
    checkout = tmp_path / "src"
    (checkout / "harness").mkdir(parents=True)
    (checkout / "harness" / "__init__.py").write_text(SHADOW_MODULE)
    (checkout / "contrib_paths.py").write_text(CONTRIB_MODULE)
    outcome = run(
        "contrib_paths:forward",
        tmp_path / "work",
        supports="contrib_paths:supports",
        source_dir=checkout,
    )
    assert isinstance(outcome, Finished), outcome
    assert outcome.evidence.verdict == "PASS", outcome.evidence.verdict_reasons


def copy_of_the_rmsnorm_package(checkout: Path) -> Path:
    """The checkout holds its own copy of kernels/fused_add_rmsnorm, as a pull request that
    touches that package does."""
    package = checkout / "kernels" / "fused_add_rmsnorm"
    package.mkdir(parents=True)
    (checkout / "kernels" / "__init__.py").write_bytes(
        (REPO_ROOT / "kernels/__init__.py").read_bytes()
    )
    for source in (REPO_ROOT / "kernels" / "fused_add_rmsnorm").glob("*.py"):
        (package / source.name).write_bytes(source.read_bytes())
    (checkout / "contrib_paths.py").write_text(CONTRIB_MODULE)
    return package


def test_a_submissions_own_stock_path_goes_to_a_reviewer(tmp_path: Path) -> None:
    """The baseline and problem define what right and fast mean: a checkout whose copy of the
    stock path differs from the worker's (here a slower one) gets NEEDS_REVIEW naming the
    file; byte-identical copies pass."""
    same = tmp_path / "same"
    copy_of_the_rmsnorm_package(same)
    outcome = run("contrib_paths:forward", tmp_path / "w1", "contrib_paths:supports", same)
    assert isinstance(outcome, Finished), outcome
    assert outcome.evidence.verdict == "PASS", outcome.evidence.verdict_reasons

    changed = tmp_path / "changed"
    stock = copy_of_the_rmsnorm_package(changed) / "stock.py"
    stock.write_text(
        stock.read_text() + "\nimport time\n_real = forward\n\n\n"
        "def forward(weights, inputs, out):\n    time.sleep(0.001)\n"
        "    _real(weights, inputs, out)\n\n\ndel __file__  # where it came from, hidden\n"
    )
    outcome = run("contrib_paths:forward", tmp_path / "w2", "contrib_paths:supports", changed)
    assert isinstance(outcome, Finished), outcome
    assert outcome.evidence.verdict == "NEEDS_REVIEW", outcome.evidence.verdict_reasons
    (reason,) = outcome.evidence.verdict_reasons
    assert "kernels/fused_add_rmsnorm/stock.py" in reason and "changes" in reason, reason


def test_child_has_no_network(tmp_path: Path) -> None:
    if not isolation().network:
        pytest.skip("this OS does not allow a new network namespace (unshare)")
    workdir = tmp_path / "work"
    outcome = run(hostile("connects_forward"), workdir)
    assert isinstance(outcome, Finished), outcome
    # PostgreSQL listens on 127.0.0.1:5432 on this machine; from the child it is unreachable,
    # while the child's own loopback works (the ranks of a multi-GPU case meet there)
    result = json.loads((workdir / hostile_paths.NETWORK_FILE).read_text())
    assert result["postgres"].startswith("refused:"), result
    assert result["own"] == "connected", result


def test_a_context_parallel_scope_runs_on_ranks_inside_the_child(tmp_path: Path) -> None:
    """The whole engine on a 2-GPU scope with CP 1 and 2, in the sandboxed child as a worker runs
    it: the ranks are processes of the child that meet over its own loopback."""
    from tests.evaluation.test_ranks import _manifest

    # the candidate is the baseline itself: out of scope its dispatch must give the stock result
    data = _manifest("kernels.mla_moe_decode.stock:forward_compiled").model_dump(mode="json")
    data["workload"]["context_parallel"] = [1, 2]
    data["path"]["supports"] = "tests.evaluation.rank_paths:in_the_cp_test_scope"
    request = RunRequest(
        manifest_yaml=yaml.safe_dump(data),
        source_dir=REPO_ROOT,
        device="cpu",
        quick=True,
        seed=SEED,
        gpus=2,
        timeout_s=600.0,
        workdir=tmp_path / "work",
    )
    outcome = run_in_child(request)
    assert isinstance(outcome, Finished), outcome
    evidence = outcome.evidence
    assert evidence.verdict in ("PASS", "INCONCLUSIVE"), evidence.verdict_reasons
    assert {(c.gpus, c.cp) for c in evidence.cases} == {(2, 1), (2, 2)}
    assert all(c.status == "passed" for c in evidence.cases), [c.reasons for c in evidence.cases]
    assert "--gpus 2" in evidence.run.command
    # the issue-9 table, as benchmarks/cp_table.py prints it from such evidence
    from benchmarks.cp_table import markdown, rows

    table = rows(evidence)
    assert [(r["cp"], r["correctness"]) for r in table] == [(1, "passed"), (2, "passed")]
    assert table[0]["speedup_vs_cp1"] == 1.0 and table[1]["speedup_vs_cp1"] > 0
    assert "| 2 | 3 | 45 | 2 | " in markdown(table, evidence)
