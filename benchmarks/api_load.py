"""API load: latency and throughput of the REST API with PostgreSQL and Redis behind it.

Starts the API with uvicorn in a subprocess (`--workers` processes) on its own PostgreSQL
database (`pathgate_bench`, schema reset and migrated first; never `public` of `test`) and Redis
db 14 as the broker (flushed before and after: every POST enqueues its jobs there and no worker
consumes them). Then `--clients` concurrent clients (asyncio + one httpx.AsyncClient each) run
closed loops for `--seconds` (back to back, or paced to a total of `--rate` requests/s), after
an unrecorded warm-up: each request is POST /v1/submissions
(the manifest text of scopes/fused-add-rmsnorm-h200.yaml, source in_tree) with probability
`--post-share`, else GET /v1/submissions/{id} of a submission created earlier. Records each
request's latency; prints a table (operation, requests, req/s, p50 ms, p99 ms, errors), the
errors by kind, and the CPU over the recorded window (this client, the API processes,
PostgreSQL, Redis, other processes; API CPU per request); writes JSON to --out (default
pathgate-out/benchmarks/api_load.json) and stops the server (its whole process group) at the end.

The load generator runs on the same machine as the server, PostgreSQL and Redis: on a small
machine it takes CPU from them, and the CPU split says how much (and how much went to other
processes: on a shared machine, other people's work).

    .venv/bin/python benchmarks/api_load.py [--clients 50] [--seconds 30] [--workers 2]
        [--rate 0] [--post-share 0.5] [--out pathgate-out/benchmarks/api_load.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.store import repositories as repo  # noqa: E402
from harness.store.migrate import upgrade  # noqa: E402

DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/pathgate_bench"
BROKER_URL = "redis://127.0.0.1:6379/14"
MANIFEST = (ROOT / "scopes" / "fused-add-rmsnorm-h200.yaml").read_text()
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SEEDED_SUBMISSIONS = 20


@dataclass
class Recorder:
    """Per-operation latencies (s) and error count, and the ids GETs choose from."""

    latencies: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    error_kinds: dict[str, int] = field(default_factory=dict)  # "POST ... 500": count
    ids: list[int] = field(default_factory=list)
    recording: bool = False

    def add(self, op: str, seconds: float, error: str | None) -> None:
        if not self.recording:
            return
        self.latencies.setdefault(op, []).append(seconds)
        self.errors[op] = self.errors.get(op, 0) + (error is not None)
        if error is not None:
            kind = f"{op}: {error}"
            self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


# --- the database, the broker and the server ------------------------------------------------


def reset_database(url: str) -> None:
    """Create the benchmark database if missing, empty its public schema, migrate it."""
    server, name = url.rsplit("/", 1)
    admin = create_engine(f"{server}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        query = text("SELECT 1 FROM pg_database WHERE datname = :name")
        if not connection.scalar(query, {"name": name}):
            connection.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(text("DROP SCHEMA IF EXISTS public CASCADE"))
        connection.execute(text("CREATE SCHEMA public"))
    engine.dispose()
    upgrade(url)


def create_token(url: str) -> str:
    engine = create_engine(url)
    try:
        with Session(engine) as session:
            _, plaintext = repo.create_token(session, "api-load", "maintainer")
            session.commit()
    finally:
        engine.dispose()
    return plaintext


def flush_broker(url: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def server_env(args: argparse.Namespace) -> dict[str, str]:
    return {
        **os.environ,
        "PATHGATE_DATABASE_URL": args.database_url,
        "PATHGATE_BROKER_URL": args.broker_url,
        "PATHGATE_RATE_LIMIT_PER_MINUTE": str(10**9),
    }


@contextmanager
def running_server(args: argparse.Namespace, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """uvicorn in its own process group; the group is stopped (TERM, then KILL) on the way out."""
    command = [
        sys.executable, "-m", "uvicorn", "harness.api.app:create_app", "--factory",
        "--host", "127.0.0.1", "--port", str(port), "--workers", str(args.workers),
        "--log-level", "warning", "--no-access-log",
    ]  # fmt: skip
    server = subprocess.Popen(command, cwd=ROOT, env=server_env(args), start_new_session=True)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", server, timeout_s=60)
        yield server
    finally:
        stop_group(server)


def wait_until_healthy(base: str, server: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"uvicorn exited with {server.returncode}")
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the API did not answer /healthz within {timeout_s} s")


def stop_group(server: subprocess.Popen[bytes]) -> None:
    for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


# --- CPU accounting (Linux /proc) ------------------------------------------------------------


def process_cpu_s(api_pgid: int) -> dict[str, float]:
    """User + system CPU seconds of the live API processes (its process group), PostgreSQL's
    and Redis's processes (by name)."""
    ticks = {"api": 0, "postgres": 0, "redis": 0}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            head, tail = (entry / "stat").read_text().rsplit(")", 1)
        except (OSError, ValueError):
            continue
        fields, name = tail.split(), head.split("(", 1)[1]
        used = int(fields[11]) + int(fields[12])  # utime, stime; fields[2] is the pgrp
        if int(fields[2]) == api_pgid:
            ticks["api"] += used
        elif name.startswith(("postgres", "redis-server")):
            ticks["postgres" if name.startswith("postgres") else "redis"] += used
    return {key: value / CLOCK_TICKS for key, value in ticks.items()}


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot (guest time is already in user)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    idle = values[3] + values[4]
    return (sum(values) - idle) / CLOCK_TICKS, sum(values) / CLOCK_TICKS


