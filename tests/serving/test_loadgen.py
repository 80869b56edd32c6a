"""The load generator against a fake server on a known schedule: every metric lands where the
schedule puts it (within the stated tolerance), failures are counted, a dying server ends the run,
and cancelling a run closes its streams.

Schedule: TTFT 80 ms, then one token every 20 ms; 10 output tokens, so e2e = 80 + 9 x 20 = 260 ms.
Tolerances cover the client's and the fake's own overhead on a loaded 2-core test machine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest

from harness.serving.launcher import RunningServer, free_port, launched
from harness.serving.loadgen import (
    TOKEN_ID_HIGH,
    TOKEN_ID_LOW,
    LoadRun,
    LoadSpec,
    ServerStopped,
    _on_line,
    _Stream,
    make_prompts,
    run_load,
)
from tests.serving.conftest import StartFake, fake_command, server_stats

TTFT_MS, ITL_MS, OUTPUT_LEN = 80.0, 20.0, 10
E2E_MS = TTFT_MS + (OUTPUT_LEN - 1) * ITL_MS
ACCEPTED_PER_DRAFT = 2
SCHEDULE_FLAGS = ("--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS))
SPECULATIVE_FLAGS = ("--speculative-config", '{"num_speculative_tokens": 3}')


def _spec(server: RunningServer, **changes: object) -> LoadSpec:
    values: dict[str, object] = {
        "base_url": server.base_url,
        "model": "fake-model",
        "input_len": 32,
        "output_len": OUTPUT_LEN,
        "num_prompts": 8,
        "concurrency": 4,
        "request_timeout_s": 30.0,
    }
    return LoadSpec(**{**values, **changes})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def schedule_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    port = free_port()
    flags = (*SCHEDULE_FLAGS, *SPECULATIVE_FLAGS, "--accepted-per-draft", str(ACCEPTED_PER_DRAFT))
    log = tmp_path_factory.mktemp("loadgen") / "fake.log"
    with launched(fake_command(port, *flags), port=port, log_path=log, startup_timeout_s=30) as s:
        # the first requests of a fresh process pay for its lazy imports and first-call paths
        asyncio.run(run_load(_spec(s)))
        yield s


@pytest.fixture(scope="module")
def schedule_run(schedule_server: RunningServer) -> LoadRun:
    return asyncio.run(run_load(_spec(schedule_server, num_prompts=16)))


def test_every_request_completes_with_exactly_output_len_tokens(schedule_run: LoadRun) -> None:
    assert (schedule_run.completed, schedule_run.failed) == (16, 0)
    assert all(r["output_tokens"] == OUTPUT_LEN for r in schedule_run.requests)
    assert all(r["usage_reported"] and r["chunks"] == OUTPUT_LEN for r in schedule_run.requests)
    assert schedule_run.total_output_tokens == 16 * OUTPUT_LEN


def test_latencies_follow_the_schedule(schedule_run: LoadRun) -> None:
    # The client's clock starts before the fake's schedule does, so a right TTFT or e2e is never
    # shorter than the schedule (2 ms for timer granularity); it is longer by both sides'
    # overhead, which a loaded CI machine stretched to +15 ms once: the upper margin is wider.
    assert TTFT_MS - 2 <= schedule_run.ttft_ms.median <= TTFT_MS + 40
    assert schedule_run.itl_ms.median == pytest.approx(ITL_MS, abs=5)
    assert schedule_run.itl_ms.count == 16 * (OUTPUT_LEN - 1)
    assert schedule_run.tpot_ms.median == pytest.approx(ITL_MS, abs=5)
    assert E2E_MS - 2 <= schedule_run.e2e_ms.median <= E2E_MS + 50


def test_tpot_is_decode_time_per_token_after_the_first(schedule_run: LoadRun) -> None:
    for row in schedule_run.requests:
        expected = (row["e2e_ms"] - row["ttft_ms"]) / (row["output_tokens"] - 1)
        assert row["tpot_ms"] == pytest.approx(expected, rel=1e-12)


def test_throughput_is_concurrency_over_e2e(schedule_run: LoadRun) -> None:
    # closed loop: 4 users each finish one request per e2e (16 prompts: four full waves)
    expected_rps = schedule_run.concurrency / (E2E_MS / 1000)
    assert schedule_run.request_throughput == pytest.approx(expected_rps, rel=0.15)
    assert schedule_run.output_throughput == pytest.approx(expected_rps * OUTPUT_LEN, rel=0.15)
    measured = schedule_run.completed / schedule_run.duration_s
    assert schedule_run.request_throughput == pytest.approx(measured, rel=1e-12)


def test_interactivity_is_per_user_tokens_per_second(schedule_run: LoadRun) -> None:
    by_itl, by_e2e = schedule_run.interactivity_itl, schedule_run.interactivity_e2e
    assert by_itl["p50"] == pytest.approx(1000 / schedule_run.itl_ms.median, rel=1e-12)
    assert by_itl["p90"] == pytest.approx(1000 / schedule_run.itl_ms.p90, rel=1e-12)
    assert by_itl["p50"] == pytest.approx(1000 / ITL_MS, rel=0.2)
    assert by_e2e["p50"] == pytest.approx(OUTPUT_LEN / (E2E_MS / 1000), rel=0.15)
    # a higher percentile is a slower tail: never a higher rate
    assert by_itl["p99"] <= by_itl["p90"] <= by_itl["p50"]
    assert by_e2e["p99"] <= by_e2e["p90"] <= by_e2e["p50"]


def test_acceptance_length_comes_from_the_counter_deltas(schedule_run: LoadRun) -> None:
    # the fake counts one draft per token, with ACCEPTED_PER_DRAFT accepted, over two engines
    assert schedule_run.spec_decode is not None
    assert schedule_run.spec_decode.drafts == 16 * OUTPUT_LEN
    assert schedule_run.acceptance_length == 1 + ACCEPTED_PER_DRAFT


def test_requests_ask_for_exact_lengths_and_usage(schedule_server: RunningServer) -> None:
    asyncio.run(run_load(_spec(schedule_server, num_prompts=1, concurrency=1)))
    body = server_stats(schedule_server)["last_request"]
    assert isinstance(body, dict)
    assert len(body["prompt"]) == 32
    assert body["max_tokens"] == OUTPUT_LEN and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_prompts_are_seeded_exact_and_distinct() -> None:
    prompts = make_prompts(16, 64, seed=7)
    assert prompts == make_prompts(16, 64, seed=7)
    assert prompts != make_prompts(16, 64, seed=8)
    assert all(len(p) == 64 for p in prompts)
    assert all(TOKEN_ID_LOW <= i < TOKEN_ID_HIGH for p in prompts for i in p)
    assert len({tuple(p) for p in prompts}) == 16


def test_without_usage_tokens_are_counted_from_chunks(start_fake: StartFake) -> None:
    server = start_fake("--no-usage", "--ttft-ms", "5", "--itl-ms", "2")
    run = asyncio.run(run_load(_spec(server, metrics_path=None)))
    assert run.completed == 8
    assert all(r["output_tokens"] == OUTPUT_LEN and not r["usage_reported"] for r in run.requests)


def test_http_500s_are_counted_and_left_out_of_latencies(start_fake: StartFake) -> None:
    server = start_fake("--http-500-every", "3", "--ttft-ms", "5", "--itl-ms", "2")
    run = asyncio.run(run_load(_spec(server, num_prompts=9, concurrency=3)))
    assert (run.completed, run.failed) == (6, 3)
    assert list(run.error_counts) == ['HTTP 500: {"error":{"message":"simulated 500"}}']
    assert run.ttft_ms.count == 6 and run.total_output_tokens == 6 * OUTPUT_LEN


def test_an_error_in_the_stream_fails_that_request(start_fake: StartFake) -> None:
    server = start_fake("--error-mid-stream-every", "2", "--ttft-ms", "5", "--itl-ms", "2")
    run = asyncio.run(run_load(_spec(server, num_prompts=6, concurrency=2)))
    assert (run.completed, run.failed) == (3, 3)
    assert all("simulated engine failure" in error for error in run.error_counts)


def test_a_server_dying_mid_run_ends_the_run(start_fake: StartFake) -> None:
    server = start_fake("--die-after-tokens", "25", "--ttft-ms", "5", "--itl-ms", "5")
    started = time.monotonic()
    with pytest.raises(ServerStopped, match="the server stopped during the run"):
        asyncio.run(run_load(_spec(server, num_prompts=40, concurrency=2)))
    assert time.monotonic() - started < 10


def test_a_failed_request_on_a_dead_server_ends_the_run(start_fake: StartFake) -> None:
    # every request fails (HTTP 500); `alive` says the process is gone: stop at the first
    server = start_fake("--http-500-every", "1")
    with pytest.raises(ServerStopped) as stopped:
        asyncio.run(run_load(_spec(server, num_prompts=10, concurrency=1), alive=lambda: False))
    assert "request 0 failed with HTTP 500" in str(stopped.value)
    assert server_stats(server)["completions"] == 1


def test_a_slow_request_times_out(start_fake: StartFake) -> None:
    server = start_fake("--ttft-ms", "50", "--itl-ms", "50")
    started = time.monotonic()
    run = asyncio.run(run_load(_spec(server, num_prompts=2, concurrency=2, request_timeout_s=0.3)))
    assert (run.completed, run.failed) == (0, 2)
    assert list(run.error_counts) == ["timed out after 0.3 s"]
    assert time.monotonic() - started < 3


def test_cancelling_a_run_closes_its_streams(start_fake: StartFake) -> None:
    server = start_fake("--ttft-ms", "5", "--itl-ms", "20")

    async def cancel_midway() -> float:
        task = asyncio.create_task(run_load(_spec(server, output_len=500, metrics_path=None)))
        await asyncio.sleep(0.5)
        assert server_stats(server)["active_streams"] == 4
        cancelled_at = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - cancelled_at

    assert asyncio.run(cancel_midway()) < 1.0
    deadline = time.monotonic() + 3
    while server_stats(server)["active_streams"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server_stats(server)["active_streams"] == 0


def test_run_results_are_plain_json(schedule_run: LoadRun) -> None:
    text = json.dumps(schedule_run.to_json(), allow_nan=False)
    assert json.loads(text)["ttft_ms"]["count"] == 16


@pytest.mark.parametrize(
    "payload", ["[1]", "1", '"text"', "null", "[" * 100_000, "1" * 5000, "{not json"]
)
def test_a_stream_line_that_is_not_a_json_object_fails_that_request(payload: str) -> None:
    """A broken or hostile server: the request fails with the line quoted, the run goes on."""
    stream = _Stream(start_s=0.0)
    _on_line(f"data: {payload}", stream, 1.0)
    assert stream.error is not None and stream.error.startswith("not a JSON object in the stream")
    assert stream.chunk_times_s == []


@pytest.mark.parametrize("choices", ['["x"]', '"x"', "[null]", "{}", "[1]"])
def test_a_chunk_whose_choices_are_not_objects_fails_that_request(choices: str) -> None:
    """Counted as a success it would be a request of no tokens that lowers the arm's figures."""
    stream = _Stream(start_s=0.0)
    _on_line(f'data: {{"choices": {choices}}}', stream, 1.0)
    assert stream.error is not None and "choices are not objects" in stream.error


def test_the_usage_only_chunk_at_the_end_is_no_token_and_no_error() -> None:
    stream = _Stream(start_s=0.0)
    _on_line('data: {"choices": [], "usage": {"completion_tokens": 7}}', stream, 1.0)
    assert stream.error is None and stream.chunk_times_s == [] and stream.usage_tokens == 7


@pytest.mark.parametrize("count", ["-5", "true", "1" * 400, '"3"', "2.5", "null"])
def test_a_usage_count_that_is_not_a_token_count_fails_that_request(count: str) -> None:
    """-5 gave negative tokens per second, true one token, 400 digits an OverflowError."""
    stream = _Stream(start_s=0.0)
    _on_line(f'data: {{"choices": [], "usage": {{"completion_tokens": {count}}}}}', stream, 1.0)
    assert stream.error is not None and "not a token count" in stream.error
    assert stream.usage_tokens is None
