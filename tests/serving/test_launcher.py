"""The launcher: healthy start with the arm's environment, a crash on start and a server that is
never healthy are errors carrying the log tail, and teardown leaves no process of the group."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from harness.serving import launcher
from harness.serving.launcher import LaunchError, free_port, group_members, launched
from tests.serving.conftest import fake_command, logged_pid


def _state(pid: int) -> str | None:
    """The process's state letter, None once it is gone entirely."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _gone(pid: int) -> bool:
    return _state(pid) in (None, "Z", "X")


def _launch_error(command: list[str], port: int, log: Path, startup_timeout_s: float = 30.0) -> str:
    """The LaunchError message of a start that must fail (the block must never run)."""
    with (
        pytest.raises(LaunchError) as failure,
        launched(command, port=port, log_path=log, startup_timeout_s=startup_timeout_s),
    ):
        pytest.fail("a server that failed to start must not be yielded")
    return str(failure.value)


def test_start_waits_for_health_and_passes_the_arm_environment(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    env = {"PATHGATE_FAKE_MARKER": "candidate-arm"}
    with launched(fake_command(port), port=port, log_path=log, env_overrides=env) as server:
        assert server.alive()
        assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
        pgid = server.pgid
        assert pgid in group_members(pgid)
    assert "marker=candidate-arm" in log.read_text()  # the log stays as an artifact
    assert group_members(pgid) == []
    assert server.process.returncode is not None


def test_a_crash_on_start_is_an_error_with_the_log_tail(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    started = time.monotonic()
    message = _launch_error(fake_command(port, "--crash-on-start"), port, log)
    assert "exited with code 3 before it was healthy" in message
    assert "simulated startup failure: CUDA out of memory" in message
    assert time.monotonic() - started < 15  # noticed at once, not after the startup timeout
    assert _gone(logged_pid(log))


def test_a_server_never_healthy_is_stopped_after_the_timeout(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    started = time.monotonic()
    command = fake_command(port, "--never-healthy")
    message = _launch_error(command, port, log, startup_timeout_s=2.0)
    elapsed = time.monotonic() - started
    assert "not healthy after 2 s (GET /health)" in message
    assert 2.0 <= elapsed < 10
    assert "fake server: pid=" in message  # the log tail
    pid = logged_pid(log)
    assert _gone(pid) and group_members(pid) == []


def test_teardown_kills_a_worker_that_ignores_sigterm(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    command = fake_command(port, "--spawn-term-ignoring-child")
    with launched(command, port=port, log_path=log, term_grace_s=1.0) as server:
        child = logged_pid(log, "child pid")
        assert not _gone(child)
        pgid = server.pgid
    assert _gone(child), "the SIGTERM-ignoring worker must be SIGKILLed"
    assert group_members(pgid) == []


def test_a_missing_executable_is_a_launch_error(tmp_path: Path) -> None:
    message = _launch_error(["/nonexistent/vllm", "serve"], free_port(), tmp_path / "log")
    assert "cannot start '/nonexistent/vllm'" in message


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_the_server_gets_no_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATHGATE_DATABASE_URL", "postgresql://secret")
    monkeypatch.setenv("GITHUB_TOKEN", "secret-token")
    monkeypatch.setenv("VLLM_API_KEY", "secret-key")
    monkeypatch.setenv("VLLM_USE_V1", "1")
    monkeypatch.setenv("HF_HOME", "/models")
    env = launcher.server_environment()
    assert env["VLLM_USE_V1"] == "1" and env["HF_HOME"] == "/models"
    assert not [name for name, value in env.items() if "secret" in value]


def test_a_vllm_beside_pathgate_is_found_without_activating_its_virtualenv(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`pip install '.[vllm]'` puts `vllm` beside this Python; a shell that never activated
    the virtualenv has no such folder on PATH. Last: an activated environment's `python` or
    `vllm` (a serve template's `python -m ...`) still wins."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    path = launcher.server_environment()["PATH"].split(os.pathsep)
    assert path == ["/usr/bin", "/bin", str(Path(sys.executable).parent)]


def test_a_program_not_on_path_is_named_with_how_to_install_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(launcher.sys, "executable", str(tmp_path / "python"))
    message = _launch_error(["vllm", "serve", "m"], free_port(), tmp_path / "log")
    hint = "(vLLM: pip install '.[vllm]' beside pathgate)"
    assert message == f"cannot start 'vllm': not found on PATH {hint}"


def test_a_second_interrupt_during_teardown_still_kills_the_group(tmp_path: Path) -> None:
    """Ctrl-C twice (or SIGTERM then Ctrl-C): the second arrives while the first one's teardown
    waits out the grace period; it must not skip the SIGKILL of a worker ignoring SIGTERM."""
    port, log = free_port(), tmp_path / "server.log"
    command = fake_command(port, "--spawn-term-ignoring-child")
    second = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    with (
        pytest.raises(KeyboardInterrupt),  # delivered once the group is gone
        launched(command, port=port, log_path=log, term_grace_s=1.5) as server,
    ):
        child = logged_pid(log, "child pid")
        pgid = server.pgid
        second.start()  # fires inside stop(), during the grace period
    second.join()
    assert _gone(child), "the SIGTERM-ignoring worker must be SIGKILLed"
    assert group_members(pgid) == []


def test_a_program_on_path_whose_interpreter_is_gone_is_not_called_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A moved virtualenv: `vllm` is on PATH, its #! interpreter is not."""
    script = tmp_path / "vllm"
    script.write_text("#!/nonexistent/python\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    message = _launch_error(["vllm", "serve", "m"], free_port(), tmp_path / "log")
    assert message == "cannot start 'vllm': No such file or directory"
