"""The evidence schema (versioned): everything a report or a verdict is made from.

Every figure a report shows is a field here or computed from the raw samples stored here.
docs/evidence.md describes the fields; `pathgate schema` prints the JSON Schema.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import CoreSchema

SCHEMA_VERSION: Final = "pathgate.evidence/1"
Verdict = Literal["PASS", "FAIL", "NEEDS_REVIEW", "INCONCLUSIVE"]
VERDICTS: tuple[Verdict, ...] = ("PASS", "FAIL", "NEEDS_REVIEW", "INCONCLUSIVE")
# The submission (and job) state a finished evaluation's verdict puts it in.
STATE_OF_VERDICT = {
    "PASS": "passed",
    "FAIL": "failed",
    "NEEDS_REVIEW": "needs_review",
    "INCONCLUSIVE": "inconclusive",
}
CaseStatus = Literal["passed", "failed", "unsupported", "crashed", "timed_out", "not_run"]
ClaimStatus = Literal["verified", "refuted", "inconclusive", "not_measurable"]


class Model(BaseModel):
    # An error can be infinite (a NaN output): in JSON it travels as the string "Infinity",
    # which reads back as a float, where JSON's own null would not.
    # The JSON Schema (evidence_json_schema) describes the file, where every field is written.
    model_config = ConfigDict(
        extra="forbid", ser_json_inf_nan="strings", json_schema_serialization_defaults_required=True
    )


class OutputErrorEvidence(Model):
    name: str
    candidate_error: float
    stock_error: float
    error_ratio: float
    cosine: float


class TrialEvidence(Model):
    seed: int
    outputs: list[OutputErrorEvidence]
    reasons: list[str]
    # rows of an output left out of its error as near-tie decisions (the problem's hook)
    excluded_rows: dict[str, int] = {}
    notes: list[str] = []


class CorrectnessEvidence(Model):
    status: CaseStatus
    reasons: list[str]
    worst_error_ratio: float
    trials: list[TrialEvidence]


class PerformanceEvidence(Model):
    method: str  # "cuda-graph" or "cpu-host-clock"
    is_gpu_evidence: bool
    layers: int
    working_set_bytes: int
    exceeds_l2: bool
    stock_us: list[float]  # per-layer samples, interleaved pairs: stock_us[i] with candidate_us[i]
    candidate_us: list[float]
    stock_us_median: float
    stock_us_ci95: tuple[float, float]
    candidate_us_median: float
    candidate_us_ci95: tuple[float, float]
    speedup: float
    # the sampling (bootstrap) interval widened by capture_spread: what claims are judged on
    speedup_ci95: tuple[float, float]
    speedup_ci95_sampling: tuple[float, float]
    captures: int  # CUDA graphs captured per path; samples rotate through them
    capture_spread: float  # relative range of per-capture medians, stock + candidate
    # which capture each sample pair ran on, and the bootstrap behind every interval (stats.py):
    # with them the intervals recompute from this file alone (empty / None in older evidence)
    capture_index: list[int] = []
    bootstrap_seed: int | None = None
    bootstrap_resamples: int | None = None
    stop_reason: str
    stock_eager_us: float | None
    candidate_eager_us: float | None
    stock_kernels_per_layer: float | None
    candidate_kernels_per_layer: float | None
    stock_kernel_us_per_layer: float | None  # summed kernel durations (busy time)
    candidate_kernel_us_per_layer: float | None
    stock_kernel_span_us_per_layer: float | None  # first kernel start to last kernel end
    candidate_kernel_span_us_per_layer: float | None
    kernel_source: str | None
    candidate_kernel_names: list[str]
    bytes_moved: int | None
    hbm_bytes_per_s: float | None
    candidate_hbm_fraction: float | None
    stock_hbm_fraction: float | None
    # Independent clock: replays between two device-wide synchronizations, host wall clock.
    stock_wall_us_per_layer: float | None = None
    candidate_wall_us_per_layer: float | None = None
    # Timed candidate replays whose outputs were compared with its eager result on the same
    # inputs: all of them since 2026-12-07's pair inputs (one per batch of pairs, picked at
    # random, before); None in evidence from before that check.
    watched_replays: int | None = None
    # Evidence of 2026-12-07 before the pair inputs: timed candidate replays each checked on
    # the device as it ran against its eager result on the one timed input set.
    tallied_replays: int | None = None
    # The input sets the timed pairs ran on, a new one for every pair with the timed inputs'
    # work (timing.PairInputs); None in evidence from before.
    timed_input_sets: int | None = None
    # Sampled timed calls whose start event may have fired before the host had queued them,
    # so their interval may hold the graph's launch, and all the sampled calls (CUDA; 0 on the
    # host clock; None in evidence from before 2026-12-07's check).
    late_starts: int | None = None
    timed_calls: int | None = None
    # Batches not sampled because a call may have started late, each doubling the GPU's spin
    # before a start event, and the spin in cycles the sampling ended with (CUDA; 0 and 0 on
    # the host clock; None in evidence from before 2026-12-07's re-timing).
    late_batches: int | None = None
    lead_cycles: int | None = None
    # Cross-checks that disagree with the event timing: each sends the verdict to review.
    integrity_flags: list[str] = []


class CaseEvidence(Model):
    id: str
    batch: int
    context: int | None
    cp: int
    gpus: int
    dtype: str
    origin: str
    status: CaseStatus
    reasons: list[str]
    correctness: CorrectnessEvidence | None
    performance: PerformanceEvidence | None


class ProbeEvidence(Model):
    id: str
    origin: str
    status: CaseStatus
    reasons: list[str]


class ClaimEvidence(Model):
    claim: dict[str, Any]
    description: str
    status: ClaimStatus
    measured: float | None
    ci95: tuple[float, float] | None
    cases: list[str]
    reason: str


class DecodeCheckEvidence(Model):
    """The model-level decode check (harness/evaluation/decode_check.py)."""

    case: str
    layers: int
    steps: int
    prompts: int
    vocab: int
    min_token_match: float
    max_mean_kl: float
    status: Literal["passed", "failed", "crashed", "not_run"]
    reasons: list[str]
    token_match: float | None = None  # greedy choices that agree, candidate teacher-forced
    first_divergence: list[int | None] = []  # per prompt: first step whose choice differs
    mean_kl: float | None = None  # KL(stock || candidate), nats, over steps and prompts
    max_kl: float | None = None
    kl_per_step: list[float] = []  # mean over prompts
    # the bar for mean_kl above max_mean_kl: mean KL(float64 reference || path), nats
    kl_budget: float = 2.0
    stock_kl_from_reference: float | None = None
    candidate_kl_from_reference: float | None = None
    stock_tokens: list[list[int]] = []  # per prompt, per step
    candidate_tokens: list[list[int]] = []
    # per prompt, per step, in nats: every KL figure above is their mean or max
    kl_by_prompt: list[list[float]] = []  # KL(stock || candidate)
    stock_kl_from_reference_by_prompt: list[list[float]] = []
    candidate_kl_from_reference_by_prompt: list[list[float]] = []


class RunInfo(Model):
    seed: int  # the secret run seed, revealed once the run is over so it can be reproduced
    device: str
    quick: bool
    started_at: str
    finished_at: str
    command: str  # reproduces this run, seed included
    # checkpoint.code_digest of the tree that ran: the git SHA in the environment cannot tell
    # an uncommitted edit, and a GPU worker's copied tree may carry a stale .git or none
    code_digest: str | None = None  # None in evidence written before it was recorded


class Evidence(Model):
    schema_version: Literal["pathgate.evidence/1"] = SCHEMA_VERSION  # the one version there is
    verdict: Verdict
    verdict_reasons: list[str]
    scope: str
    manifest: dict[str, Any]
    run: RunInfo
    environment: dict[str, Any]
    not_run: list[str]
    cases: list[CaseEvidence]
    probes: list[ProbeEvidence]
    claims: list[ClaimEvidence]
    notes: list[str]
    # what the harness relies on that the submitted code replaced (any entry is a FAIL)
    tampering: list[str] = []
    # the static pre-screen's findings: for the reviewer, never a verdict by themselves
    warnings: list[str] = []
    decode_check: DecodeCheckEvidence | None = None


class EvidenceFileSchema(GenerateJsonSchema):
    """evidence.json as the engine writes it: a float may be the string "Infinity",
    "-Infinity" or "NaN" (Model's ser_json_inf_nan), which a plain JSON Schema number refuses."""

    def float_schema(self, schema: CoreSchema) -> dict[str, Any]:  # type: ignore[override]
        number = super().float_schema(schema)  # type: ignore[arg-type]
        return {"anyOf": [number, {"enum": ["Infinity", "-Infinity", "NaN"]}]}


def evidence_json_schema() -> dict[str, Any]:
    """The JSON Schema of evidence.json (`pathgate schema`): the serialized form, so every
    field the engine always writes (schema_version included) is required."""
    return Evidence.model_json_schema(mode="serialization", schema_generator=EvidenceFileSchema)
