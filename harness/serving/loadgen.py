"""A closed-loop, streaming load generator for an OpenAI-compatible `/v1/completions` server.

`concurrency` workers pull from one list of `num_prompts` prompts; each sends its request,
reads the SSE stream to the end and takes the next prompt, so exactly `concurrency` requests are
in flight until the list runs out (vLLM's `bench serve --max-concurrency` with an infinite
request rate behaves the same way).

Prompts are lists of token ids (vLLM accepts them as `prompt`), so the input length is exact
without a tokenizer: ids are drawn uniformly from [1000, 30000), inside every current LLM
vocabulary and above the low ids where special tokens usually sit, from a seeded generator. Every
request gets its own random prompt, so prefix caching cannot make one arm look faster.
Requests ask for `max_tokens=output_len` with `ignore_eos`, so every request generates exactly
`output_len` tokens.

Per request: start, the arrival of every content chunk (the first one is the first token), end,
output tokens (the `usage` of the last chunk, asked for with `stream_options.include_usage`;
the number of content chunks when the server sends no usage) and the error if any.
docs/serving.md defines the aggregate metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from harness.json_input import UnreadableJson, load_json
from harness.serving.jsonable import jsonable
from harness.serving.prometheus import (
    MetricsError,
    SpecDecodeCounters,
    fetch_counters,
    spec_decode_counters,
)

TOKEN_ID_LOW, TOKEN_ID_HIGH = 1000, 30000
INTERACTIVITY_PERCENTILES = (50, 90, 99)
CONNECT_TIMEOUT_S = 10.0


def make_prompts(count: int, input_len: int, seed: int) -> list[list[int]]:
    """`count` prompts of exactly `input_len` token ids each, the same for the same seed."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(TOKEN_ID_LOW, TOKEN_ID_HIGH, size=(count, input_len))  # (count, input_len)
    return [[int(i) for i in row] for row in ids]


@dataclass(frozen=True)
class LoadSpec:
    base_url: str  # http://host:port
    model: str
    input_len: int
    output_len: int
    num_prompts: int
    concurrency: int
    seed: int = 0
    request_timeout_s: float = 600.0
    metrics_path: str | None = "/metrics"  # None: do not read speculative-decoding counters
    health_path: str = "/health"  # GET once per connection before the clock starts


@dataclass(frozen=True)
class RequestRecord:
    """One request. Times are seconds since the run started (perf_counter)."""

    index: int
    start_s: float
    chunk_times_s: tuple[float, ...]  # arrival of each content chunk; [0] is the first token
    end_s: float
    output_tokens: int
    usage_reported: bool
    error: str | None = None
    connect_failed: bool = False  # the server refused the connection: it is not there

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] - self.start_s if self.chunk_times_s else float("nan")

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float:
        """(e2e - ttft) / (output tokens - 1): decode time per token after the first."""
        if self.output_tokens < 2 or not self.chunk_times_s:
            return float("nan")
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in itertools.pairwise(times)]