@dataclass(frozen=True)
class CpuSample:
    seconds: dict[str, float]  # client (this process), api, postgres, redis, busy, total

    @classmethod
    def take(cls, api_pgid: int) -> CpuSample:
        busy, total = machine_cpu_s()
        processes = process_cpu_s(api_pgid)
        return cls({"client": time.process_time(), **processes, "busy": busy, "total": total})


def cpu_split(start: CpuSample, end: CpuSample, requests: int) -> dict[str, float]:
    """Shares of the machine's CPU capacity over the recorded window, and API CPU per request."""
    used = {key: end.seconds[key] - start.seconds[key] for key in start.seconds}
    ours = sum(used[key] for key in ("client", "api", "postgres", "redis"))
    shares = {key: used[key] / used["total"] for key in ("busy", "client", "api", "postgres")}
    return {
        **shares,
        "redis": used["redis"] / used["total"],
        "other": max(0.0, used["busy"] - ours) / used["total"],
        "api_cpu_ms_per_request": 1000 * used["api"] / max(1, requests),
    }


# --- the load --------------------------------------------------------------------------------


async def one_request(client: httpx.AsyncClient, recorder: Recorder, post: bool) -> None:
    op = "POST /v1/submissions" if post else "GET /v1/submissions/{id}"
    started = time.perf_counter()
    response, error = None, None
    try:
        if post:
            body = {"manifest": MANIFEST, "source": {"kind": "in_tree"}}
            response = await client.post("/v1/submissions", json=body)
        else:
            response = await client.get(f"/v1/submissions/{random.choice(recorder.ids)}")
        error = None if response.is_success else f"HTTP {response.status_code}"
    except httpx.HTTPError as exc:
        error = type(exc).__name__
    recorder.add(op, time.perf_counter() - started, error)
    if post and response is not None and error is None:
        recorder.ids.append(int(response.json()["id"]))


async def client_loop(
    base: str, token: str, recorder: Recorder, args: argparse.Namespace, stop_at: float
) -> None:
    """Requests back to back or, with --rate, one every clients/rate seconds (a late request
    is followed by the next one at once; missed slots are not made up)."""
    headers = {"Authorization": f"Bearer {token}"}
    interval = args.clients / args.rate if args.rate > 0 else 0.0
    next_at = time.monotonic() + random.uniform(0, interval)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=30) as client:
        while max(next_at, time.monotonic()) < stop_at:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            await one_request(client, recorder, random.random() < args.post_share)
            next_at = max(next_at + interval, time.monotonic()) if interval else 0.0


async def seed(base: str, token: str, recorder: Recorder) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=30) as client:
        for _ in range(SEEDED_SUBMISSIONS):
            await one_request(client, recorder, post=True)
    if len(recorder.ids) < SEEDED_SUBMISSIONS:
        raise RuntimeError("could not create the submissions the GETs read")


