"""`pathgate validate` end to end on CPU: exit codes, evidence.json schema, report.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from harness.cli import app
from harness.evaluation import engine, stats
from harness.evaluation.checkpoint import code_digest
from harness.evaluation.environment import REPO_ROOT
from harness.evaluation.evidence import SCHEMA_VERSION, Evidence
from harness.evaluation.timing import capture_spread
from scopes.manifest import load_manifest_file

SCOPES = Path(__file__).resolve().parents[1] / "scopes"


def _small_scope(tmp_path: Path, claims: list[dict]) -> Path:
    data = yaml.safe_load((SCOPES / "fused-add-rmsnorm-h200.yaml").read_text())
    data["model"]["config"] = {"hidden": 256}
    data["workload"]["batch"] = {"min": 1, "max": 512}
    data["claims"] = claims
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _validate(tmp_path: Path, scope: Path, *extra: str) -> tuple[int, str, dict]:
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["validate", str(scope), "--device", "cpu", "--quick", "--out", str(out), *extra]
    )
    evidence = json.loads((out / "evidence.json").read_text()) if result.exit_code != 2 else {}
    return result.exit_code, result.output, evidence


def test_pass_exits_0_with_evidence_and_report(tmp_path: Path) -> None:
    scope = _small_scope(tmp_path, [])
    code, output, evidence = _validate(tmp_path, scope)
    assert code == 0, output
    assert output.strip().splitlines()[-1] == "PASS"
    assert evidence["schema_version"] == SCHEMA_VERSION
    assert evidence["verdict"] == "PASS"
    Evidence.model_validate(evidence)  # the file round-trips through the schema
    cases = evidence["cases"]
    assert cases and all(c["status"] == "passed" for c in cases)
    assert any(c["origin"] == "random" for c in cases)
    for case in cases:
        perf = case["performance"]
        assert len(perf["stock_us"]) == len(perf["candidate_us"]) >= 4
        assert perf["is_gpu_evidence"] is False
        assert perf["speedup_ci95"][0] <= perf["speedup"] <= perf["speedup_ci95"][1]
        assert case["correctness"]["trials"][0]["outputs"][0]["error_ratio"] <= 2.0
    report = (tmp_path / "out" / "report.md").read_text()
    assert report.startswith("# pathgate: fused-add-rmsnorm-h200: **PASS**")
    assert evidence["run"]["command"] in report
    assert "--seed" in evidence["run"]["command"]
    # the tree that ran, pinned even where the git SHA is "-dirty" or stale
    modules = [spec.split(":")[0] for spec in yaml.safe_load(scope.read_text())["path"].values()]
    assert evidence["run"]["code_digest"] == code_digest(REPO_ROOT, modules)
    assert f"| code digest | {evidence['run']['code_digest']} |" in report


def test_evidence_files_meet_the_printed_schema_infinite_errors_included(tmp_path: Path) -> None:
    """`pathgate schema` describes evidence.json as written: a fresh run's file validates, and so
    does one whose candidate wrote NaN (its errors travel as the string "Infinity", which a plain
    number schema refused); a file without schema_version, or with another, does not."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")  # schemathesis' validator (dev tools)
    code, output, evidence = _validate(tmp_path, _small_scope(tmp_path, []))
    assert code == 0, output
    printed = CliRunner().invoke(app, ["schema"])
    validator = jsonschema_rs.validator_for(json.loads(printed.output))
    assert validator.is_valid(evidence)
    model = Evidence.model_validate(evidence)
    trial = model.cases[0].correctness.trials[0]  # type: ignore[union-attr]
    trial.outputs[0].candidate_error = trial.outputs[0].error_ratio = float("inf")
    trial.outputs[0].cosine = float("nan")
    nan_output = json.loads(model.model_dump_json())
    assert nan_output["cases"][0]["correctness"]["trials"][0]["outputs"][0]["error_ratio"] == (
        "Infinity"
    )
    assert validator.is_valid(nan_output)
    assert not validator.is_valid({k: v for k, v in evidence.items() if k != "schema_version"})
    assert not validator.is_valid(evidence | {"schema_version": "pathgate.evidence/0"})


