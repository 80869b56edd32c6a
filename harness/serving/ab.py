"""The engine-level A/B: the same load and the same greedy prompts against a server started
with the stock path (baseline arm) and with the specialized path (candidate arm).

For each arm: start the server (once per distinct speculative config of the workloads), warm it
up, run every workload at every concurrency `repeats` times, read the greedy completions (and
GSM8K when asked), stop it. Then per (workload, concurrency) a row compares the arms' per-run
values: medians, their bootstrap 95% CIs, and the gain (> 1: the candidate is better) with a
paired bootstrap CI. Serving claims of the manifest are judged on those rows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import math
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.evaluation.evidence import ClaimEvidence, ClaimStatus
from harness.evaluation.stats import distinct_texts, median_ci95, speedup_ci95
from harness.evaluation.verdict import (
    claim_bound,
    claim_evidence,
    interval_margin,
    interval_status,
)
from harness.serving.accuracy import (
    AccuracyResult,
    Completion,
    Gsm8kOutcome,
    compare_greedy,
    greedy_completions,
    gsm8k_summary,
    run_gsm8k,
)
from harness.serving.jsonable import jsonable
from harness.serving.launcher import (
    LaunchError,
    RunningServer,
    free_port,
    interrupts_deferred,
    launched,
)
from harness.serving.loadgen import LoadRun, LoadSpec, ServerStopped, make_prompts, run_load
from scopes.engine import Arm, EngineSpec, ServingWorkload, render_serve
from scopes.manifest import SERVING_METRICS, Claim, ScopeManifest

ARMS = ("baseline", "candidate")
# metric -> whether a larger value is better; the per-run values LoadRun.metric gives
COMPARED_METRICS = {
    "tokens_per_s": True,
    "request_throughput": True,
    "ttft_ms": False,
    "tpot_ms": False,
    "itl_ms": False,
    "e2e_ms": False,
    "interactivity_p50": True,
    "interactivity_p90": True,
    "interactivity_p99": True,
    "acceptance_length": True,
}
GAIN_CLAIMS = {"tokens_per_s_gain": "tokens_per_s", "interactivity_p90_gain": "interactivity_p90"}
WARMUP_PROMPTS = 8


@dataclass(frozen=True)
class ServeParams:
    """What fills the serve template (the port is picked per launch)."""

    model: str
    tp: int
    dp: int
    ep: int
    cp: int
    gpus: int

    def template_values(self, port: int) -> dict[str, str | int]:
        return {**dataclasses.asdict(self), "port": port}


def serve_params(
    manifest: ScopeManifest, cp: int | None = None, gpus: int | None = None
) -> ServeParams:
    """The manifest's model and shard, at one CP degree and GPU count (default: the first)."""
    shard = manifest.model.shard
    return ServeParams(
        model=manifest.model.id,
        tp=shard.tp,
        dp=shard.dp,
        ep=shard.ep,
        cp=cp if cp is not None else manifest.workload.context_parallel[0],
        gpus=gpus if gpus is not None else manifest.hardware.gpus[0],
    )


def server_command(
    engine: EngineSpec, params: ServeParams, arm: Arm, port: int, speculative: dict[str, Any] | None
) -> list[str]:
    argv = render_serve(engine.serve, params.template_values(port)) + list(arm.flags)
    if speculative:
        argv += ["--speculative-config", json.dumps(speculative, sort_keys=True)]
    return argv


@dataclass(frozen=True)
class ABOptions:
    out_dir: Path  # server logs and lm-eval output land here (artifacts)
    params: ServeParams
    host_gpu: str  # the host's GPU kind ("H200", ..., "cpu"): claims for others are not judged
    seed: int = 0  # prompts; the same for both arms, different per run (no prefix-cache reuse)
    warmup: bool = True  # a discarded short run after each start (first-request compilation)
    term_grace_s: float = 20.0


@dataclass
class ArmResult:
    arm: str
    runs: dict[str, list[LoadRun]] = field(default_factory=dict)  # row id -> runs, run order
    commands: list[list[str]] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    gsm8k: Gsm8kOutcome | None = None
    failure: str | None = None  # the server did not start or went away: no comparison


