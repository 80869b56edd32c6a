"""The engine: one scope manifest in, one Evidence out.

evaluate() detects the host, draws the secret run seed, expands the plan, loads the path's entry
points, and for every case runs correctness first and, if it passes, timing and profiling; then
the guard probes, the model-level decode check, the claims and the verdict. Each stage lives in
its own module; this one only sequences them and turns their results into evidence.
"""

from __future__ import annotations

import secrets
import shlex
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from harness.evaluation import checkpoint as checkpoints
from harness.evaluation import correctness as correctness_mod
from harness.evaluation import decode_check
from harness.evaluation.bandwidth import floor_warnings, hbm_bytes_per_s
from harness.evaluation.cases import Case
from harness.evaluation.environment import REPO_ROOT, detect_host, fingerprint, git_sha
from harness.evaluation.evidence import (
    CaseEvidence,
    CorrectnessEvidence,
    DecodeCheckEvidence,
    Evidence,
    OutputErrorEvidence,
    PerformanceEvidence,
    ProbeEvidence,
    RunInfo,
    TrialEvidence,
)
from harness.evaluation.guard import check_probe
from harness.evaluation.integrity import Snapshot
from harness.evaluation.loading import (
    EntryPointError,
    LoadedPath,
    load_judges,
    load_path,
    submitted_judges,
    use_triton_interpreter,
)
from harness.evaluation.outcomes import (
    SUBMITTED_CODE_ERRORS,
    Crashed,
    Mismatch,
    Outcome,
    Passed,
    Unsupported,
    reasons_of,
)
from harness.evaluation.plan import Host, Plan, derive_seed, make_plan
from harness.evaluation.prescreen import Finding, screen_files
from harness.evaluation.profiling import profile_step
from harness.evaluation.ranks import run_case_on_ranks, runs_on_ranks
from harness.evaluation.stats import BOOTSTRAP_RESAMPLES, median_ci95, speedup_ci95
from harness.evaluation.timing import (
    LayerSet,
    RankSync,
    StopRule,
    Timing,
    build_layers,
    changed_weights,
    cross_check_flags,
    eager_us,
    l2_cache_bytes,
    layer_weights,
    pair_inputs,
    refresh_inputs,
    replay_mismatches,
    sample_interleaved,
    speedup_interval,
    step_runners,
    wall_us_per_layer,
    watched_replays,
)
from harness.evaluation.verdict import check_claim, decide, looser_standard
from scopes.manifest import ScopeManifest

ProgressFn = Callable[[int, int, str], None]
CPU_NOTE = "CPU run: timings are host-clock times of eager calls, not GPU evidence."


@dataclass(frozen=True)
class EngineOptions:
    device: str = "auto"  # "auto", "cpu" or "cuda"
    quick: bool = False
    seed: int | None = None  # None: a fresh secret seed
    gpus: int | None = None  # only the cases of this GPU count (a gpu.<kind>.x<n> job)
    trials: int | None = None  # correctness trials per case; None: 2 quick, 3 otherwise
    max_layers: int | None = None  # layers per timed step; None: 64 on CUDA, 2 on CPU
    stop: StopRule | None = None
    scope_path: str = ""  # as the command line named it, for the reproduce command
    checkpoint: Path | None = None  # written after every case (harness.evaluation.checkpoint)
    resume: checkpoints.Checkpoint | None = None  # an interrupted run's cases, not run again
    # A submission's checkout the path imports from (the service's git source); None: the
    # harness's own tree. Its problem and baseline files must be the harness tree's.
    submitted_source: Path | None = None


def default_stop_rule(device: torch.device, quick: bool) -> StopRule:
    if device.type == "cpu":
        return StopRule(4 if quick else 10, 10 if quick else 100, 1.0 if quick else 5.0, 0.05, 2)
    if quick:
        return StopRule(30, 400, 3.0, 0.01)
    return StopRule(50, 2000, 10.0, 0.005)