@dataclass(frozen=True)
class Distribution:
    count: int
    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> Distribution:
        clean = np.asarray([v for v in values if v == v], dtype=np.float64)
        if clean.size == 0:
            return cls(0, float("nan"), float("nan"), float("nan"), float("nan"))
        p50, p90, p99 = np.percentile(clean, [50, 90, 99])
        return cls(int(clean.size), float(clean.mean()), float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class LoadRun:
    """One run at one concurrency: aggregates, then the per-request raw figures."""

    concurrency: int
    num_prompts: int
    input_len: int
    output_len: int
    seed: int
    duration_s: float
    completed: int
    failed: int
    error_counts: dict[str, int]
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens of completed requests / s (tokens_per_s)
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    # tokens/s per user at p50/p90/p99: 1000 / pX(ITL), and the (100 - X)th percentile of
    # output_tokens / e2e per request (the rate X% of requests reach or beat)
    interactivity_itl: dict[str, float]
    interactivity_e2e: dict[str, float]
    spec_decode: SpecDecodeCounters | None
    acceptance_length: float | None
    notes: list[str]
    requests: list[dict[str, Any]] = field(repr=False)

    def metric(self, name: str) -> float:
        """A per-run value of a serving claim metric (NaN when this run has none)."""
        values = {
            "tokens_per_s": self.output_throughput,
            "request_throughput": self.request_throughput,
            "ttft_ms": self.ttft_ms.median,
            "tpot_ms": self.tpot_ms.median,
            "itl_ms": self.itl_ms.median,
            "e2e_ms": self.e2e_ms.median,
            "interactivity_p50": self.interactivity_itl["p50"],
            "interactivity_p90": self.interactivity_itl["p90"],
            "interactivity_p99": self.interactivity_itl["p99"],
            "acceptance_length": float("nan")
            if self.acceptance_length is None
            else self.acceptance_length,
        }
        return values[name]

    def to_json(self) -> dict[str, Any]:
        return dict(jsonable(self))


class ServerStopped(Exception):
    """The server went away during a run: the run ends here rather than timing out request by
    request."""


@dataclass
class _Run:
    spec: LoadSpec
    client: httpx.AsyncClient
    clock_zero: float
    alive: Callable[[], bool] | None
    records: list[RequestRecord] = field(default_factory=list)

    def now(self) -> float:
        return time.perf_counter() - self.clock_zero


async def run_load(spec: LoadSpec, alive: Callable[[], bool] | None = None) -> LoadRun:
    """Drive one closed-loop run; ServerStopped if the server goes away (a refused connection,
    or `alive()` false after a failed request). Cancelling the task closes every stream."""
    prompts = make_prompts(spec.num_prompts, spec.input_len, spec.seed)
    timeout = httpx.Timeout(spec.request_timeout_s, connect=CONNECT_TIMEOUT_S)
    limits = httpx.Limits(max_connections=spec.concurrency + 2)
    async with httpx.AsyncClient(base_url=spec.base_url, timeout=timeout, limits=limits) as client:
        before, notes = await _spec_counters(client, spec)
        await _open_connections(client, spec)
        run = _Run(spec, client, time.perf_counter(), alive)
        queue = deque(enumerate(prompts))
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(min(spec.concurrency, len(prompts))):
                    group.create_task(_worker(run, queue))
        except* ServerStopped as stopped:
            raise stopped.exceptions[0] from None
        duration_s = run.now()
        after, after_notes = await _spec_counters(client, spec)
    zero = SpecDecodeCounters(0.0, 0.0, 0.0)  # a labelled counter has no sample until used
    delta = after.minus(before or zero) if after else None
    return summarize(spec, run.records, duration_s, delta, notes + after_notes)


async def _open_connections(client: httpx.AsyncClient, spec: LoadSpec) -> None:
    """One concurrent GET per worker opens the pool's connections, so TCP setup is not charged
    to the first requests' TTFT. Failures are left to the run itself to report."""
    with contextlib.suppress(httpx.HTTPError):
        gets = (client.get(spec.health_path) for _ in range(spec.concurrency))
        await asyncio.gather(*gets)


async def _worker(run: _Run, queue: deque[tuple[int, list[int]]]) -> None:
    while queue:
        index, prompt = queue.popleft()
        record = await _request(run, index, prompt)
        run.records.append(record)
        if record.error is None:
            continue
        if record.connect_failed or (run.alive is not None and not run.alive()):
            done = len(run.records)
            raise ServerStopped(
                f"the server stopped during the run: request {index} failed with "
                f"{record.error} ({done} of {run.spec.num_prompts} requests finished or failed)"
            )


def _request_body(spec: LoadSpec, prompt: list[int]) -> dict[str, Any]:
    return {
        "model": spec.model,
        "prompt": prompt,
        "max_tokens": spec.output_len,
        "ignore_eos": True,  # generate exactly output_len tokens: every request costs the same
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _request(run: _Run, index: int, prompt: list[int]) -> RequestRecord:
    stream = _Stream(start_s=run.now())
    try:
        async with asyncio.timeout(run.spec.request_timeout_s):
            await _consume(run, prompt, stream)
    except TimeoutError:
        stream.error = f"timed out after {run.spec.request_timeout_s:g} s"
    except httpx.ConnectError as exc:
        stream.error, stream.connect_failed = f"cannot connect: {exc}", True
    except httpx.HTTPError as exc:
        stream.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return stream.record(index, run.now())


@dataclass
class _Stream:
    start_s: float
    chunk_times_s: list[float] = field(default_factory=list)
    usage_tokens: int | None = None
    done_s: float | None = None  # when [DONE] arrived: the request's end
    error: str | None = None
    connect_failed: bool = False

    @property
    def done(self) -> bool:
        return self.done_s is not None

    def record(self, index: int, end_s: float) -> RequestRecord:
        if self.error is None and not self.done:
            self.error = f"stream ended without [DONE] after {len(self.chunk_times_s)} chunks"
        tokens = self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times_s)
        return RequestRecord(
            index=index,
            start_s=self.start_s,
            chunk_times_s=tuple(self.chunk_times_s),
            end_s=self.done_s if self.done_s is not None else end_s,
            output_tokens=tokens,
            usage_reported=self.usage_tokens is not None,
            error=self.error,
            connect_failed=self.connect_failed,
        )


async def _consume(run: _Run, prompt: list[int], stream: _Stream) -> None:
    body = _request_body(run.spec, prompt)
    async with run.client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread())[:300].decode("utf-8", "replace")
            stream.error = f"HTTP {response.status_code}: {detail}"
            return
        async for line in response.aiter_lines():
            _on_line(line, stream, run.now())
            if stream.done or stream.error:
                return


