"""The evaluation child: `python -m workers.child`, started by workers.runner.run_in_child.

It reads its request from stdin before anything else is imported, limits its own resources, runs
one evaluation and sends the evidence (or the error) over a private pipe, authenticated with an
HMAC under a key only the parent and this process know. Stdout and stderr go to a log file, so
whatever a candidate prints there can never be taken for a result.

Only the standard library is imported at module level: the runner imports `message_mac` from
here, and the child must not import the harness (or anything submitted) before its limits are set.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import resource
import signal
import socket
import struct
import sys
import traceback
from pathlib import Path
from typing import Any

ERROR_SUMMARY_CHARS = 1000
ERROR_TAIL_CHARS = 4000
CORE_LIMIT = 0
FILE_SIZE_LIMIT = 4 * 1024**3
OPEN_FILES_LIMIT = 4096
# Dropped from sys.modules before the path's modules import, so a checkout's own `kernels`
# package is the one its entry points get (the harness itself may have imported the in-tree one).
SHADOWABLE_PACKAGES = ("kernels",)
PROCESS_LIMIT = 4096  # a fork bomb stops here (per user; root in the worker's namespace is exempt)
SHM = "/dev/shm"  # the run's own tmpfs, writable: NCCL's and torch's shared memory lives there
SHM_OPTIONS = b"size=25%,mode=1777"
# stays writable: the run's own /proc (its PID namespace's); the CUDA driver's cuInit fails
# (CUDA_ERROR_OPERATING_SYSTEM) on a read-only one (measured on an H100, 2026-12-05)
PROC = "/proc"
# Linux's mount(2), unshare(2) and mount_setattr(2) constants (x86-64 and arm64 alike)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC = 0x1, 0x2, 0x4, 0x8, 0x1000, 0x4000
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1


def message_mac(key: bytes, kind: str, payload: str) -> str:
    """HMAC-SHA256 of one result message. The kind ("evidence" or "error") is part of what is
    signed, so an authenticated error text can never be replayed as evidence."""
    data = kind.encode() + b"\n" + payload.encode()
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def main() -> int:
    try:
        envelope = json.loads(sys.stdin.buffer.read())
        result_fd, key = int(envelope["result_fd"]), bytes.fromhex(envelope["key"])
        request: dict[str, Any] = envelope["request"]
    except Exception as exc:  # no key, so nothing can be sent; the runner sees no result
        print(f"workers.child: unreadable request on stdin: {exc!r}", file=sys.stderr)
        return 2
    die_with_parent(int(envelope.get("parent_pid", 0)))
    loopback_up()  # before confine_files: in the user namespace it enters, lo is not ours to set
    confined, complete = confine_files(
        envelope.get("hidden", []),
        envelope.get("writable", []),
        envelope.get("read_only", []),
        envelope.get("worker_mount_namespace", ""),
    )
    required = bool(envelope.get("require_confinement", False))
    del envelope
    # pass_fds made the result pipe inheritable; programs a candidate starts must not get it.
    os.set_inheritable(result_fd, False)
    limit_resources()
    print(f"workers.child: {confined}")
    if required and not complete:  # fail closed: no submitted code runs half-confined
        send(result_fd, key, "error", f"the worker could not confine the evaluation: {confined}")
        return 1
    try:
        evidence_json = evaluate_request(request)
    except BaseException as exc:  # SystemExit from a candidate too: report it, then exit 1
        # The traceback goes to the log (the job's log tail); the job's reason, which the
        # report and the pull request's status show, gets the one-line summary.
        print(f"workers.child: the evaluation raised\n{describe(exc)}", file=sys.stderr)
        send(result_fd, key, "error", summary(exc))
        return 1
    send(result_fd, key, "evidence", evidence_json)
    return 0


def die_with_parent(parent_pid: int) -> None:
    """If the worker process that launched us dies (a candidate may kill it), we die too, rather
    than run on as an orphan that nobody reads or kills."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    # As the first process of a new PID namespace our parent is unshare (getppid() says 0),
    # which dies with the worker; otherwise the worker itself must still be our parent.
    in_own_namespace = os.getpid() == 1
    if parent_pid and not in_own_namespace and os.getppid() != parent_pid:
        os._exit(3)  # the worker died before prctl took effect