def evaluate(
    manifest: ScopeManifest, options: EngineOptions, progress: ProgressFn | None = None
) -> Evidence:
    started_at = _now()
    # the code as loaded, before any case runs: the repository and the path's own modules
    entry_modules = [spec.split(":")[0] for spec in manifest.path.model_dump().values()]
    code_digest = checkpoints.code_digest(REPO_ROOT, entry_modules)
    harness_sha = git_sha(REPO_ROOT)
    host = detect_host(options.device)
    secret_seed = options.seed if options.seed is not None else secrets.randbits(63)
    plan = make_plan(manifest, host, secret_seed, options.quick, options.gpus)
    notes = [CPU_NOTE] if host.device == "cpu" else []
    record = None
    if options.checkpoint is not None or options.resume is not None:
        record = _checkpointer(
            manifest, options, host, secret_seed, started_at, code_digest, harness_sha
        )
    if options.resume is not None:
        checkpoints.check_cases(options.resume, [(c.id, c.origin) for c in plan.cases])
        notes.append(checkpoints.resume_note(options.resume, started_at))
        started_at = options.resume.started_at
    run = RunResults()
    if plan.runnable:
        run = _run_path(manifest, plan, host, secret_seed, options, progress, record)
    claims = [check_claim(claim, run.cases, host.gpu) for claim in manifest.claims]
    verdict, reasons = decide(
        run.cases,
        run.probes,
        claims,
        list(plan.not_run),
        run.tampering,
        run.decode_check,
        list(plan.left_out),
        run.review + looser_standard(manifest),
    )
    # the resolved device, not `auto`: on another host `auto` may pick another device
    scope_path = options.scope_path or f"scopes/{manifest.name}.yaml"
    command = reproduce_command(scope_path, host.device, options.quick, secret_seed, options.gpus)
    return Evidence(
        verdict=verdict,
        verdict_reasons=reasons,
        scope=manifest.name,
        manifest=manifest.model_dump(mode="json"),
        run=RunInfo(
            seed=secret_seed,
            device=host.device,
            quick=options.quick,
            started_at=started_at,
            finished_at=_now(),
            command=command,
            code_digest=code_digest,
        ),
        # after the run: clocks as they were under load; the SHA as the run began
        environment=fingerprint(host, harness_sha),
        not_run=list(plan.not_run),
        cases=run.cases,
        probes=run.probes,
        tampering=run.tampering,
        warnings=run.warnings + floor_warnings(),
        decode_check=run.decode_check,
        claims=claims,
        notes=notes,
    )


Recorder = Callable[[list[CaseEvidence]], None]


def _checkpointer(
    manifest: ScopeManifest,
    options: EngineOptions,
    host: Host,
    seed: int,
    started_at: str,
    code_digest: str,
    harness_sha: str | None,
) -> Recorder | None:
    """What writes the checkpoint after each case (None: no checkpoint asked for). Refuses a
    resume whose checkpoint was made under other settings (ResumeRefused)."""
    environment = fingerprint(host, harness_sha)
    current = checkpoints.Checkpoint(
        scope=manifest.name,
        manifest=manifest.model_dump(mode="json"),
        seed=seed,
        device=host.device,
        quick=options.quick,
        gpus=options.gpus,
        trials=options.trials,
        max_layers=options.max_layers,
        stop=asdict(options.stop) if options.stop else None,
        environment=environment,
        code_digest=code_digest,
        started_at=options.resume.started_at if options.resume else started_at,
        cases=[],
    )
    if options.resume is not None:
        problems = checkpoints.mismatches(options.resume, current)
        if problems:
            raise checkpoints.ResumeRefused("cannot resume: " + "; ".join(problems))
    path = options.checkpoint
    if path is None:
        return None
    return lambda cases: checkpoints.write(path, current.model_copy(update={"cases": cases}))


@dataclass
class RunResults:
    cases: list[CaseEvidence] = field(default_factory=list)
    probes: list[ProbeEvidence] = field(default_factory=list)
    tampering: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # the pre-screen's; evaluate adds the floor's
    review: list[str] = field(default_factory=list)  # why no verdict may pass without a reviewer
    decode_check: DecodeCheckEvidence | None = None


