"""Fake OpenAI-compatible servers as real processes, each stopped (group and all) after its test."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from harness.serving.launcher import RunningServer, free_port, launched

FAKE_SERVER = Path(__file__).with_name("fake_openai_server.py")
STARTUP_TIMEOUT_S = 30.0

StartFake = Callable[..., RunningServer]


def fake_command(port: int, *flags: str) -> list[str]:
    return [sys.executable, str(FAKE_SERVER), "--port", str(port), *flags]


def fake_serve_template() -> str:
    """A serve template for the manifest's engine section that starts the fake server."""
    return f"{sys.executable} {FAKE_SERVER} --port {{port}} --model {{model}}"


def logged_pid(log_path: Path, name: str = "pid") -> int:
    match = re.search(rf"\b{name}=(\d+)", log_path.read_text())
    assert match, f"no {name}= in {log_path}"
    return int(match.group(1))


def server_stats(server: RunningServer) -> dict[str, object]:
    response = httpx.get(f"{server.base_url}/debug/stats", timeout=5)
    return dict(response.json())


@pytest.fixture
def start_fake(tmp_path: Path) -> Iterator[StartFake]:
    """start_fake(*flags, env_overrides=...) -> a healthy fake server, stopped after the test."""
    with ExitStack() as stack:

        def start(*flags: str, env_overrides: dict[str, str] | None = None) -> RunningServer:
            port = free_port()
            return stack.enter_context(
                launched(
                    fake_command(port, *flags),
                    port=port,
                    log_path=tmp_path / f"fake-{port}.log",
                    env_overrides=env_overrides,
                    startup_timeout_s=STARTUP_TIMEOUT_S,
                    term_grace_s=5.0,
                )
            )

        yield start
