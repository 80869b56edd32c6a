"""The REST API on SQLite and the real PostgreSQL: submit, read, list, rerun, validate, and every
error the issue names (422 with field paths, 401, 403, 404, 413, 429)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from harness.api.app import create_app
from harness.config import get_settings
from harness.store import repositories as repo
from harness.store.db import session_scope

SCOPES = Path(__file__).resolve().parents[2] / "scopes"
RMSNORM = (SCOPES / "fused-add-rmsnorm-h200.yaml").read_text()
SHA = "0123456789abcdef0123456789abcdef01234567"


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[int, str]] = []

    def __call__(self, job_id: int, queue: str) -> None:
        self.sent.append((job_id, queue))


@pytest.fixture
def enqueued() -> Recorder:
    return Recorder()


@pytest.fixture
def client(database_url: str, enqueued: Recorder) -> Iterator[TestClient]:
    with TestClient(create_app(enqueue=enqueued)) as test_client:
        yield test_client


def _token(role: str, name: str) -> dict[str, str]:
    with session_scope() as session:
        _, plaintext = repo.create_token(session, name, role)
    return {"Authorization": f"Bearer {plaintext}"}


@pytest.fixture
def alice() -> dict[str, str]:
    return _token("contributor", "alice")


@pytest.fixture
def bob() -> dict[str, str]:
    return _token("contributor", "bob")


@pytest.fixture
def maintainer() -> dict[str, str]:
    return _token("maintainer", "maria")


def _submit(client: TestClient, headers: dict[str, str], manifest: object = RMSNORM) -> int:
    response = client.post(
        "/v1/submissions",
        json={"manifest": manifest, "source": {"kind": "in_tree"}},
        headers=headers,
    )
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def test_submit_stores_jobs_and_enqueues_after_commit(
    client: TestClient, alice: dict[str, str], enqueued: Recorder
) -> None:
    submission_id = _submit(client, alice)
    body = client.get(f"/v1/submissions/{submission_id}", headers=alice).json()
    assert body["scope"] == "fused-add-rmsnorm-h200"
    assert [job["queue"] for job in body["jobs"]] == ["cpu", "gpu.h200.x1"]
    # no worker has beaten: each job says so instead of sitting in "queued"
    assert body["state"] == "waiting_for_hardware"
    assert all(
        job["reason"] == f"no live worker serves queue {job['queue']}" for job in body["jobs"]
    )
    assert sorted(queue for _, queue in enqueued.sent) == ["cpu", "gpu.h200.x1"]
    assert {job_id for job_id, _ in enqueued.sent} == {job["id"] for job in body["jobs"]}


def test_jobs_for_served_queues_are_queued(client: TestClient, alice: dict[str, str]) -> None:
    with session_scope() as session:
        repo.beat(session, "w1", ["cpu"], "cpu")
    body = client.get(f"/v1/submissions/{_submit(client, alice)}", headers=alice).json()
    assert {j["queue"]: j["state"] for j in body["jobs"]} == {
        "cpu": "queued",
        "gpu.h200.x1": "waiting_for_hardware",
    }
    assert body["state"] == "queued"


def test_manifest_as_json_object(client: TestClient, alice: dict[str, str]) -> None:
    submission_id = _submit(client, alice, yaml.safe_load(RMSNORM))
    assert client.get(f"/v1/submissions/{submission_id}", headers=alice).status_code == 200


def test_invalid_manifest_is_422_with_field_paths_and_stores_nothing(
    client: TestClient, alice: dict[str, str], enqueued: Recorder
) -> None:
    bad = RMSNORM.replace("gpu: [cpu, H200]", "gpu: [cpu, H300]").replace(
        "phase: decode", "phase: x"
    )
    response = client.post(
        "/v1/submissions", json={"manifest": bad, "source": {"kind": "in_tree"}}, headers=alice
    )
    assert response.status_code == 422
    errors = response.json()["errors"]
    locs = {".".join(map(str, e["loc"])) for e in errors}
    assert "body.manifest.hardware.gpu" in locs or any("hardware.gpu" in loc for loc in locs)
    assert any(loc.endswith("workload.phase") for loc in locs)
    assert all(e["line"] for e in errors)
    assert client.get("/v1/submissions", headers=alice).json()["total"] == 0
    assert enqueued.sent == []


def test_an_invalid_manifest_sent_as_an_object_names_no_line(
    client: TestClient, alice: dict[str, str]
) -> None:
    """Its lines were those of a YAML dump the sender never saw."""
    bad = yaml.safe_load(RMSNORM)
    bad["workload"]["phase"] = "x"
    response = client.post("/v1/scopes/validate", json={"manifest": bad}, headers=alice)
    assert response.status_code == 422
    [error] = response.json()["errors"]
    assert error["loc"][-2:] == ["workload", "phase"] and error["line"] is None


def _many_claims() -> dict:
    """Over 100000 nodes in under the 1 MB a body may have."""
    return {**yaml.safe_load(RMSNORM), "claims": [{"metric": "speedup", "at_least": 1}] * 20_001}


@pytest.mark.parametrize(
    ("manifest", "words"),
    [
        (RMSNORM.replace("name: ", "name: \ud800", 1), "lone surrogate"),
        ({**yaml.safe_load(RMSNORM), "name": "a\ud800"}, "invalid Unicode character"),
        (RMSNORM.replace("max: 512", "max: " + "9" * 5000, 1), "Exceeds the limit"),
        # an object meets the YAML text's node limit too (it once skipped it, and its job
        # ended in an error that showed the worker's traceback)
        (_many_claims(), "over 100000 YAML nodes"),
    ],
    ids=["surrogate-in-text", "surrogate-in-object", "long-int", "too-many-nodes"],
)
def test_an_unreadable_manifest_is_422_and_stores_nothing(
    client: TestClient, alice: dict[str, str], manifest: str | dict, words: str
) -> None:
    bodies = {
        "/v1/scopes/validate": {"manifest": manifest},
        "/v1/submissions": {"manifest": manifest, "source": {"kind": "in_tree"}},
    }
    for url, body in bodies.items():
        # as a client sends it: json.dumps writes the surrogate as the escape "\\ud800"
        json_headers = {**alice, "content-type": "application/json"}
        response = client.post(url, content=json.dumps(body), headers=json_headers)
        assert response.status_code == 422, response.text
        assert words in response.text
    assert client.get("/v1/submissions", headers=alice).json()["total"] == 0


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        (
            {"manifest": RMSNORM, "source": {"kind": "git", "url": "https://x/y", "sha": "abc"}},
            "body.source.git.sha",
        ),
        ({"manifest": RMSNORM, "source": {"kind": "ftp"}}, "body.source"),
        ({"source": {"kind": "in_tree"}}, "body.manifest"),
        ({"manifest": RMSNORM, "source": {"kind": "in_tree"}, "extra": 1}, "body.extra"),
    ],
)
def test_malformed_body_is_422(
    client: TestClient, alice: dict[str, str], body: dict, loc: str
) -> None:
    response = client.post("/v1/submissions", json=body, headers=alice)
    assert response.status_code == 422
    assert any(".".join(map(str, e["loc"])).startswith(loc) for e in response.json()["errors"])


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        # FastAPI's own parse of these raised past its decode-error branch: a bare 400
        b'{"manifest": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"manifest": ' + b"9" * 5000 + b"}",
    ],
    ids=["not-json", "nested-too-deeply", "long-int"],
)
@pytest.mark.parametrize("path", ["/v1/submissions", "/v1/scopes/validate"])
def test_not_json_is_422_in_the_usual_shape(
    client: TestClient, alice: dict[str, str], path: str, content: bytes
) -> None:
    response = client.post(
        path, content=content, headers={**alice, "content-type": "application/json"}
    )
    assert response.status_code == 422, response.text
    assert response.json()["errors"][0]["type"] == "json_invalid"
    assert client.get("/v1/submissions", headers=alice).json()["total"] == 0


@pytest.mark.parametrize("media_type", ["text/plain", "application/xml", "multipart/form-data"])
@pytest.mark.parametrize("path", ["/v1/submissions", "/v1/scopes/validate"])
def test_a_body_sent_as_another_media_type_is_415_saying_so(
    client: TestClient, alice: dict[str, str], path: str, media_type: str
) -> None:
    """A JSON body FastAPI was told is something else arrives as no object: a 422 about a
    missing dictionary said nothing of the header that caused it."""
    body = json.dumps({"manifest": RMSNORM})
    response = client.post(path, content=body, headers={**alice, "content-type": media_type})
    assert response.status_code == 415, response.text
    assert "must be JSON (Content-Type: application/json)" in response.json()["detail"]
    assert client.get("/v1/submissions", headers=alice).json()["total"] == 0


def test_git_source_is_stored(client: TestClient, alice: dict[str, str]) -> None:
    response = client.post(
        "/v1/submissions",
        json={
            "manifest": RMSNORM,
            "source": {"kind": "git", "url": "file:///tmp/r.git", "sha": SHA},
        },
        headers=alice,
    )
    body = client.get(f"/v1/submissions/{response.json()['id']}", headers=alice).json()
    assert (body["source_kind"], body["source_url"], body["source_sha"]) == (
        "git",
        "file:///tmp/r.git",
        SHA,
    )


@pytest.mark.parametrize(
    ("url", "protocol"),
    [
        ("file:///srv/private.git", "file"),
        ("git@github.com:someone/private.git", "ssh"),
        ("http://example.com/r.git", "http"),
    ],
)
def test_a_git_source_outside_the_allowed_protocols_is_422_and_stores_nothing(
    client: TestClient,
    alice: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    url: str,
    protocol: str,
) -> None:
    """By default https only: a file:// or ssh URL would make a worker fetch from its own disk
    or with its own keys."""
    monkeypatch.delenv("PATHGATE_GIT_PROTOCOLS")
    get_settings.cache_clear()
    body = {"manifest": RMSNORM, "source": {"kind": "git", "url": url, "sha": SHA}}
    response = client.post("/v1/submissions", json=body, headers=alice)
    assert response.status_code == 422, response.text
    [error] = response.json()["errors"]
    assert error["loc"] == ["body", "source", "url"]
    assert error["msg"] == f"git {protocol} URLs are not accepted here (allowed: https)"
    assert client.get("/v1/submissions", headers=alice).json()["total"] == 0
    body["source"]["url"] = "https://github.com/someone/public.git"
    assert client.post("/v1/submissions", json=body, headers=alice).status_code == 201


@pytest.mark.parametrize("header", [None, "Bearer nope", "Basic abc", "Bearer "])
def test_missing_or_bad_token_is_401(client: TestClient, header: str | None) -> None:
    headers = {"Authorization": header} if header else {}
    assert client.get("/v1/submissions", headers=headers).status_code == 401


def test_another_contributors_submission_is_404(
    client: TestClient, alice: dict[str, str], bob: dict[str, str], maintainer: dict[str, str]
) -> None:
    submission_id = _submit(client, alice)
    for path in ("", "/report.json", "/report.md", "/report.html", "/manifest.yaml"):
        assert client.get(f"/v1/submissions/{submission_id}{path}", headers=bob).status_code == 404
        assert (
            client.get(f"/v1/submissions/{submission_id}{path}", headers=alice).status_code == 200
        )
        assert (
            client.get(f"/v1/submissions/{submission_id}{path}", headers=maintainer).status_code
            == 200
        )
    assert client.get("/v1/submissions", headers=bob).json()["total"] == 0
    assert client.get("/v1/submissions", headers=maintainer).json()["total"] == 1
    assert client.get("/v1/submissions/999999", headers=alice).status_code == 404


def test_rerun_is_maintainer_only_and_appends_jobs(
    client: TestClient, alice: dict[str, str], maintainer: dict[str, str]
) -> None:
    submission_id = _submit(client, alice)
    assert client.post(f"/v1/submissions/{submission_id}/rerun", headers=alice).status_code == 403
    response = client.post(f"/v1/submissions/{submission_id}/rerun", headers=maintainer)
    assert response.status_code == 201
    jobs = client.get(f"/v1/submissions/{submission_id}", headers=alice).json()["jobs"]
    assert len(jobs) == 4  # the first round stays; a rerun is new jobs, never an overwrite
    assert client.post("/v1/submissions/424242/rerun", headers=maintainer).status_code == 404


def test_list_paginates_and_filters(client: TestClient, alice: dict[str, str]) -> None:
    ids = [_submit(client, alice) for _ in range(5)]
    page = client.get("/v1/submissions?per_page=2&page=2", headers=alice).json()
    assert page["total"] == 5 and page["page"] == 2
    assert [item["id"] for item in page["items"]] == sorted(ids, reverse=True)[2:4]
    by_state = client.get("/v1/submissions?state=waiting_for_hardware", headers=alice).json()
    assert by_state["total"] == 5
    assert client.get("/v1/submissions?verdict=PASS", headers=alice).json()["total"] == 0
    assert client.get("/v1/submissions?scope=other", headers=alice).json()["total"] == 0
    assert client.get("/v1/submissions?state=nonsense", headers=alice).status_code == 422
    assert client.get("/v1/submissions?per_page=0", headers=alice).status_code == 422


def test_body_over_limit_is_413(client: TestClient, alice: dict[str, str]) -> None:
    huge = "#" + "x" * (get_settings().max_body_bytes + 10)
    response = client.post(
        "/v1/submissions", json={"manifest": huge, "source": {"kind": "in_tree"}}, headers=alice
    )
    assert response.status_code == 413


def test_a_chunked_body_over_limit_is_413_and_a_small_one_is_read(
    client: TestClient, alice: dict[str, str]
) -> None:
    """Without a Content-Length the body arrives in chunks; its size is known only by reading."""
    limit = get_settings().max_body_bytes
    chunk = b"x" * 65536

    def chunks(total: int) -> Iterator[bytes]:
        for _ in range(total // len(chunk) + 1):
            yield chunk

    for url in ("/v1/submissions", "/v1/scopes/validate"):
        response = client.post(url, content=chunks(limit + 10), headers=alice)
        assert response.status_code == 413, (url, response.text)
    body = json.dumps({"manifest": RMSNORM, "source": {"kind": "in_tree"}}).encode()
    small = client.post(
        "/v1/submissions",
        content=iter([body[:100], body[100:]]),
        headers={**alice, "content-type": "application/json"},
    )
    assert small.status_code == 201, small.text


def test_rate_limit_is_429_with_retry_after(
    database_url: str, monkeypatch: pytest.MonkeyPatch, alice: dict[str, str]
) -> None:
    monkeypatch.setenv("PATHGATE_RATE_LIMIT_PER_MINUTE", "3")
    get_settings.cache_clear()
    with TestClient(create_app(enqueue=Recorder())) as limited:
        codes = [limited.get("/v1/submissions", headers=alice).status_code for _ in range(4)]
        response = limited.get("/v1/submissions", headers=alice)
    assert codes == [200, 200, 200, 429]
    assert response.status_code == 429
    assert 1 <= int(response.headers["Retry-After"]) <= 60


def test_validate_scope_without_submitting(client: TestClient, alice: dict[str, str]) -> None:
    response = client.post("/v1/scopes/validate", json={"manifest": RMSNORM}, headers=alice)
    assert response.json() == {
        "valid": True,
        "name": "fused-add-rmsnorm-h200",
        "queues": ["cpu", "gpu.h200.x1"],
    }
    kimi = (SCOPES / "kimi-k3-mla-moe-decode-gb300.yaml").read_text()
    response = client.post("/v1/scopes/validate", json={"manifest": kimi}, headers=alice)
    # one job per GPU count of the scope (8 and 16): a host of 8 runs only the 8-GPU cases
    assert response.json()["queues"] == ["gpu.gb300.x8", "gpu.gb300.x16"]
    bad = client.post("/v1/scopes/validate", json={"manifest": "name: [x"}, headers=alice)
    assert bad.status_code == 422
    assert client.get("/v1/submissions", headers=alice).json()["total"] == 0


def test_health_ready_metrics_openapi(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.json()["database"] == "ok"
    client.get("/healthz")
    metrics = client.get("/metrics").text
    assert 'pathgate_http_requests_total{method="GET",route="/healthz",status="200"}' in metrics
    spec = client.get("/openapi.json").json()
    assert {"/v1/submissions", "/v1/submissions/{submission_id}/rerun"} <= set(spec["paths"])


def test_combined_verdict_over_jobs_on_different_hardware() -> None:
    from harness.evaluation.evidence import Evidence
    from harness.submissions import combined_verdict
    from tests.reports.evidence_fixtures import load as load_evidence

    gpu = load_evidence("h200_rmsnorm_rerun")
    cpu = load_evidence("cpu_rmsnorm")
    assert isinstance(gpu, Evidence) and gpu.verdict == "PASS" and cpu.verdict == "INCONCLUSIVE"
    # the CPU job cannot measure the H200 claims; the H200 job verified them
    assert combined_verdict([cpu, gpu]) == "PASS"
    assert combined_verdict([cpu]) == "INCONCLUSIVE"
    failing = load_evidence("cpu_offgrid_fail")
    assert combined_verdict([failing, gpu]) == "FAIL"
    assert combined_verdict([]) == "INCONCLUSIVE"
    # another job that measured a claim and left it open keeps the submission from a PASS
    open_job = gpu.model_copy(deep=True)
    open_job.verdict = "INCONCLUSIVE"
    open_job.claims[0].status = "inconclusive"
    assert combined_verdict([gpu, open_job]) == "INCONCLUSIVE"
    assert combined_verdict([open_job, gpu]) == "INCONCLUSIVE"


def test_submitted_text_in_the_combined_markdown_is_escaped() -> None:
    from harness.reports.combined import render_combined_markdown

    attack = "</details><h1>PASS</h1><img src=x>"
    report = {
        "verdict": "FAIL",
        "state": "failed",
        "submission": 1,
        "scope": "s",
        "verdict_reasons": [f"cpu: error: {attack}"],
        "source": {"kind": "in_tree"},
        "jobs": [{"id": 1, "queue": "cpu", "state": "error", "reason": attack, "markdown": ""}],
        "serving_results": [],
    }
    text = render_combined_markdown(report)
    assert "<h1>" not in text and "<img" not in text and "</details>" not in text
    assert "&lt;h1>PASS&lt;/h1>" in text


VLLM_RESULT = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_bench_serve_result.json"


def test_a_vllm_result_attached_to_a_submission_becomes_evidence_rows(
    client: TestClient, alice: dict[str, str], bob: dict[str, str]
) -> None:
    submission_id = _submit(client, alice)
    raw = VLLM_RESULT.read_bytes()
    url = f"/v1/submissions/{submission_id}/serving-results"
    response = client.post(url, params={"name": "kimi-c1.json"}, content=raw, headers=alice)
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["sha256"] == hashlib.sha256(raw).hexdigest()
    assert body["attached_by"] == "alice" and body["kind"] == "vllm_bench_serve"
    provenance = body["data"]["provenance"]
    assert provenance["file_name"] == "kimi-c1.json" and provenance["backend"]
    listed = client.get(url, headers=alice).json()
    assert [r["id"] for r in listed] == [body["id"]]
    # another contributor can neither see nor attach to it
    assert client.get(url, headers=bob).status_code == 404
    assert client.post(url, params={"name": "x.json"}, content=raw, headers=bob).status_code == 404
    # the submission's report shows the rows with their provenance
    markdown = client.get(f"/v1/submissions/{submission_id}/report.md", headers=alice).text
    assert "## Serving results" in markdown and "kimi-c1.json" in markdown
    assert "tokens_per_s" in markdown and "`output_throughput`" in markdown
    page = client.get(f"/v1/submissions/{submission_id}/report.html", headers=alice).text
    assert "Serving results" in page


def test_a_vllm_result_may_be_larger_than_other_bodies_up_to_its_own_limit(
    database_url: str, monkeypatch: pytest.MonkeyPatch, alice: dict[str, str]
) -> None:
    """--save-detailed results run to megabytes: their route has its own limit, others keep
    max_body_bytes."""
    monkeypatch.setenv("PATHGATE_MAX_BODY_BYTES", "65536")
    monkeypatch.setenv("PATHGATE_MAX_SERVING_RESULT_BYTES", "262144")
    get_settings.cache_clear()
    raw = VLLM_RESULT.read_bytes()
    padded = raw + b" " * (100_000 - len(raw))  # trailing whitespace: still the same JSON
    with TestClient(create_app(enqueue=Recorder())) as app:
        submission_id = _submit(app, alice)
        url = f"/v1/submissions/{submission_id}/serving-results"
        accepted = app.post(url, params={"name": "big.json"}, content=padded, headers=alice)
        assert accepted.status_code == 201, accepted.text
        assert accepted.json()["sha256"] == hashlib.sha256(padded).hexdigest()
        over = padded + b" " * 262144
        refused = app.post(url, params={"name": "huge.json"}, content=over, headers=alice)
        assert refused.status_code == 413
        assert refused.json()["detail"] == "request body over 262144 bytes"
        chunked = app.post(url, params={"name": "c.json"}, content=iter([over]), headers=alice)
        assert chunked.status_code == 413
        elsewhere = app.post(
            "/v1/scopes/validate", json={"manifest": "#" + "x" * 100_000}, headers=alice
        )
        assert elsewhere.status_code == 413
        assert [r["source_name"] for r in app.get(url, headers=alice).json()] == ["big.json"]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "expected one JSON object"),
        (b'{"date": "20261202-120000"}', "backend"),
        (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
        # valid JSON, but a lone surrogate: stored, it broke every later read of the results
        (VLLM_RESULT.read_bytes().replace(b'"model_id": "', b'"model_id": "\\ud800'), "surrogate"),
        (b'{"completed": ' + b"9" * 5000 + b"}", "Exceeds the limit"),
    ],
    ids=["not-json", "a-list", "missing-fields", "nested-too-deeply", "surrogate", "long-int"],
)
def test_a_bad_vllm_result_is_422_and_stores_nothing(
    client: TestClient, alice: dict[str, str], content: bytes, expected: str
) -> None:
    submission_id = _submit(client, alice)
    url = f"/v1/submissions/{submission_id}/serving-results"
    response = client.post(url, params={"name": "r.json"}, content=content, headers=alice)
    assert response.status_code == 422, response.text
    assert expected in response.text
    assert client.get(url, headers=alice).json() == []