def _run_path(
    manifest: ScopeManifest,
    plan: Plan,
    host: Host,
    secret_seed: int,
    options: EngineOptions,
    progress: ProgressFn | None,
    record: Recorder | None,
) -> RunResults:
    if host.device == "cpu":
        use_triton_interpreter()
    snapshot = Snapshot.take()  # before any submitted code is imported
    roots = [REPO_ROOT, *([options.submitted_source] if options.submitted_source else [])]
    run = RunResults()
    try:
        judges = load_judges(manifest)
        # a submission's checkout may hold the judges: what their import changed counts too
        if _tampered(snapshot, "importing the problem and baseline", run):
            return run
        # the stock path's own code, watched from before the candidate could change it
        snapshot = snapshot.including(judges.modules, roots)
        path = load_path(manifest, judges)
    except EntryPointError as exc:
        crashed = Crashed(f"loading the path: {exc}")
        return RunResults(cases=[_case_evidence(c, crashed) for c in plan.cases])
    run.warnings = [f"pre-screen: {f}" for f in screen_entry_points(manifest)]
    run.review = submitted_judges(path, options.submitted_source, REPO_ROOT)
    if _tampered(snapshot, "importing the path", run):
        return run
    _run_plan(path, plan, manifest, host, secret_seed, options, progress, record, run, snapshot)
    return run


def _tampered(snapshot: Snapshot, when: str, run: RunResults) -> bool:
    replaced = snapshot.replaced()
    if replaced:
        run.tampering.append(f"{', '.join(replaced)} replaced while {when}")
        snapshot.restore()
    return bool(replaced)


def _run_plan(
    path: LoadedPath,
    plan: Plan,
    manifest: ScopeManifest,
    host: Host,
    secret_seed: int,
    options: EngineOptions,
    progress: ProgressFn | None,
    record: Recorder | None,
    run: RunResults,
    snapshot: Snapshot,
) -> None:
    """Cases, then probes; after each, check that nothing the harness relies on was replaced
    (the first replacement ends the run: nothing measured after it can be trusted). A case an
    interrupted run already measured (options.resume) is taken from it."""
    device = torch.device(host.device)
    total = len(plan.cases) + len(plan.probes)
    carried = {(c.id, c.origin): c for c in options.resume.cases} if options.resume else {}
    for index, case in enumerate(plan.cases):
        if progress:
            progress(index, total, case.id)
        evidence = carried.get((case.id, case.origin))
        if evidence is None:
            evidence = run_case(path, case, manifest, secret_seed, options, device)
        run.cases.append(evidence)
        if _tampered(snapshot, f"running {case.id}", run):
            return  # and no checkpoint: a resumed run's fresh process would not see it
        if record:
            record(run.cases)
    for index, probe in enumerate(plan.probes, start=len(plan.cases)):
        if progress:
            progress(index, total, probe.origin)
        outcome = check_probe(path, probe, secret_seed, device)
        run.probes.append(
            ProbeEvidence(
                id=probe.id, origin=probe.origin, status=outcome.status, reasons=reasons_of(outcome)
            )
        )
        if _tampered(snapshot, f"checking {probe.origin}", run):
            return
    if progress:
        progress(total, total, "model-level decode check")
    failing = [c for c in run.cases if c.status != "passed"]
    if failing:  # already a FAIL: the model-level check would add time, not a verdict
        why = f"skipped: {len(failing)} in-scope case(s) already failed"
        run.decode_check = decode_check.not_run(manifest, why)
    else:
        run.decode_check = model_check(path, manifest, host, secret_seed, options.quick, device)
    if _tampered(snapshot, "the model-level decode check", run):
        return
    if progress:
        progress(total, total, "done")


def model_check(
    path: LoadedPath,
    manifest: ScopeManifest,
    host: Host,
    secret_seed: int,
    quick: bool,
    device: torch.device,
) -> DecodeCheckEvidence:
    """The model-level decode check, where the problem has decode hooks and the guard accepts
    the check's case."""
    if not decode_check.has_hooks(path.problem):
        return decode_check.not_run(manifest, "the problem has no decode-stack hooks")
    case = decode_check.check_case(manifest, host.gpu, 1)
    try:
        accepted: object = path.supports(case.for_guard())
    except SUBMITTED_CODE_ERRORS as exc:
        accepted = f"raised {exc!r}"
    if accepted is not True:
        why = f"the guard refuses {case.id} ({accepted!r})"
        if decode_check.in_scope(manifest, case):  # refusing it would skip the check unpunished
            return decode_check.failed(manifest, case.id, f"{why}, an in-scope case")
        return decode_check.not_run(manifest, why)
    settings = decode_check.effective_settings(manifest.model_check, quick)
    seed = derive_seed(secret_seed, "model check")
    return decode_check.run_decode_check(path, case, settings, seed, device)


