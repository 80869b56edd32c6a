"""The model-level decode check: an honest candidate decodes the same tokens as the stock path,
one with a small numeric error is caught, at the step where greedy decoding diverges.

The add+RMSNorm problem (hidden 256) stands in for a layer on CPU; the MLA+MoE problem at a test
size shows the check drives a layer with a KV cache.
"""

from __future__ import annotations

import pytest
import torch

from harness.evaluation.cases import Case
from harness.evaluation.decode_check import (
    Trace,
    _evidence,
    check_case,
    compare,
    has_hooks,
    run_decode_check,
)
from harness.evaluation.engine import EngineOptions, evaluate
from harness.evaluation.loading import load_path
from scopes.manifest import ModelCheck, validate_manifest
from tests.evaluation.test_engine_catches import FAST_STOP, make_manifest
from tests.fixtures import bad_paths

CPU = torch.device("cpu")
SETTINGS = ModelCheck(layers=3, steps=24, prompts=4, vocab=512)
SEED = 7


def decode_check_of(candidate: str, settings: ModelCheck = SETTINGS):  # type: ignore[no-untyped-def]
    manifest = make_manifest(candidate)
    path = load_path(manifest)
    case = check_case(manifest.model_copy(update={"model_check": settings}), "cpu", 1)
    return run_decode_check(path, case, settings, SEED, CPU)


def test_the_stock_path_against_itself_matches_exactly() -> None:
    result = decode_check_of("honest_forward")
    assert result.status == "passed", result.reasons
    assert result.token_match == 1.0 and result.mean_kl == 0.0
    assert result.first_divergence == [None] * 4
    assert len(result.stock_tokens) == 4 and len(result.stock_tokens[0]) == SETTINGS.steps
    # the tokens are really decoded: not one token repeated
    assert len({t for seq in result.stock_tokens for t in seq}) > 4


def test_the_shipped_triton_kernel_decodes_the_same_tokens() -> None:
    manifest = make_manifest("honest_forward").model_copy(
        update={
            "path": make_manifest("honest_forward").path.model_copy(
                update={"candidate": "kernels.fused_add_rmsnorm.fused:forward"}
            )
        }
    )
    settings = ModelCheck(layers=2, steps=8, prompts=4, vocab=512)
    path = load_path(manifest)
    result = run_decode_check(path, check_case(manifest, "cpu", 1), settings, SEED, CPU)
    assert result.status == "passed", result.reasons
    assert result.token_match == 1.0
    assert result.mean_kl is not None and result.mean_kl < 1e-4


def test_a_drift_is_caught_where_decoding_diverges() -> None:
    bad_paths.drift_calls[0] = 0
    result = decode_check_of("drifts_after_forward")
    assert result.status == "failed"
    # the stock run comes first and makes no candidate calls: the candidate's first
    # DRIFT_AFTER_CALLS calls are its first steps, each step calling every layer once
    honest_steps = bad_paths.DRIFT_AFTER_CALLS // SETTINGS.layers
    diverged = [s for s in result.first_divergence if s is not None]
    assert diverged and min(diverged) >= honest_steps
    for prompt, step in enumerate(result.first_divergence):
        stock, candidate = result.stock_tokens[prompt], result.candidate_tokens[prompt]
        if step is None:
            assert stock == candidate
            continue
        assert stock[:step] == candidate[:step] and stock[step] != candidate[step]
    assert all(kl == 0.0 for kl in result.kl_per_step[:honest_steps])
    assert any("first divergence at step" in r for r in result.reasons), result.reasons


def test_past_the_kl_floor_the_stock_paths_own_distance_from_float64_sets_the_bar() -> None:
    """With the absolute bound out of reach (1e-12 nats), a right candidate with other
    roundings than the stock path (float64, rounded once) passes by the budget, and one with a
    small constant error does not: it is far further from the float64 model than the stock."""
    settings = ModelCheck(layers=2, steps=8, prompts=4, vocab=512, max_mean_kl=1e-12)
    passed = decode_check_of("exact_then_rounded_forward", settings)
    assert passed.status == "passed", passed.reasons
    assert passed.mean_kl is not None and passed.mean_kl > settings.max_mean_kl
    stock_off, candidate_off = passed.stock_kl_from_reference, passed.candidate_kl_from_reference
    assert stock_off is not None and candidate_off is not None and stock_off > 0
    assert candidate_off <= settings.kl_budget * stock_off
    off = decode_check_of("slightly_off_forward", settings)
    assert off.status == "failed"
    assert off.candidate_kl_from_reference > settings.kl_budget * off.stock_kl_from_reference
    assert any("from the float64 reference" in r for r in off.reasons), off.reasons


def _trace(p_first: float) -> Trace:
    """Two steps of one prompt over a vocabulary of two, both steps (p_first, 1 - p_first)."""
    probs = torch.tensor([[[p_first, 1 - p_first]]] * 2, dtype=torch.float64)
    return Trace(probs.argmax(-1), probs.log().float())