@dataclass(frozen=True)
class MetricComparison:
    metric: str
    higher_is_better: bool
    baseline: list[float]  # per run, in run order
    candidate: list[float]
    baseline_median: float
    baseline_ci95: tuple[float, float]
    candidate_median: float
    candidate_ci95: tuple[float, float]
    gain: float  # > 1: the candidate is better (its throughput higher, its latency lower)
    gain_ci95: tuple[float, float]


@dataclass(frozen=True)
class ABRow:
    id: str  # "<workload>/c<concurrency>"
    workload: str
    concurrency: int
    input_len: int
    output_len: int
    metrics: dict[str, MetricComparison]
    failed_requests: dict[str, int]  # per arm, over all its runs of this row


@dataclass(frozen=True)
class ABResult:
    scope: str
    params: ServeParams
    host_gpu: str
    rows: list[ABRow]
    accuracy: AccuracyResult | None
    failures: list[str]  # an arm that did not start or whose server went away
    arms: dict[str, dict[str, Any]]  # per arm: serve commands, logs, raw runs
    claims: list[ClaimEvidence] = field(default_factory=list)
    interrupted: bool = False  # SIGINT or SIGTERM: the runs finished before it are kept

    def to_json(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data = dict(jsonable({k: v for k, v in fields.items() if k != "claims"}))
        data["claims"] = [c.model_dump(mode="json") for c in self.claims]
        return data


def run_ab(manifest: ScopeManifest, options: ABOptions) -> ABResult:
    """Both arms, one after the other, then the rows, the accuracy comparison and the claims."""
    engine = _engine(manifest)
    arms = {name: ArmResult(name) for name in ARMS}
    interrupted = False
    try:
        for arm in arms.values():
            if any(other.failure for other in arms.values()):
                # a server start takes minutes on a large model; with no baseline there is no A/B
                arm.failure = "not run: the baseline arm failed"
            else:
                run_arm(manifest, engine, arm, options)
    except KeyboardInterrupt:  # the server is stopped by now (launched's finally)
        interrupted = True
        for arm in arms.values():
            if arm.failure is None:
                arm.failure = "interrupted" if arm.commands else "not run: interrupted"
    with interrupts_deferred(reraise=False) as late:  # the runs done are analysed whole
        result = _analyse(manifest, engine, arms, options)
    return dataclasses.replace(result, interrupted=interrupted or bool(late))


def _analyse(
    manifest: ScopeManifest, engine: EngineSpec, arms: dict[str, ArmResult], options: ABOptions
) -> ABResult:
    failures = [f"{a.arm}: {a.failure}" for a in arms.values() if a.failure]
    rows = [] if failures else compare_arms(manifest, engine, arms["baseline"], arms["candidate"])
    result = ABResult(
        scope=manifest.name,
        params=options.params,
        host_gpu=options.host_gpu,
        rows=rows,
        accuracy=None if failures else _accuracy(engine, arms),
        failures=failures,
        arms={name: _arm_record(arm) for name, arm in arms.items()},
    )
    return dataclasses.replace(result, claims=check_serving_claims(manifest.claims, result))


def _engine(manifest: ScopeManifest) -> EngineSpec:
    if manifest.engine is None:
        raise ValueError(f"scope {manifest.name} has no engine: section; nothing to A/B")
    return manifest.engine


def run_arm(
    manifest: ScopeManifest, engine: EngineSpec, result: ArmResult, options: ABOptions
) -> None:
    """One arm into `result`: a server per speculative group; the first one also serves the
    accuracy prompts. A server that fails ends the arm with its failure recorded (the log stays
    on disk); so does an error of pathgate's own, with its traceback in OUT/ARM-error.log."""
    for index, (speculative, workloads) in enumerate(_launch_groups(engine)):
        try:
            _serve_group(manifest, engine, result, index, speculative, workloads, options)
        except (LaunchError, ServerStopped) as exc:
            result.failure = str(exc)
            return
        except Exception as exc:  # the runs so far stay in result, and so in serving.json
            reason = f"stopped by an internal error: {type(exc).__name__}: {exc}"[:500]
            log = options.out_dir / f"{result.arm}-error.log"
            try:
                log.write_text(traceback.format_exc())
            except OSError as write_error:
                result.failure = f"{reason} (traceback not saved: {write_error.strerror})"
            else:
                result.failure = f"{reason} ({log})"
            return


def _launch_groups(
    engine: EngineSpec,
) -> Iterator[tuple[dict[str, Any] | None, list[ServingWorkload]]]:
    """Workloads grouped by speculative config (a server flag), the plain group first; one
    empty group when there are no workloads, for the accuracy comparison alone."""
    groups: dict[str, list[ServingWorkload]] = {}
    for workload in engine.workloads:
        key = json.dumps(workload.speculative, sort_keys=True) if workload.speculative else ""
        groups.setdefault(key, []).append(workload)
    if not groups:
        groups[""] = []
    for key in sorted(groups):
        yield (json.loads(key) if key else None), groups[key]


def _serve_group(
    manifest: ScopeManifest,
    engine: EngineSpec,
    result: ArmResult,
    index: int,
    speculative: dict[str, Any] | None,
    workloads: list[ServingWorkload],
    options: ABOptions,
) -> None:
    arm: Arm = getattr(engine, result.arm)
    port = free_port()
    command = server_command(engine, options.params, arm, port, speculative)
    log_path = options.out_dir / f"{result.arm}-server-{index}.log"
    result.commands.append(command)
    result.logs.append(str(log_path))
    with launched(
        command,
        port=port,
        log_path=log_path,
        env_overrides=arm.env,
        health_path=engine.health_path,
        startup_timeout_s=engine.startup_timeout_s,
        term_grace_s=options.term_grace_s,
    ) as server:
        if options.warmup and workloads:
            _warm_up(engine, server, workloads[0], options)
        for workload in workloads:
            _run_workload(manifest, engine, server, workload, result, options)
        if index == 0:
            _read_accuracy(engine, server, result, options)


def _spec(
    engine: EngineSpec,
    server: RunningServer,
    workload: ServingWorkload,
    concurrency: int,
    options: ABOptions,
) -> LoadSpec:
    return LoadSpec(
        base_url=server.base_url,
        # vLLM serves the model under the name it was started with: the template's {model}
        model=options.params.model,
        input_len=workload.input_len,
        output_len=workload.output_len,
        num_prompts=workload.num_prompts,
        concurrency=concurrency,
        request_timeout_s=engine.request_timeout_s,
        metrics_path=engine.metrics_path,
        health_path=engine.health_path,
    )


def _warm_up(
    engine: EngineSpec, server: RunningServer, workload: ServingWorkload, options: ABOptions
) -> None:
    """A short discarded run at concurrency WARMUP_PROMPTS: the first requests of a fresh
    server pay for compilation and graph capture of shapes it has not seen."""
    spec = _spec(engine, server, workload, WARMUP_PROMPTS, options)
    spec = dataclasses.replace(spec, num_prompts=WARMUP_PROMPTS)
    spec = dataclasses.replace(spec, seed=run_seed(options.seed, spec, -1))
    asyncio.run(run_load(spec, alive=server.alive))


def _run_workload(
    manifest: ScopeManifest,
    engine: EngineSpec,
    server: RunningServer,
    workload: ServingWorkload,
    result: ArmResult,
    options: ABOptions,
) -> None:
    batch = manifest.workload.batch
    for concurrency in workload.concurrency_levels(batch.min, batch.max):
        runs = result.runs.setdefault(row_id(workload.name, concurrency), [])
        # Repeats of one arm run back to back; the arms cannot alternate run by run without
        # restarting servers, so "pair i" below is repeat i of each arm, matched by run order only.
        for repeat in range(workload.repeats):
            spec = _spec(engine, server, workload, concurrency, options)
            seeded = dataclasses.replace(spec, seed=run_seed(options.seed, spec, repeat))
            runs.append(asyncio.run(run_load(seeded, alive=server.alive)))


def row_id(workload: str, concurrency: int) -> str:
    return f"{workload}/c{concurrency}"


def run_seed(base_seed: int, spec: LoadSpec, repeat: int) -> int:
    """The same prompts for both arms at the same run; new ones for every other run (repeat -1:
    the warm-up)."""
    key = f"{base_seed}:{spec.input_len}:{spec.output_len}:{spec.concurrency}:{repeat}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> 1


def _read_accuracy(
    engine: EngineSpec, server: RunningServer, result: ArmResult, options: ABOptions
) -> None:
    spec = engine.accuracy
    prompts = make_prompts(spec.prompts, spec.input_len, options.seed)
    model = options.params.model
    result.completions = asyncio.run(
        greedy_completions(
            server.base_url, model, prompts, spec.max_tokens, engine.request_timeout_s
        )
    )
    if spec.gsm8k:
        out = options.out_dir / f"gsm8k-{result.arm}"
        result.gsm8k = run_gsm8k(server.base_url, model, spec.gsm8k_limit, out)


def _accuracy(engine: EngineSpec, arms: dict[str, ArmResult]) -> AccuracyResult:
    greedy = compare_greedy(arms["baseline"].completions, arms["candidate"].completions)
    if not engine.accuracy.gsm8k:
        return AccuracyResult(greedy)
    outcomes = {name: arm.gsm8k for name, arm in arms.items() if arm.gsm8k is not None}
    return AccuracyResult(greedy, outcomes, gsm8k_summary(outcomes))


def _arm_record(arm: ArmResult) -> dict[str, Any]:
    return {
        "commands": arm.commands,
        "logs": arm.logs,
        "failure": arm.failure,
        "runs": {rid: [run.to_json() for run in runs] for rid, runs in arm.runs.items()},
        "completions": jsonable(arm.completions),  # the greedy outputs, for the reviewer
    }


def compare_arms(
    manifest: ScopeManifest, engine: EngineSpec, baseline: ArmResult, candidate: ArmResult
) -> list[ABRow]:
    rows = []
    batch = manifest.workload.batch
    for workload in engine.workloads:
        for concurrency in workload.concurrency_levels(batch.min, batch.max):
            rid = row_id(workload.name, concurrency)
            base_runs, cand_runs = baseline.runs[rid], candidate.runs[rid]
            rows.append(
                ABRow(
                    id=rid,
                    workload=workload.name,
                    concurrency=concurrency,
                    input_len=workload.input_len,
                    output_len=workload.output_len,
                    metrics=_compare_metrics(base_runs, cand_runs),
                    failed_requests={
                        "baseline": sum(r.failed for r in base_runs),
                        "candidate": sum(r.failed for r in cand_runs),
                    },
                )
            )
    return rows


def _compare_metrics(
    base_runs: list[LoadRun], cand_runs: list[LoadRun]
) -> dict[str, MetricComparison]:
    compared = {}
    for metric, higher_is_better in COMPARED_METRICS.items():
        base = [run.metric(metric) for run in base_runs]
        cand = [run.metric(metric) for run in cand_runs]
        if all(math.isnan(v) for v in cand):
            continue  # e.g. acceptance length without speculative decoding
        compared[metric] = compare_metric(metric, higher_is_better, base, cand)
    return compared


def compare_metric(
    metric: str, higher_is_better: bool, baseline: list[float], candidate: list[float]
) -> MetricComparison:
    """Medians with bootstrap CIs, and the gain median(better-direction ratio) with a paired
    bootstrap CI (pair i: repeat i of each arm)."""
    base_median, *base_ci = _median_ci(baseline)
    cand_median, *cand_ci = _median_ci(candidate)
    finite = all(math.isfinite(v) and v > 0 for v in baseline + candidate)
    if finite and len(baseline) == len(candidate):
        better, worse = (candidate, baseline) if higher_is_better else (baseline, candidate)
        gain, *gain_ci = speedup_ci95(better, worse)
    else:
        gain, gain_ci = float("nan"), [float("nan"), float("nan")]
    return MetricComparison(
        metric=metric,
        higher_is_better=higher_is_better,
        baseline=baseline,
        candidate=candidate,
        baseline_median=base_median,
        baseline_ci95=(base_ci[0], base_ci[1]),
        candidate_median=cand_median,
        candidate_ci95=(cand_ci[0], cand_ci[1]),
        gain=gain,
        gain_ci95=(gain_ci[0], gain_ci[1]),
    )


def _median_ci(values: list[float]) -> tuple[float, float, float]:
    if not values or any(math.isnan(v) for v in values):
        return float("nan"), float("nan"), float("nan")
    return median_ci95(values)


def check_serving_claims(claims: list[Claim], result: ABResult) -> list[ClaimEvidence]:
    """Judge the manifest's serving-metric claims on the A/B rows (other claims are the layer
    verdict's). A claim's `where` selects rows: batch is the request concurrency, context the
    prompt length, cp and gpus the values the server was started with."""
    return [_check(claim, result) for claim in claims if claim.metric in SERVING_METRICS]


def _check(claim: Claim, result: ABResult) -> ClaimEvidence:
    judged = functools.partial(claim_evidence, claim)
    if claim.hardware and claim.hardware != result.host_gpu:
        return judged(
            "not_measurable", f"needs {claim.hardware}; this run was on {result.host_gpu}"
        )
    if result.host_gpu == "cpu":
        return judged("not_measurable", "no GPU on this host: serving figures are not GPU evidence")
    if result.failures:
        return judged("inconclusive", "the A/B did not complete: " + "; ".join(result.failures))
    rows = [row for row in result.rows if _selected(claim, row, result.params)]
    measured = [(row, *_claim_value(claim, row)) for row in rows]
    measured = [m for m in measured if not math.isnan(m[1])]
    if not measured:
        return judged("not_measurable", "no A/B row matches its `where` and measures it")
    ids = [row.id for row, *_ in measured]
    verdicts = [(_row_status(claim, row, ci), row, value, ci) for row, value, ci in measured]
    for wanted in ("refuted", "inconclusive"):
        for status, row, value, ci in verdicts:
            if status == wanted:
                return judged(wanted, _row_reason(row, value, ci, claim), value, ci, ids)
    _, row, value, ci = min(verdicts, key=lambda v: interval_margin(claim, v[3]))
    closest = _row_reason(row, value, ci, claim)
    return judged(
        "verified", f"all {len(ids)} selected rows meet it; closest {closest}", value, ci, ids
    )


def _selected(claim: Claim, row: ABRow, params: ServeParams) -> bool:
    values = {"batch": row.concurrency, "context": row.input_len, "cp": params.cp}
    values["gpus"] = params.gpus
    for key, wanted in claim.where.items():
        if values[key] not in (wanted if isinstance(wanted, list) else [wanted]):
            return False
    return True


def _claim_value(claim: Claim, row: ABRow) -> tuple[float, tuple[float, float]]:
    """The candidate's median and CI for a metric; the gain and its CI for a *_gain claim."""
    base_metric = GAIN_CLAIMS.get(claim.metric, claim.metric)
    comparison = row.metrics.get(base_metric)
    if comparison is None:
        return float("nan"), (float("nan"), float("nan"))
    if claim.metric in GAIN_CLAIMS:
        return comparison.gain, comparison.gain_ci95
    return comparison.candidate_median, comparison.candidate_ci95


def _row_status(claim: Claim, row: ABRow, ci: tuple[float, float]) -> ClaimStatus:
    low, high = ci
    if row.failed_requests["candidate"] or row.failed_requests["baseline"]:
        return "inconclusive"  # throughput over completed requests only would flatter a path
    return interval_status(claim, low, high)


def _row_reason(row: ABRow, value: float, ci: tuple[float, float], claim: Claim) -> str:
    failed = row.failed_requests
    failures = (
        f"; failed requests: baseline {failed['baseline']}, candidate {failed['candidate']}"
        if failed["baseline"] or failed["candidate"]
        else ""
    )
    point, low, high = distinct_texts((value, *ci, claim_bound(claim)))[:3]
    return f"{row.id}: {claim.metric} {point}, 95% CI [{low}, {high}]{failures}"
