"""The service commands: `pathgate db upgrade`, `token create`, and `submit` against a live API."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import uvicorn
from sqlalchemy import create_engine, inspect
from typer.testing import CliRunner

from harness.api.app import create_app
from harness.cli import app
from harness.config import get_settings
from harness.store import repositories as repo
from harness.store.db import session_scope
from tests.service_fixtures import use_database

SCOPE = Path(__file__).resolve().parents[1] / "scopes" / "fused-add-rmsnorm-h200.yaml"


def test_db_upgrade_and_downgrade(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    use_database(monkeypatch, url)
    assert CliRunner().invoke(app, ["db", "upgrade"]).exit_code == 0
    assert "submissions" in inspect(create_engine(url)).get_table_names()
    assert CliRunner().invoke(app, ["db", "downgrade"]).exit_code == 0
    assert "submissions" not in inspect(create_engine(url)).get_table_names()


def test_token_create_prints_the_token_last(database_url: str) -> None:
    result = CliRunner().invoke(app, ["token", "create", "--role", "maintainer", "--name", "ci"])
    assert result.exit_code == 0
    token = result.output.split()[-1]
    with session_scope() as session:
        found = repo.find_token(session, token)
        assert found is not None and (found.role, found.name) == ("maintainer", "ci")
    bad = CliRunner().invoke(app, ["token", "create", "--role", "admin", "--name", "x"])
    assert bad.exit_code == 2


def test_token_list_and_revoke(database_url: str) -> None:
    created = CliRunner().invoke(app, ["token", "create", "--role", "contributor", "--name", "bob"])
    token = created.output.split()[-1]
    listed = CliRunner().invoke(app, ["token", "list"])
    assert listed.exit_code == 0
    [line] = [row for row in listed.output.splitlines() if "\tbob\t" in row]
    token_id = line.split("\t")[0]
    assert line.endswith("active") and token not in listed.output  # never the value
    revoked = CliRunner().invoke(app, ["token", "revoke", token_id])
    assert revoked.exit_code == 0, revoked.output
    with session_scope() as session:
        assert repo.find_token(session, token) is None  # the API refuses it from now on
    assert CliRunner().invoke(app, ["token", "list"]).output.count("revoked ") == 1
    missing = CliRunner().invoke(app, ["token", "revoke", "999999"])
    assert missing.exit_code == 2 and "no token 999999" in missing.output
    # past the database's integers: a usage error, not the driver's overflow
    too_large = CliRunner().invoke(app, ["token", "revoke", "99999999999"])
    assert too_large.exit_code == 2 and "2147483647" in too_large.output


def test_a_token_name_that_looks_like_markup_prints_as_given(database_url: str) -> None:
    """rich read "[/bot]" as a closing tag and crashed after the revoke had been stored."""
    created = CliRunner().invoke(
        app, ["token", "create", "--role", "contributor", "--name", "ci[/bot]"]
    )
    token_id = created.output.split()[3]
    revoked = CliRunner().invoke(app, ["token", "revoke", token_id])
    assert revoked.exit_code == 0, revoked.output
    assert f"revoked token {token_id} (ci[/bot])" in revoked.output


def test_token_create_with_a_name_too_long_exits_2(database_url: str) -> None:
    result = CliRunner().invoke(
        app, ["token", "create", "--role", "contributor", "--name", "x" * 101]
    )
    assert result.exit_code == 2
    assert "1 to 100 characters" in result.output


def test_token_create_before_the_tables_exist_says_what_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_database(monkeypatch, f"sqlite:///{tmp_path / 'empty.db'}")
    result = CliRunner().invoke(app, ["token", "create", "--role", "contributor", "--name", "a"])
    assert result.exit_code == 2
    assert "pathgate db upgrade" in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_serve_on_a_port_in_use_says_so_before_starting_anything() -> None:
    """It started its workers, failed to bind, stopped them, and then blamed the worker."""
    taken = socket.create_server(("127.0.0.1", 0))
    port = str(taken.getsockname()[1])
    result = CliRunner().invoke(app, ["serve", "--port", port, "--no-embedded-worker"])
    taken.close()
    assert result.exit_code == 2, result.output
    assert f"cannot listen on 127.0.0.1:{port}" in result.output
    assert "worker" not in result.output


def test_serve_refuses_a_port_number_past_65535() -> None:
    """uvicorn took 99999 modulo 65536, listened on 34463 and logged 99999."""
    result = CliRunner().invoke(app, ["serve", "--port", "99999"])
    assert result.exit_code == 2 and "65535" in result.output


@pytest.fixture
def server(database_url: str) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    config = uvicorn.Config(
        create_app(enqueue=lambda job, queue: None), port=port, log_level="warning"
    )
    instance = uvicorn.Server(config)
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    while not instance.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    instance.should_exit = True
    thread.join(timeout=10)


def _token(role: str = "contributor") -> str:
    with session_scope() as session:
        return repo.create_token(session, "cli", role)[1]


def test_submit_and_wait_until_only_hardware_is_missing(server: str) -> None:
    result = CliRunner().invoke(
        app,
        [
            "submit",
            str(SCOPE),
            "--server",
            server,
            "--token",
            _token(),
            "--wait",
            "--timeout",
            "30",
        ],
    )
    assert result.exit_code == 3, result.output
    assert "waiting_for_hardware" in result.output
    assert "no live worker serves queue gpu.h200.x1" in result.output


def test_submit_without_wait_exits_0(server: str) -> None:
    result = CliRunner().invoke(
        app, ["submit", str(SCOPE), "--server", server, "--token", _token()]
    )
    assert result.exit_code == 0
    assert result.output.startswith("submission ")


def test_submit_with_a_bad_token_exits_2(server: str) -> None:
    result = CliRunner().invoke(app, ["submit", str(SCOPE), "--server", server, "--token", "nope"])
    assert result.exit_code == 2
    assert "HTTP 401" in result.output


def test_submit_checks_the_manifest_before_sending(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(SCOPE.read_text().replace("phase: decode", "phase: training"))
    result = CliRunner().invoke(
        app, ["submit", str(bad), "--server", "http://127.0.0.1:9", "--token", "x"]
    )
    assert result.exit_code == 2
    assert "workload.phase" in result.output


@pytest.mark.parametrize("given", [["--git-sha", "0" * 40], ["--git-url", "https://x.invalid/r"]])
def test_submit_with_half_a_git_source_exits_2(given: list[str]) -> None:
    """A SHA without its repository (or the reverse) would have run the in-tree code."""
    result = CliRunner().invoke(
        app, ["submit", str(SCOPE), "--server", "http://127.0.0.1:9", "--token", "x", *given]
    )
    assert result.exit_code == 2
    assert "--git-url and --git-sha go together" in result.output


@pytest.mark.parametrize("timeout", ["-1", "0", "nan"])
def test_submit_refuses_a_timeout_it_cannot_wait_before_submitting(timeout: str) -> None:
    """Checked before anything is sent: a job queued with no one waiting for it is not what
    --wait asked for (the server here does not exist, so reaching it would say so)."""
    args = ["submit", str(SCOPE), "--server", "http://127.0.0.1:9", "--token", "x", "--wait"]
    result = CliRunner().invoke(app, [*args, "--timeout", timeout])
    assert result.exit_code == 2, result.output
    assert "--timeout must be a positive number of seconds" in result.output
    assert "cannot reach" not in result.output


def test_submit_to_no_server_exits_2() -> None:
    result = CliRunner().invoke(
        app, ["submit", str(SCOPE), "--server", "http://127.0.0.1:9", "--token", "x"]
    )
    assert result.exit_code == 2
    assert "cannot reach" in result.output
    get_settings.cache_clear()


@pytest.mark.parametrize(
    ("given", "words"),
    [
        (["--token", "tökén", "--server", "http://127.0.0.1:9"], "printable ASCII"),
        (["--token", "x", "--server", "http://[::1"], "is not a URL"),
    ],
)
def test_submit_with_a_token_or_server_that_cannot_be_used_exits_2(
    given: list[str], words: str
) -> None:
    result = CliRunner().invoke(app, ["submit", str(SCOPE), *given])
    assert result.exit_code == 2 and words in result.output, result.output


Replies = list[bytes | tuple[int, bytes]]


@pytest.fixture
def not_pathgate() -> Iterator[tuple[str, Replies]]:
    """An HTTP server that answers every POST with whatever the test puts in the list: a body
    (status 200) or a (status, body) pair."""
    replies: Replies = []

    class Answer(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            status, body = replies[0] if isinstance(replies[0], tuple) else (200, replies[0])
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    http = HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{http.server_port}", replies
    http.shutdown()


@pytest.mark.parametrize("reply", [b"<html>a web page</html>", b'{"state": "queued"}', b"[1]"])
def test_submit_to_a_server_that_is_not_pathgate_exits_2(
    not_pathgate: tuple[str, Replies], reply: bytes
) -> None:
    url, replies = not_pathgate
    replies.append(reply)
    result = CliRunner().invoke(app, ["submit", str(SCOPE), "--server", url, "--token", "x"])
    assert result.exit_code == 2, result.output
    assert f"{url} is not a pathgate service" in result.output


def test_the_client_waits_for_every_finished_state() -> None:
    from harness.client import SETTLED
    from harness.store.models import FINISHED_STATES

    assert set(FINISHED_STATES) | {"waiting_for_hardware"} == SETTLED


def test_import_vllm_attach_stores_the_file_with_the_submission(server: str) -> None:
    token = _token()
    submitted = CliRunner().invoke(
        app, ["submit", str(SCOPE), "--server", server, "--token", token]
    )
    submission_id = int(submitted.output.split()[1].rstrip(":"))
    result_file = Path(__file__).resolve().parent / "fixtures" / "vllm_bench_serve_result.json"
    attach = ["--attach", str(submission_id), "--server", server, "--token", token]
    result = CliRunner().invoke(app, ["serving", "import-vllm", str(result_file), *attach])
    assert result.exit_code == 0, result.output
    with session_scope() as session:
        stored = repo.serving_results_of(session, submission_id)
    assert [r.source_name for r in stored] == ["vllm_bench_serve_result.json"]
    refused = CliRunner().invoke(
        app,
        [
            "serving",
            "import-vllm",
            str(result_file),
            "--attach",
            "999",
            "--server",
            server,
            "--token",
            token,
        ],
    )
    assert refused.exit_code == 2 and "404" in refused.output


VLLM_RESULT = Path(__file__).resolve().parent / "fixtures" / "vllm_bench_serve_result.json"


def test_import_vllm_attach_to_a_server_that_is_not_pathgate_exits_2(
    not_pathgate: tuple[str, Replies],
) -> None:
    """A 201 that is not pathgate's reply was reported as attached."""
    url, replies = not_pathgate
    replies.append(b'{"state": "queued"}')
    attach = ["--attach", "1", "--server", url, "--token", "x"]
    result = CliRunner().invoke(app, ["serving", "import-vllm", str(VLLM_RESULT), *attach])
    assert result.exit_code == 2, result.output
    assert f"{url} is not a pathgate service" in result.output


