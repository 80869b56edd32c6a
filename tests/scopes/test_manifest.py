"""Manifest validation: every kind of bad field gets its own located message; CLI exits 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from harness.cli import app
from scopes.manifest import ManifestError, load_manifest, load_manifest_file

SCOPES = Path(__file__).resolve().parents[2] / "scopes"
GOOD = (SCOPES / "fused-add-rmsnorm-h200.yaml").read_text()


def _mutated(change: str, value: object) -> str:
    data = yaml.safe_load(GOOD)
    node = data
    *parents, last = change.split(".")
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return yaml.safe_dump(data, sort_keys=False)


def _problems(text: str) -> list[str]:
    with pytest.raises(ManifestError) as caught:
        load_manifest(text)
    return [str(p) for p in caught.value.problems]


@pytest.mark.parametrize("path", sorted(SCOPES.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_manifests_are_valid(path: Path) -> None:
    manifest = load_manifest_file(path)
    assert manifest.name == path.stem


@pytest.mark.parametrize(
    ("change", "value", "field", "words"),
    [
        ("hardware.gpu", ["H300"], "hardware.gpu", "unknown GPU 'H300'"),
        ("workload.batch", {"min": 64, "max": 1}, "workload.batch", "min (64) is larger than max"),
        (
            "workload.batch",
            {"min": 0, "max": 8},
            "workload.batch.min",
            "greater than or equal to 1",
        ),
        ("path.candidate", "not an entry point", "path.candidate", "not an entry point"),
        ("model.dtype", "int4", "model.dtype", "'bfloat16', 'float16' or 'float32'"),
        ("name", "Bad Name!", "name", "must be a slug"),
        ("claims", [{"metric": "flops", "at_least": 1}], "claims.0.metric", "Input should be"),
        ("claims", [{"metric": "speedup"}], "claims.0", "exactly one of at_least / at_most"),
        (
            "claims",
            [{"metric": "speedup", "at_least": 1, "at_most": 2}],
            "claims.0",
            "exactly one of at_least / at_most",
        ),
        (
            "claims",
            [{"metric": "speedup", "at_least": 1, "where": {"seq": 1}}],
            "claims.0.where",
            "unknown case key 'seq'",
        ),
        (
            "claims",
            [{"metric": "speedup", "at_least": 1, "hardware": "GB300"}],
            "",
            "not in hardware.gpu",
        ),
        ("workload.context_parallel", [1, 1], "workload.context_parallel", "distinct"),
        ("tolerance", {"error_budget": -1}, "tolerance.error_budget", "greater than 0"),
        # past the database's integers: it lost its job's evidence at the insert
        ("workload.batch", {"min": 1, "max": 10**400}, "workload.batch.max", "less than or equal"),
        # a check that can never fail
        ("tolerance", {"error_budget": float("inf")}, "tolerance.error_budget", "finite number"),
        (
            "claims",
            [{"metric": "speedup", "at_least": float("nan")}],
            "claims.0.at_least",
            "finite ",
        ),
    ],
)
def test_each_bad_field_gets_its_message(
    change: str, value: object, field: str, words: str
) -> None:
    problems = _problems(_mutated(change, value))
    assert any(words in p and (field == "" or f"{field}:" in p) for p in problems), problems


def test_a_range_of_one_value_is_valid() -> None:
    data = yaml.safe_load(_mutated("workload.batch", {"min": 8, "max": 8}))
    data["claims"] = []  # they name batches 1 and 512
    manifest = load_manifest(yaml.safe_dump(data, sort_keys=False))
    assert (manifest.workload.batch.min, manifest.workload.batch.max) == (8, 8)


@pytest.mark.parametrize(
    ("where", "outside"),
    [
        ({"batch": 999999}, "batch=999999"),
        ({"batch": [1, 600]}, "batch=600"),
        ({"context": 4096}, "context=4096"),  # the scope has no context range
        ({"cp": 2}, "cp=2"),
        ({"gpus": 8}, "gpus=8"),
    ],
)
def test_a_claim_on_cases_outside_the_scope_is_refused(where: dict, outside: str) -> None:
    """No plan could hold such a case: the claim would end "not measurable" on every run."""
    data = yaml.safe_load(GOOD)
    data["claims"] = [{"metric": "speedup", "where": where, "at_least": 1.0}]
    problems = _problems(yaml.safe_dump(data, sort_keys=False))
    assert len(problems) == 1 and f"selects {outside}, outside the scope" in problems[0]


@pytest.mark.parametrize(
    ("gpus", "cp", "refused"), [([1], [1, 3], 3), ([1, 2], [1, 4], 4), ([2, 6], [1, 4], 4)]
)
def test_a_cp_degree_no_gpu_count_splits_into_is_refused(
    gpus: list[int], cp: list[int], refused: int
) -> None:
    """Every case of it would be 'not run': check passed such a manifest, validate then ran
    nothing for the degree and ended INCONCLUSIVE."""
    data = yaml.safe_load(GOOD)
    data["hardware"]["gpus"], data["workload"]["context_parallel"] = gpus, cp
    problems = _problems(yaml.safe_dump(data, sort_keys=False))
    assert len(problems) == 1, problems
    assert f"workload.context_parallel lists {refused}, but no GPU count" in problems[0]


def test_extra_keys_are_refused_with_their_line() -> None:
    text = GOOD.replace("  phase: decode\n", "  phase: decode\n  batchh: 3\n")
    problems = _problems(text)
    line = text.splitlines().index("  batchh: 3") + 1
    assert problems == [f"line {line}: workload.batchh: unknown field (not allowed here)"]


def test_missing_field_and_several_problems_are_all_reported() -> None:
    data = yaml.safe_load(GOOD)
    del data["summary"]
    data["hardware"]["gpus"] = []
    problems = _problems(yaml.safe_dump(data))
    assert any(p.endswith("summary: Field required") for p in problems)
    assert any("hardware.gpus" in p and "at least 1 item" in p for p in problems)


def test_yaml_syntax_error_has_a_line() -> None:
    problems = _problems("name: x\nsummary: [unclosed\n")
    assert problems[0].startswith("line ")
    assert "not valid YAML" in problems[0]


def test_not_a_mapping() -> None:
    assert _problems("- just\n- a list\n") == ["(manifest): a manifest is a mapping of fields"]


def test_cli_exits_2_with_messages_and_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(_mutated("hardware.gpu", ["TPU"]))
    for command in (["validate", str(bad)], ["check", str(bad)]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2
        assert "unknown GPU 'TPU'" in result.output
        assert "Traceback" not in result.output


def test_cli_missing_file_exits_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["validate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert "cannot read" in result.output


def test_a_key_given_twice_is_refused_with_its_line() -> None:
    """YAML lets the last of two equal keys win: a second, empty `claims:` would hide every
    claim a reviewer reads above it from the judgement."""
    text = GOOD + "claims: []\n"
    line = len(text.splitlines())
    assert _problems(text) == [f"line {line}: claims: given twice"]


def test_aliases_that_expand_past_the_node_cap_are_refused() -> None:
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(c + 1)}: &{chr(c + 1)} [*{chr(c)}, *{chr(c)}, *{chr(c)}, *{chr(c)}]\n"
        for c in range(ord("a"), ord("j"))
    )
    problems = _problems(GOOD.replace("summary:", bomb + "summary:", 1))
    assert len(problems) == 1 and "expands to over 100000 YAML nodes" in problems[0]
    assert "expands to over" in _problems("a: &l [*l]\n")[0]  # an alias of itself


def test_a_manifest_of_too_many_plain_nodes_is_not_said_to_use_aliases() -> None:
    many = "".join(f"k{i}: [x, x, x, x]\n" for i in range(25_000))
    [problem] = _problems(GOOD.replace("summary:", many + "summary:", 1))
    assert "has over 100000 YAML nodes; a manifest has a few hundred" in problem
    assert "alias" not in problem


def test_aliases_a_yaml_writer_makes_for_repeated_values_are_fine() -> None:
    data = yaml.safe_load(GOOD)
    claim = data["claims"][0]
    data["claims"] = [claim, claim]  # the same object twice: safe_dump writes &id001 / *id001
    text = yaml.safe_dump(data, sort_keys=False)
    assert "*id001" in text
    assert len(load_manifest(text).claims) == 2


def test_a_manifest_that_is_not_utf8_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(GOOD.encode() + b"# caf\xe9\n")
    result = CliRunner().invoke(app, ["check", str(bad)])
    assert result.exit_code == 2
    assert "not UTF-8 text" in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_check_warns_of_an_entry_point_whose_module_is_not_found(tmp_path: Path) -> None:
    """It said "valid" and validate then crashed every case on the import; finding the module
    imports nothing (a package's __init__ may be submitted code)."""
    scope = tmp_path / "scope.yaml"
    scope.write_text(
        GOOD.replace("kernels.fused_add_rmsnorm.problem:Problem", "nonexistent.mod:Foo")
    )
    result = CliRunner().invoke(app, ["check", str(scope)])
    output = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "path.problem: no module 'nonexistent.mod' on this Python's path" in output
    assert "path.candidate" not in output and "path.baseline" not in output
    good = CliRunner().invoke(app, ["check", str(SCOPES / "fused-add-rmsnorm-h200.yaml")])
    assert "warning" not in good.output
