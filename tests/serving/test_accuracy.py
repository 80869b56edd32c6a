"""Greedy comparison rules, and GSM8K's skip and result reading (lm_eval itself is optional)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from harness.serving import accuracy
from harness.serving.accuracy import (
    Completion,
    Gsm8kFailed,
    Gsm8kScore,
    Gsm8kSkipped,
    compare_greedy,
    gsm8k_summary,
    parse_lm_eval_results,
    run_gsm8k,
)


def test_identical_outputs_match_fully() -> None:
    outputs = [Completion("a b", [1, 2]), Completion("c", [3])]
    result = compare_greedy(outputs, list(outputs))
    assert (result.exact_match_rate, result.token_match_rate) == (1.0, 1.0)
    assert result.unit == "token ids" and result.first_divergence == [None, None]


def test_a_divergence_counts_the_matched_prefix_of_the_longer_output() -> None:
    baseline = [Completion("", [1, 2, 3, 4]), Completion("", [5, 6])]
    candidate = [Completion("", [1, 2, 9, 9, 9]), Completion("", [5, 6])]
    result = compare_greedy(baseline, candidate)
    assert result.exact_match_rate == 0.5
    assert result.token_match_rate == pytest.approx((2 + 2) / (5 + 2))
    assert result.first_divergence == [2, None]


def test_without_token_ids_words_of_the_text_are_compared() -> None:
    result = compare_greedy([Completion("the cat sat", None)], [Completion("the cat ran", None)])
    assert result.unit == "words"
    assert result.token_match_rate == pytest.approx(2 / 3)


def test_a_failed_request_is_a_mismatch_and_reported() -> None:
    baseline = [Completion("x", [1]), Completion("y", [2])]
    candidate = [Completion("x", [1]), Completion("", None, "HTTP 500: boom")]
    result = compare_greedy(baseline, candidate)
    assert result.exact_match_rate == 0.5
    assert result.errors == ["prompt 1 (candidate): HTTP 500: boom"]


def test_gsm8k_is_skipped_without_lm_eval(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(accuracy.importlib.util, "find_spec", lambda name: None)
    outcome = run_gsm8k("http://127.0.0.1:1", "m", 10, tmp_path)
    assert isinstance(outcome, Gsm8kSkipped)
    assert str(outcome) == "skipped: lm_eval is not installed (pip install 'lm-eval[api]')"
    assert gsm8k_summary({"baseline": outcome, "candidate": outcome}) == str(outcome)


def _write_results(folder: Path, task: dict[str, object]) -> Path:
    path = folder / "fake-model" / "results_2026-01-15T10-15-00.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"results": {"gsm8k": task}, "config": {}}))
    return path


def test_lm_eval_results_are_read_for_both_filters(tmp_path: Path) -> None:
    path = _write_results(
        tmp_path, {"exact_match,strict-match": 0.75, "exact_match,flexible-extract": 0.8}
    )
    outcome = parse_lm_eval_results(tmp_path, limit=20)
    assert outcome == Gsm8kScore(0.75, 0.8, 20, str(path))
    candidate = Gsm8kScore(0.7, 0.77, 20, str(path))
    summary = gsm8k_summary({"baseline": outcome, "candidate": candidate})
    assert summary == "gsm8k flexible-extract: baseline 0.8000, candidate 0.7700 (-0.0300)"


def test_lm_eval_results_without_gsm8k_scores_are_a_failure(tmp_path: Path) -> None:
    _write_results(tmp_path, {"acc,none": 0.5})
    outcome = parse_lm_eval_results(tmp_path, limit=None)
    assert isinstance(outcome, Gsm8kFailed) and "no gsm8k exact_match scores" in outcome.error


@pytest.mark.parametrize(
    "body", [b'{"choices": ["x"]}', b'{"choices": [null]}', b'{"choices": "x"}', b"[" * 100_000]
)
def test_a_completion_reply_without_a_choice_object_is_that_prompts_error(body: bytes) -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))

    async def complete() -> Completion:
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            return await accuracy._complete(client, "m", [1, 2], 4)

    completion = asyncio.run(complete())
    assert completion.token_ids is None and completion.text == ""
    assert completion.error is not None and completion.error.startswith("no choices")


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"text": "a b", "token_ids": [1, 2]}, Completion("a b", [1, 2])),
        # nested 900 deep, the evidence's JSON writer overflowed the stack and lost the A/B
        ({"text": "a", "token_ids": [[[]]] * 2}, Completion("a", None)),
        ({"text": "a", "token_ids": [1, True]}, Completion("a", None)),
        ({"text": ["a"], "token_ids": "12"}, Completion("", None)),
    ],
)
def test_token_ids_that_are_not_ints_are_compared_as_words(
    choice: dict, expected: Completion
) -> None:
    body = json.dumps({"choices": [choice]}).encode()
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))

    async def complete() -> Completion:
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            return await accuracy._complete(client, "m", [1, 2], 4)

    assert asyncio.run(complete()) == expected