@pytest.mark.parametrize(
    ("reply", "shown"),
    [
        ((404, b'["nope"]'), 'HTTP 404: ["nope"]'),
        ((501, b"<!DOCTYPE HTML>\n<html><body>" + b"x" * 900), "a web page, not a pathgate"),
        ((422, b'{"detail": "bad", "errors": [{"loc": 5, "msg": "m"}, 1]}'), "  5: m"),
    ],
)
def test_an_error_reply_that_is_not_pathgates_is_shown_as_it_came(
    not_pathgate: tuple[str, Replies], reply: tuple[int, bytes], shown: str
) -> None:
    url, replies = not_pathgate
    replies.append(reply)
    attach = ["--attach", "1", "--server", url, "--token", "x"]
    result = CliRunner().invoke(app, ["serving", "import-vllm", str(VLLM_RESULT), *attach])
    assert result.exit_code == 2 and shown in result.output, result.output
    assert "Traceback" not in result.output


def test_a_result_file_whose_name_is_not_utf8_is_attached_under_a_readable_name(
    not_pathgate: tuple[str, Replies], tmp_path: Path
) -> None:
    url, replies = not_pathgate
    replies.append(b'{"id": 7, "sha256": "ab"}')
    odd = tmp_path / os.fsdecode(b"r\xe9sult.json")  # Latin-1 name: not UTF-8
    odd.write_bytes(VLLM_RESULT.read_bytes())
    attach = ["--attach", "1", "--server", url, "--token", "x"]
    result = CliRunner().invoke(app, ["serving", "import-vllm", str(odd), *attach])
    assert result.exit_code == 0, result.output
    assert "r\ufffdsult.json: attached to submission 1" in result.output


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (["--attach", "1", "--token", "tö"], "printable ASCII"),
        (["--attach", "1", "--token", "x", "--server", "http://[::1"], "is not a URL"),
        (["--out", "/"], "cannot write /"),
        (["--out", "/no-such-folder/rows.json"], "cannot write /no-such-folder/rows.json"),
    ],
)
def test_import_vllm_with_options_it_cannot_use_exits_2(options: list[str], words: str) -> None:
    result = CliRunner().invoke(app, ["serving", "import-vllm", str(VLLM_RESULT), *options])
    assert result.exit_code == 2 and words in result.output, result.output
    assert "Traceback" not in result.output


