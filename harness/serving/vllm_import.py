"""Import a `vllm bench serve --save-result` JSON file as serving evidence rows with provenance.

The keys are the ones vLLM's vllm/benchmarks/serve.py writes: the setup (`date` as
%Y%m%d-%H%M%S, `backend`, `label`, `model_id`, `tokenizer_id`, `num_prompts`, `request_rate` (a
number or "inf"), `burstiness`, `max_concurrency`), the run (`duration` s, `completed`, `failed`,
`total_input_tokens`, `total_output_tokens`, `request_throughput` req/s, `output_throughput` and
`total_token_throughput` tok/s), latency statistics `{mean,median,std,pNN}_{ttft,tpot,itl,e2el}_ms`
(only the percentile metrics asked with --percentile-metrics and --metric-percentiles are there),
the speculative-decoding figures `spec_decode_*` when the server drafted, and with
--save-detailed the per-request lists `input_lens`, `output_lens`, `ttfts` (s), `itls` (s, one
list per request), `latencies` (s), `errors`, `generated_texts`.

Every row keeps vLLM's key and value; `metric` names the pathgate metric it corresponds to where
there is one. Rows derived by pathgate from the per-request lists are kept apart (`derived`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.json_input import UnreadableJson, load_json
from harness.serving.jsonable import jsonable

REQUIRED_TEXT = ("date", "backend", "model_id")
REQUIRED_NUMBERS = ("duration", "request_throughput", "output_throughput")
REQUIRED_COUNTS = ("completed", "total_input_tokens", "total_output_tokens")
OPTIONAL_TEXT = ("endpoint_type", "label", "tokenizer_id")
OPTIONAL_COUNTS = ("num_prompts", "max_concurrency", "failed", "max_concurrent_requests")
SCALAR_ROWS = {
    # vLLM key: (unit, pathgate metric or None)
    "duration": ("s", None),
    "completed": ("requests", None),
    "failed": ("requests", None),
    "total_input_tokens": ("tokens", None),
    "total_output_tokens": ("tokens", None),
    "request_throughput": ("req/s", "request_throughput"),
    "request_goodput": ("req/s", None),
    "output_throughput": ("tok/s", "tokens_per_s"),
    "total_token_throughput": ("tok/s", None),
    "max_output_tokens_per_s": ("tok/s", None),
    "spec_decode_acceptance_length": ("tokens", "acceptance_length"),
    "spec_decode_acceptance_rate": ("%", None),
    "spec_decode_num_drafts": ("drafts", None),
    "spec_decode_draft_tokens": ("tokens", None),
    "spec_decode_accepted_tokens": ("tokens", None),
}
LATENCY_KEY = re.compile(r"^(mean|median|std|p\d+(?:\.\d+)?)_(ttft|tpot|itl|e2el)_ms$")
LATENCY_METRIC = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_ms", "e2el": "e2e_ms"}
PER_REQUEST_NUMBERS = ("input_lens", "output_lens", "ttfts", "latencies")


class VllmResultError(Exception):
    """The file is not a `vllm bench serve` result; the message names the file and field."""


@dataclass(frozen=True)
class Provenance:
    file_name: str
    sha256: str
    date: str
    backend: str
    model_id: str
    tokenizer_id: str | None
    label: str | None
    num_prompts: int | None
    request_rate: float | str | None  # vLLM writes "inf" for an unlimited rate
    max_concurrency: int | None


@dataclass(frozen=True)
class EvidenceRow:
    key: str  # as vLLM wrote it
    value: float
    unit: str
    metric: str | None  # the pathgate metric this is, where there is one
    statistic: str | None  # "median", "p99", ... for latency statistics


@dataclass(frozen=True)
class VllmBenchImport:
    provenance: Provenance
    rows: list[EvidenceRow]
    derived: list[EvidenceRow]  # computed here from the per-request lists, not written by vLLM
    per_request: int  # requests in the per-request lists (0 without --save-detailed)

    def row(self, key: str) -> EvidenceRow:
        return next(r for r in self.rows + self.derived if r.key == key)

    def to_json(self) -> dict[str, Any]:
        return dict(jsonable(self))


def import_vllm_result(path: Path) -> VllmBenchImport:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise VllmResultError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = load_json(raw)
    except UnreadableJson as exc:
        raise VllmResultError(f"{path.name}: {exc}") from None
    return parse_vllm_result(data, path.name, hashlib.sha256(raw).hexdigest())


def parse_vllm_result(data: Any, file_name: str, sha256: str) -> VllmBenchImport:
    if not isinstance(data, dict):
        got = type(data).__name__
        raise VllmResultError(f"{file_name}: expected one JSON object (a result), got {got}")
    field = _Fields(data, file_name)
    for key in REQUIRED_TEXT:
        field.text(key, required=True)
    for key in REQUIRED_NUMBERS:
        field.number(key, required=True)
    for key in REQUIRED_COUNTS + OPTIONAL_COUNTS:
        field.count(key, required=key in REQUIRED_COUNTS)
    for key in OPTIONAL_TEXT:
        field.text(key)
    per_request = field.per_request_lists()
    return VllmBenchImport(
        provenance=_provenance(data, field, file_name, sha256),
        rows=_scalar_rows(field) + _latency_rows(field),
        derived=_derived_rows(data) if per_request else [],
        per_request=per_request,
    )


@dataclass(frozen=True)
class _Fields:
    """Typed reads of the result; each wrong field raises with its name."""

    data: dict[str, Any]
    file_name: str

    def _fail(self, key: str, wanted: str) -> VllmResultError:
        if key not in self.data:
            return VllmResultError(f"{self.file_name}: field {key!r} is missing ({wanted})")
        got = json.dumps(self.data[key])[:60]
        return VllmResultError(f"{self.file_name}: field {key!r}: expected {wanted}, got {got}")

    def text(self, key: str, required: bool = False) -> str | None:
        value = self.data.get(key)
        if isinstance(value, str) or (value is None and not required):
            return value
        raise self._fail(key, "a string")

    def number(self, key: str, required: bool = False) -> float | None:
        value = self.data.get(key)
        if value is None and not required:
            return None
        if value is not None and _is_number(value):
            return float(value)
        raise self._fail(key, "a finite number")

    def count(self, key: str, required: bool = False) -> int | None:
        value = self.data.get(key)
        if value is None and not required:
            return None
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63:
            return value
        raise self._fail(key, "a whole number >= 0 (below 2^63)")

    def rate(self) -> float | str | None:
        value = self.data.get("request_rate")
        if value is None or value == "inf":
            return value
        return self.number("request_rate")

    def per_request_lists(self) -> int:
        """Check the --save-detailed lists; their common length (0 when absent)."""
        lengths = {}
        for key in (*PER_REQUEST_NUMBERS, "itls"):
            if key not in self.data:
                continue
            values = self.data[key]
            if not isinstance(values, list) or not all(_is_item(key, v) for v in values):
                kind = "lists of numbers, one per request" if key == "itls" else "numbers"
                raise self._fail(key, f"a list of {kind}")
            lengths[key] = len(values)
        if len(set(lengths.values())) > 1:
            shown = ", ".join(f"{k}={n}" for k, n in lengths.items())
            raise VllmResultError(f"{self.file_name}: per-request lists differ in length: {shown}")
        return next(iter(lengths.values()), 0)


def _is_number(value: Any) -> bool:
    """A finite JSON number: Python's JSON reader also takes NaN, Infinity, 1e999 and integers
    too large for a float, none of which a statistic can use."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_item(key: str, value: Any) -> bool:
    if key == "itls":
        return isinstance(value, list) and all(_is_number(v) for v in value)
    return _is_number(value)