def confine_files(
    hidden: list[str], writable: list[str], read_only: list[str], worker_namespace: str
) -> tuple[str, bool]:
    """In a mount namespace of our own (the runner's `unshare --mount-proc`): cover the worker's
    service files and credentials (`hidden`: /dev/null over a file, an empty read-only tmpfs over
    a folder), give the run a private /dev/shm, make the whole file system read-only but the
    run's own folders (`writable`: its workdir, less `read_only` inside it: its checkout), that
    /dev/shm and its own /proc, then enter a user and mount namespace of our own, in which all
    of it is locked: submitted code can neither uncover the files nor make anything writable
    again. So it cannot plant files in another job's workspace or for a later job, change the
    worker's harness or its own checkout, or read the worker's keys. In the worker's own
    namespace none of this may happen (it would cover the files for the whole host). Returns
    what was done, for the log, and whether all of it was."""
    if sys.platform != "linux" or not worker_namespace:
        return "no mount namespace of its own; the file system is as the worker sees it", False
    try:
        if os.readlink("/proc/self/ns/mnt") == worker_namespace:
            return "no mount namespace of its own; the file system is as the worker sees it", False
    except OSError:
        return "no mount namespace of its own; the file system is as the worker sees it", False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    failed = [path for path in hidden if not _cover(libc, path)]
    shm = _private_shm(libc)
    own = [path for path in (SHM, PROC) if os.path.isdir(path)]
    done_read_only = shm and _read_only_except(libc, [*writable, *own], read_only)
    # A mount made in this namespace could be undone by whoever holds CAP_SYS_ADMIN here (a
    # mapped root); in a namespace owned by a new user namespace, inherited mounts are locked.
    locked = libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) == 0
    done = f"{len(hidden) - len(failed)} of {len(hidden)} service files and credentials hidden"
    done += "; read-only but its workdir" if done_read_only else "; the file system stays writable"
    done += "" if shm else "; no private /dev/shm"
    done += "" if locked else " (not locked: no user namespace)"
    return done, not failed and done_read_only and locked


def _private_shm(libc: Any) -> bool:
    """A fresh tmpfs on /dev/shm, the run's own: nothing of a job before it, nothing left for
    one after it (NCCL and torch keep shared-memory segments there)."""
    if not os.path.isdir(SHM):
        return True  # no /dev/shm, nothing to share
    flags = MS_NOSUID | MS_NODEV
    return bool(libc.mount(b"tmpfs", SHM.encode(), b"tmpfs", flags, SHM_OPTIONS) == 0)


def _cover(libc: Any, path: str) -> bool:
    if not os.path.exists(path):
        return True  # nothing there to read
    if os.path.isdir(path):
        options = b"size=4k,mode=000"
        flags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
        return bool(libc.mount(b"tmpfs", path.encode(), b"tmpfs", flags, options) == 0)
    return (
        os.path.isfile(path) and libc.mount(b"/dev/null", path.encode(), None, MS_BIND, None) == 0
    )


def _read_only_except(libc: Any, writable: list[str], inside_read_only: list[str]) -> bool:
    """Every mount read-only (mount_setattr, Linux 5.12+), then each writable folder made
    writable again, and the folders inside them that must not be read-only once more: each
    bound onto itself first, a mount of its own, so the setting covers only that subtree."""
    for path in [*writable, *inside_read_only]:
        if libc.mount(path.encode(), path.encode(), None, MS_BIND | MS_REC, None) != 0:
            return False
    if not _set_read_only(libc, "/", True, recursive=True):
        return False
    if not all(_set_read_only(libc, path, False, recursive=True) for path in writable):
        return False
    return all(_set_read_only(libc, path, True, recursive=True) for path in inside_read_only)


