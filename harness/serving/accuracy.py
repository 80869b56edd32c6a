"""The accuracy half of the A/B: the same greedy completions from both arms, and GSM8K.

Greedy decoding (temperature 0) of one seeded prompt set on each arm; per prompt the two outputs
are compared as token-id lists when both servers return them (vLLM with `return_token_ids`),
else as whitespace-separated words of the text. Exact match: the fraction of prompts with
identical outputs. Token match: matched leading units over the longer output's units, summed over
prompts; after the first difference greedy outputs diverge, so later positions are not compared.
Numerics that differ in the last bit may flip a near-tie, so a fast path can be correct with an
exact-match rate below 1; the report shows where each pair first diverges.

GSM8K runs lm-eval's `gsm8k` task through its `local-completions` model against each arm, only
when lm_eval is installed and the dataset is in the local Hugging Face cache (runs are offline);
otherwise the outcome says why it was skipped.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from harness.json_input import UnreadableJson, load_json
from harness.serving.jsonable import jsonable

GSM8K_TASK = "gsm8k"
GSM8K_TIMEOUT_S = 4 * 3600.0
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int] | None
    error: str | None = None


async def greedy_completions(
    base_url: str,
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    timeout_s: float,
    concurrency: int = 8,
) -> list[Completion]:
    """Temperature-0 completions of every prompt, in prompt order (no logprobs asked)."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s) as client:

        async def one(prompt: list[int]) -> Completion:
            async with gate:
                return await _complete(client, model, prompt, max_tokens)

        return list(await asyncio.gather(*(one(p) for p in prompts)))


async def _complete(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int
) -> Completion:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,  # vLLM returns the generated ids: compare tokens, not text
    }
    try:
        response = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        return Completion("", None, f"{type(exc).__name__}: {exc}")
    if response.status_code != 200:
        return Completion("", None, f"HTTP {response.status_code}: {response.text[:300]}")
    try:
        choice = load_json(response.content)["choices"][0]
    except (UnreadableJson, KeyError, IndexError, TypeError):
        choice = None
    if not isinstance(choice, dict):
        return Completion("", None, f"no choices in the response: {response.text[:300]}")
    text, ids = choice.get("text", ""), choice.get("token_ids")
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        ids = None  # absent, or not token ids: compared as words instead
    return Completion(text if isinstance(text, str) else "", ids)


@dataclass(frozen=True)
class GreedyComparison:
    prompts: int
    unit: Literal["token ids", "words"]
    exact_match_rate: float
    token_match_rate: float
    first_divergence: list[int | None]  # per prompt: first differing unit; None when identical
    errors: list[str]  # a prompt one arm failed on counts as a mismatch

    def to_json(self) -> dict[str, Any]:
        return dict(jsonable(self))


def compare_greedy(baseline: list[Completion], candidate: list[Completion]) -> GreedyComparison:
    if len(baseline) != len(candidate):
        raise ValueError(f"{len(baseline)} baseline vs {len(candidate)} candidate completions")
    by_ids = all(c.token_ids is not None for c in baseline + candidate if c.error is None)
    errors = [
        f"prompt {i} ({arm}): {c.error}"
        for i, pair in enumerate(zip(baseline, candidate, strict=True))
        for arm, c in zip(("baseline", "candidate"), pair, strict=True)
        if c.error
    ]
    pairs = [_compare_pair(b, c, by_ids) for b, c in zip(baseline, candidate, strict=True)]
    matched = sum(prefix for _, prefix, _ in pairs)
    total = sum(units for _, _, units in pairs)
    exact = sum(same for same, _, _ in pairs)
    divergence = [None if same else prefix for same, prefix, _ in pairs]
    count = len(baseline)
    return GreedyComparison(
        prompts=count,
        unit="token ids" if by_ids else "words",
        exact_match_rate=exact / count if count else float("nan"),
        token_match_rate=matched / total if total else float("nan"),
        first_divergence=divergence,
        errors=errors,
    )


def _compare_pair(base: Completion, cand: Completion, by_ids: bool) -> tuple[bool, int, int]:
    """(identical, matched leading units, units compared) of one prompt's two outputs."""
    if base.error or cand.error:
        return False, 0, max(len(_units(base, by_ids)), len(_units(cand, by_ids)), 1)
    a, b = _units(base, by_ids), _units(cand, by_ids)
    if not a and not b:
        return True, 1, 1  # two empty outputs agree: one unit, matched
    return a == b, _common_prefix(a, b), max(len(a), len(b))


def _units(completion: Completion, by_ids: bool) -> list[Any]:
    if by_ids and completion.token_ids is not None:
        return list(completion.token_ids)
    return completion.text.split()


def _common_prefix(a: list[Any], b: list[Any]) -> int:
    for position, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return position
    return min(len(a), len(b))


@dataclass(frozen=True)
class Gsm8kScore:
    strict_match: float  # lm-eval's exact_match, strict-match filter
    flexible_extract: float  # exact_match, flexible-extract filter
    limit: int | None
    results_file: str
    status: Literal["scored"] = "scored"