def _provenance(data: dict[str, Any], field: _Fields, file_name: str, sha256: str) -> Provenance:
    return Provenance(
        file_name=file_name,
        sha256=sha256,
        date=str(data["date"]),
        backend=str(data["backend"]),
        model_id=str(data["model_id"]),
        tokenizer_id=field.text("tokenizer_id"),
        label=field.text("label"),
        num_prompts=field.count("num_prompts"),
        request_rate=field.rate(),
        max_concurrency=field.count("max_concurrency"),
    )


def _scalar_rows(field: _Fields) -> list[EvidenceRow]:
    rows = []
    for key, (unit, metric) in SCALAR_ROWS.items():
        value = field.number(key)
        if value is not None:
            rows.append(EvidenceRow(key, value, unit, metric, None))
    return rows


def _latency_rows(field: _Fields) -> list[EvidenceRow]:
    rows = []
    for key in sorted(field.data):
        match = LATENCY_KEY.match(key)
        if match:
            value = field.number(key, required=True)
            assert value is not None
            statistic, name = match.groups()
            rows.append(EvidenceRow(key, value, "ms", LATENCY_METRIC[name], statistic))
    return rows


def _derived_rows(data: dict[str, Any]) -> list[EvidenceRow]:
    """Interactivity from the per-request ITLs, defined as in harness/serving/loadgen.py:
    tokens/s per user at pX = 1 / pX(ITL)."""
    itls_s = [gap for request in data.get("itls", []) for gap in request]
    rows = []
    for percentile in (50, 90, 99):
        interval = float(np.percentile(itls_s, percentile)) if itls_s else math.nan
        if interval > 0:
            key = f"interactivity_p{percentile}"
            rows.append(EvidenceRow(key, 1.0 / interval, "tok/s/user", key, f"p{percentile}"))
    return rows