async def run_load(
    args: argparse.Namespace, base: str, token: str, server_pgid: int
) -> tuple[Recorder, CpuSample, CpuSample]:
    """The recorded requests, and CPU samples at the start and end of the recorded window."""
    recorder = Recorder()
    await seed(base, token, recorder)
    stop_at = time.monotonic() + args.warmup + args.seconds
    loops = [
        asyncio.create_task(client_loop(base, token, recorder, args, stop_at))
        for _ in range(args.clients)
    ]
    await asyncio.sleep(args.warmup)
    recorder.recording, start = True, CpuSample.take(server_pgid)
    await asyncio.gather(*loops)
    return recorder, start, CpuSample.take(server_pgid)


# --- results ---------------------------------------------------------------------------------


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return float("nan")
    rank = min(max(1, math.ceil(q / 100 * len(sorted_values))), len(sorted_values))
    return sorted_values[rank - 1]


def summarize(recorder: Recorder, seconds: float) -> list[dict[str, Any]]:
    rows = []
    every: list[float] = []
    for op, values in sorted(recorder.latencies.items()):
        every += values
        rows.append(_row(op, sorted(values), recorder.errors[op], seconds))
    rows.append(_row("all", sorted(every), sum(recorder.errors.values()), seconds))
    return rows


def _row(op: str, values: list[float], errors: int, seconds: float) -> dict[str, Any]:
    return {
        "operation": op,
        "requests": len(values),
        "req_per_s": len(values) / seconds,
        "p50_ms": 1000 * percentile(values, 50),
        "p99_ms": 1000 * percentile(values, 99),
        "max_ms": 1000 * max(values, default=float("nan")),
        "errors": errors,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'operation':<28}{'requests':>10}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}")
    for r in rows:
        print(
            f"{r['operation']:<28}{r['requests']:>10}{r['req_per_s']:>9.1f}"
            f"{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}{r['errors']:>8}"
        )


# --- main ------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--workers", type=int, default=2, help="uvicorn worker processes")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds, not recorded")
    parser.add_argument("--post-share", type=float, default=0.5, help="share of POSTs")
    parser.add_argument(
        "--rate", type=float, default=0.0, help="total requests/s to pace at; 0: back to back"
    )
    parser.add_argument("--database-url", default=DATABASE_URL)
    parser.add_argument("--broker-url", default=BROKER_URL)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "pathgate-out" / "benchmarks" / "api_load.json"
    )
    return parser.parse_args()


def measure(args: argparse.Namespace, token: str) -> dict[str, Any]:
    port = free_port()
    with running_server(args, port) as server:
        load = run_load(args, f"http://127.0.0.1:{port}", token, server.pid)
        recorder, start, end = asyncio.run(load)
    rows = summarize(recorder, args.seconds)
    return {
        "rows": rows,
        "errors": recorder.error_kinds,
        "cpu": cpu_split(start, end, rows[-1]["requests"]),
    }


def main() -> int:
    args = parse_args()
    reset_database(args.database_url)
    token = create_token(args.database_url)
    flush_broker(args.broker_url)
    try:
        result = measure(args, token)
    finally:
        flush_broker(args.broker_url)
    pacing = f"paced at {args.rate:g} req/s" if args.rate > 0 else "back to back"
    print(
        f"{args.clients} clients ({pacing}), {args.seconds:g} s after {args.warmup:g} s warm-up, "
        f"{args.workers} uvicorn workers, POST share {args.post_share:g}, "
        f"{os.cpu_count()} CPU cores"
    )
    print_table(result["rows"])
    for kind, count in sorted(result["errors"].items()):
        print(f"  error: {kind} x{count}")
    print(
        "CPU, share of the machine's: busy {busy:.0%} = load client {client:.0%} + API "
        "{api:.0%} + PostgreSQL {postgres:.0%} + Redis {redis:.0%} + other processes "
        "{other:.0%}; API CPU per request {api_cpu_ms_per_request:.1f} ms".format(**result["cpu"])
    )
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report = {"config": {**config, "cpu_count": os.cpu_count()}, **result}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
