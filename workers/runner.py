"""Run one evaluation in a child process that a candidate cannot use against the worker.

The child (`python -m workers.child`) gets its own process group, a scratch folder as HOME,
TMPDIR and cwd, an allow-listed environment (no PATHGATE_* settings, no tokens, no database or
broker URL), where the OS allows it new network and PID namespaces (no connection out, no view
of other processes or their environments) and a mount namespace in which the file system is
read-only except its scratch folder, and the worker's service files and credentials are covered;
and a wall-clock limit, after which its whole process group is killed. Its stdout and stderr
only go to a log file; the result travels over a private pipe and is accepted only with a valid
HMAC under a fresh per-run key, so a forged verdict printed or written by a candidate is never
taken for the evidence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hmac
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pydantic import ValidationError

import harness
from harness.config import Settings, get_settings
from harness.evaluation.evidence import Evidence
from workers.child import message_mac

LOG_NAME = "child.log"
LOG_TAIL_BYTES = 8 * 1024
LOG_KEEP_BYTES = 8 * 1024 * 1024  # of a run's log, kept in its workspace after the run
MAX_RESULT_BYTES = 64 * 1024 * 1024  # evidence of a long GPU run is a few MB
POLL_S = 0.1
CHUNK_BYTES = 64 * 1024
KEY_BYTES = 32
PASSED_THROUGH = (
    "PATH",
    "LANG",
    "LC_ALL",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "LD_LIBRARY_PATH",
)


@dataclass(frozen=True)
class RunRequest:
    manifest_yaml: str  # the manifest text as submitted
    source_dir: Path  # the entry points import from here (repo root in-tree, else a checkout)
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    quick: bool = False
    seed: int | None = None
    gpus: int | None = None  # run only the cases of this GPU count; None: every count
    timeout_s: float = 1800.0  # wall clock for the whole child
    workdir: Path | None = None  # the child's scratch (HOME, TMPDIR, Triton cache); temp if None
    # what the evidence's reproduce command calls the manifest (the service: the file
    # GET /v1/submissions/{id}/manifest.yaml downloads)
    scope_path: str = ""


@dataclass(frozen=True)
class Finished:
    evidence: Evidence
    log_tail: str


@dataclass(frozen=True)
class ChildCrashed:
    error: str
    exit_code: int | None
    log_tail: str


@dataclass(frozen=True)
class ChildTimedOut:
    after_s: float
    log_tail: str


RunOutcome = Finished | ChildCrashed | ChildTimedOut


def run_in_child(request: RunRequest) -> RunOutcome:
    """Evaluate the request's manifest in a child process; never raises for what the child does."""
    if request.workdir is not None:
        return _run(request, request.workdir.resolve())
    with tempfile.TemporaryDirectory(prefix="pathgate-run-") as scratch:
        return _run(request, Path(scratch).resolve())


@dataclass(frozen=True)
class Isolation:
    """How the child is started: a command prefix and what it keeps from the child."""

    prefix: tuple[str, ...]
    network: bool  # new, empty network and IPC namespaces: every connect fails, no shared SysV IPC
    processes: bool  # a new PID namespace with its own /proc: no other process is visible


# The PID namespace hides the worker's /proc/<pid>/environ (readable by any process of the same
# user), where its secrets live. --kill-child and the parent-death signal tie the namespace's
# life to the worker: if the worker dies, unshare dies, its child and every process under it too.
_NEW_PID_NAMESPACE = ("--pid", "--fork", "--mount-proc", "--kill-child")
_DIE_WITH_WORKER = ("setpriv", "--pdeathsig", "KILL", "--")


@functools.cache
def isolation() -> Isolation:
    """The strongest isolation this OS allows the worker's user, probed once."""
    if shutil.which("unshare") is None:
        return Isolation((), network=False, processes=False)
    guard = _DIE_WITH_WORKER if shutil.which("setpriv") else ()
    for user in ((), ("--user", "--map-root-user")):
        for processes in (True, False):
            extra = _NEW_PID_NAMESPACE if processes else ()
            prefix = (*guard, "unshare", *user, "--net", "--ipc", *extra, "--")
            probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
            if probe.returncode == 0:
                return Isolation(prefix, network=True, processes=processes)
    return Isolation((), network=False, processes=False)