def screen_entry_points(manifest: ScopeManifest) -> list[Finding]:
    """The pre-screen over the files of the entry points' modules and their packages."""
    files: set[Path] = set()
    for spec in (
        manifest.path.problem,
        manifest.path.baseline,
        manifest.path.candidate,
        manifest.path.supports,
    ):
        module = sys.modules.get(spec.split(":", 1)[0])
        origin = getattr(module, "__file__", None)
        if origin:
            files.update(Path(origin).parent.glob("*.py"))
    return screen_files(sorted(files), Path.cwd())


def run_case(
    path: LoadedPath,
    case: Case,
    manifest: ScopeManifest,
    secret_seed: int,
    options: EngineOptions,
    device: torch.device,
) -> CaseEvidence:
    try:
        accepted = path.supports(case.for_guard())
    except SUBMITTED_CODE_ERRORS as exc:
        return _case_evidence(case, Crashed(f"supports({case.id}) raised {exc!r}"))
    if accepted is not True:
        return _case_evidence(
            case,
            Unsupported(f"the guard refuses this in-scope case (supports returned {accepted!r})"),
        )
    trials = options.trials or (2 if options.quick else 3)
    stop = options.stop or default_stop_rule(device, options.quick)
    max_layers = options.max_layers or (64 if device.type == "cuda" else 2)
    if runs_on_ranks(case):
        ran = run_case_on_ranks(manifest, case, secret_seed, trials, stop, max_layers, device)
        checked_on_ranks = _correctness_evidence(ran.correctness) if ran.correctness else None
        return _case_evidence(case, ran.outcome, checked_on_ranks, ran.performance)
    checked = correctness_mod.check_case(
        path, case, secret_seed, trials, manifest.tolerance, device
    )
    correctness = _correctness_evidence(checked)
    if not isinstance(checked.outcome, Passed):
        return _case_evidence(case, checked.outcome, correctness)
    try:
        performance, stale, _ = measure_case(
            path, case, secret_seed, stop, max_layers, device, manifest
        )
        stale += still_correct_after_timing(path, case, secret_seed, manifest, device)
    except SUBMITTED_CODE_ERRORS as exc:
        return _case_evidence(case, Crashed(f"while timing: {exc!r}"), correctness)
    if stale:
        return _case_evidence(case, Mismatch(tuple(stale)), correctness, performance)
    return _case_evidence(case, Passed(), correctness, performance)


def still_correct_after_timing(
    path: LoadedPath,
    case: Case,
    secret_seed: int,
    manifest: ScopeManifest,
    device: torch.device,
) -> list[str]:
    """One more correctness trial, on draws of its own, after the many timed calls: a path
    that is right while it is checked and wrong once it has been called often enough fails
    here. The reasons it fails; empty when it passes. A crash raises (on N ranks the failing
    rank must end, or its peers would wait for it in a collective)."""
    checked = correctness_mod.check_case(
        path, case, derive_seed(secret_seed, "after timing"), 1, manifest.tolerance, device
    )
    match checked.outcome:
        case Mismatch(reasons=reasons):
            return [f"after the timed runs, a correctness trial: {r}" for r in reasons]
        case Crashed(error=error):
            raise correctness_mod.CandidateCrash(f"after the timed runs: {error}")
    return []