def test_a_worker_that_cannot_isolate_submitted_code_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without namespaces (no unshare, a container's default profiles) a child would see the
    worker's network and every file of its user: the worker says so and stops, unless the
    setting says every submitter is trusted. The "github" worker runs no submitted code."""
    from workers import heartbeat, runner
    from workers import run as worker_run

    monkeypatch.setattr(heartbeat, "identity", heartbeat.identity)  # restored after the test
    started = []
    monkeypatch.setattr(runner, "isolation", lambda: runner.Isolation((), False, False))
    monkeypatch.setattr("workers.celery_app.app.worker_main", lambda argv: started.append(argv))
    result = CliRunner().invoke(app, ["worker", "--queues", "cpu"])
    assert result.exit_code == 2, result.output
    assert "PATHGATE_ALLOW_UNISOLATED=true" in result.output
    assert started == []
    worker_run.run_worker(["github"])
    assert started and started[-1][started[-1].index("-Q") + 1] == "github"
    monkeypatch.setenv("PATHGATE_ALLOW_UNISOLATED", "true")
    get_settings.cache_clear()
    try:
        assert CliRunner().invoke(app, ["worker", "--queues", "cpu"]).exit_code == 0
    finally:
        get_settings.cache_clear()
    assert started[-1][started[-1].index("-Q") + 1] == "cpu"


def test_a_worker_whose_child_cannot_be_confined_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Namespaces alone are not enough: where the child's file system cannot be made read-only
    and locked (a kernel before 5.12, no nested user namespace), the probe says why and the
    worker does not start; here, where it can, the probe finds nothing wrong."""
    from workers import heartbeat, runner

    if runner.isolation().processes:
        assert runner.confinement_problem() is None
    monkeypatch.setattr(heartbeat, "identity", heartbeat.identity)  # restored after the test
    monkeypatch.setattr(runner, "isolation", lambda: runner.Isolation(("x",), True, True))
    monkeypatch.setattr(runner, "confinement_problem", lambda: "the file system stays writable")
    started = []
    monkeypatch.setattr("workers.celery_app.app.worker_main", lambda argv: started.append(argv))
    result = CliRunner().invoke(app, ["worker", "--queues", "cpu"])
    assert result.exit_code == 2, result.output
    assert "the file system stays writable" in result.output
    assert started == []
