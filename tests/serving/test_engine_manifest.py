"""The manifest's engine: section: a good one loads; bad placeholders and extra keys are located
errors; the serve template renders to argv safely; the default concurrency grid."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.serving.ab import serve_params, server_command
from scopes.engine import DEFAULT_SERVE, default_concurrency, render_serve
from scopes.manifest import ManifestError, ManifestProblem, ScopeManifest, load_manifest

SCOPES = Path(__file__).resolve().parents[2] / "scopes"
BASE = yaml.safe_load((SCOPES / "fused-add-rmsnorm-h200.yaml").read_text())
ENGINE: dict[str, Any] = {
    "baseline": {"env": {"VLLM_USE_FUSED_ADD_RMSNORM": "0"}},
    "candidate": {"env": {"VLLM_USE_FUSED_ADD_RMSNORM": "1"}, "flags": ["--enforce-eager"]},
    "workloads": [
        {"name": "decode-1k", "input_len": 1024, "output_len": 256, "num_prompts": 64},
        {
            "name": "decode-eagle",
            "input_len": 1024,
            "output_len": 256,
            "num_prompts": 64,
            "concurrency": [8, 1],
            "speculative": {"method": "eagle3", "num_speculative_tokens": 3},
        },
    ],
    "accuracy": {"prompts": 16, "max_tokens": 64},
}


def _load(engine: dict[str, Any], claims: list[dict[str, Any]] | None = None) -> ScopeManifest:
    data = {**BASE, "engine": engine, "claims": claims if claims is not None else BASE["claims"]}
    return load_manifest(yaml.safe_dump(data, sort_keys=False))


def _problems(engine: dict[str, Any]) -> list[ManifestProblem]:
    with pytest.raises(ManifestError) as caught:
        _load(engine)
    return caught.value.problems


def test_a_scope_with_an_engine_section_loads() -> None:
    manifest = _load(ENGINE, [{"metric": "ttft_ms", "where": {"batch": 1}, "at_most": 50}])
    engine = manifest.engine
    assert engine is not None
    assert engine.serve == DEFAULT_SERVE and engine.health_path == "/health"
    assert engine.startup_timeout_s == 900 and engine.workloads[0].repeats == 3
    assert engine.workloads[0].concurrency_levels(1, 512) == default_concurrency(1, 512)
    assert engine.workloads[1].concurrency == [1, 8]
    assert engine.accuracy.gsm8k is False and engine.accuracy.prompts == 16
    assert manifest.claims[0].metric == "ttft_ms"


def test_the_shipped_scope_without_an_engine_still_loads() -> None:
    assert load_manifest((SCOPES / "fused-add-rmsnorm-h200.yaml").read_text()).engine is None


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"serve": "vllm serve {model} --host {host} --port {port}"}, "engine.serve", "{host}"),
        ({"serve": "vllm serve {} --port {port}"}, "engine.serve", "positional"),
        ({"serve": "vllm serve {model!r} --port {port}"}, "engine.serve", "conversion"),
        ({"serve": "vllm serve {model}"}, "engine.serve", "must contain {port}"),
        ({"serve": "vllm serve '{model} --port {port}"}, "engine.serve", "not a valid command"),
        ({"bogus": 1}, "engine.bogus", "unknown field"),
        ({"health_path": "health"}, "engine.health_path", "not a URL path"),
        ({"baseline": {}, "candidate": {}}, "engine", "the same arm"),
        ({"candidate": {"env": {"X": "1"}, "flag": ["--x"]}}, "engine.candidate.flag", "unknown"),
        # an infinite timeout waits forever on a server that never answers
        ({"startup_timeout_s": float("inf")}, "engine.startup_timeout_s", "finite"),
        ({"request_timeout_s": float("nan")}, "engine.request_timeout_s", "finite"),
        ({"startup_timeout_s": 10**9}, "engine.startup_timeout_s", "less than or equal"),
        # no process environment can hold these names
        ({"candidate": {"env": {"A=B": "1"}}}, "engine.candidate.env", "not an environment"),
        ({"candidate": {"env": {"": "1"}}}, "engine.candidate.env", "not an environment"),
        ({"accuracy": {"prompts": 10**22}}, "engine.accuracy.prompts", "less than or equal"),
        ({"accuracy": {"prompts": 100_000, "input_len": 4096}}, "engine.accuracy", "in memory"),
    ],
)
def test_bad_engine_fields_are_located_errors(
    change: dict[str, Any], field: str, words: str
) -> None:
    problems = _problems({**ENGINE, **change})
    assert any(p.field == field and words in p.message for p in problems), problems


def test_unknown_placeholder_message_lists_the_allowed_ones() -> None:
    problems = _problems({**ENGINE, "serve": "vllm serve {modle} --port {port}"})
    allowed = "{model}, {tp}, {dp}, {ep}, {cp}, {port}, {gpus}"
    expected = f"unknown placeholder {{modle}}; allowed: {allowed}"
    assert [p.message for p in problems if p.field == "engine.serve"] == [expected]


@pytest.mark.parametrize(
    ("workload", "field", "words"),
    [
        ({"extra": 1}, "engine.workloads.0.extra", "unknown field"),
        ({"output_len": 1}, "engine.workloads.0.output_len", "greater than or equal to 2"),
        ({"concurrency": [2, 2]}, "engine.workloads.0.concurrency", "distinct"),
        # empty ran the batch grid, past the bound on the grid
        ({"concurrency": []}, "engine.workloads.0.concurrency", "at least 1 item"),
        ({"name": "Decode 1k"}, "engine.workloads.0.name", "workload name"),
        ({"input_len": 10**11}, "engine.workloads.0.input_len", "less than or equal"),
        ({"num_prompts": 10**6}, "engine.workloads.0.num_prompts", "less than or equal"),
        ({"concurrency": [10**11]}, "engine.workloads.0.concurrency.0", "less than or equal"),
        ({"repeats": 10**4}, "engine.workloads.0.repeats", "less than or equal"),
        # each bound alone allows it; the prompt set's token ids would not fit in memory
        ({"num_prompts": 65_536, "input_len": 65_536}, "engine.workloads.0", "in memory"),
    ],
)
def test_bad_workloads_are_located_errors(workload: dict[str, Any], field: str, words: str) -> None:
    first = {**ENGINE["workloads"][0], **workload}
    problems = _problems({**ENGINE, "workloads": [first]})
    assert any(p.field == field and words in p.message for p in problems), problems


@pytest.mark.parametrize(
    "change",
    [
        {"candidate": {"env": {"VLLM_X": "a\x00b"}}},
        {"candidate": {"flags": ["--x\x00"]}},
        {"serve": "vllm serve {model} --port {port} --x \x00"},
    ],
)
def test_a_nul_character_anywhere_is_refused_with_its_line(change: dict[str, Any]) -> None:
    """No argv, environment, or database text column can carry NUL: refused at load, not as a
    launcher traceback mid-run (or a failed insert on PostgreSQL)."""
    problems = _problems({**ENGINE, **change})
    assert [p.message for p in problems] == ["holds a NUL character (\\0)"]
    assert problems[0].line is not None


def test_a_nul_character_in_the_model_id_is_refused() -> None:
    data = {**BASE, "model": {**BASE["model"], "id": "fake\x00model"}}
    with pytest.raises(ManifestError, match="NUL"):
        load_manifest(yaml.safe_dump(data, sort_keys=False))


def test_the_batch_grid_as_concurrency_is_bounded_like_an_explicit_list() -> None:
    """A workload without `concurrency` runs the batch grid: a batch max of 10^9 held that many
    requests in flight (a MemoryError an hour into the A/B)."""
    data = {**BASE, "engine": ENGINE}
    data["workload"] = {**BASE["workload"], "batch": {"min": 1, "max": 10**9}}
    with pytest.raises(ManifestError, match="decode-1k runs the batch grid up to 1000000000"):
        load_manifest(yaml.safe_dump(data, sort_keys=False))
    listed = {**ENGINE["workloads"][0], "concurrency": [1, 64]}
    data["engine"] = {**ENGINE, "workloads": [listed]}
    assert load_manifest(yaml.safe_dump(data, sort_keys=False)).engine is not None


def test_duplicate_workload_names_are_refused() -> None:
    first = ENGINE["workloads"][0]
    problems = _problems({**ENGINE, "workloads": [first, first]})
    assert any("workload names must be distinct: decode-1k" in p.message for p in problems)


def test_default_concurrency_is_min_max_and_powers_of_two_between() -> None:
    assert default_concurrency(1, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert default_concurrency(3, 20) == [3, 4, 8, 16, 20]
    assert default_concurrency(5, 5) == [5]


def test_a_value_with_spaces_stays_one_argument() -> None:
    argv = render_serve("vllm serve {model} --port {port}", {"model": "a b --evil", "port": 1})
    assert argv == ["vllm", "serve", "a b --evil", "--port", "1"]


def test_server_command_adds_arm_flags_and_the_speculative_config() -> None:
    manifest = _load(ENGINE)
    assert manifest.engine is not None
    params = serve_params(manifest)
    speculative = manifest.engine.workloads[1].speculative
    argv = server_command(manifest.engine, params, manifest.engine.candidate, 8123, speculative)
    assert argv[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    assert argv[3:11] == [
        "--tensor-parallel-size",
        "1",
        "--data-parallel-size",
        "1",
        "--decode-context-parallel-size",
        "1",
        "--port",
        "8123",
    ]
    assert argv[11:] == [
        "--enforce-eager",
        "--speculative-config",
        '{"method": "eagle3", "num_speculative_tokens": 3}',
    ]
