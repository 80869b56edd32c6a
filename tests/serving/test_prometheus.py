"""Prometheus text: counters summed over engines, vLLM's speculative-decoding counters read."""

from __future__ import annotations

import pytest

from harness.serving.prometheus import (
    MetricsError,
    SpecDecodeCounters,
    parse_counters,
    spec_decode_counters,
)

# Two engines (data parallel 2), as vLLM's v1 engine exposes them, with _created timestamps.
VLLM_TEXT = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 40.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 60.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 120.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 180.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 70.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 110.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""


def test_counters_are_summed_over_engines_without_created_timestamps() -> None:
    counters = parse_counters(VLLM_TEXT)
    assert counters["vllm:spec_decode_num_drafts"] == 100.0
    assert counters["vllm:num_requests_running"] == 3.0
    assert not any(name.endswith("_created") for name in counters)


def test_acceptance_length_includes_the_bonus_token() -> None:
    counters = spec_decode_counters(parse_counters(VLLM_TEXT))
    assert counters == SpecDecodeCounters(drafts=100, draft_tokens=300, accepted_tokens=180)
    assert counters.acceptance_length == pytest.approx(1 + 180 / 100)
    assert counters.acceptance_rate == pytest.approx(180 / 300)


def test_deltas_measure_one_run() -> None:
    before = SpecDecodeCounters(10, 30, 15)
    after = SpecDecodeCounters(30, 90, 55)
    assert after.minus(before).acceptance_length == pytest.approx(1 + 40 / 20)


def test_no_counters_without_speculative_decoding() -> None:
    text = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
    assert spec_decode_counters(parse_counters(text)) is None
    assert SpecDecodeCounters(0, 0, 0).acceptance_length is None


def test_text_that_is_not_prometheus_is_an_error() -> None:
    with pytest.raises(MetricsError, match="not Prometheus text"):
        parse_counters("vllm:x{engine=0 1\n")
