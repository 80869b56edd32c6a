"""Importing `vllm bench serve --save-result` JSON: rows keep vLLM's keys with provenance; a
malformed file is an error naming the field."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from harness.serving.cli import app
from harness.serving.vllm_import import VllmResultError, import_vllm_result

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_bench_serve_result.json"
RESULT: dict[str, Any] = json.loads(FIXTURE.read_text())


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "result.json"
    path.write_text(json.dumps(data))
    return path


def test_provenance_names_the_file_its_hash_and_vllm_setup() -> None:
    provenance = import_vllm_result(FIXTURE).provenance
    assert provenance.file_name == FIXTURE.name
    assert provenance.sha256 == hashlib.sha256(FIXTURE.read_bytes()).hexdigest()
    assert (provenance.date, provenance.backend) == (RESULT["date"], RESULT["backend"])
    assert provenance.model_id == RESULT["model_id"]
    assert provenance.request_rate == "inf" and provenance.max_concurrency == 2


def test_rows_keep_vllm_keys_and_name_pathgate_metrics() -> None:
    imported = import_vllm_result(FIXTURE)
    throughput = imported.row("output_throughput")
    assert (throughput.value, throughput.unit) == (RESULT["output_throughput"], "tok/s")
    assert throughput.metric == "tokens_per_s"
    p99 = imported.row("p99_ttft_ms")
    assert (p99.value, p99.metric, p99.statistic) == (RESULT["p99_ttft_ms"], "ttft_ms", "p99")
    assert imported.row("median_tpot_ms").metric == "tpot_ms"
    assert imported.row("p90_itl_ms").statistic == "p90"
    assert imported.row("mean_e2el_ms").metric == "e2e_ms"
    length = imported.row("spec_decode_acceptance_length")
    assert length.value == RESULT["spec_decode_acceptance_length"]
    assert length.metric == "acceptance_length"


def test_interactivity_is_derived_from_the_per_request_itls() -> None:
    imported = import_vllm_result(FIXTURE)
    assert imported.per_request == len(RESULT["ttfts"])
    all_itls = [gap for request in RESULT["itls"] for gap in request]
    p90 = imported.row("interactivity_p90")
    assert p90.value == pytest.approx(1 / np.percentile(all_itls, 90))
    assert [row.key for row in imported.derived] == [f"interactivity_p{p}" for p in (50, 90, 99)]


def test_a_result_without_per_request_lists_has_no_derived_rows(tmp_path: Path) -> None:
    summary = {k: v for k, v in RESULT.items() if k not in ("ttfts", "itls", "input_lens")}
    summary = {k: v for k, v in summary.items() if k not in ("output_lens", "latencies")}
    imported = import_vllm_result(_write(tmp_path, summary))
    assert imported.per_request == 0 and imported.derived == []
    assert json.loads(json.dumps(imported.to_json(), allow_nan=False))["rows"]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"output_throughput": None}, "field 'output_throughput' is missing (a finite number)"),
        ({"completed": "four"}, "field 'completed': expected a whole number >= 0 (below 2^63)"),
        ({"completed": 10**401}, "field 'completed': expected a whole number >= 0 (below 2^63)"),
        ({"duration": float("nan")}, "field 'duration': expected a finite number, got NaN"),
        ({"duration": 10**401}, "field 'duration': expected a finite number"),
        ({"ttfts": [0.1, float("inf"), 0.1, 0.1]}, "field 'ttfts': expected a list of numbers"),
        ({"model_id": 7}, "field 'model_id': expected a string, got 7"),
        ({"duration": True}, "field 'duration': expected a finite number, got true"),
        ({"mean_ttft_ms": "fast"}, "field 'mean_ttft_ms': expected a finite number"),
        ({"itls": [0.1, 0.2, 0.3, 0.4]}, "field 'itls': expected a list of lists of numbers"),
        ({"ttfts": [0.05]}, "per-request lists differ in length: input_lens=4, output_lens=4"),
    ],
)
def test_a_malformed_field_is_named(tmp_path: Path, change: dict[str, Any], words: str) -> None:
    data = {k: v for k, v in {**RESULT, **change}.items() if v is not None}
    with pytest.raises(VllmResultError) as failure:
        import_vllm_result(_write(tmp_path, data))
    assert str(failure.value).startswith("result.json: ")
    assert words in str(failure.value)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{not json", "result.json: not JSON"),
        ("[1, 2]", "expected one JSON object (a result)"),
        ("[" * 100_000, "result.json: JSON nested too deeply"),
        ('{"completed": ' + "9" * 5000 + "}", "result.json: not JSON: Exceeds the limit"),
        ('{"model_id": "\\ud800"}', "result.json: the JSON holds a lone surrogate"),
    ],
)
def test_a_file_that_is_not_a_result_is_an_error(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "result.json"
    path.write_text(text)
    with pytest.raises(VllmResultError, match=words.replace("(", r"\(").replace(")", r"\)")):
        import_vllm_result(path)


def test_the_cli_prints_rows_and_exits_2_on_a_bad_file(tmp_path: Path) -> None:
    runner = CliRunner()
    good = runner.invoke(app, ["import-vllm", str(FIXTURE)])
    assert good.exit_code == 0, good.output
    assert (
        json.loads(good.stdout)[0]["provenance"]["sha256"]
        == hashlib.sha256(FIXTURE.read_bytes()).hexdigest()
    )
    bad = runner.invoke(app, ["import-vllm", str(_write(tmp_path, {"date": "x"}))])
    assert bad.exit_code == 2
    assert "field 'backend' is missing" in bad.output
