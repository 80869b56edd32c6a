"""The scope manifest: what a specialized path claims, and where.

A manifest names the path's entry points (problem, baseline, candidate, guard), the model it
serves, the hardware, the workload range (batch, context, decode context-parallel degrees), the
correctness tolerance and the performance claims. Extra keys are refused everywhere, so a typo is
an error rather than a silently ignored claim.

`load_manifest` parses YAML text and turns every problem into a `ManifestProblem` carrying the
field path and, where the YAML parser knows it, the line number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from scopes.engine import MAX_CONCURRENCY, EngineSpec

KNOWN_GPUS = ("H100", "H200", "B200", "GB200", "GB300", "MI300X", "cpu")
GpuKind = Literal["H100", "H200", "B200", "GB200", "GB300", "MI300X", "cpu"]
# Judged by the engine-level A/B (harness/serving/ab.py), never by a layer benchmark.
ServingMetric = Literal[
    "tokens_per_s",
    "ttft_ms",
    "tpot_ms",
    "interactivity_p90",
    "request_throughput",
    "acceptance_length",
    "tokens_per_s_gain",
    "interactivity_p90_gain",
]
SERVING_METRICS: tuple[str, ...] = get_args(ServingMetric)
LayerMetric = Literal["speedup", "latency_us", "kernels_per_layer", "hbm_fraction"]
Metric = Literal[LayerMetric, ServingMetric]  # nested Literals flatten into one
Dtype = Literal["bfloat16", "float16", "float32"]
WHERE_KEYS = ("batch", "context", "cp", "gpus")

_ENTRY_POINT = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")
_SLUG = re.compile(r"^[a-z0-9][a-z0-9-]{1,62}[a-z0-9]$")


class Strict(BaseModel):
    # No .inf or .nan anywhere: an infinite error_budget or a claim bound of .nan would make a
    # check that can never fail.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class PathSpec(Strict):
    """Entry points as `package.module:attribute`."""

    problem: str
    baseline: str
    candidate: str
    supports: str

    @field_validator("problem", "baseline", "candidate", "supports")
    @classmethod
    def _entry_point(cls, value: str) -> str:
        if not _ENTRY_POINT.match(value):
            raise ValueError(f"{value!r} is not an entry point of the form 'package.module:attr'")
        return value


class Shard(Strict):
    tp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    dp: int = Field(1, ge=1)


class ModelSpec(Strict):
    id: str = Field(min_length=1)
    dtype: Dtype
    shard: Shard = Shard()
    # Architecture numbers the problem needs (hidden size, ...); the problem documents its keys.
    config: dict[str, int | float | str] = Field(default_factory=dict)


class Hardware(Strict):
    gpu: list[GpuKind] = Field(min_length=1)
    gpus: list[Annotated[int, Field(ge=1, le=1024)]] = Field(min_length=1)

    @field_validator("gpu", mode="before")
    @classmethod
    def _known_gpu(cls, value: Any) -> Any:
        for kind in value if isinstance(value, list) else [value]:
            if kind not in KNOWN_GPUS:
                raise ValueError(f"unknown GPU {kind!r}; known: {', '.join(KNOWN_GPUS)}")
        return value


# Batch and context bounds: far past any real case, and within the database's integers (a
# 400-digit batch passed the manifest and lost its job's evidence at the insert).
MAX_BOUND = 2**31 - 1


class IntRange(Strict):
    min: int = Field(ge=1, le=MAX_BOUND)
    max: int = Field(ge=1, le=MAX_BOUND)

    @model_validator(mode="after")
    def _ordered(self) -> IntRange:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is larger than max ({self.max})")
        return self


class Workload(Strict):
    phase: Literal["decode", "prefill"]
    batch: IntRange
    context: IntRange | None = None  # None: the path does not depend on context length
    context_parallel: list[Annotated[int, Field(ge=1, le=1024)]] = Field(
        default_factory=lambda: [1]
    )

    @field_validator("context_parallel")
    @classmethod
    def _distinct(cls, value: list[int]) -> list[int]:
        if len(set(value)) != len(value):
            raise ValueError("context_parallel degrees must be distinct")
        return sorted(value)


class Tolerance(Strict):
    # Candidate error may be at most error_budget x the stock path's own error vs the reference.
    error_budget: float = Field(2.0, gt=0)
    min_cosine: float = Field(0.9999, gt=0, le=1)
    # Relative-error floor under which the stock error is raised before applying the budget;
    # None derives it from the dtype (machine epsilon / 8).
    abs_floor: float | None = Field(None, gt=0)
    deterministic: bool = True


class Claim(Strict):
    metric: Metric
    where: dict[str, int | list[int]] = Field(default_factory=dict)
    at_least: float | None = None
    at_most: float | None = None
    hardware: GpuKind | None = None
    # Relative slack: a speedup claim of 1.8 with tolerance 0.05 is met by a CI above 1.71.
    tolerance: float = Field(0.0, ge=0, lt=1)

    @field_validator("where")
    @classmethod
    def _where_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if key not in WHERE_KEYS:
                raise ValueError(f"unknown case key {key!r} in where; use {', '.join(WHERE_KEYS)}")
        return value

    @model_validator(mode="after")
    def _one_bound(self) -> Claim:
        if (self.at_least is None) == (self.at_most is None):
            raise ValueError("a claim needs exactly one of at_least / at_most")
        return self

    def where_values(self) -> list[tuple[str, int]]:
        """Each (key, value) the claim's `where` names, a list flattened."""
        return [
            (key, value)
            for key, wanted in self.where.items()
            for value in (wanted if isinstance(wanted, list) else [wanted])
        ]

    def describe(self) -> str:
        bound = f">= {self.at_least}" if self.at_least is not None else f"<= {self.at_most}"
        where = ", ".join(f"{k}={v}" for k, v in self.where.items()) or "all cases"
        on = f" on {self.hardware}" if self.hardware else ""
        return f"{self.metric} {bound} ({where}){on}"