def test_the_relative_bar_keeps_max_mean_kl_as_slack() -> None:
    """Reference 60/40, stock 61/39, candidate 58/42 (same greedy token): the two paths are
    1.9e-3 nats apart (over the 1e-3 bound), the candidate 8.2e-4 from the reference against
    the stock's 2.1e-4. 2x the stock's distance alone (4.2e-4) would fail it; with the slack
    (1.4e-3) it passes, as a candidate one rare flip further off than the stock path should.
    At 56/44 (3.3e-3 from the reference) it fails."""
    evidence = _evidence(SETTINGS, "case", 1, [])
    passed = compare(evidence, _trace(0.61), _trace(0.58), _trace(0.6))
    assert passed.mean_kl is not None and passed.mean_kl > SETTINGS.max_mean_kl
    assert passed.candidate_kl_from_reference > 2 * passed.stock_kl_from_reference
    assert passed.status == "passed", passed.reasons
    failed = compare(evidence, _trace(0.61), _trace(0.56), _trace(0.6))
    assert failed.status == "failed" and "from the float64 reference" in failed.reasons[0]


def test_a_small_constant_error_fails_with_its_numbers() -> None:
    result = decode_check_of("slightly_off_forward")
    assert result.status == "failed"
    assert result.mean_kl is not None and result.mean_kl > SETTINGS.max_mean_kl
    assert any("mean KL" in r for r in result.reasons)


def test_every_kl_figure_recomputes_from_the_stored_per_step_values() -> None:
    """The evidence keeps KL per prompt and step for all three comparisons: the means, the
    maximum and the per-step curve a report prints are derived, not trusted."""
    result = decode_check_of("slightly_off_forward")
    rows = result.kl_by_prompt
    assert len(rows) == SETTINGS.prompts and all(len(r) == SETTINGS.steps for r in rows)
    values = [v for row in rows for v in row]
    assert result.mean_kl == pytest.approx(sum(values) / len(values), rel=1e-12)
    assert result.max_kl == max(values)
    columns = list(zip(*rows, strict=True))
    assert result.kl_per_step == pytest.approx([sum(c) / len(c) for c in columns], rel=1e-12)
    for stored, mean in (
        (result.stock_kl_from_reference_by_prompt, result.stock_kl_from_reference),
        (result.candidate_kl_from_reference_by_prompt, result.candidate_kl_from_reference),
    ):
        flat = [v for row in stored for v in row]
        assert len(flat) == len(values) and mean == pytest.approx(sum(flat) / len(flat), rel=1e-12)


def test_a_crashing_candidate_is_a_crashed_check() -> None:
    result = decode_check_of("exits_forward")
    assert result.status == "crashed" and "SystemExit" in result.reasons[0]


def test_the_engine_puts_the_check_in_the_evidence_and_the_verdict() -> None:
    options = EngineOptions(device="cpu", quick=True, seed=SEED, trials=2, stop=FAST_STOP)
    honest = evaluate(make_manifest("honest_forward"), options)
    assert honest.decode_check is not None and honest.decode_check.status == "passed"
    assert honest.verdict == "PASS"
    off = evaluate(
        make_manifest("slightly_off_forward", error_budget=1000.0, min_cosine=0.99), options
    )
    # within the (deliberately loose) layer tolerance, so only the model-level check catches it
    assert all(c.status == "passed" for c in off.cases)
    assert off.verdict == "FAIL"
    assert any("model-level decode check failed" in r for r in off.verdict_reasons)


def test_the_mla_problem_offers_the_hooks_and_decodes_through_its_cache() -> None:
    config = {
        "hidden": 64,
        "heads": 2,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "experts": 4,
        "experts_total": 16,
        "top_k": 4,
        "moe_intermediate": 32,
        "shared_intermediate": 16,
    }
    manifest = validate_manifest(
        {
            "name": "mla-decode-check-test",
            "summary": "decode check on the MLA+MoE problem",
            "path": {
                "problem": "kernels.mla_moe_decode.problem:Problem",
                "baseline": "kernels.mla_moe_decode.stock:forward",
                "candidate": "kernels.mla_moe_decode.stock:forward",
                "supports": "tests.fixtures.bad_paths:honest_supports",
            },
            "model": {"id": "test/mla", "dtype": "bfloat16", "config": config},
            "hardware": {"gpu": ["cpu"], "gpus": [1]},
            "workload": {
                "phase": "decode",
                "batch": {"min": 1, "max": 8},
                "context": {"min": 6, "max": 32},
            },
        }
    )
    path = load_path(manifest)
    assert has_hooks(path.problem)
    case: Case = check_case(manifest, "cpu", 1)
    assert case.context == 6 and case.batch == 4
    settings = ModelCheck(layers=2, steps=6, prompts=4, vocab=256)
    result = run_decode_check(path, case, settings, SEED, CPU)
    assert result.status == "passed", result.reasons
    assert result.token_match == 1.0


@pytest.mark.parametrize("bad", [{"layers": 0}, {"steps": 0}, {"min_token_match": 1.5}, {"x": 1}])
def test_the_manifest_section_refuses_bad_values(bad: dict) -> None:
    data = make_manifest("honest_forward").model_dump(mode="json", exclude_defaults=True)
    data["model_check"] = bad
    with pytest.raises(Exception, match="model_check"):
        validate_manifest(data)


def test_the_reports_show_the_check() -> None:
    from harness.reports.html import render_report_page
    from harness.reports.markdown import render_markdown

    options = EngineOptions(device="cpu", quick=True, seed=SEED, trials=2, stop=FAST_STOP)
    evidence = evaluate(make_manifest("honest_forward"), options)
    markdown = render_markdown(evidence)
    assert "## Model-level decode check" in markdown
    assert "greedy tokens agree at 100.0% of steps" in markdown
    assert "Model-level decode check" in render_report_page(evidence)