@dataclass(frozen=True)
class Gsm8kSkipped:
    reason: str
    status: Literal["skipped"] = "skipped"

    def __str__(self) -> str:
        return f"skipped: {self.reason}"


@dataclass(frozen=True)
class Gsm8kFailed:
    error: str
    status: Literal["failed"] = "failed"


Gsm8kOutcome = Gsm8kScore | Gsm8kSkipped | Gsm8kFailed


def gsm8k_unavailable(python: str = sys.executable) -> str | None:
    """Why GSM8K cannot run here, or None when lm_eval and the dataset are both available."""
    if importlib.util.find_spec("lm_eval") is None:
        return "lm_eval is not installed (pip install 'lm-eval[api]')"
    probe = (
        "import datasets\n"
        "for name in ('openai/gsm8k', 'gsm8k'):\n"
        "    try:\n"
        "        datasets.load_dataset(name, 'main', split='test'); break\n"
        "    except Exception as exc: error = exc\n"
        "else: raise SystemExit(f'{type(error).__name__}: {error}')\n"
    )
    done = subprocess.run(
        [python, "-c", probe], env=_offline_env(), capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"the gsm8k dataset is not in the local Hugging Face cache (offline): {last}"
    return None


def run_gsm8k(
    base_url: str, model: str, limit: int | None, out_dir: Path, python: str = sys.executable
) -> Gsm8kOutcome:
    reason = gsm8k_unavailable(python)
    if reason is not None:
        return Gsm8kSkipped(reason)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = _lm_eval_command(python, base_url, model, limit, out_dir)
    log = out_dir / "lm_eval.log"
    with log.open("wb") as sink:
        try:
            done = subprocess.run(
                command, env=_offline_env(), stdout=sink, stderr=subprocess.STDOUT,
                timeout=GSM8K_TIMEOUT_S,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return Gsm8kFailed(f"lm_eval did not finish in {GSM8K_TIMEOUT_S:g} s; log: {log}")
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        return Gsm8kFailed(f"lm_eval exited with code {done.returncode}:\n{tail}")
    return parse_lm_eval_results(out_dir, limit)


def _lm_eval_command(
    python: str, base_url: str, model: str, limit: int | None, out_dir: Path
) -> list[str]:
    model_args = ",".join(
        [
            f"model={model}",
            f"base_url={base_url}/v1/completions",
            "num_concurrent=8",
            "max_retries=3",
            "tokenized_requests=False",
        ]
    )
    command = [python, "-m", "lm_eval", "--model", "local-completions"]
    command += ["--model_args", model_args, "--tasks", GSM8K_TASK, "--output_path", str(out_dir)]
    return command + (["--limit", str(limit)] if limit else [])


def _offline_env() -> dict[str, str]:
    # lm-eval and datasets read their settings from the environment; offline so a worker never
    # downloads during an evaluation
    return {**os.environ, **OFFLINE_ENV}


def parse_lm_eval_results(out_dir: Path, limit: int | None) -> Gsm8kOutcome:
    """The newest results*.json lm-eval wrote under out_dir, read for the gsm8k task."""
    files = sorted(out_dir.rglob("results*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        return Gsm8kFailed(f"lm_eval wrote no results*.json under {out_dir}")
    try:
        task = json.loads(files[-1].read_text())["results"][GSM8K_TASK]
        strict, flexible = task["exact_match,strict-match"], task["exact_match,flexible-extract"]
    except (ValueError, KeyError, TypeError) as exc:
        return Gsm8kFailed(f"{files[-1]}: no gsm8k exact_match scores ({exc!r})")
    return Gsm8kScore(float(strict), float(flexible), limit, str(files[-1]))


@dataclass(frozen=True)
class AccuracyResult:
    greedy: GreedyComparison
    gsm8k: dict[str, Gsm8kOutcome] = field(default_factory=dict)  # per arm
    gsm8k_summary: str = "not requested"

    def to_json(self) -> dict[str, Any]:
        return dict(jsonable(self))


def gsm8k_summary(outcomes: dict[str, Gsm8kOutcome]) -> str:
    """One line for the report: the two scores and their difference, or why not."""
    base, cand = outcomes.get("baseline"), outcomes.get("candidate")
    if isinstance(base, Gsm8kScore) and isinstance(cand, Gsm8kScore):
        delta = cand.flexible_extract - base.flexible_extract
        return (
            f"gsm8k flexible-extract: baseline {base.flexible_extract:.4f}, "
            f"candidate {cand.flexible_extract:.4f} ({delta:+.4f})"
        )
    for outcome in (base, cand):
        if isinstance(outcome, Gsm8kSkipped):
            return str(outcome)
        if isinstance(outcome, Gsm8kFailed):
            return f"failed: {outcome.error.splitlines()[0]}"
    return "not requested"