# What the confinement probe runs in a child: confine_files on an empty scratch folder.
_PROBE = (
    "import json, sys\n"
    "from workers.child import confine_files\n"
    "print(json.dumps(confine_files([], [sys.argv[1]], [], sys.argv[2])))\n"
)


@functools.cache
def confinement_problem() -> str | None:
    """Why a child cannot be confined here (None: it can), probed once by confining an empty
    run as a real child would be: unshare alone says nothing of mount_setattr (Linux 5.12+) or
    of a nested user namespace to lock the mounts."""
    if not isolation().processes:
        return "no mount namespace of its own (unshare --mount-proc)"
    with tempfile.TemporaryDirectory(prefix="pathgate-probe-") as scratch:
        workdir = Path(scratch).resolve()
        command = [*isolation().prefix, sys.executable, "-P", "-c", _PROBE]
        try:
            probe = subprocess.run(
                [*command, str(workdir), _mount_namespace()],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=workdir,
                env=child_environment(workdir),
            )
        except subprocess.TimeoutExpired:
            return "the confinement probe did not finish in 60 s"
    try:
        done, complete = json.loads(probe.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return f"the confinement probe gave no answer: {probe.stderr.strip()[-300:]}"
    return None if complete else str(done)


def service_files(settings: Settings) -> list[Path]:
    """The worker's files that a child must not read or write: the SQLite database and broker
    (with their journals), the .env file, the GitHub App key. The child hides them in its own
    mount namespace (workers.child.confine_files); they exist only on the embedded defaults or
    where a deployment keeps them beside the worker."""
    found = [Path(".env")]
    for url in (settings.database_url, settings.broker_url):
        database = _sqlite_file(url)
        if database is not None:
            found += [Path(f"{database}{suffix}") for suffix in ("", "-wal", "-shm", "-journal")]
    if settings.github_private_key_path is not None:
        found.append(settings.github_private_key_path)
    return [path.resolve() for path in found if path.is_file()]


# What a worker's user may keep in its home that a submission must not read: keys and tokens
# for ssh, git hosts, clouds, registries and databases.
CREDENTIALS = (
    ".ssh",
    ".gnupg",
    ".aws",
    ".azure",
    ".kube",
    ".docker",
    ".config/gh",
    ".config/gcloud",
    ".git-credentials",
    ".netrc",
    ".pypirc",
    ".pgpass",
)


def home_paths(workdir: Path, source_dir: Path) -> list[Path]:
    """What the child covers of the worker's home: all of it where nothing the run needs lies
    inside (the harness, the interpreter and its base, PYTHONPATH, the workdir, the source),
    else the credentials in it."""
    home = Path.home().resolve()
    needed = [Path(harness.__file__).resolve().parents[1], workdir, source_dir]
    needed += [Path(sys.prefix), Path(sys.base_prefix)]
    needed += [Path(p) for p in sys.path if p]  # PYTHONPATH and .pth (editable) entries too
    needed += [Path(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    inside = any(path.resolve().is_relative_to(home) for path in needed)
    if home != Path("/") and home.is_dir() and not inside:
        return [home]
    return credential_paths()


def credential_paths() -> list[Path]:
    """The credential files and folders of CREDENTIALS in the worker's home, where they exist.
    The child covers them (a folder with an empty read-only tmpfs)."""
    home = Path.home()
    return [(home / name).resolve() for name in CREDENTIALS if (home / name).exists()]


def _sqlite_file(url: str) -> str | None:
    for prefix in ("sqlite:///", "sqla+sqlite:///"):
        if url.startswith(prefix):
            return url[len(prefix) :].split("?", 1)[0] or None
    return None


def _mount_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/mnt")
    except OSError:
        return ""


def child_environment(workdir: Path) -> dict[str, str]:
    """The child's whole environment: an allow-list, never a copy of the worker's."""
    env = {name: os.environ[name] for name in PASSED_THROUGH if name in os.environ}
    env.setdefault("PATH", os.defpath)
    env["HOME"] = str(workdir)
    env["TMPDIR"] = str(workdir / "tmp")
    env["TRITON_CACHE_DIR"] = str(workdir / "triton-cache")
    # Compiled modules are read from and written to here only: a .pyc committed in a checkout's
    # __pycache__ (which Python would run instead of a byte-identical .py) is never used.
    env["PYTHONPYCACHEPREFIX"] = str(workdir / "pycache")
    # The installed harness's folder first, so the child imports exactly the worker's harness;
    # then the worker's PYTHONPATH (configuration, not a secret), where a worker's packages may
    # live when they are not installed in the interpreter.
    paths = [str(Path(harness.__file__).resolve().parents[1])]
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _run(request: RunRequest, workdir: Path) -> RunOutcome:
    for folder in (workdir, workdir / "tmp", workdir / "triton-cache"):
        folder.mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(KEY_BYTES)
    # The worker draws the secret run seed, so it can tell evidence of this run from any other.
    if request.seed is None:
        request = dataclasses.replace(request, seed=secrets.randbits(63))
    started = time.monotonic()
    # The parent keeps its own handle on the log: the child may replace the file at that path
    # (it is in its HOME), but the tail is read from the file the child was given.
    with open(workdir / LOG_NAME, "w+b") as log:
        read_fd, write_fd = os.pipe()
        try:
            process = _spawn(workdir, log, write_fd)
            try:
                _send_request(process, request, write_fd, key, workdir)
                raw, timed_out = _collect(process, read_fd, started + request.timeout_s)
            finally:
                _kill_group(process)
        finally:
            os.close(read_fd)
        tail = _log_tail(log)
        _keep_log(log, workdir / LOG_NAME)
    if timed_out:
        return ChildTimedOut(round(time.monotonic() - started, 1), tail)
    return _outcome(raw, key, process.returncode, tail, request.seed)


def _spawn(workdir: Path, log: IO[bytes], write_fd: int) -> subprocess.Popen[bytes]:
    try:
        # -P: the cwd (the child's scratch, writable by the candidate) is not put on sys.path.
        return subprocess.Popen(
            [*isolation().prefix, sys.executable, "-P", "-m", "workers.child"],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=child_environment(workdir),
            pass_fds=(write_fd,),
            start_new_session=True,
        )
    finally:
        # Only the child may hold the write end: EOF then means the child side is done.
        os.close(write_fd)


def _send_request(
    process: subprocess.Popen[bytes], request: RunRequest, result_fd: int, key: bytes, workdir: Path
) -> None:
    envelope = {
        "result_fd": result_fd,
        "key": key.hex(),
        "parent_pid": os.getpid(),
        "hidden": [
            str(p)
            for p in [*service_files(get_settings()), *home_paths(workdir, request.source_dir)]
        ],
        "writable": [str(workdir)],
        # a checkout in the workdir stays as fetched: the judges' files are compared with the
        # worker's tree after the run, so submitted code must not rewrite them meanwhile
        "read_only": [str(request.source_dir)]
        if request.source_dir.is_relative_to(workdir)
        else [],
        # no submitted code runs half-confined, unless the operator said every submitter is trusted
        "require_confinement": isolation().processes and not get_settings().allow_unisolated,
        "worker_mount_namespace": _mount_namespace(),
        "request": _request_json(request),
    }
    assert process.stdin is not None
    try:
        process.stdin.write(json.dumps(envelope).encode() + b"\n")
        process.stdin.close()
    except BrokenPipeError:
        pass  # the child died before reading its request; its exit status says how


def _request_json(request: RunRequest) -> dict[str, Any]:
    return {
        "manifest_yaml": request.manifest_yaml,
        "source_dir": str(request.source_dir.resolve()),
        "device": request.device,
        "quick": request.quick,
        "seed": request.seed,
        "gpus": request.gpus,
        "scope_path": request.scope_path,
    }


def _collect(process: subprocess.Popen[bytes], read_fd: int, deadline: float) -> tuple[bytes, bool]:
    """Read the result pipe until the child exits; (bytes read, whether the deadline passed).

    Reading while waiting keeps a large result from blocking the child on a full pipe. The
    exit, not EOF, ends the wait: a grandchild holding the write end open must not stall us.
    """
    data = bytearray()
    with selectors.DefaultSelector() as selector:  # not select(): fds above 1023 are fine
        selector.register(read_fd, selectors.EVENT_READ)
        pipe_open = True
        while not _has_exited(process):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(data), True
            if not pipe_open:
                time.sleep(min(remaining, POLL_S))
            elif selector.select(min(remaining, POLL_S)):
                pipe_open = _read_into(read_fd, data)
                if not pipe_open:
                    selector.unregister(read_fd)
    _drain(read_fd, data)
    return bytes(data), False


def _drain(fd: int, data: bytearray) -> None:
    """Read what the child left in the pipe before it exited, without waiting for EOF, and
    boundedly: a grandchild that left the process group may still hold the write end."""
    os.set_blocking(fd, False)
    for _ in range(MAX_RESULT_BYTES // CHUNK_BYTES):
        if not _read_into(fd, data):
            return


def _read_into(fd: int, data: bytearray) -> bool:
    """Append one chunk; False at EOF or when nothing more is waiting (non-blocking)."""
    try:
        chunk = os.read(fd, CHUNK_BYTES)
    except BlockingIOError:
        return False
    data += chunk
    if len(data) > MAX_RESULT_BYTES:  # a flood: keep the end, where the real message is
        del data[: len(data) - MAX_RESULT_BYTES]
    return bool(chunk)


def _has_exited(process: subprocess.Popen[bytes]) -> bool:
    """Whether the child has exited, without reaping it: while it is an unreaped zombie its pid
    cannot be reused, so killing its process group afterwards cannot hit a stranger's group."""
    try:
        status = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return status is not None


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's whole process group (grandchildren a candidate started included),
    then reap the child. Done after every run, not only on timeout."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group may be empty
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _keep_log(log: IO[bytes], path: Path) -> None:
    """Leave at `path` a new file of the log's last LOG_KEEP_BYTES, read through the parent's
    own handle: the child may have put anything at that path meanwhile (a link, a file of its
    own of gigabytes), and a run may print gigabytes itself."""
    size = os.fstat(log.fileno()).st_size
    start = max(0, size - LOG_KEEP_BYTES)
    kept = os.pread(log.fileno(), size - start, start)
    if start:
        kept = f"[the first {start} bytes of this log were cut]\n".encode() + kept
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a link itself, never what it points to
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    with contextlib.suppress(OSError), os.fdopen(os.open(path, flags, 0o644), "wb") as fresh:
        fresh.write(kept)


def _log_tail(log: IO[bytes]) -> str:
    size = os.fstat(log.fileno()).st_size
    offset = max(0, size - LOG_TAIL_BYTES)
    return os.pread(log.fileno(), size - offset, offset).decode("utf-8", errors="replace")


def _outcome(
    raw: bytes, key: bytes, exit_code: int | None, tail: str, seed: int | None
) -> RunOutcome:
    message = authenticated_message(raw, key)
    if message is None:
        error = f"no authenticated result from the child (exit code {exit_code})"
        return ChildCrashed(error, exit_code, tail)
    kind, payload = message
    if kind == "error":
        return ChildCrashed(payload, exit_code, tail)
    if exit_code != 0:
        error = f"the child exited with code {exit_code} after sending its evidence"
        return ChildCrashed(error, exit_code, tail)
    try:
        evidence = Evidence.model_validate_json(payload)
    except ValidationError as exc:
        return ChildCrashed(f"the evidence sent is not valid: {exc}", exit_code, tail)
    if evidence.run.seed != seed:
        error = f"the evidence is of another run (seed {evidence.run.seed}, this run's {seed})"
        return ChildCrashed(error, exit_code, tail)
    return Finished(evidence, tail)


def authenticated_message(raw: bytes, key: bytes) -> tuple[str, str] | None:
    """The last line of the result pipe that is a message with a valid MAC, as (kind, payload).

    Earlier lines may be garbage a candidate wrote into the pipe; without the key it cannot
    make a line that verifies.
    """
    for line in reversed(raw.split(b"\n")):
        parsed = _parse_message(line)
        if parsed is None:
            continue
        kind, payload, mac = parsed
        if hmac.compare_digest(mac.encode(), message_mac(key, kind, payload).encode()):
            return kind, payload
    return None


def _parse_message(line: bytes) -> tuple[str, str, str] | None:
    try:
        message = json.loads(line)
    except ValueError:  # also UnicodeDecodeError
        return None
    if not isinstance(message, dict) or not isinstance(message.get("mac"), str):
        return None
    kinds = [k for k in ("evidence", "error") if isinstance(message.get(k), str)]
    if len(kinds) != 1 or len(message) != 2:
        return None
    mac: str = message["mac"]
    return kinds[0], message[kinds[0]], mac
