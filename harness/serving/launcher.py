"""Start a serving engine, wait until it is healthy, and stop it without leaving anything behind.

The server runs in its own session (so its own process group: vLLM's engine and worker processes
join it), with stdout and stderr in one log file that is kept as an artifact. `launched` polls the
health endpoint; a server that exits first, or is not healthy in time, is an error carrying the
tail of its log. Teardown sends SIGTERM to the whole group, waits, then SIGKILL, and returns only
once no process of the group is left.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

LOG_TAIL_LINES = 40
POLL_INTERVAL_S = 0.25
TERM_GRACE_S = 20.0  # vLLM frees GPU memory and joins its workers on SIGTERM; give it time
KILL_WAIT_S = 10.0


class LaunchError(Exception):
    """The server did not come up; the message ends with the tail of its log."""


def free_port() -> int:
    """A port nobody listens on now (the OS picks it); the server binds it moments later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"(no log: {exc.strerror})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class RunningServer:
    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    command: list[str]

    @property
    def pgid(self) -> int:
        return self.process.pid  # start_new_session: the leader's pid is the group id

    def alive(self) -> bool:
        return self.process.poll() is None


@contextmanager
def launched(
    command: list[str],
    *,
    port: int,
    log_path: Path,
    env_overrides: Mapping[str, str] | None = None,
    health_path: str = "/health",
    startup_timeout_s: float = 900.0,
    term_grace_s: float = TERM_GRACE_S,
) -> Iterator[RunningServer]:
    """Run `command` (argv, no shell) until the block ends; yields once it answers health."""
    server = _start(command, port, log_path, env_overrides or {})
    try:
        _wait_healthy(server, health_path, startup_timeout_s)
        yield server
    finally:
        try:
            stop(server, term_grace_s)
        except KeyboardInterrupt:  # it landed before stop() deferred the next ones
            stop(server, term_grace_s)
            raise


# The engine runs contributed code: it gets the host's CUDA, driver, Python and Hugging Face
# cache settings, never the worker's secrets (tokens, database and broker URLs). A gated model
# must already be in HF_HOME; a token is not passed on.
SERVER_ENV_NAMES = (
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "TMPDIR",
    "PYTHONPATH",
    "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "CUDA_HOME",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
)
SERVER_ENV_PREFIXES = ("VLLM_",)


def server_environment() -> dict[str, str]:
    """The allow-listed part of this process's environment that a server inherits, with the
    folder of this Python first on PATH: `vllm` installed beside pathgate (`pip install
    '.[vllm]'` in its virtualenv) is found without activating the virtualenv."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name in SERVER_ENV_NAMES
        or (name.startswith(SERVER_ENV_PREFIXES) and "TOKEN" not in name and "KEY" not in name)
    }
    # last: a `python` or `vllm` of the caller's own PATH (an activated environment) wins
    env["PATH"] = os.pathsep.join([env.get("PATH", os.defpath), str(Path(sys.executable).parent)])
    return env


def _start(
    command: list[str], port: int, log_path: Path, env_overrides: Mapping[str, str]
) -> RunningServer:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**server_environment(), **env_overrides}
    with log_path.open("wb") as log:  # the child holds its own copy of the descriptor
        try:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except (OSError, ValueError) as exc:  # ValueError: a NUL the manifest should have refused
            why = _why_not(command[0], env["PATH"], exc)
            raise LaunchError(f"cannot start {command[0]!r}: {why}") from None
    return RunningServer(process, f"http://127.0.0.1:{port}", log_path, command)


def _why_not(program: str, path: str, exc: OSError | ValueError) -> str:
    # found on PATH but not started: its #! interpreter is missing (a moved virtualenv)
    if (
        isinstance(exc, FileNotFoundError)
        and "/" not in program
        and not shutil.which(program, path=path)
    ):
        hint = " (vLLM: pip install '.[vllm]' beside pathgate)" if program == "vllm" else ""
        return f"not found on PATH{hint}"
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def _wait_healthy(server: RunningServer, health_path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=server.base_url, timeout=2.0) as client:
        while True:
            code = server.process.poll()
            if code is not None:
                raise LaunchError(
                    f"the server exited with code {code} before it was healthy; "
                    f"log tail ({server.log_path}):\n{log_tail(server.log_path)}"
                )
            if _healthy(client, health_path):
                return
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"the server was not healthy after {timeout_s:g} s (GET {health_path}); "
                    f"stopped it; log tail ({server.log_path}):\n{log_tail(server.log_path)}"
                )
            time.sleep(POLL_INTERVAL_S)


def _healthy(client: httpx.Client, health_path: str) -> bool:
    try:
        return client.get(health_path).status_code == 200
    except httpx.HTTPError:
        return False  # not listening yet


def stop(server: RunningServer, term_grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM to the group, wait, SIGKILL to whatever is left; return once the group is gone.

    The leader is reaped here; other members (vLLM's workers) are the leader's children and are
    reaped by init once orphaned, so they count as gone once they are zombies. A second Ctrl-C
    or SIGTERM waits until the group is gone: delivered mid-way it would skip the SIGKILL.
    """
    with interrupts_deferred(reraise=True):
        _signal_group(server.pgid, signal.SIGTERM)
        if not _wait_group_gone(server, term_grace_s):
            _signal_group(server.pgid, signal.SIGKILL)
            _wait_group_gone(server, KILL_WAIT_S)
        if server.process.poll() is None:
            server.process.wait(timeout=KILL_WAIT_S)


@contextmanager
def interrupts_deferred(reraise: bool) -> Iterator[list[int]]:
    """SIGINT and SIGTERM arriving inside the block are held; it yields the list they go to.
    At its end they reach their handlers (reraise) or are left to the caller to act on. Python
    runs signal handlers on the main thread only, so elsewhere there is nothing to defer."""
    pending: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield pending
        return
    deferred = (signal.SIGINT, signal.SIGTERM)
    previous = {
        sig: signal.signal(sig, lambda signum, frame: pending.append(signum)) for sig in deferred
    }
    try:
        yield pending
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: a handler not set from Python, left as it is
                signal.signal(sig, handler)
        for signum in dict.fromkeys(pending) if reraise else ():
            signal.raise_signal(signum)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(pgid, sig)


def _wait_group_gone(server: RunningServer, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        server.process.poll()  # reap the leader as soon as it exits
        if not group_members(server.pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, read from /proc; where /proc is
    missing, whether the group can still be signalled at all."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    return [pid for pid in _pids(proc) if _pgid_if_live(proc / str(pid)) == pgid]


def _pids(proc: Path) -> list[int]:
    return [int(entry.name) for entry in proc.iterdir() if entry.name.isdigit()]


def _pgid_if_live(path: Path) -> int | None:
    try:
        stat = (path / "stat").read_text()
    except OSError:
        return None  # exited while we looked
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after it
    fields = stat.rsplit(")", 1)[1].split()
    state, pgrp = fields[0], int(fields[2])
    return None if state in ("Z", "X") else pgrp