def _on_line(line: str, stream: _Stream, now_s: float) -> None:
    """One SSE line: `data: {json}` chunks, `data: [DONE]` at the end; others are ignored."""
    if not line.startswith("data:"):
        return
    payload = line[len("data:") :].strip()
    if payload == "[DONE]":
        stream.done_s = now_s
        return
    try:
        event = load_json(payload)
    except UnreadableJson:
        event = None
    if not isinstance(event, dict):
        stream.error = f"not a JSON object in the stream: {payload[:120]!r}"
        return
    if "error" in event or event.get("object") == "error":
        stream.error = f"server error in the stream: {payload[:300]}"
        return
    choices = event.get("choices", [])  # [] in the usage-only chunk at the end
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        stream.error = f"a chunk whose choices are not objects: {payload[:120]!r}"
        return
    # a chunk with only a finish_reason carries no token: it is not a token arrival
    if choices and (choices[0].get("text") or choices[0].get("token_ids")):
        stream.chunk_times_s.append(now_s)
    usage = event.get("usage")
    if isinstance(usage, dict) and "completion_tokens" in usage:
        count = usage["completion_tokens"]
        if type(count) is not int or not 0 <= count < 2**31:  # bool is an int subclass
            stream.error = f"a usage count that is not a token count: {payload[:120]!r}"
            return
        stream.usage_tokens = count


async def _spec_counters(
    client: httpx.AsyncClient, spec: LoadSpec
) -> tuple[SpecDecodeCounters | None, list[str]]:
    if spec.metrics_path is None:
        return None, []
    try:
        return spec_decode_counters(await fetch_counters(client, spec.metrics_path)), []
    except MetricsError as exc:
        return None, [f"speculative-decoding counters not read: {exc}"]


def summarize(
    spec: LoadSpec,
    records: list[RequestRecord],
    duration_s: float,
    spec_delta: SpecDecodeCounters | None,
    notes: list[str],
) -> LoadRun:
    """The run's aggregates; only completed requests enter latencies and throughput."""
    done = sorted((r for r in records if r.error is None), key=lambda r: r.index)
    failed = [r for r in records if r.error is not None]
    itls_ms = [1000 * gap for r in done for gap in r.itls_s]
    rates = [r.output_tokens / r.e2e_s for r in done if r.e2e_s > 0]
    tokens = sum(r.output_tokens for r in done)
    return LoadRun(
        concurrency=spec.concurrency,
        num_prompts=spec.num_prompts,
        input_len=spec.input_len,
        output_len=spec.output_len,
        seed=spec.seed,
        duration_s=duration_s,
        completed=len(done),
        failed=len(failed),
        error_counts=dict(Counter(str(r.error) for r in failed)),
        total_output_tokens=tokens,
        request_throughput=len(done) / duration_s if duration_s > 0 else float("nan"),
        output_throughput=tokens / duration_s if duration_s > 0 else float("nan"),
        ttft_ms=Distribution.of([1000 * r.ttft_s for r in done]),
        tpot_ms=Distribution.of([1000 * r.tpot_s for r in done]),
        itl_ms=Distribution.of(itls_ms),
        e2e_ms=Distribution.of([1000 * r.e2e_s for r in done]),
        interactivity_itl=_per_user_rate(itls_ms, lambda p, v: _per_s(_pct(v, p))),
        interactivity_e2e=_per_user_rate(rates, lambda p, v: _pct(v, 100 - p)),
        spec_decode=spec_delta,
        acceptance_length=spec_delta.acceptance_length if spec_delta else None,
        notes=notes,
        requests=[_request_row(r) for r in sorted(records, key=lambda r: r.index)],
    )


def _pct(values: list[float], percentile: float) -> float:
    return float(np.percentile(values, percentile)) if values else float("nan")


def _per_s(interval_ms: float) -> float:
    return 1000 / interval_ms if interval_ms > 0 else float("nan")


def _per_user_rate(
    values: list[float], rate: Callable[[float, list[float]], float]
) -> dict[str, float]:
    return {f"p{p}": rate(p, values) for p in INTERACTIVITY_PERCENTILES}


def _request_row(record: RequestRecord) -> dict[str, Any]:
    return {
        "index": record.index,
        "start_s": record.start_s,
        "ttft_ms": 1000 * record.ttft_s,
        "e2e_ms": 1000 * record.e2e_s,
        "tpot_ms": 1000 * record.tpot_s,
        "output_tokens": record.output_tokens,
        "chunks": len(record.chunk_times_s),
        "usage_reported": record.usage_reported,
        "error": record.error,
    }