class ModelCheck(Strict):
    """The model-level decode check: a small model of `layers` layers of the problem (distinct
    synthetic weights), a random embedding and LM head, greedy decoding for `steps` steps from
    `prompts` random prompts, stock vs candidate (harness/evaluation/decode_check.py)."""

    layers: int = Field(4, ge=1, le=64)
    steps: int = Field(32, ge=1, le=4096)
    prompts: int = Field(4, ge=1, le=512)
    vocab: int = Field(4096, ge=2, le=262144)
    # greedy tokens that must agree (under teacher forcing on the stock's tokens)
    min_token_match: float = Field(0.95, gt=0, le=1)
    # mean KL(stock || candidate) of the next-token distributions, in nats; above it the check
    # still passes when the candidate's mean KL from the float64 reference model is at most
    # kl_budget x the stock path's + max_mean_kl (decode_check.py says why)
    max_mean_kl: float = Field(1e-3, gt=0)
    kl_budget: float = Field(2.0, ge=1)


class ScopeManifest(Strict):
    name: str
    summary: str = Field(min_length=1)
    path: PathSpec
    model: ModelSpec
    hardware: Hardware
    workload: Workload
    tolerance: Tolerance = Tolerance()
    claims: list[Claim] = Field(default_factory=list)
    engine: EngineSpec | None = None  # how to A/B the path inside a serving engine
    # run where the problem offers decode-stack hooks; these are the defaults when absent
    model_check: ModelCheck = ModelCheck()

    @field_validator("name")
    @classmethod
    def _slug(cls, value: str) -> str:
        if not _SLUG.match(value):
            raise ValueError("name must be a slug: lowercase letters, digits and '-', 3-64 long")
        return value

    @model_validator(mode="after")
    def _claims_in_scope(self) -> ScopeManifest:
        for claim in self.claims:
            if claim.hardware and claim.hardware not in self.hardware.gpu:
                raise ValueError(
                    f"claim '{claim.describe()}' names {claim.hardware}, "
                    f"which is not in hardware.gpu"
                )
            if claim.metric in SERVING_METRICS:
                continue  # `where` selects A/B rows: batch is the request concurrency
            outside = [
                f"{key}={value}"
                for key, value in claim.where_values()
                if not self._in_scope(key, value)
            ]
            if outside:  # no case could ever match: the claim would end "not measurable" every run
                raise ValueError(
                    f"claim '{claim.describe()}' selects {', '.join(outside)}, outside the scope"
                )
        return self

    @model_validator(mode="after")
    def _cp_degrees_runnable(self) -> ScopeManifest:
        """A CP degree runs on a GPU count it divides (the ranks split into CP groups); one
        that divides none of hardware.gpus would leave every run of it 'not run'."""
        counts = self.hardware.gpus
        for cp in self.workload.context_parallel:
            if not any(gpus % cp == 0 for gpus in counts):
                raise ValueError(
                    f"workload.context_parallel lists {cp}, but no GPU count in hardware.gpus "
                    f"({', '.join(map(str, counts))}) splits into CP groups of {cp}"
                )
        return self

    def _in_scope(self, key: str, value: int) -> bool:
        workload = self.workload
        if key == "batch":
            return workload.batch.min <= value <= workload.batch.max
        if key == "context":
            return (
                workload.context is not None
                and workload.context.min <= value <= workload.context.max
            )
        if key == "cp":
            return value in workload.context_parallel
        return value in self.hardware.gpus

    @model_validator(mode="after")
    def _engine_concurrency_bounded(self) -> ScopeManifest:
        """A workload without `concurrency` runs the batch grid as concurrency levels."""
        batch = self.workload.batch
        for workload in self.engine.workloads if self.engine else []:
            if workload.concurrency is None and batch.max > MAX_CONCURRENCY:
                raise ValueError(
                    f"engine workload {workload.name} runs the batch grid up to {batch.max} "
                    f"concurrent requests, over {MAX_CONCURRENCY}: give it a concurrency list"
                )
        return self


@dataclass(frozen=True)
class ManifestProblem:
    """One thing wrong with a manifest, located."""

    field: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line else ""
        return f"{where}{self.field or '(manifest)'}: {self.message}"


