"""The adversarial corpus: each known way to game a kernel benchmark, as a submission, with the
outcome pathgate must give it.

Every attack runs the way the service runs a submission: `workers.runner.run_in_child` (own
process, allow-listed environment, network and PID namespaces where the OS allows, wall-clock
kill, authenticated result channel) evaluating a small add+RMSNorm scope (hidden 256, batch
1..64, quick plan, no claims). The tests in test_corpus.py assert each row;
benchmarks/adversarial_corpus.py prints the table recorded in docs/adversarial.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.adversarial.submissions.common import REPORT_FILE
from workers.runner import ChildCrashed, ChildTimedOut, Finished, RunRequest, run_in_child

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "tests.adversarial.submissions"
HONEST_GUARD = f"{PACKAGE}.common:supports"
SEED = 20261202
RUN_TIMEOUT_S = {"cpu": 240.0, "cuda": 420.0}
LOOP_TIMEOUT_S = 20.0
# Case-level correctness failures: which of these texts appears depends on the garbage found.
WRONG = ("error", "cosine", "NaN", "never written")


@dataclass(frozen=True)
class Attack:
    name: str
    what: str
    expected: tuple[str, ...]  # outcomes that count as caught: a verdict, or "timed_out"
    reasons: tuple[str, ...]  # one must appear in the reasons (or, if blocked, be True)
    devices: tuple[str, ...] = ("cpu", "cuda")
    candidate: str = ""  # default: the package's forward
    supports: str = HONEST_GUARD
    timeout_s: float | None = None
    note: str = ""
    # An attack that gains only time: caught when no case's measured speedup exceeds this.
    max_speedup: float | None = None

    @property
    def entry_point(self) -> str:
        return self.candidate or f"{PACKAGE}.{self.name}:forward"


ATTACKS = (
    Attack("honest", "own torch implementation", ("PASS",), ()),
    Attack(
        "honest_triton",
        "the shipped fused Triton kernel",
        ("PASS", "NEEDS_REVIEW"),
        (),
        candidate="kernels.fused_add_rmsnorm.fused:forward",
        note="on a GPU its speedup may exceed 10x, which is NEEDS_REVIEW by rule",
    ),
    Attack(
        "freed_memory",
        "uninitialised output, hoping for the stock result in freed memory",
        ("FAIL",),
        WRONG,
    ),
    Attack("zeroes_inputs", "zeroes its input", ("FAIL",), ("modified its input",)),
    Attack("scales_inputs", "scales its inputs", ("FAIL",), ("modified its input",)),
    Attack(
        "aliases_input",
        "output aliases (is) an input",
        ("FAIL",),
        ("modified its input", "never written"),
    ),
    Attack(
        "side_stream",
        "work on a side stream never joined",
        ("FAIL",),
        ("after the timed runs", "while timing", "crashed"),
        devices=("cuda",),
        note="no streams on CPU",
    ),
    Attack(
        "patches_event_timer",
        "replaces torch.cuda.Event.elapsed_time",
        ("FAIL",),
        ("tampering",),
    ),
    Attack("patches_perf_counter", "replaces time.perf_counter", ("FAIL",), ("tampering",)),
    Attack(
        "caches_by_identity",
        "outputs cached by input address",
        ("FAIL",),
        ("after the timed runs", *WRONG),
    ),
    Attack(
        "caches_by_content",
        "outputs cached by input content; a copy while capturing",
        ("FAIL",),
        ("after the timed runs", "while timing"),
        devices=("cuda",),
        note="on CPU a content cache returns right outputs and CPU timings are never evidence",
    ),
    Attack(
        "wrong_after_checks",
        "right while checked, wrong once called often (timing, captures)",
        ("FAIL",),
        ("after the timed runs",),
    ),
    Attack(
        "probed_sizes_only",
        "right only at grid batch sizes",
        ("FAIL",),
        ("origin random", *WRONG),
    ),
    Attack(
        "standard_normal_only",
        "right only for standard-normal inputs",
        ("FAIL",),
        WRONG,
    ),
    Attack("unwritten_tail", "last row left unwritten", ("FAIL",), ("never written",)),
    Attack(
        "guard_accepts_all",
        "guard accepts out-of-scope cases",
        ("FAIL",),
        ("guard",),
        supports=f"{PACKAGE}.guard_accepts_all:supports",
    ),
    Attack(
        "forges_result",
        "forged PASS on stdout and inherited descriptors, zeros computed",
        ("FAIL", "crashed"),
        (*WRONG, "CUDA error"),
        note="on a GPU its writes land in the CUDA driver's own descriptors and the run ends in "
        "an error: never the forged PASS",
    ),
    Attack(
        "reads_secrets",
        "reads secrets from its and other processes' environments",
        ("PASS",),
        ("blocked",),
        note="honest arithmetic: caught means it found nothing to read",
    ),
    Attack(
        "opens_network",
        "opens network connections",
        ("PASS",),
        ("blocked",),
        note="honest arithmetic: caught means every connection failed",
    ),
    Attack(
        "writes_outside",
        "plants files beside its workspace and in the harness's source tree",
        ("PASS",),
        ("blocked",),
        note="honest arithmetic: caught means no write outside its own folder succeeded",
    ),
    Attack(
        "swaps_verdict_code",
        "swaps the verdict function's code in place, zeros computed",
        ("FAIL",),
        ("tampering",),
    ),
    Attack(
        "endless_loop",
        "never returns",
        ("timed_out",),
        ("killed",),
        timeout_s=LOOP_TIMEOUT_S,
    ),
    Attack("data_race", "racing threads write the output", ("FAIL",), ("non-deterministic",)),
    Attack(
        "skips_unless_poisoned",
        "does the work only when its outputs look checked (poisoned), else leaves them",
        ("PASS",),
        (),
        devices=("cpu",),
        max_speedup=1.0,
        note="honest arithmetic when it computes: caught means its timed calls all did the work "
        "(it calls the stock path, so its speedup stays near 1; skipping, it measured several "
        "times the stock's speed). On a GPU the same needs a kernel that exits early",
    ),
    Attack(
        "caches_by_checksum",
        "copies the result it kept while a cheap checksum of its inputs is unchanged, computes "
        "slowly otherwise",
        ("PASS",),
        (),
        devices=("cpu",),
        max_speedup=1.0,
        note="honest arithmetic when it computes: caught means no timed call met the inputs it "
        "had kept a result for (every timed pair runs on inputs of its own), so its speedup "
        "stays near a third of the stock's; on one timed input set it was timed copying. On a "
        "GPU the same needs a kernel that exits early",
    ),
    Attack(
        "skips_now_and_then",
        "skips its work now and then while timed (one replay in ten captured, one call in four "
        "eager), leaving its outputs as they were",
        ("FAIL",),
        ("timed replays of the candidate",),
        note="one compared replay per batch missed it most of the time; every timed replay is "
        "now checked",
    ),
    Attack(
        "subclasses_outputs",
        "turns its outputs into a tensor subclass that does the work when the harness reads them",
        ("FAIL",),
        ("tampering",),
    ),
    Attack(
        "rewrites_weights",
        "rewrites the shared weights the stock path is timed on, computes from a copy",
        ("FAIL",),
        ("weights changed while both paths were timed",),
    ),
)


@dataclass
class Got:
    outcome: str  # the verdict, "timed_out" or "crashed"
    reasons: list[str]
    observed: dict[str, Any] = field(default_factory=dict)  # what the attack itself recorded
    warnings: list[str] = field(default_factory=list)  # the pre-screen's findings
    speedups: list[float] = field(default_factory=list)  # each measured case's

    def caught(self, attack: Attack) -> bool:
        if self.outcome not in attack.expected:
            return False
        if attack.max_speedup is not None and not (
            self.speedups and max(self.speedups) <= attack.max_speedup
        ):
            return False
        if "blocked" in attack.reasons:
            return self.observed.get("blocked") is True
        if not attack.reasons:
            return True
        text = "\n".join(self.reasons)
        return any(reason in text for reason in attack.reasons)


def manifest_yaml(attack: Attack) -> str:
    manifest = {
        "name": f"adversarial-{attack.name.replace('_', '-')}",
        "summary": f"Adversarial corpus: {attack.what}",
        "path": {
            "problem": "kernels.fused_add_rmsnorm.problem:Problem",
            "baseline": "kernels.fused_add_rmsnorm.stock:forward",
            "candidate": attack.entry_point,
            "supports": attack.supports,
        },
        "model": {"id": "test/rmsnorm", "dtype": "bfloat16", "config": {"hidden": 256}},
        # both Hopper GPUs the device lends: the attacks and their catches know no GPU kind
        "hardware": {"gpu": ["cpu", "H200", "H100"], "gpus": [1]},
        "workload": {"phase": "decode", "batch": {"min": 1, "max": 64}, "context_parallel": [1]},
        "tolerance": {"error_budget": 2.0, "min_cosine": 0.9999},
        "claims": [],
    }
    return yaml.safe_dump(manifest, sort_keys=False)


def run_attack(attack: Attack, device: str, workdir: Path) -> Got:
    """Evaluate the attack's submission in a child, exactly as a worker would."""
    request = RunRequest(
        manifest_yaml=manifest_yaml(attack),
        source_dir=REPO_ROOT,
        device=device,
        quick=True,
        seed=SEED,
        timeout_s=attack.timeout_s or RUN_TIMEOUT_S[device],
        workdir=workdir,
    )
    outcome = run_in_child(request)
    observed = _observed(workdir / REPORT_FILE)
    match outcome:
        case Finished(evidence=evidence):
            reasons = list(evidence.verdict_reasons)
            reasons += [
                f"case {c.id} origin {c.origin}: {r}" for c in evidence.cases for r in c.reasons
            ]
            speedups = [c.performance.speedup for c in evidence.cases if c.performance]
            return Got(evidence.verdict, reasons, observed, list(evidence.warnings), speedups)
        case ChildTimedOut(after_s=after_s):
            return Got("timed_out", [f"killed at the {after_s:.0f} s limit"], observed)
        case ChildCrashed(error=error, exit_code=code):
            return Got("crashed", [f"exit {code}: {error}"], observed)
    raise TypeError(f"unknown run outcome {outcome!r}")


def _observed(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
