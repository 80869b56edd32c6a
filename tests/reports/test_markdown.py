"""The Markdown report from real engine evidence: verdict first, every claim status worded right,
warnings, coverage, environment, the reproduce command, and under GitHub's limit at scale."""

from __future__ import annotations

from harness.evaluation.evidence import Evidence
from harness.reports.facts import SourceInfo
from harness.reports.html import render_report_page
from harness.reports.markdown import GITHUB_LIMIT_CHARS, MAX_CASE_ROWS, render_markdown
from tests.reports.evidence_fixtures import load, many_cases

SHA = "0123456789abcdef0123456789abcdef01234567"


def _claim_statuses(markdown: str) -> list[tuple[str, str, str]]:
    """(metric, claimed, status) of each row of the claims table."""
    section = markdown.split("## Claims", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
    cells = [[c.strip() for c in row.strip("|").split(" | ")] for row in rows]
    return [(c[0], c[3], c[6]) for c in cells]


def test_every_claim_status_is_worded_as_the_engine_decided() -> None:
    evidence = load("h200_claims")
    rows = _claim_statuses(render_markdown(evidence))
    assert [(m, s) for m, _, s in rows] == [
        ("kernels_per_layer", "verified"),
        ("latency_us", "**refuted**"),
        ("speedup", "not measurable here"),
        ("speedup", "inconclusive"),
        ("speedup", "inconclusive"),
        ("speedup", "inconclusive"),
    ]
    assert [c.status for c in evidence.claims] == [
        "verified",
        "refuted",
        "not_measurable",
        "inconclusive",
        "inconclusive",
        "inconclusive",
    ]
    assert rows[1][1] == "<= 1"  # a tag-less "<" is left readable


def test_verdict_and_its_reasons_come_first() -> None:
    evidence = load("h200_claims")
    lines = render_markdown(evidence).splitlines()
    assert lines[0] == "# pathgate: fused-add-rmsnorm-h200-claims: **FAIL**"
    assert lines[2].startswith("- claim refuted: latency_us <= 1.0 (batch=1) on H200")


def test_reproduce_command_closes_the_report() -> None:
    for name in ("h200_rmsnorm", "cpu_rmsnorm", "cpu_offgrid_fail"):
        evidence = load(name)
        markdown = render_markdown(evidence)
        tail = markdown.rsplit("## Reproduce", 1)[1]
        assert f"```\n{evidence.run.command}\n```" in tail
        assert "--seed" in evidence.run.command
        # evidence written before the code digest was recorded says so, rather than failing
        assert evidence.run.code_digest is None and "| code digest | - |" in markdown


def test_cpu_run_warns_and_leaves_claims_not_measurable() -> None:
    markdown = render_markdown(load("cpu_rmsnorm"))
    assert "**INCONCLUSIVE**" in markdown.splitlines()[0]
    assert "- CPU timings: host-clock times of eager calls, not GPU evidence." in markdown
    assert {s for _, _, s in _claim_statuses(markdown)} == {"not measurable here"}


def test_implausible_speedup_and_l2_sized_working_set_are_warned_about() -> None:
    markdown = render_markdown(load("h200_rmsnorm"))
    warnings = markdown.split("## Warnings", 1)[1].split("\n## ", 1)[0]
    assert "implausible speedup: " in warnings and "above 10x" in warnings
    assert "fits in L2" in warnings


def test_the_runs_own_warnings_reach_the_report() -> None:
    """The pre-screen's findings and a floor fallback are in the evidence for the reviewer:
    the report must show them (before 2026-12-04 it did not)."""
    evidence = load("h200_rmsnorm").model_copy(
        update={
            "warnings": [
                "pre-screen: fused.py:3: opens a network connection: socket.socket()",
                "HBM floor from the copy alone on cuda:0: the read stream failed (no Triton)",
            ]
        }
    )
    warnings = render_markdown(evidence).split("## Warnings", 1)[1].split("\n## ", 1)[0]
    assert "pre-screen: fused.py:3: opens a network connection" in warnings
    assert "HBM floor from the copy alone" in warnings


def test_a_candidate_faster_than_hbm_allows_is_warned_about() -> None:
    evidence = load("h200_rmsnorm")
    case = evidence.cases[-1]
    assert case.performance is not None
    # An impossible figure on purpose: the bytes moved faster than the measured copy bandwidth.
    perf = case.performance.model_copy(update={"candidate_hbm_fraction": 1.7})
    evidence.cases[-1] = case.model_copy(update={"performance": perf})
    assert "beyond the HBM floor" in render_markdown(evidence)


def test_timed_calls_that_may_have_started_late_are_warned_about() -> None:
    evidence = load("h200_rmsnorm")
    assert "late starts" not in render_markdown(evidence)  # evidence from before the count
    for index in (-1, -2):
        case = evidence.cases[index]
        assert case.performance is not None
        perf = case.performance.model_copy(update={"late_starts": 3 - index, "timed_calls": 400})
        evidence.cases[index] = case.model_copy(update={"performance": perf})
    warnings = render_markdown(evidence).split("## Warnings", 1)[1].split("\n## ", 1)[0]
    assert "late starts: 9 of the 800 timed calls of 2 case(s)" in warnings
    assert f"(most at {evidence.cases[-2].id})" in warnings
    assert "re-timed batches" not in warnings


def test_batches_timed_again_for_a_late_start_are_reported() -> None:
    evidence = load("h200_rmsnorm")
    assert "re-timed batches" not in render_markdown(evidence)
    for index, (batches, lead) in zip((-1, -3), ((1, 1_000_000), (2, 2_000_000)), strict=True):
        case = evidence.cases[index]
        assert case.performance is not None
        update = {"late_batches": batches, "lead_cycles": lead, "late_starts": 0}
        evidence.cases[index] = case.model_copy(
            update={"performance": case.performance.model_copy(update=update)}
        )
    warnings = render_markdown(evidence).split("## Warnings", 1)[1].split("\n## ", 1)[0]
    assert "re-timed batches: 3 batch(es) of pairs in 2 case(s)" in warnings
    assert "(to 2,000,000 cycles at most)" in warnings
    assert "late starts:" not in warnings  # none left once the spin had grown


def test_correctness_summary_names_the_failing_case_and_worst_ratio() -> None:
    evidence = load("cpu_offgrid_fail")
    markdown = render_markdown(evidence)
    failed = [c for c in evidence.cases if c.status != "passed"]
    assert len(failed) == 1
    section = markdown.split("## Correctness", 1)[1].split("\n## ", 1)[0]
    assert (
        f"{len(evidence.cases) - 1} of {len(evidence.cases)} in-scope cases passed, 1 failed"
        in section
    )
    assert f"at `{failed[0].id}`" in section
    assert failed[0].correctness is not None
    assert f"{failed[0].correctness.worst_error_ratio:.3g}" in section
    tolerance = evidence.manifest["tolerance"]
    assert (
        f"Held to: error at most {tolerance['error_budget']:g}x the stock path's (relative floor "
        f"eps/8 of its dtype), cosine at least {tolerance['min_cosine']:g}, the same result twice."
    ) in section
    loose = evidence.model_copy(
        update={
            "manifest": {**evidence.manifest, "tolerance": {**tolerance, "deterministic": False}}
        }
    )
    assert "non-deterministic declared." in render_markdown(loose)


def _assert_stated(line: str, evidence: Evidence) -> None:
    """In the Markdown report and on the report page."""
    assert line in render_markdown(evidence)
    assert " ".join(line.split()) in " ".join(render_report_page(evidence).split())


def test_the_checks_of_the_timed_replays_are_stated_where_recorded() -> None:
    evidence = load("h200_claims")
    assert "timed replays of the candidate" not in render_markdown(evidence)  # before the check
    counted = evidence.model_copy(deep=True)
    timed = [c for c in counted.cases if c.performance]
    for count, case in enumerate(timed, start=3):
        assert case.performance is not None
        case.performance.watched_replays = count
    total = sum(range(3, 3 + len(timed)))
    line = (
        f"{total} timed replays of the candidate were compared with its eager result as they ran."
    )
    _assert_stated(line, counted)
    for case in timed:
        assert case.performance is not None
        case.performance.tallied_replays = 10 * case.performance.watched_replays  # type: ignore[operator]
    line = (
        f"All {10 * total} timed replays of the candidate were checked as they ran (the same "
        f"bits as its eager result); {total} of them, one per batch, were compared in full "
        "with its eager result."
    )
    _assert_stated(line, counted)
    tolerance = {**counted.manifest.get("tolerance", {}), "deterministic": False}
    loose = counted.model_copy(update={"manifest": {**counted.manifest, "tolerance": tolerance}})
    assert "as close to its eager result as the cosine floor demands" in render_markdown(loose)
    for case in timed:  # since every timed pair runs on inputs of its own: all compared
        assert case.performance is not None
        case.performance.tallied_replays = None
        case.performance.timed_input_sets = case.performance.watched_replays
    line = (
        f"All {total} timed replays of the candidate were checked (the same bits as its eager "
        f"result on the same inputs); each timed pair ran on inputs of its own ({total} sets), "
        "each drawn afresh, so no timed call met inputs seen before."
    )
    _assert_stated(line, counted)


def test_environment_coverage_and_kernels() -> None:
    evidence = load("h200_claims")
    markdown = render_markdown(evidence, SourceInfo("git", "https://example.com/k.git", SHA))
    for row in (
        "| GPU | NVIDIA H200 |",
        "| driver | 580.159.04 |",
        "| CUDA | 13.0 |",
        "| Triton | 3.6.0 |",
        "| CuTe DSL | - |",
        "| vLLM | - |",
        "| SMs | 132 |",
        "| L2 cache (bytes) | 62914560 |",
        "| SM clock at start | 1980 MHz |",
        "| power limit | 700.00 W |",
        "| NumPy | 2.5.2 |",
        f"| candidate source | https://example.com/k.git at {SHA} |",
    ):
        assert row in markdown
    assert "stock 13, candidate 1 kernels per layer." in markdown
    assert "Run here: 12 cases (10 grid, 2 random)" in markdown


def test_hundreds_of_cases_are_summarized_under_githubs_limit() -> None:
    evidence = many_cases()
    assert len(evidence.cases) == 385 and evidence.verdict == "FAIL"
    markdown = render_markdown(evidence)
    assert len(markdown) < GITHUB_LIMIT_CHARS
    assert f"Summarized: {MAX_CASE_ROWS} of 385 cases shown" in markdown
    table = markdown.split("## Cases", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| batch=")]
    assert len(rows) == MAX_CASE_ROWS
    assert all("| failed |" in row for row in rows[:25])  # the failing cases come first
    assert "more verdict reasons (see the HTML report)" in markdown
    assert evidence.run.command in markdown


def test_a_summarized_table_samples_from_the_first_case_to_the_last() -> None:
    """With fewer than twice as many cases as rows it showed the first rows only (72 cases:
    batch 1-16 of 1-64, and none of the cases the batch-64 claims rest on)."""
    evidence = many_cases(copies=5, failing_copies=0)  # 60 passing cases
    cases = evidence.cases
    table = render_markdown(evidence).split("## Cases", 1)[1].split("\n## ", 1)[0]
    shown = [line.split(" | ")[0].removeprefix("| ") for line in table.splitlines()]
    shown = [row for row in shown if row.startswith("batch=")]
    assert len(shown) == MAX_CASE_ROWS < len(cases)
    assert shown[0] == cases[0].id and shown[-1] == cases[-1].id
    assert shown == [c.id for c in cases if c.id in shown]  # in order, no repeats


def test_a_crashed_case_shows_no_error_ratio() -> None:
    """It has a correctness record without trials, whose ratio of 0 read as a perfect match."""
    evidence = load("cpu_rmsnorm")
    case = evidence.cases[0]
    assert case.correctness is not None
    crashed = case.model_copy(
        update={
            "status": "crashed",
            "performance": None,
            "correctness": case.correctness.model_copy(
                update={"trials": [], "worst_error_ratio": 0.0}
            ),
        }
    )
    evidence = evidence.model_copy(update={"cases": [crashed, *evidence.cases[1:]]})
    row = next(line for line in render_markdown(evidence).splitlines() if crashed.id in line)
    assert row.split(" | ")[3] == "-", row


def test_submitted_text_cannot_open_html() -> None:
    evidence = load("cpu_offgrid_fail")
    case = evidence.cases[0]
    evidence.cases[0] = case.model_copy(update={"reasons": ["<script>alert(1)</script> | x"]})
    markdown = render_markdown(evidence)
    assert "<script>" not in markdown
    assert "&lt;script>alert(1)&lt;/script> \\| x" in markdown


def test_huge_reasons_are_cut_but_the_reproduce_command_stays() -> None:
    evidence = load("cpu_offgrid_fail")
    case = evidence.cases[0]
    evidence.cases[0] = case.model_copy(update={"reasons": ["x" * 200_000]})
    markdown = render_markdown(evidence)
    assert len(markdown) < GITHUB_LIMIT_CHARS
    assert "truncated to stay under GitHub's limit" in markdown
    assert markdown.rstrip().endswith(f"{evidence.run.command}\n```")


def test_a_kl_below_float_rounding_prints_as_its_bound() -> None:
    """Identical distributions summed to -1.18e-09 nats, printed as a negative divergence."""
    from harness.evaluation.evidence import DecodeCheckEvidence
    from harness.reports.facts import decode_check_line

    check = DecodeCheckEvidence(
        case="batch=16 context=1024 cp=1 gpus=1 bfloat16",
        layers=4,
        steps=32,
        prompts=4,
        vocab=4096,
        min_token_match=0.95,
        max_mean_kl=1e-3,
        status="passed",
        reasons=[],
        token_match=1.0,
        first_divergence=[None] * 4,
        mean_kl=-1.18e-09,
        max_kl=0.0125,
    )
    line = decode_check_line(load("cpu_rmsnorm").model_copy(update={"decode_check": check}))
    assert line is not None
    assert "mean KL(stock || candidate) < 1e-06 nats" in line and "max 0.0125" in line


def test_every_recorded_environment_key_is_shown() -> None:
    """A key the report has no label for (a newer harness's) still shows, under its own name."""
    evidence = load("h200_claims")
    evidence = evidence.model_copy(
        update={"environment": {**evidence.environment, "gpu_uuid": "GPU-1234"}}
    )
    markdown = render_markdown(evidence)
    assert "| gpu_uuid | GPU-1234 |" in markdown
    assert "| host_gpu |" not in markdown  # already shown as "host GPU kind x count"


def test_a_dirty_tree_is_flagged_beside_its_sha() -> None:
    """Most stored GPU runs ran on a tree with uncommitted changes: checking out the SHA alone
    does not give the code that ran."""
    evidence = load("cpu_rmsnorm")
    evidence = evidence.model_copy(
        update={"environment": {**evidence.environment, "harness_sha": "74d2858-dirty"}}
    )
    markdown = render_markdown(evidence)
    assert (
        "| harness SHA | 74d2858-dirty (uncommitted changes; the code digest below pins the "
        "code that ran) |" in markdown
    )
    clean = evidence.model_copy(
        update={"environment": {**evidence.environment, "harness_sha": "74d2858"}}
    )
    assert "| harness SHA | 74d2858 |" in render_markdown(clean)


def test_cpu_counts_read_as_torch_ops_not_kernels() -> None:
    """On the CPU the profile counts top-level torch ops (kernel_source "cpu-ops"): the report
    says so in every case row and in the summary, so that "35" beside a claim of at most one
    kernel does not read as a GPU kernel count."""
    evidence = load("cpu_rmsnorm")
    timed = [c for c in evidence.cases if c.performance is not None]
    assert timed and all(c.performance.kernel_source == "cpu-ops" for c in timed)  # type: ignore[union-attr]
    markdown = render_markdown(evidence)
    rows = [line for line in markdown.splitlines() if line.startswith("| batch=")]
    assert rows and all(row.endswith(" ops |") for row in rows)
    summary = markdown.split("## Kernels per layer", 1)[1].split("\n## ", 1)[0]
    assert "torch ops per layer (counted on the CPU: not GPU kernels)." in summary
    assert "GPU kernels" not in render_markdown(load("h200_claims")).split("## Kernels", 1)[1]