def _set_read_only(libc: Any, path: str, read_only: bool, recursive: bool) -> bool:
    import ctypes

    # struct mount_attr {u64 attr_set, attr_clr, propagation, userns_fd}
    attr = struct.pack(
        "QQQQ", *((MOUNT_ATTR_RDONLY, 0) if read_only else (0, MOUNT_ATTR_RDONLY)), 0, 0
    )
    flags = AT_RECURSIVE if recursive else 0
    result = libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        ctypes.c_char_p(path.encode()),
        ctypes.c_uint(flags),
        ctypes.c_char_p(attr),
        ctypes.c_size_t(len(attr)),
    )
    return bool(result == 0)


def loopback_up() -> None:
    """Bring up the loopback interface, which a new network namespace starts with down: the
    ranks of a multi-GPU case meet over 127.0.0.1 (gloo's and NCCL's bootstrap). Nothing outside
    the namespace becomes reachable. Best effort: where it fails, lo is already up (no namespace)
    or a multi-rank case fails with its connection error."""
    get_flags, set_flags, up = 0x8913, 0x8914, 0x1  # SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, get_flags, request))[1]
        if not flags & up:
            fcntl.ioctl(sock, set_flags, struct.pack("16sh", b"lo", flags | up))


def limit_resources() -> None:
    """No core dumps, no file over 4 GiB, at most 4096 open files and 4096 processes; soft and
    hard, so submitted code cannot raise them again. No memory limit: CUDA maps huge virtual
    ranges (a cgroup would be the way; not built)."""
    _limit(resource.RLIMIT_CORE, CORE_LIMIT)
    _limit(resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT)
    _limit(resource.RLIMIT_NOFILE, OPEN_FILES_LIMIT)
    _limit(resource.RLIMIT_NPROC, PROCESS_LIMIT)


def _limit(which: int, value: int) -> None:
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)  # an unprivileged process can only lower a hard limit
    resource.setrlimit(which, (value, value))


def evaluate_request(request: dict[str, Any]) -> str:
    """Run the engine on the request and return the evidence as JSON text."""
    # The harness, the manifest model and their dependencies import before the source folder
    # joins sys.path, so a checkout cannot shadow them with modules of the same name.
    from harness.evaluation.engine import EngineOptions, evaluate
    from harness.evaluation.environment import REPO_ROOT
    from scopes.manifest import load_manifest

    manifest = load_manifest(request["manifest_yaml"])
    source_dir = Path(request["source_dir"]).resolve()
    prefer_source_dir(source_dir)
    options = EngineOptions(
        device=request["device"],
        quick=bool(request["quick"]),
        seed=request["seed"],
        gpus=request.get("gpus"),
        scope_path=request.get("scope_path", ""),
        submitted_source=None if source_dir == REPO_ROOT else source_dir,
    )
    return evaluate(manifest, options).model_dump_json()


def prefer_source_dir(source_dir: Path) -> None:
    """Put the submitted source first on sys.path and forget already-imported `kernels` modules,
    so the entry points import from the submission rather than from the installed tree."""
    sys.path.insert(0, str(source_dir))
    for name in list(sys.modules):
        if any(name == p or name.startswith(p + ".") for p in SHADOWABLE_PACKAGES):
            del sys.modules[name]


def summary(exc: BaseException) -> str:
    """One line (a manifest error lists its problems over several), bounded: a candidate
    chooses the message and could make it huge."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {'; '.join(lines)}"[:ERROR_SUMMARY_CHARS]


def describe(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(exc))
    return f"{summary(exc)}\n{text[-ERROR_TAIL_CHARS:]}"


def send(fd: int, key: bytes, kind: str, payload: str) -> None:
    """Write one authenticated message. The leading newline starts a fresh line even if a
    candidate wrote a partial line of garbage into the pipe first."""
    message = {kind: payload, "mac": message_mac(key, kind, payload)}
    data = b"\n" + json.dumps(message).encode() + b"\n"
    while data:
        data = data[os.write(fd, data) :]


def _exit(code: int) -> None:
    """Flush the log and leave at once: atexit handlers and non-daemon threads a candidate left
    behind must neither hang the exit nor change the exit code."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    # Line-buffered, so the log tail survives a candidate that kills the process.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    try:
        exit_code = main()
    except BaseException as exc:  # an error while sending: the runner reports no result
        print(f"workers.child: {describe(exc)}", file=sys.stderr)
        exit_code = 1
    _exit(exit_code)
