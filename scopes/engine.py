"""The optional `engine:` section of a scope manifest: how to A/B the path inside a real server.

A layer benchmark shows a path is faster in isolation; the engine section says how to show it in
the serving engine: the serve command (a template), the two arms (environment variables and flags
that switch the specialized path off for `baseline` and on for `candidate`), the load to drive
through the OpenAI-compatible API, and the greedy accuracy comparison. `harness/serving/` runs
it; docs/serving.md defines every metric.
"""

from __future__ import annotations

import re
import shlex
import string
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SERVE_PLACEHOLDERS = ("model", "tp", "dp", "ep", "cp", "port", "gpus")
DEFAULT_SERVE = (
    "vllm serve {model} --tensor-parallel-size {tp} --data-parallel-size {dp} "
    "--decode-context-parallel-size {cp} --port {port}"
)
_WORKLOAD_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


class EngineStrict(BaseModel):
    # The same rules as scopes.manifest.Strict; its own class so manifest.py can import this one.
    # No .inf or .nan: an infinite startup timeout waits forever on a server that never answers.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# Upper bounds: far above any real serving run, low enough that the prompt lists pathgate builds
# before the first request (token ids, num_prompts x input_len) fit in memory.
MAX_TOKENS_PER_REQUEST = 2**20
MAX_PROMPTS = 100_000
MAX_PROMPT_TOKENS = 2**25  # the count x input_len of one prompt set
MAX_CONCURRENCY = 4096
MAX_TIMEOUT_S = 7 * 24 * 3600.0
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _check_prompt_tokens(count: int, input_len: int, what: str) -> None:
    if count * input_len > MAX_PROMPT_TOKENS:
        raise ValueError(
            f"{what}: {count} prompts x {input_len} tokens is over {MAX_PROMPT_TOKENS} prompt "
            "tokens, more than pathgate holds in memory"
        )


def serve_placeholders(template: str) -> list[str]:
    """The placeholder names of a serve template, in order; ValueError on a malformed one."""
    names = []
    for _, field_name, spec, conversion in string.Formatter().parse(template):
        if field_name is None:
            continue
        if field_name not in SERVE_PLACEHOLDERS:
            shown = "{" + field_name + "}" if field_name else "{} (a positional field)"
            raise ValueError(
                f"unknown placeholder {shown}; allowed: "
                + ", ".join("{" + name + "}" for name in SERVE_PLACEHOLDERS)
            )
        if spec or conversion:
            raise ValueError(f"placeholder {{{field_name}}} may not carry a format or conversion")
        names.append(field_name)
    return names


def render_serve(template: str, values: dict[str, str | int]) -> list[str]:
    """The argv of a serve template: split first, then fill each word, so a value holding
    spaces or quotes stays one argument and cannot add flags."""
    return [word.format(**values) for word in shlex.split(template)]


def default_concurrency(low: int, high: int) -> list[int]:
    """Batch min, max and the powers of two between: the plan's grid, as request concurrency."""
    powers = [1 << k for k in range(high.bit_length()) if low < (1 << k) < high]
    return sorted({low, *powers, high})


class Arm(EngineStrict):
    """What switches the specialized path off (baseline) or on (candidate)."""

    env: dict[str, str] = Field(default_factory=dict)
    flags: list[str] = Field(default_factory=list)

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not _ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not an environment variable name")
        return value


class ServingWorkload(EngineStrict):
    name: str
    input_len: int = Field(ge=1, le=MAX_TOKENS_PER_REQUEST)  # prompt tokens per request
    # generated tokens per request (>= 2, or TPOT is undefined)
    output_len: int = Field(ge=2, le=MAX_TOKENS_PER_REQUEST)
    num_prompts: int = Field(ge=1, le=MAX_PROMPTS)  # requests per run
    # Closed-loop request concurrency; None: the scope's batch grid (default_concurrency).
    concurrency: list[Annotated[int, Field(ge=1, le=MAX_CONCURRENCY)]] | None = Field(
        None, min_length=1
    )
    repeats: int = Field(3, ge=1, le=100)  # runs per (arm, concurrency): the samples of the CI
    # Passed to the server as --speculative-config '<json>', e.g. {method: eagle3, ...}
    speculative: dict[str, Any] | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _WORKLOAD_NAME.match(value):
            raise ValueError("workload name: lowercase letters, digits, '-' and '_', 1-63 long")
        return value

    @field_validator("concurrency")
    @classmethod
    def _distinct(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError("concurrency levels must be distinct")
        return sorted(value) if value is not None else None

    @model_validator(mode="after")
    def _fits_in_memory(self) -> ServingWorkload:
        _check_prompt_tokens(self.num_prompts, self.input_len, f"workload {self.name}")
        return self

    def concurrency_levels(self, batch_min: int, batch_max: int) -> list[int]:
        return self.concurrency or default_concurrency(batch_min, batch_max)


class AccuracySpec(EngineStrict):
    """Greedy completions of one seeded prompt set, compared between the arms."""

    prompts: int = Field(32, ge=1, le=MAX_PROMPTS)
    input_len: int = Field(128, ge=1, le=MAX_TOKENS_PER_REQUEST)
    max_tokens: int = Field(128, ge=1, le=MAX_TOKENS_PER_REQUEST)
    gsm8k: bool = False  # lm-eval's gsm8k through `local-completions`, when installed offline
    gsm8k_limit: int | None = Field(None, ge=1, le=MAX_PROMPTS)  # None: the whole test split

    @model_validator(mode="after")
    def _fits_in_memory(self) -> AccuracySpec:
        _check_prompt_tokens(self.prompts, self.input_len, "accuracy")
        return self


class EngineSpec(EngineStrict):
    serve: str = DEFAULT_SERVE
    baseline: Arm = Arm()
    candidate: Arm = Arm()
    health_path: str = "/health"
    metrics_path: str = "/metrics"
    startup_timeout_s: float = Field(900.0, gt=0, le=MAX_TIMEOUT_S)
    # one request, first byte to last
    request_timeout_s: float = Field(600.0, gt=0, le=MAX_TIMEOUT_S)
    workloads: list[ServingWorkload] = Field(default_factory=list)
    accuracy: AccuracySpec = AccuracySpec()

    @field_validator("serve")
    @classmethod
    def _serve(cls, value: str) -> str:
        names = serve_placeholders(value)
        try:
            words = shlex.split(value)
        except ValueError as exc:
            raise ValueError(f"serve is not a valid command line: {exc}") from None
        if not words:
            raise ValueError("serve is empty")
        if "port" not in names:
            # pathgate picks a free port and polls it; a server on its default port is not found
            raise ValueError("serve must contain {port}")
        return value

    @field_validator("health_path", "metrics_path")
    @classmethod
    def _url_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"{value!r} is not a URL path (it must start with '/')")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> EngineSpec:
        names = [w.name for w in self.workloads]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"workload names must be distinct: {', '.join(duplicates)}")
        if self.baseline == self.candidate:
            raise ValueError("baseline and candidate are the same arm: nothing would differ")
        return self