def measure_case(
    path: LoadedPath,
    case: Case,
    secret_seed: int,
    stop: StopRule,
    max_layers: int,
    device: torch.device,
    manifest: ScopeManifest,
    sync: RankSync | None = None,
) -> tuple[PerformanceEvidence, list[str], Timing]:
    """The case's timing evidence, why the candidate's outputs after the timed runs are wrong
    (empty when they are right), and the raw samples. `sync`: on N ranks (timing.RankSync)."""
    align = sync.align if sync is not None else lambda: None
    layer_set = build_layers(path, case, secret_seed, device, max_layers, sync)
    stock_steps = step_runners(path.baseline, layer_set, device, stop.captures)
    candidate_steps = step_runners(path.candidate, layer_set, device, stop.captures)
    seed = derive_seed(secret_seed, case.id, "bootstrap")
    refresh_inputs(path, case, layer_set, derive_seed(seed, "before timing"), device)
    pairs = pair_inputs(path, case, layer_set, derive_seed(seed, "pairs"), device)
    bytes_moved = _bytes_moved(path, case, layer_set, secret_seed, device)  # the timed work
    tolerance = manifest.tolerance
    watched = watched_replays(
        path.candidate,
        layer_set,
        device,
        tolerance.min_cosine,
        tolerance.deterministic,
        pairs,
        path.problem,
    )
    timing = sample_interleaved(
        stock_steps, candidate_steps, layer_set, device, stop, seed, sync, watched
    )
    # The profile, the wall clock and the eager times run on the last pair's inputs, which do
    # the timed work (a MoE's active experts), so a cross-check compares like with like.
    # (With fresh inputs first, a batch-4 case whose timed draw routed to fewer local experts
    # than the next flagged its profile as 1.54x the events: H200 run of 2026-12-04.)
    align()
    stock_profile = profile_step(stock_steps[0], timing.layers, device)
    align()
    candidate_profile = profile_step(candidate_steps[0], timing.layers, device)
    samples = sample_statistics(timing, seed)
    cand_median = samples["candidate_us_median"]
    bandwidth = hbm_bytes_per_s(device.index or 0) if device.type == "cuda" else None
    stock_wall = candidate_wall = None
    flags: list[str] = []
    if device.type == "cuda":
        align()
        stock_wall = wall_us_per_layer(stock_steps[0], timing.layers, device)
        align()
        candidate_wall = wall_us_per_layer(candidate_steps[0], timing.layers, device)
        flags = cross_check_flags(
            cand_median, candidate_wall, candidate_profile.span_us_per_layer, timing.layers
        )
    align()
    stock_eager = eager_us(path.baseline, layer_set, device)
    align()
    candidate_eager = eager_us(path.candidate, layer_set, device)
    rewritten = changed_weights(path, case, secret_seed, layer_set, device)
    refresh_inputs(path, case, layer_set, derive_seed(seed, "after timing"), device)
    stale = []
    if rewritten:
        stale.append(
            f"the layers' weights changed while both paths were timed ({', '.join(rewritten)}): "
            "the stock path read what the candidate left there"
        )
    stale += timing.watched_problems[:1]
    if len(timing.watched_problems) > 1:
        later = len(timing.watched_problems) - 1
        stale.append(f"so did replays in {later} later batch{'es' if later > 1 else ''}")
    stale += replay_mismatches(
        candidate_steps,
        path.candidate,
        layer_set,
        device,
        tolerance.min_cosine,
        path.problem,
        tolerance.deterministic,
    )
    performance = PerformanceEvidence(
        method=timing.method,
        is_gpu_evidence=device.type == "cuda",
        layers=timing.layers,
        working_set_bytes=timing.working_set_bytes,
        exceeds_l2=timing.working_set_bytes > l2_cache_bytes(device),
        **samples,
        captures=len(stock_steps),
        stop_reason=timing.stop_reason,
        stock_eager_us=stock_eager,
        candidate_eager_us=candidate_eager,
        stock_kernels_per_layer=stock_profile.kernels_per_layer,
        candidate_kernels_per_layer=candidate_profile.kernels_per_layer,
        stock_kernel_us_per_layer=stock_profile.kernel_us_per_layer,
        candidate_kernel_us_per_layer=candidate_profile.kernel_us_per_layer,
        stock_kernel_span_us_per_layer=stock_profile.span_us_per_layer,
        candidate_kernel_span_us_per_layer=candidate_profile.span_us_per_layer,
        kernel_source=candidate_profile.source,
        candidate_kernel_names=list(candidate_profile.kernel_names),
        bytes_moved=bytes_moved,
        hbm_bytes_per_s=bandwidth,
        candidate_hbm_fraction=hbm_fraction(bytes_moved, cand_median, bandwidth),
        stock_hbm_fraction=hbm_fraction(bytes_moved, samples["stock_us_median"], bandwidth),
        stock_wall_us_per_layer=stock_wall,
        candidate_wall_us_per_layer=candidate_wall,
        integrity_flags=flags,
        watched_replays=timing.watched,
        timed_input_sets=timing.input_sets,
        late_starts=timing.late_starts,
        timed_calls=timing.timed_calls,
        late_batches=timing.late_batches,
        lead_cycles=timing.lead_cycles,
    )
    return performance, stale, timing


