"""Starting processes: a worker for this machine's hardware, and `pathgate serve` (the API with
an embedded worker beside it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

from harness.config import get_settings
from harness.evaluation.environment import detect_host
from harness.github.hooks import GITHUB_QUEUE
from harness.store.migrate import upgrade
from workers import heartbeat
from workers.routing import queues_for_host


def detected_queues() -> tuple[list[str], str]:
    settings = get_settings()
    host = detect_host(settings.worker_hardware or "auto")
    return queues_for_host(host.gpu, host.count), f"{host.gpu}x{host.count}"


class CannotIsolate(Exception):
    pass


def check_isolation(queues: list[str]) -> None:
    """A worker that runs submitted code (any queue but "github") needs the child's network, PID
    and mount namespaces, or the setting that says every submitter is trusted."""
    from workers.runner import confinement_problem, isolation

    if queues == [GITHUB_QUEUE] or get_settings().allow_unisolated:
        return
    if os.geteuid() == 0:
        # Namespaces do not change the kernel's uid: the child can open root-owned device nodes
        # (a raw disk writes past every read-only mount) and read root-only files.
        print(
            "pathgate worker: running as root, so submitted code runs as uid 0 inside its "
            "namespaces; run workers as an unprivileged user (the Dockerfile's does)",
            file=sys.stderr,
        )
    found = isolation()
    if not (found.network and found.processes):
        raise CannotIsolate(
            "this OS does not let the worker give submitted code its own network, PID and mount "
            "namespaces (unshare; in a container: its seccomp and AppArmor profiles), so a "
            "submission could read the worker's secrets and reach its network. Run the worker "
            "where unshare works, or set PATHGATE_ALLOW_UNISOLATED=true if every submitter is "
            "trusted (`pathgate serve --no-embedded-worker` runs the API without a worker)."
        )
    problem = confinement_problem()
    if problem:
        raise CannotIsolate(
            f"the worker cannot confine submitted code's file system here ({problem}): it needs "
            "Linux 5.12+ (mount_setattr) and user namespaces. Run the worker where both work, or "
            "set PATHGATE_ALLOW_UNISOLATED=true if every submitter is trusted."
        )


def run_worker(queues: list[str] | None = None) -> None:
    from workers.celery_app import app

    found, hardware = detected_queues()
    check_isolation(queues or found)
    heartbeat.identity = heartbeat.Identity(queues or found, hardware, os.getpid())
    name = f"pathgate-{os.getpid()}@{socket.gethostname()}"
    app.worker_main(
        [
            "worker",
            "-Q",
            ",".join(heartbeat.identity.queues),
            "-n",
            name,
            "--concurrency",
            "1",
            "--loglevel",
            "INFO",
            "--without-mingle",
            "--without-gossip",
        ]
    )


def _stop_if_worker_dies(worker: subprocess.Popen[bytes], stopping: threading.Event) -> None:
    """Without its worker the embedded service would accept jobs nobody runs: stop it."""
    code = worker.wait()
    if stopping.is_set():  # the service is stopping them itself
        return
    print(f"pathgate serve: the embedded worker exited with {code}; stopping", file=sys.stderr)
    os.kill(os.getpid(), signal.SIGTERM)


class CannotListen(Exception):
    pass


def listening_socket(host: str, port: int) -> socket.socket:
    """The API's socket, bound before any worker starts: a port in use is one clear error, not
    a server that exits behind workers it then has to stop."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise CannotListen(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def serve_all(host: str, port: int, embedded_worker: bool) -> None:
    import uvicorn

    from harness.api.app import create_app

    sock = listening_socket(host, port)
    settings = get_settings()
    upgrade(settings.database_url)
    # uvicorn names no address for a socket it is handed: say where the API is, and where
    # report links point (they follow PATHGATE_PUBLIC_URL, not --port)
    print(
        f"pathgate API on http://{host}:{port}; report links use {settings.public_url} "
        "(PATHGATE_PUBLIC_URL)",
        flush=True,
    )
    commands = []
    if embedded_worker:
        commands.append([sys.executable, "-m", "harness.cli", "worker"])
    # GitHub statuses are posted from the API's side (workers on GPU machines never hold GitHub
    # credentials), by their own process so a status never waits behind an hour-long job.
    commands.append([sys.executable, "-m", "harness.cli", "worker", "--queues", GITHUB_QUEUE])
    processes = [subprocess.Popen(command) for command in commands]
    stopping = threading.Event()
    for process in processes:
        watch = threading.Thread(target=_stop_if_worker_dies, args=(process, stopping), daemon=True)
        watch.start()
    try:
        uvicorn.Server(uvicorn.Config(create_app(), host=host, port=port)).run(sockets=[sock])
    finally:
        stopping.set()
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            process.wait(timeout=30)
