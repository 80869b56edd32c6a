"""The model-level decode check: does a model built from the path still answer the same?

Layer-level correctness bounds one layer's error; a model stacks layers and feeds its own tokens
back, so small errors can compound into different text. The check builds a small model from the
problem's own layer: `layers` layers with distinct seeded weights, each with its decode state (for
the MLA problem, a latent cache holding the case's context: the random prompt history), a random
embedding, a final RMSNorm and a random LM head. The stock path decodes greedily for `steps`
steps from random prompt tokens. The candidate is then teacher-forced on the stock's tokens (the
same inputs at every step), so at every step both next-token distributions can be compared:
whether their greedy choice agrees, and KL(stock || candidate). The first step whose greedy
choice differs is where free-running decoding would diverge.

The bar for the KL is set by the stock path's own error, as the layer check's is: the reference
(the baseline on float64 copies of the model, its state and the stock's tokens) gives
KL(reference || stock) and KL(reference || candidate), and the check passes when KL(stock ||
candidate) is within `max_mean_kl`, or the candidate is no further from the reference than
`kl_budget` x the stock path (+ `max_mean_kl`). In a mixture-of-experts model two correct bf16
paths part ways at routing near-ties (one token takes another expert, and that step's
distributions differ by a whole expert); the stock path's own distance from the reference shows
how much of that to expect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.evaluation.cases import Case
from harness.evaluation.correctness import upcast
from harness.evaluation.evidence import DecodeCheckEvidence
from harness.evaluation.integrity import require_plain_tensors
from harness.evaluation.loading import LoadedPath, PathFn
from harness.evaluation.outcomes import SUBMITTED_CODE_ERRORS
from harness.evaluation.plan import derive_seed
from scopes.manifest import ModelCheck, ScopeManifest

Tensors = dict[str, torch.Tensor]
HOOKS = ("decode_state", "step_inputs", "step_finish")
QUICK_STEPS, QUICK_LAYERS = 8, 2
LOGIT_STD = 4.0  # logits of this spread make greedy choices neither flat nor one-hot
NORM_EPS = 1e-6


@dataclass(frozen=True)
class SyntheticModel:
    embedding: torch.Tensor  # (vocab, hidden), the case's dtype
    head: torch.Tensor  # (vocab, hidden), float32
    layers: list[Tensors]  # each layer's weights
    prompt: torch.Tensor  # (prompts,) the first token of every sequence
    state_seeds: list[int]  # each layer's decode-state seed: every run starts from the same state


@dataclass(frozen=True)
class Trace:
    tokens: torch.Tensor  # (steps, prompts) greedy choices
    log_probs: torch.Tensor  # (steps, prompts, vocab) float32


def has_hooks(problem: object) -> bool:
    return all(callable(getattr(problem, hook, None)) for hook in HOOKS)


def check_case(manifest: ScopeManifest, host_gpu: str, gpus: int) -> Case:
    """Where the check runs: as many sequences as prompts (within the batch range), the
    shortest context in scope."""
    workload, settings = manifest.workload, manifest.model_check
    batch = min(max(settings.prompts, workload.batch.min), workload.batch.max)
    return Case(
        batch=batch,
        context=workload.context.min if workload.context else None,
        cp=1,
        gpus=gpus,
        dtype=manifest.model.dtype,
        gpu=host_gpu,
        origin="model check",
        config=dict(manifest.model.config),
    )


def effective_settings(settings: ModelCheck, quick: bool) -> ModelCheck:
    if not quick:
        return settings
    return settings.model_copy(
        update={
            "steps": min(settings.steps, QUICK_STEPS),
            "layers": min(settings.layers, QUICK_LAYERS),
        }
    )


def run_decode_check(
    path: LoadedPath, case: Case, settings: ModelCheck, seed: int, device: torch.device
) -> DecodeCheckEvidence:
    """The check on one case; a candidate that raises is a crashed check, never an exception."""
    evidence = _evidence(settings, case.id, case.batch, [])
    model = build_model(path, case, settings, seed, device)
    try:
        stock = decode(path.baseline, path, case, model, settings.steps, forced=None)
    except SUBMITTED_CODE_ERRORS as exc:
        return replace_status(evidence, "crashed", [f"the stock path raised {exc!r}"])
    try:
        reference = decode(
            path.reference_fn, path, case, model, settings.steps, stock.tokens, exact=True
        )
    except SUBMITTED_CODE_ERRORS as exc:
        return replace_status(evidence, "crashed", [f"the float64 reference raised {exc!r}"])
    # last: the candidate gets the model's own weight tensors, and nothing runs after it
    try:
        candidate = decode(path.candidate, path, case, model, settings.steps, forced=stock.tokens)
    except SUBMITTED_CODE_ERRORS as exc:
        return replace_status(evidence, "crashed", [f"the candidate raised {exc!r}"])
    return compare(evidence, stock, candidate, reference)


def build_model(
    path: LoadedPath, case: Case, settings: ModelCheck, seed: int, device: torch.device
) -> SyntheticModel:
    problem = path.problem
    hidden = problem.make_inputs(case, derive_seed(seed, "width"), device)["x"].shape[-1]
    gen = torch.Generator(device="cpu").manual_seed(derive_seed(seed, "model"))
    dtype = getattr(torch, case.dtype)
    embedding = torch.randn(settings.vocab, hidden, generator=gen).to(device, dtype)
    head = (
        torch.randn(settings.vocab, hidden, generator=gen) * (LOGIT_STD / math.sqrt(hidden))
    ).to(device)
    prompt = torch.randint(0, settings.vocab, (case.batch,), generator=gen).to(device)
    layers = [
        problem.make_weights(case, derive_seed(seed, "layer", i), device)
        for i in range(settings.layers)
    ]
    state_seeds = [derive_seed(seed, "state", i) for i in range(settings.layers)]
    return SyntheticModel(embedding, head, layers, prompt, state_seeds)


def decode(
    fn: PathFn,
    path: LoadedPath,
    case: Case,
    model: SyntheticModel,
    steps: int,
    forced: torch.Tensor | None,
    exact: bool = False,
) -> Trace:
    """Greedy decoding with one path; with `forced`, each step's input is the forced token.
    `exact`: on float64 copies of the model, its decode state and the outputs (the reference)."""
    problem, device = path.problem, model.embedding.device
    widen = upcast if exact else dict  # either way a fresh dict
    states = [widen(problem.decode_state(case, s, device)) for s in model.state_seeds]
    outputs = widen(problem.make_outputs(case, device))
    embedding = model.embedding.double() if exact else model.embedding
    token, tokens, log_probs = model.prompt, [], []
    for step in range(steps):
        hidden = embedding[token]
        residual = torch.zeros_like(hidden)
        for weights, state in zip(model.layers, states, strict=True):
            inputs = problem.step_inputs(state, hidden, residual)
            # widened per call: one layer's float64 copy at a time (17 GB for the MLA shard)
            # fresh dicts: rebinding an entry must not change the tensors read back
            fn(widen(weights), dict(inputs), dict(outputs))
            require_plain_tensors(inputs, outputs, when="after a decode step's call")
            hidden, residual = problem.step_finish(state, outputs)
        step_log_probs = _next_token_log_probs(hidden, residual, model.head)
        greedy = step_log_probs.argmax(-1)
        tokens.append(greedy)
        log_probs.append(step_log_probs)
        token = greedy if forced is None else forced[step]
    return Trace(torch.stack(tokens), torch.stack(log_probs))


def _next_token_log_probs(
    hidden: torch.Tensor, residual: torch.Tensor, head: torch.Tensor
) -> torch.Tensor:
    wide = torch.promote_types(hidden.dtype, torch.float32)  # float64 for the reference
    final = hidden.to(wide) + residual.to(wide)
    final = final * torch.rsqrt(final.square().mean(-1, keepdim=True) + NORM_EPS)
    return torch.log_softmax(final @ head.to(wide).T, dim=-1)


def kl_divergence(p: Trace, q: Trace) -> torch.Tensor:
    """KL(p || q) per step and prompt, in nats; a NaN or -inf log-prob makes it infinite."""
    p_log, q_log = p.log_probs.double(), q.log_probs.double()
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    return torch.where(kl.isfinite(), kl, torch.full_like(kl, math.inf))


def compare(
    evidence: DecodeCheckEvidence, stock: Trace, candidate: Trace, reference: Trace
) -> DecodeCheckEvidence:
    agree = stock.tokens == candidate.tokens  # (steps, prompts)
    kl = kl_divergence(stock, candidate)
    token_match = float(agree.float().mean())
    mean_kl = float(kl.mean())
    stock_from_reference = kl_divergence(reference, stock)
    candidate_from_reference = kl_divergence(reference, candidate)
    stock_off = float(stock_from_reference.mean())
    candidate_off = float(candidate_from_reference.mean())
    evidence = evidence.model_copy(
        update={
            "token_match": token_match,
            "first_divergence": [_first_false(agree[:, p]) for p in range(agree.shape[1])],
            "mean_kl": mean_kl,
            "max_kl": float(kl.max()),
            "kl_per_step": [float(v) for v in kl.mean(-1)],
            "stock_kl_from_reference": stock_off,
            "candidate_kl_from_reference": candidate_off,
            "stock_tokens": stock.tokens.T.tolist(),
            "candidate_tokens": candidate.tokens.T.tolist(),
            "kl_by_prompt": kl.T.tolist(),
            "stock_kl_from_reference_by_prompt": stock_from_reference.T.tolist(),
            "candidate_kl_from_reference_by_prompt": candidate_from_reference.T.tolist(),
        }
    )
    reasons = []
    if not token_match >= evidence.min_token_match:
        diverged = [s for s in evidence.first_divergence if s is not None]
        reasons.append(
            f"greedy tokens agree at {token_match:.1%} of steps (at least "
            f"{evidence.min_token_match:.1%} needed); first divergence at step {min(diverged)}"
        )
    # A stock path infinitely far from the reference (a NaN) sets no bar at all. The bound
    # keeps max_mean_kl as slack: a flip is a rare event, and on a seed where the stock path
    # happens to flip nothing, one flip of the candidate's is no sign of a worse path.
    bar = evidence.kl_budget * stock_off + evidence.max_mean_kl
    within_budget = math.isfinite(stock_off) and candidate_off <= bar
    if not (mean_kl <= evidence.max_mean_kl or within_budget):
        reasons.append(
            f"mean KL(stock || candidate) of the next-token distributions {mean_kl:.3g} nats "
            f"(at most {evidence.max_mean_kl:g}), and from the float64 reference the candidate "
            f"is {candidate_off:.3g} nats away against the stock path's {stock_off:.3g} "
            f"(at most {evidence.kl_budget:g}x that + {evidence.max_mean_kl:g})"
        )
    return replace_status(evidence, "failed" if reasons else "passed", reasons)


def replace_status(
    evidence: DecodeCheckEvidence, status: str, reasons: list[str]
) -> DecodeCheckEvidence:
    return evidence.model_copy(update={"status": status, "reasons": reasons})


def _first_false(column: torch.Tensor) -> int | None:
    misses = (~column).nonzero()
    return int(misses[0, 0]) if len(misses) else None


def not_run(manifest: ScopeManifest, why: str) -> DecodeCheckEvidence:
    settings = manifest.model_check
    return _evidence(settings, "", settings.prompts, [why])


def failed(manifest: ScopeManifest, case_id: str, why: str) -> DecodeCheckEvidence:
    settings = manifest.model_check
    return _evidence(settings, case_id, settings.prompts, [why]).model_copy(
        update={"status": "failed"}
    )


def in_scope(manifest: ScopeManifest, case: Case) -> bool:
    """Whether the check's case lies in the scope (its batch and context are in range by
    construction): the scope's GPU kind, GPU count and CP degree."""
    hardware = manifest.hardware
    return (
        case.gpu in hardware.gpu
        and case.gpus in hardware.gpus
        and case.cp in manifest.workload.context_parallel
    )


def _evidence(
    settings: ModelCheck, case_id: str, prompts: int, reasons: list[str]
) -> DecodeCheckEvidence:
    """A check not (yet) run: its settings, no measurements."""
    return DecodeCheckEvidence(
        case=case_id,
        layers=settings.layers,
        steps=settings.steps,
        prompts=prompts,
        vocab=settings.vocab,
        min_token_match=settings.min_token_match,
        max_mean_kl=settings.max_mean_kl,
        kl_budget=settings.kl_budget,
        status="not_run",
        reasons=reasons,
    )