def sample_statistics(timing: Timing, seed: int) -> dict[str, Any]:
    """The PerformanceEvidence fields that come from the timed samples alone: the samples and
    the capture each pair ran on, each arm's median and CI, the speedup with its interval and
    the capture spread, and the bootstrap's seed and resample count, so that every interval can
    be recomputed from the evidence alone."""
    speedup, speedup_ci, spread = speedup_interval(timing, seed)
    _, *sampling_ci = speedup_ci95(timing.stock_us, timing.candidate_us, seed)
    stock_median, *stock_ci = median_ci95(timing.stock_us, seed)
    cand_median, *cand_ci = median_ci95(timing.candidate_us, seed)
    return {
        "stock_us": timing.stock_us,
        "candidate_us": timing.candidate_us,
        "stock_us_median": stock_median,
        "stock_us_ci95": (stock_ci[0], stock_ci[1]),
        "candidate_us_median": cand_median,
        "candidate_us_ci95": (cand_ci[0], cand_ci[1]),
        "speedup": speedup,
        "speedup_ci95": speedup_ci,
        "speedup_ci95_sampling": (sampling_ci[0], sampling_ci[1]),
        "capture_spread": spread,
        "capture_index": timing.capture_index,
        "bootstrap_seed": seed,
        "bootstrap_resamples": BOOTSTRAP_RESAMPLES,
    }


def reproduce_command(
    scope_path: str, device: str, quick: bool, seed: int, gpus: int | None = None
) -> str:
    parts = ["pathgate", "validate", scope_path, "--device", device, "--seed", str(seed)]
    parts += ["--gpus", str(gpus)] if gpus is not None else []
    return shlex.join(parts + (["--quick"] if quick else []))


def _bytes_moved(
    path: LoadedPath, case: Case, layer_set: LayerSet, secret_seed: int, device: torch.device
) -> int | None:
    """The bytes one timed layer must move, for the HBM fraction: the problem's
    `floor_bytes(case, weights, inputs)` averaged over the timed layers where it has that hook
    (exact for these inputs: e.g. only the experts their routing activates, which at batch 1
    varies from layer to layer by tens of MB), else its `bytes_moved(case)` estimate. The
    weights are made again from their seeds: the candidate has had the timed layers' own in
    its hands (warm-up, capture), and rewriting, say, the router there must not raise the
    count. Under decode CP the timed layers hold whole inputs and each rank gets its share
    inside the call, so there the estimate (one rank's share) is what a rank must move."""
    floor = getattr(path.problem, "floor_bytes", None)
    if floor is not None and case.cp == 1:
        per_layer = [
            floor(case, layer_weights(path, case, secret_seed, layer, device), inputs)
            for layer, (_, inputs, _) in enumerate(layer_set.args)
        ]
        return round(sum(per_layer) / len(per_layer))
    counter = getattr(path.problem, "bytes_moved", None)
    return int(counter(case)) if counter else None


def hbm_fraction(
    bytes_moved: int | None, time_us: float, bytes_per_s: float | None
) -> float | None:
    """Fraction of the measured HBM bandwidth reached (bandwidth.hbm_bytes_per_s): HBM floor
    time over measured time."""
    if bytes_moved is None or bytes_per_s is None or time_us <= 0:
        return None
    return (bytes_moved / bytes_per_s) / (time_us * 1e-6)


def _correctness_evidence(result: correctness_mod.CorrectnessResult) -> CorrectnessEvidence:
    trials = [
        TrialEvidence(
            seed=t.seed,
            reasons=t.reasons,
            outputs=[OutputErrorEvidence(**vars(o)) for o in t.outputs],
            excluded_rows=t.excluded_rows,
            notes=t.notes,
        )
        for t in result.trials
    ]
    return CorrectnessEvidence(
        status=result.outcome.status,
        reasons=reasons_of(result.outcome),
        worst_error_ratio=result.worst_error_ratio,
        trials=trials,
    )


def _case_evidence(
    case: Case,
    outcome: Outcome,
    correctness: CorrectnessEvidence | None = None,
    performance: PerformanceEvidence | None = None,
) -> CaseEvidence:
    return CaseEvidence(
        id=case.id,
        batch=case.batch,
        context=case.context,
        cp=case.cp,
        gpus=case.gpus,
        dtype=case.dtype,
        origin=case.origin,
        status=outcome.status,
        reasons=reasons_of(outcome),
        correctness=correctness,
        performance=performance,
    )


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