def test_every_interval_recomputes_from_the_evidence_alone(tmp_path: Path) -> None:
    """Evidence is the product: the stored samples, the capture each pair ran on and the
    bootstrap's seed and resample count give back every median, interval, the capture spread
    and the judged speedup interval exactly, with no seed rebuilt from the harness's code."""
    code, output, evidence = _validate(tmp_path, _small_scope(tmp_path, []))
    assert code == 0, output
    timed = [c["performance"] for c in evidence["cases"] if c["performance"]]
    assert timed
    for perf in timed:
        seed, stock, candidate = perf["bootstrap_seed"], perf["stock_us"], perf["candidate_us"]
        assert perf["bootstrap_resamples"] == stats.BOOTSTRAP_RESAMPLES
        assert len(perf["capture_index"]) == len(stock) == len(candidate)
        point, *sampling = stats.speedup_ci95(stock, candidate, seed)
        assert (point, sampling) == (perf["speedup"], list(perf["speedup_ci95_sampling"]))
        for arm, samples in (("stock", stock), ("candidate", candidate)):
            median, *ci = stats.median_ci95(samples, seed)
            assert (median, ci) == (perf[f"{arm}_us_median"], list(perf[f"{arm}_us_ci95"]))
        spread = capture_spread(stock, perf["capture_index"])
        spread += capture_spread(candidate, perf["capture_index"])
        assert spread == perf["capture_spread"]
        judged = [sampling[0] * (1 - spread), sampling[1] * (1 + spread)]
        assert judged == list(perf["speedup_ci95"])


