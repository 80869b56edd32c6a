"""Tampering with the harness is a FAIL with the reason; the static pre-screen reports, for the
reviewer, the constructs an attack would use."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from harness.evaluation.engine import EngineOptions, evaluate
from harness.evaluation.integrity import TamperedTensors, require_plain_tensors
from harness.evaluation.prescreen import screen_files
from harness.evaluation.timing import StopRule
from scopes.manifest import validate_manifest
from tests.fixtures import tampering_paths

FAST = StopRule(min_pairs=2, max_pairs=2, max_seconds=1.0, ci_relative_width=1.0, pairs_per_batch=2)


def _manifest(candidate: str) -> dict:
    return {
        "name": "tampering-test",
        "summary": "tampering",
        "path": {
            "problem": "kernels.fused_add_rmsnorm.problem:Problem",
            "baseline": "kernels.fused_add_rmsnorm.stock:forward",
            "candidate": f"tests.fixtures.tampering_paths:{candidate}",
            "supports": "tests.fixtures.bad_paths:honest_supports",
        },
        "model": {"id": "t", "dtype": "bfloat16", "config": {"hidden": 256}},
        "hardware": {"gpu": ["cpu", "H200"], "gpus": [1]},
        "workload": {"phase": "decode", "batch": {"min": 1, "max": 64}},
    }


@pytest.fixture(autouse=True)
def restore_originals() -> Iterator[None]:
    yield
    tampering_paths.restore()


@pytest.mark.parametrize(
    ("candidate", "replaced"),
    [
        ("fast_clock_forward", "time.perf_counter"),
        ("event_timer_forward", "torch.cuda.Event.elapsed_time"),
        ("verdict_forward", "harness.evaluation.verdict.decide"),
        ("private_check_forward", "harness.evaluation.correctness._within_tolerance"),
        ("code_swap_forward", "harness.evaluation.verdict.decide.__code__"),
        ("engine_rebind_forward", "harness.evaluation.engine.decide"),
        ("bandwidth_rebind_forward", "harness.evaluation.engine.hbm_bytes_per_s"),
        ("stock_code_swap_forward", "kernels.fused_add_rmsnorm.stock.forward.__code__"),
    ],
)
def test_replacing_what_the_harness_uses_is_a_fail(candidate: str, replaced: str) -> None:
    manifest = validate_manifest(_manifest(candidate))
    evidence = evaluate(manifest, EngineOptions(device="cpu", quick=True, seed=3, stop=FAST))
    assert evidence.verdict == "FAIL"
    assert evidence.tampering and replaced in evidence.tampering[0]
    assert evidence.verdict_reasons[0].startswith("tampering: ")
    # the run stops at the first replacement: nothing measured after it is kept
    assert len(evidence.cases) == 1


def test_a_baseline_whose_import_changes_the_harness_is_a_fail() -> None:
    """The judges load before the candidate, from a submission's checkout in the service: what
    their import swaps is tampering too, put back before the verdict."""
    sys.modules.pop("tests.fixtures.tampering_baseline", None)
    data = _manifest("fast_clock_forward")
    data["path"]["baseline"] = "tests.fixtures.tampering_baseline:forward"
    data["path"]["candidate"] = "tests.fixtures.bad_paths:honest_forward"
    evidence = evaluate(
        validate_manifest(data), EngineOptions(device="cpu", quick=True, seed=3, stop=FAST)
    )
    assert evidence.verdict == "FAIL", evidence.verdict_reasons
    (tampering,) = evidence.tampering
    assert "harness.evaluation.verdict.decide.__code__" in tampering, tampering
    assert tampering.endswith("replaced while importing the problem and baseline"), tampering


def test_an_honest_path_has_no_tampering() -> None:
    manifest = validate_manifest(_manifest("fast_clock_forward"))
    data = manifest.model_dump()
    data["path"]["candidate"] = "tests.fixtures.bad_paths:honest_forward"
    evidence = evaluate(
        validate_manifest(data), EngineOptions(device="cpu", quick=True, seed=3, stop=FAST)
    )
    assert evidence.verdict == "PASS"
    assert evidence.tampering == []


def test_prescreen_reports_what_a_reviewer_should_see(tmp_path: Path) -> None:
    source = tmp_path / "suspicious.py"
    source.write_text(
        "import os, socket, threading\n"
        "import torch, time\n"
        "s = torch.cuda.Stream()\n"
        "token = os.environ.get('GITHUB_TOKEN')\n"
        "time.perf_counter = lambda: 0.0\n"
        "threading.Thread(target=print).start()\n"
    )
    findings = [str(f) for f in screen_files([source], tmp_path)]
    expected = {
        "suspicious.py:1: imports socket (network access)",
        "suspicious.py:1: imports threading (threads)",
        "suspicious.py:3: creates a CUDA stream",
        "suspicious.py:4: reads the environment",
        "suspicious.py:5: patches time.perf_counter",
        "suspicious.py:6: starts a thread",
    }
    joined = "\n".join(findings)
    for item in expected:
        assert item in joined, joined


def test_prescreen_of_the_shipped_kernel_is_quiet() -> None:
    root = Path(__file__).resolve().parents[2]
    files = sorted((root / "kernels" / "fused_add_rmsnorm").glob("*.py"))
    assert screen_files(files, root) == []


def test_prescreen_findings_reach_the_evidence() -> None:
    manifest = validate_manifest(_manifest("fast_clock_forward"))
    evidence = evaluate(manifest, EngineOptions(device="cpu", quick=True, seed=3, stop=FAST))
    assert any("patches time.perf_counter" in w for w in evidence.warnings)


class _Sub(torch.Tensor):
    """A tensor subclass: its __torch_function__ would run inside the harness's operations."""


def test_a_tensor_whose_class_was_changed_is_tampering() -> None:
    out = torch.zeros(4)
    require_plain_tensors({"out": out}, {"w": torch.nn.Parameter(torch.ones(2))}, when="now")
    out.__class__ = _Sub
    with pytest.raises(TamperedTensors, match=r"tampering now: 'out' is a .*_Sub"):
        require_plain_tensors({"x": torch.ones(1)}, {"out": out}, when="now")


def test_a_torch_function_mode_left_active_is_tampering() -> None:
    mode = pytest.raises(TamperedTensors, match="a torch function mode is active")
    with mode, TorchFunctionMode():
        require_plain_tensors({}, when="now")
    with torch.device("cpu"):  # set_default_device's mode changes where tensors are made only
        require_plain_tensors({}, when="now")
    require_plain_tensors({}, when="now")  # and nothing once the mode is left
