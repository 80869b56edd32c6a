"""The dashboard's submissions list with 10,000 submissions in PostgreSQL: p50 must be <= 300 ms.

Uses its own database, `pathgate_dash_bench`, created (dropped first if it exists) through an
AUTOCOMMIT connection to the local server's `test` database; the `public` schema of `test` is
never touched (other tests drop it). Submissions (with two jobs each) are bulk-inserted, then the
list page is requested through the real app (sign-in cookie, templates, queries) in process,
`--requests` times per variant, after a few warm-up requests.

    .venv/bin/python benchmarks/dashboard_list.py [--submissions 10000] [--requests 40]

Prints a table and writes JSON (default pathgate-out/benchmarks/dashboard_list.json). Exits 1
when a variant's p50 is over the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, insert, text

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
BENCH_DB = "pathgate_dash_bench"
BENCH_URL = f"postgresql+psycopg://postgres@127.0.0.1:5432/{BENCH_DB}"
BUDGET_MS = 300.0
SCOPES = [f"scope-{i:02d}" for i in range(12)] + ["fused-add-rmsnorm-h200"]
STATES = ["passed", "failed", "inconclusive", "waiting_for_hardware", "queued", "error"]
VERDICT_OF = {"passed": "PASS", "failed": "FAIL", "inconclusive": "INCONCLUSIVE"}
VARIANTS = {
    "first page": "",
    "page 100": "page=100",
    "state=failed": "state=failed",
    "verdict=PASS, page 20": "verdict=PASS&page=20",
    "scope + submitter": "scope=fused-add-rmsnorm-h200&submitter=contributor-3",
}


def create_database() -> None:
    admin = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)"))
        connection.execute(text(f"CREATE DATABASE {BENCH_DB}"))
    admin.dispose()


def seed(count: int) -> str:
    """Tokens, `count` submissions and two jobs each; returns a maintainer's token."""
    from harness.store import repositories as repo
    from harness.store.db import session_scope
    from harness.store.models import Job, Submission

    rng = random.Random(7)
    with session_scope() as session:
        tokens = [
            repo.create_token(session, f"contributor-{i}", "contributor")[0] for i in range(20)
        ]
        _, maintainer = repo.create_token(session, "maria", "maintainer")
        start = datetime.now(UTC) - timedelta(days=30)
        rows = [_submission_row(i, rng, tokens[i % 20].id, start) for i in range(count)]
        session.execute(insert(Submission), rows)
        ids = [row[0] for row in session.execute(text("SELECT id FROM submissions"))]
        jobs = [
            {"submission_id": sid, "queue": queue, "state": "passed", "attempts": 1}
            for sid in ids
            for queue in ("cpu", "gpu.h200.x1")
        ]
        session.execute(insert(Job), jobs)
        session.execute(text("ANALYZE"))
    return maintainer


def _submission_row(i: int, rng: random.Random, owner: int, start: datetime) -> dict[str, Any]:
    state = rng.choice(STATES)
    created = start + timedelta(seconds=i * 250)
    return {
        "scope": rng.choice(SCOPES),
        "manifest_text": "name: x\n",
        "manifest": {"name": "x"},
        "source_kind": "git",
        "source_url": "https://example.com/kernels.git",
        "source_sha": f"{rng.getrandbits(160):040x}",
        "submitter_id": owner,
        "state": state,
        "verdict": VERDICT_OF.get(state),
        "verdict_reasons": [f"gpu.h200.x1: {VERDICT_OF.get(state, state)}"],
        "created_at": created,
        "updated_at": created,
    }


def measure(token: str, requests: int) -> dict[str, dict[str, float]]:
    from fastapi.testclient import TestClient

    from harness.api.app import create_app

    results = {}
    with TestClient(create_app(enqueue=lambda job, queue: None)) as client:
        _sign_in(client, token)
        for name, query in VARIANTS.items():
            url = f"/dashboard/submissions?{query}"
            for _ in range(3):  # warm the connection pool, the template cache, PostgreSQL's
                assert client.get(url).status_code == 200
            times = [_timed(client, url) for _ in range(requests)]
            results[name] = _stats(times)
    return results


def _sign_in(client: Any, token: str) -> None:
    form = client.get("/dashboard/login").text
    csrf = re.search(r'name="csrf" value="([^"]+)"', form)
    assert csrf is not None
    response = client.post("/dashboard/login", data={"token": token, "csrf": csrf.group(1)})
    assert response.status_code == 200, response.text


def _timed(client: Any, url: str) -> float:
    started = time.perf_counter()
    response = client.get(url)
    elapsed = (time.perf_counter() - started) * 1000
    assert response.status_code == 200 and 'data-id="' in response.text
    return elapsed


def _stats(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "n": len(times),
        "p50_ms": statistics.median(ordered),
        "p95_ms": ordered[max(0, round(0.95 * len(ordered)) - 1)],
        "max_ms": ordered[-1],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--submissions", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument(
        "--out", type=Path, default=Path("pathgate-out/benchmarks/dashboard_list.json")
    )
    args = parser.parse_args()

    create_database()
    # The app reads its database from Settings; point it at the benchmark's own database.
    os.environ["PATHGATE_DATABASE_URL"] = BENCH_URL
    from harness.store.migrate import upgrade

    upgrade(BENCH_URL)
    started = time.perf_counter()
    token = seed(args.submissions)
    seed_s = time.perf_counter() - started
    results = measure(token, args.requests)

    print(f"{args.submissions} submissions in PostgreSQL (seeded in {seed_s:.1f} s)")
    print(f"{'variant':<24} {'n':>4} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8}")
    for name, row in results.items():
        times = f"{row['p50_ms']:>8.1f} {row['p95_ms']:>8.1f} {row['max_ms']:>8.1f}"
        print(f"{name:<24} {row['n']:>4} {times}")
    worst = max(row["p50_ms"] for row in results.values())
    ok = worst <= BUDGET_MS
    print(f"worst p50 {worst:.1f} ms: {'within' if ok else 'OVER'} the {BUDGET_MS:.0f} ms budget")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "submissions": args.submissions,
        "budget_p50_ms": BUDGET_MS,
        "within_budget": ok,
        "variants": results,
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