def test_the_git_sha_is_the_trees_as_the_run_began(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The code digest is taken before any case runs; the git SHA beside it must be too. Read
    after the run, it named whatever the tree had become by then (a commit or an edit made
    while a long validate ran), while the digest still pinned the code that ran."""
    reads: list[str] = []

    def sha_now(_: Path) -> str:
        reads.append(f"commit-{len(reads)}")  # the tree moves on after every read
        return reads[-1]

    monkeypatch.setattr(engine, "git_sha", sha_now)
    code, output, evidence = _validate(tmp_path, _small_scope(tmp_path, []))
    assert code == 0, output
    assert reads == ["commit-0"]
    assert evidence["environment"]["harness_sha"] == "commit-0"


def test_claims_not_measurable_on_cpu_exit_3(tmp_path: Path) -> None:
    claims = [
        {"metric": "speedup", "at_least": 1.5, "hardware": "H200"},
        {"metric": "speedup", "where": {"batch": 1}, "at_least": 1.5},
    ]
    code, output, evidence = _validate(tmp_path, _small_scope(tmp_path, claims))
    assert code == 3, output
    assert evidence["verdict"] == "INCONCLUSIVE"
    assert [c["status"] for c in evidence["claims"]] == ["not_measurable", "not_measurable"]
    assert evidence["claims"][0]["reason"] == "needs H200; this run was on cpu"
    assert evidence["claims"][1]["reason"] == "CPU timings are not GPU evidence"
    assert "not GPU evidence" in evidence["notes"][0]


def test_a_guard_that_raises_exits_1(tmp_path: Path) -> None:
    data = yaml.safe_load(_small_scope(tmp_path, []).read_text())
    data["path"]["supports"] = "kernels.fused_add_rmsnorm.fused:forward"  # not a guard
    scope = tmp_path / "broken.yaml"
    scope.write_text(yaml.safe_dump(data))
    code, output, evidence = _validate(tmp_path, scope)
    assert code == 1, output
    assert evidence["verdict"] == "FAIL"
    assert any("raised" in r for r in evidence["verdict_reasons"])


def test_not_runnable_scope_says_what_it_needs(tmp_path: Path) -> None:
    code, output, evidence = _validate(tmp_path, SCOPES / "kimi-k3-mla-moe-decode-gb300.yaml")
    assert code == 3
    assert "not runnable here: needs 8x GB300" in output
    assert evidence["cases"] == []


def test_the_seed_reproduces_the_plan_and_the_numbers(tmp_path: Path) -> None:
    scope = _small_scope(tmp_path, [])
    _, _, first = _validate(tmp_path, scope, "--seed", "1234")
    _, _, second = _validate(tmp_path, scope, "--seed", "1234")
    assert first["run"]["seed"] == second["run"]["seed"] == 1234
    assert [c["id"] for c in first["cases"]] == [c["id"] for c in second["cases"]]
    errors = [[t["outputs"] for t in c["correctness"]["trials"]] for c in first["cases"]]
    assert errors == [[t["outputs"] for t in c["correctness"]["trials"]] for c in second["cases"]]


def test_the_reproduce_command_names_the_device_the_run_resolved(tmp_path: Path) -> None:
    """`--device auto` on this host ran on the CPU; on a GPU host `auto` would pick CUDA, so
    the command that reproduces this run must say `cpu`."""
    scope = _small_scope(tmp_path, [])
    out = tmp_path / "auto"
    args = ["validate", str(scope), "--device", "auto", "--quick", "--seed", "7", "--out", str(out)]
    CliRunner().invoke(app, args)
    evidence = json.loads((out / "evidence.json").read_text())
    assert evidence["run"]["device"] == "cpu"
    assert evidence["run"]["command"] == (
        f"pathgate validate {scope} --device cpu --seed 7 --quick"
    )


def test_an_output_folder_that_is_a_file_is_refused_before_any_case_runs(tmp_path: Path) -> None:
    """It ran the first case, then lost it in two chained tracebacks."""
    scope = _small_scope(tmp_path, [])
    out = tmp_path / "taken"
    out.write_text("a file")
    result = CliRunner().invoke(app, ["validate", str(scope), "--device", "cpu", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert f"cannot write the output folder {out}" in result.output
    assert "Traceback" not in result.output and "[1/" not in result.output
    assert out.read_text() == "a file"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--gpus", "0"], "Invalid value for '--gpus'"),
        (["--gpus", "8"], "--gpus 8: the scope has no 8-GPU cases (hardware.gpus: 1)"),
        (["--seed", "-5"], "Invalid value for '--seed'"),
        (["--seed", str(2**64)], "Invalid value for '--seed'"),
    ],
)
def test_a_bad_gpu_count_or_seed_is_a_usage_error_that_keeps_the_last_run(
    tmp_path: Path, extra: list[str], message: str
) -> None:
    """`--gpus 0` ran no case and replaced the folder's evidence with an empty INCONCLUSIVE."""
    scope = _small_scope(tmp_path, [])
    out = tmp_path / "out"
    out.mkdir()
    (out / "evidence.json").write_text("the last run")
    code, output, _ = _validate(tmp_path, scope, *extra)
    assert code == 2, output
    assert message in " ".join(output.split())
    assert "Traceback" not in output and "[1/" not in output
    assert (out / "evidence.json").read_text() == "the last run"


def test_a_path_that_looks_like_markup_prints_as_given(tmp_path: Path) -> None:
    """rich read "[/x]" in a file name as a closing tag and crashed."""
    folder = tmp_path / "br[/x]"
    folder.mkdir(parents=True)
    good = folder / "a.yaml"
    good.write_text((SCOPES / "fused-add-rmsnorm-h200.yaml").read_text())
    result = CliRunner().invoke(app, ["check", str(good)])
    assert result.exit_code == 0, result.output
    assert f"{good}: valid scope" in result.output
    bad = folder / "bad[bold].yaml"
    bad.write_text(good.read_text().replace("phase: decode", "phase: x"))
    result = CliRunner().invoke(app, ["check", str(bad)])
    assert result.exit_code == 2 and f"{bad}: invalid scope manifest" in result.output


@pytest.mark.parametrize(
    ("entry", "warned"),
    [
        ("sys:exit", False),  # built into the interpreter: no file
        ("os:getcwd", False),  # frozen: no file either
        ("torch._C:_get_tracing_state", False),  # a compiled submodule
        ("no_such_package_here:supports", True),
        ("torch.no_such_module:supports", True),
    ],
)
def test_check_warns_of_an_entry_point_only_when_it_cannot_be_found(
    tmp_path: Path, entry: str, warned: bool
) -> None:
    text = (SCOPES / "fused-add-rmsnorm-h200.yaml").read_text()
    scope = tmp_path / "s.yaml"
    scope.write_text(re.sub(r"supports: \S+", f"supports: {entry}", text))
    result = CliRunner().invoke(app, ["check", str(scope)])
    assert result.exit_code == 0, result.output
    assert ("warning: path.supports: no module" in result.output) == warned, result.output


def test_schema_command_prints_json_schema() -> None:
    result = CliRunner().invoke(app, ["schema"])
    assert result.exit_code == 0
    assert "verdict" in json.loads(result.stdout)["properties"]


# An interrupted run, finished with --resume.


class _Interrupted(Exception):
    """Stands for the machine going away mid-run."""


def _count_cases(monkeypatch, stop_after: int | None = None) -> list[str]:
    """Count the cases the engine really runs; optionally stop the run after `stop_after`."""
    from harness.evaluation import engine

    ran: list[str] = []
    real_run_case = engine.run_case

    def counting_run_case(path, case, *args, **kwargs):
        if stop_after is not None and len(ran) == stop_after:
            raise _Interrupted
        ran.append(case.id)
        return real_run_case(path, case, *args, **kwargs)

    monkeypatch.setattr(engine, "run_case", counting_run_case)
    return ran


def test_progress_is_one_line_per_step_outside_a_terminal(tmp_path: Path) -> None:
    code, output, evidence = _validate(tmp_path, _small_scope(tmp_path, []))
    assert code == 0, output
    steps = [line for line in output.splitlines() if line.startswith("[")]
    total = len(evidence["cases"]) + len(evidence["probes"])
    assert steps[0].startswith(f"[0/{total}] ")
    assert steps[0].endswith(evidence["cases"][0]["id"])
    assert steps[-1].startswith(f"[{total}/{total}] ") and steps[-1].endswith("done")


def test_an_interrupted_run_resumes_where_it_stopped(tmp_path: Path, monkeypatch) -> None:
    scope = _small_scope(tmp_path, [])
    out = tmp_path / "out"
    ran = _count_cases(monkeypatch, stop_after=2)
    args = ["validate", str(scope), "--device", "cpu", "--quick", "--out", str(out)]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 5, first.output  # stopped before a verdict: not a FAIL's 1
    assert "error: the run stopped: _Interrupted" in first.output
    assert "2 finished case(s) are in" in first.output and "--resume" in first.output
    assert "Traceback" not in first.output and "_Interrupted" in (out / "error.log").read_text()
    saved = json.loads((out / "checkpoint.json").read_text())
    assert [c["id"] for c in saved["cases"]] == ran and len(ran) == 2
    assert not (out / "evidence.json").exists()
    again = CliRunner().invoke(app, args)  # without --resume: the saved cases are not lost
    assert again.exit_code == 2 and "holds an unfinished run" in again.output

    monkeypatch.undo()
    ran_again = _count_cases(monkeypatch)
    second = CliRunner().invoke(app, [*args, "--resume"])
    assert second.exit_code == 0, second.output
    evidence = json.loads((out / "evidence.json").read_text())
    ids = [c["id"] for c in evidence["cases"]]
    assert ids[:2] == ran and ran_again == ids[2:]  # nothing measured twice, nothing skipped
    assert evidence["cases"][:2] == saved["cases"]  # carried over as measured
    assert evidence["run"]["seed"] == saved["seed"]
    assert evidence["run"]["started_at"] == saved["started_at"]
    assert any(n.startswith("resumed: 2 case(s) carried over") for n in evidence["notes"])
    assert "resumed: 2 case(s)" in (out / "report.md").read_text()
    assert not (out / "checkpoint.json").exists()


def test_a_resume_under_other_settings_is_refused(tmp_path: Path, monkeypatch) -> None:
    scope = _small_scope(tmp_path, [])
    out = tmp_path / "out"
    args = ["validate", str(scope), "--device", "cpu", "--quick", "--out", str(out)]
    missing = CliRunner().invoke(app, [*args, "--resume"])
    assert missing.exit_code == 2 and "no checkpoint" in missing.output

    _count_cases(monkeypatch, stop_after=1)
    CliRunner().invoke(app, args)
    monkeypatch.undo()
    saved = (out / "checkpoint.json").read_text()
    other_seed = CliRunner().invoke(app, [*args, "--resume", "--seed", "7"])
    assert other_seed.exit_code == 2 and "cannot resume: seed" in other_seed.output
    data = yaml.safe_load(scope.read_text())
    data["tolerance"]["error_budget"] = 3.0
    scope.write_text(yaml.safe_dump(data))
    other_scope = CliRunner().invoke(app, [*args, "--resume"])
    assert other_scope.exit_code == 2 and "the scope manifest changed" in other_scope.output
    assert (out / "checkpoint.json").read_text() == saved  # a refusal loses nothing
    scope.write_text(
        yaml.safe_dump({**data, "tolerance": {**data["tolerance"], "error_budget": 2.0}})
    )
    edited = json.loads(saved) | {"code_digest": "0" * 16}  # as if a kernel had been edited
    (out / "checkpoint.json").write_text(json.dumps(edited))
    other_code = CliRunner().invoke(app, [*args, "--resume"])
    assert other_code.exit_code == 2 and "the code changed" in other_code.output
    assert "manifest" not in other_code.output  # the scope is back as it was
    (out / "checkpoint.json").write_text("{not json")
    for extra in (["--resume"], []):  # without --resume it suggested --resume, which failed
        broken = CliRunner().invoke(app, [*args, *extra])
        message = " ".join(broken.output.split())
        assert broken.exit_code == 2 and "not a pathgate checkpoint" in message
        assert "delete it to start over" in message and "errors.pydantic.dev" not in message
        assert (out / "checkpoint.json").read_text() == "{not json"


def test_a_hand_edited_checkpoint_is_refused_and_kept(tmp_path: Path, monkeypatch) -> None:
    """A checkpoint is the engine's own record: a seed --seed would refuse (the report's
    command could not run), a case the plan does not hold (it was dropped without a word) or
    a case twice (counted twice in the note) means it was edited, and the resume refuses."""
    scope = _small_scope(tmp_path, [])
    out = tmp_path / "out"
    args = ["validate", str(scope), "--device", "cpu", "--quick", "--out", str(out), "--resume"]
    _count_cases(monkeypatch, stop_after=2)
    CliRunner().invoke(app, args[:-1])
    monkeypatch.undo()
    saved = json.loads((out / "checkpoint.json").read_text())
    stray = {**saved["cases"][0], "id": "batch=49 context=7 cp=1 gpus=1 bfloat16"}
    edits = [
        ({"seed": -5}, "seed: Input should be greater than or equal to 0"),
        ({"cases": [stray, *saved["cases"][1:]]}, "is not in this run's plan"),
        ({"cases": [*saved["cases"], saved["cases"][0]]}, "twice"),
    ]
    for edit, words in edits:
        text = json.dumps(saved | edit)
        (out / "checkpoint.json").write_text(text)
        result = CliRunner().invoke(app, args)
        message = " ".join(result.output.split())
        assert result.exit_code == 2 and words in message, result.output
        assert (out / "checkpoint.json").read_text() == text  # a refusal loses nothing


def test_a_folder_where_the_checkpoint_goes_is_named_as_such(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "checkpoint.json").mkdir(parents=True)
    args = ["validate", str(_small_scope(tmp_path, [])), "--device", "cpu", "--quick"]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    message = " ".join(result.output.split())
    assert result.exit_code == 2 and "is not a file: move it away" in message, result.output
    assert "nothing to resume" not in message


def test_ctrl_c_says_what_was_saved(tmp_path: Path, monkeypatch) -> None:
    from harness.evaluation import engine

    real_run_case = engine.run_case
    calls: list[int] = []

    def interrupted_run_case(*args, **kwargs):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real_run_case(*args, **kwargs)

    monkeypatch.setattr(engine, "run_case", interrupted_run_case)
    out = tmp_path / "out"
    args = ["validate", str(_small_scope(tmp_path, [])), "--device", "cpu", "--quick"]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 130
    assert result.output.splitlines()[-1].startswith("interrupted; 1 finished case(s) are in")


def test_resume_ignores_clock_readings_and_the_git_revision_but_not_the_driver() -> None:
    """The environment as a CUDA host records it: the clocks move between two runs on one
    machine, and the git revision with any docs-only commit (the code digest checks the code)."""
    from harness.evaluation.checkpoint import Checkpoint, mismatches

    environment = {
        "host_gpu": "H200", "driver": "580.159.04", "sm_clock": "1980 MHz",
        "mem_clock": "3201 MHz", "harness_sha": "a" * 40, "fingerprint_hash": "1" * 16,
    }  # fmt: skip
    then = Checkpoint(
        scope="s", manifest={}, seed=1, device="cuda", quick=False, gpus=None,
        environment=environment, code_digest="d", started_at="t", cases=[],
    )  # fmt: skip
    idle = {"sm_clock": "345 MHz", "mem_clock": "1593 MHz", "harness_sha": "b" * 40 + "-dirty"}
    now = then.model_copy(update={"environment": environment | idle | {"fingerprint_hash": "2"}})
    assert mismatches(then, now) == []
    other_driver = now.model_copy(update={"environment": now.environment | {"driver": "590.1"}})
    assert mismatches(then, other_driver) == ["environment driver: '580.159.04' then, '590.1' now"]


def test_resume_requires_the_same_engine_options(tmp_path: Path) -> None:
    """Trials, layers and the stop rule shape the measurements as much as --quick does; an
    API caller that sets them resumes only under the same ones."""
    from harness.evaluation import checkpoint
    from harness.evaluation.engine import EngineOptions, evaluate
    from harness.evaluation.timing import StopRule

    manifest = load_manifest_file(_small_scope(tmp_path, []))
    path = tmp_path / "checkpoint.json"
    stop = StopRule(4, 10, 1.0, 0.05, 2)
    options = EngineOptions(device="cpu", quick=True, seed=5, trials=1, stop=stop, checkpoint=path)
    evaluate(manifest, options)
    saved = checkpoint.read(path)
    assert saved.trials == 1 and saved.stop is not None and saved.stop["max_pairs"] == 10
    other = EngineOptions(device="cpu", quick=True, seed=5, trials=2, stop=stop, resume=saved)
    with pytest.raises(checkpoint.ResumeRefused, match="trials: 1 then, 2 now"):
        evaluate(manifest, other)


def test_the_code_digest_covers_entry_points_outside_the_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A candidate on PYTHONPATH, outside the repository: changing it between an interrupted run
    and its --resume must change the digest, and finding it must import nothing."""
    package = tmp_path / "elsewhere"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (package / "candidate.py").write_text("def forward(w, i, o):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = code_digest(REPO_ROOT, ["elsewhere.candidate"])
    assert before != code_digest(REPO_ROOT)
    (package / "candidate.py").write_text("def forward(w, i, o):\n    o.clear()\n")
    assert code_digest(REPO_ROOT, ["elsewhere.candidate"]) != before
    assert code_digest(REPO_ROOT, ["no.such.module"]) == code_digest(REPO_ROOT)


def test_the_code_digest_finds_entry_points_an_editable_install_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pip install -e` may serve a package through a finder of its own, not sys.path: under
    the console script the entry modules were left out, so `pathgate validate` and a worker
    gave one tree two digests."""
    import importlib.abc
    import importlib.util
    import sys

    from harness.evaluation.checkpoint import module_file

    package = tmp_path / "served"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (package / "candidate.py").write_text("def forward(w, i, o):\n    pass\n")

    class EditableFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if name != "served":
                return None
            init = package / "__init__.py"
            return importlib.util.spec_from_file_location(
                name, init, submodule_search_locations=[str(package)]
            )

    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, EditableFinder()])
    assert module_file("served.candidate") == package / "candidate.py"
    assert code_digest(REPO_ROOT, ["served.candidate"]) != code_digest(REPO_ROOT)
    assert "served" not in sys.modules