class ManifestError(Exception):
    def __init__(self, problems: list[ManifestProblem]) -> None:
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems


# Nodes a manifest may expand to, aliases followed: the shipped ones have a few hundred.
MAX_NODES = 100_000


def load_manifest(text: str) -> ScopeManifest:
    """Parse and validate manifest YAML (JSON is YAML too); raise ManifestError on any problem."""
    try:
        text.encode("utf-8")
        root, data = _parse(text)
    except UnicodeEncodeError as exc:
        # a lone surrogate (JSON's "\ud800" decodes to one): no database or report can hold it
        problem = f"not valid Unicode text (character {exc.start} is a lone surrogate)"
        raise ManifestError([ManifestProblem("", problem)]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else None
        raise ManifestError([ManifestProblem("", f"not valid YAML: {exc}", line)]) from None
    except RecursionError:
        raise ManifestError([ManifestProblem("", "nested too deeply to be a manifest")]) from None
    except ValueError as exc:  # an integer of thousands of digits: Python refuses to convert it
        raise ManifestError([ManifestProblem("", f"a value that cannot be read: {exc}")]) from None
    return validate_manifest(data, root)


def _parse(text: str) -> tuple[yaml.Node | None, Any]:
    """One pass: the node tree (for line numbers) and the data built from it, with libyaml's
    parser where PyYAML has it (about ten times faster than the pure-Python one)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)
    try:
        root = loader.get_single_node()
        if root is not None:
            _check_nodes(root)
        return root, loader.construct_document(root) if root is not None else None
    finally:
        loader.dispose()


def _check_nodes(root: yaml.Node) -> None:
    """What YAML allows and a manifest must not have: a key given twice (the last would win
    silently: a reviewer would read claims that are never judged), a NUL character, and aliases
    that expand the document past MAX_NODES (a small file of nested `*name`s can stand for
    gigabytes; a tool's YAML writer may use aliases for repeated values, which stays allowed).
    Each with its line."""
    problems = []
    checked: set[int] = set()
    visits, stack, aliased = 0, [root], False
    while stack:
        node = stack.pop()
        visits += 1
        aliased = aliased or id(node) in checked  # a node met twice: reached through an alias
        if visits > MAX_NODES:
            how = "expands to" if aliased else "has"
            through = " (through aliases, *name)" if aliased else "; a manifest has a few hundred"
            message = f"{how} over {MAX_NODES} YAML nodes{through}"
            raise ManifestError([ManifestProblem("", message, node.start_mark.line + 1)])
        if isinstance(node, yaml.MappingNode):
            if id(node) not in checked:
                problems += _duplicate_keys(node)
            stack += [item for pair in node.value for item in pair]
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value
        elif id(node) not in checked and "\x00" in node.value:
            # a database's text and JSON columns, a process's argv and environment refuse it
            line = node.start_mark.line + 1
            problems.append(ManifestProblem("", "holds a NUL character (\\0)", line))
        checked.add(id(node))
    if problems:
        raise ManifestError(problems)


def _duplicate_keys(node: yaml.MappingNode) -> list[ManifestProblem]:
    seen: set[str] = set()
    problems = []
    for key, _ in node.value:
        if isinstance(key, yaml.ScalarNode):
            if key.value in seen:
                problems.append(ManifestProblem(key.value, "given twice", key.start_mark.line + 1))
            seen.add(key.value)
    return problems


def load_manifest_file(path: Path) -> ScopeManifest:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError([ManifestProblem("", f"cannot read {path}: {exc.strerror}")]) from None
    except UnicodeDecodeError as exc:
        problem = f"not UTF-8 text (byte {exc.start} of {path.name})"
        raise ManifestError([ManifestProblem("", problem)]) from None
    return load_manifest(text)


def validate_manifest(data: Any, root: yaml.Node | None = None) -> ScopeManifest:
    if not isinstance(data, dict):
        raise ManifestError([ManifestProblem("", "a manifest is a mapping of fields")])
    try:
        return ScopeManifest.model_validate(data)
    except ValidationError as exc:
        problems = [_problem(error, root) for error in exc.errors()]
        raise ManifestError(problems) from None


def _problem(error: Any, root: yaml.Node | None) -> ManifestProblem:
    loc = [part for part in error["loc"] if not _is_type_tag(part)]
    field = ".".join(str(part) for part in loc)
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unknown field (not allowed here)"
    return ManifestProblem(field, message, _line_of(root, loc))


def _is_type_tag(part: Any) -> bool:
    # pydantic puts union member names ("int", "list[int]") into the location
    return isinstance(part, str) and ("[" in part or part in {"int", "float", "str", "IntRange"})


def _line_of(node: yaml.Node | None, loc: list[Any]) -> int | None:
    """Walk the composed YAML tree along a pydantic location to the deepest node we can find."""
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = [(k, v) for k, v in node.value if k.value == str(part)]
            if not match:
                break
            line = match[0][0].start_mark.line + 1
            node = match[0][1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                break
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line
