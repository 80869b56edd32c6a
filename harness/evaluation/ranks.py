"""A case on N ranks: correctness and timing in every rank, combined into one CaseEvidence.

A case of `gpus` = N runs on N processes (distributed.run_on_ranks: NCCL, rank r on GPU r; gloo
on the CPU). Its CP degree c splits the ranks into N / c CP groups of consecutive ranks; each
group is a replica with inputs of its own (seeded by the group), every rank of a group holds the
whole inputs but is given only its share (the problem's `shard_inputs(case, inputs, cp_rank)`:
for decode CP, its slice of the KV cache), and the path finds its group with `cp_group()`. The
weights are the same on every rank.

Every rank runs the engine's own correctness check and timing on its share:
- correctness: each trial's candidate and stock runs get the rank's share; the float64 reference
  runs the baseline on the whole inputs in one process (no group: the unsplit computation a CP
  path must equal); every rank compares the full outputs it returns. After each trial all ranks
  agree whether all passed, so they stop together;
- timing: the same fixed number of stock/candidate pairs on every rank (an adaptive stop could
  end one rank's schedule before a peer's, leaving that peer in a collective), interleaved as
  on one GPU; sample i's time is the slowest rank's sample i (distributed.slowest_rank_us);
  then the replay check and one more correctness trial, as on one GPU.

The parent gets every rank's result (results gathered to it; rank 0 is the root): the case's
correctness is rank 0's unless some rank failed (then the first such rank's, its reasons
prefixed with the rank), its performance rank 0's with the slowest-rank samples and the
statistics recomputed from them. A rank that raises fails the case with its error, one that
hangs with a timeout; the other ranks are killed at once either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

from harness.evaluation import correctness as correctness_mod
from harness.evaluation.cases import Case
from harness.evaluation.distributed import (
    Backend,
    RankCrashed,
    RanksFinished,
    RanksTimedOut,
    run_on_ranks,
    slowest_rank_us,
)
from harness.evaluation.evidence import PerformanceEvidence
from harness.evaluation.integrity import Snapshot, require_plain_tensors
from harness.evaluation.loading import LoadedPath, PathFn, load_path, use_triton_interpreter
from harness.evaluation.outcomes import Crashed, Mismatch, Outcome, Passed, TimedOut
from harness.evaluation.plan import derive_seed
from harness.evaluation.timing import RankSync, StopRule, Timing
from scopes.manifest import ScopeManifest

Tensors = dict[str, torch.Tensor]
# Per rank: the case's correctness and timing together, past the ranks' start-up. A hang in a
# collective captured in a CUDA graph is invisible to NCCL's watchdog, so this clock is what
# ends it; it must leave room in the evaluation child's deadline (config.job_timeout_s, an hour)
# for the rest of the plan. The largest showcase CP case (batch 64 x 32k on 2 GPUs: three
# float64 trials, 50 fixed pairs, eager stock) needs about two minutes by estimate.
RANKS_TIMEOUT_S = 600.0

_cp_group: dist.ProcessGroup | None = None


def cp_group() -> dist.ProcessGroup | None:
    """The context-parallel group of the rank this process is, while a multi-rank case calls a
    path; None on one process (and for the float64 reference, which sees the whole inputs)."""
    return _cp_group


@contextlib.contextmanager
def _in_cp_group(group: dist.ProcessGroup | None) -> Iterator[None]:
    global _cp_group
    previous, _cp_group = _cp_group, group
    try:
        yield
    finally:
        _cp_group = previous


def runs_on_ranks(case: Case) -> bool:
    return case.gpus > 1 or case.cp > 1


@dataclass(frozen=True)
class RankTask:
    """What every rank receives: plain data (spawned ranks import the path themselves)."""

    manifest_json: str
    case: dict[str, Any]
    secret_seed: int
    trials: int
    stop: StopRule
    max_layers: int
    device_type: str  # "cuda" or "cpu"


@dataclass
class RankResult:
    correctness: correctness_mod.CorrectnessResult
    performance: PerformanceEvidence | None = None
    timing: Timing | None = None
    stale: list[str] | None = None


@dataclass(frozen=True)
class CaseOnRanks:
    """What the engine turns into a CaseEvidence."""

    outcome: Outcome
    correctness: correctness_mod.CorrectnessResult | None
    performance: PerformanceEvidence | None


def run_case_on_ranks(
    manifest: ScopeManifest,
    case: Case,
    secret_seed: int,
    trials: int,
    stop: StopRule,
    max_layers: int,
    device: torch.device,
    timeout_s: float = RANKS_TIMEOUT_S,
) -> CaseOnRanks:
    fixed = StopRule(
        min_pairs=stop.min_pairs,
        max_pairs=stop.min_pairs,  # a fixed count: the same schedule on every rank
        max_seconds=float("inf"),
        ci_relative_width=0.0,
        pairs_per_batch=stop.pairs_per_batch,
        captures=stop.captures,
    )
    task = RankTask(
        manifest.model_dump_json(),
        _case_fields(case),
        secret_seed,
        trials,
        fixed,
        max_layers,
        device.type,
    )
    backend: Backend = "nccl" if device.type == "cuda" else "gloo"
    ended = run_on_ranks(_rank_main, case.gpus, backend, timeout_s, (task,))
    if isinstance(ended, RankCrashed):
        also = f" (ranks {list(ended.also_failed)} failed too)" if ended.also_failed else ""
        return CaseOnRanks(Crashed(f"rank {ended.rank}{also}: {ended.error}"), None, None)
    if isinstance(ended, RanksTimedOut):
        why = f"ranks {list(ended.ranks)} had not finished ({ended.phase}); every rank was killed"
        return CaseOnRanks(TimedOut(ended.after_s, why), None, None)
    return _combine(ended, derive_seed(secret_seed, case.id, "bootstrap"))


def _combine(ended: RanksFinished[RankResult], seed: int) -> CaseOnRanks:
    failing = [
        (rank, r) for rank, r in enumerate(ended.results)
        if not isinstance(r.correctness.outcome, Passed)
    ]  # fmt: skip
    if failing:
        rank, result = failing[0]
        return CaseOnRanks(_on_rank(rank, result.correctness.outcome), result.correctness, None)
    root = ended.root
    timings = [r.timing for r in ended.results]
    if root.performance is None or any(t is None for t in timings):
        return CaseOnRanks(Crashed("a rank returned no timing"), root.correctness, None)
    performances = [r.performance for r in ended.results]
    performance = _slowest_rank_performance(performances, timings, seed)  # type: ignore[arg-type]
    stale = [f"rank {rank}: {why}" for rank, r in enumerate(ended.results) for why in r.stale or []]
    outcome: Outcome = Mismatch(tuple(stale)) if stale else Passed()
    return CaseOnRanks(outcome, root.correctness, performance)


def _on_rank(rank: int, outcome: Outcome) -> Outcome:
    if isinstance(outcome, Mismatch):
        return Mismatch(tuple(f"rank {rank}: {r}" for r in outcome.reasons))
    if isinstance(outcome, Crashed):
        return Crashed(f"rank {rank}: {outcome.error}")
    return outcome


def _slowest_rank_performance(
    performances: list[PerformanceEvidence], timings: list[Timing], seed: int
) -> PerformanceEvidence:
    """Rank 0's evidence with the slowest rank's samples, the statistics and floor fractions
    recomputed from them, and every rank's integrity flags (a rank's own, named)."""
    # the engine imports this module
    from harness.evaluation.engine import hbm_fraction, sample_statistics

    root = performances[0]
    slowest = replace(
        timings[0],
        stock_us=slowest_rank_us([t.stock_us for t in timings]),
        candidate_us=slowest_rank_us([t.candidate_us for t in timings]),
    )
    samples = sample_statistics(slowest, seed)
    bytes_moved, bandwidth = root.bytes_moved, root.hbm_bytes_per_s
    flags = list(root.integrity_flags) + [
        f"rank {rank}: {flag}"
        for rank, performance in enumerate(performances[1:], start=1)
        for flag in performance.integrity_flags
    ]
    return root.model_copy(
        update={
            **samples,
            "candidate_hbm_fraction": hbm_fraction(
                bytes_moved, samples["candidate_us_median"], bandwidth
            ),
            "stock_hbm_fraction": hbm_fraction(bytes_moved, samples["stock_us_median"], bandwidth),
            "integrity_flags": flags,
        }
    )


# --- in each rank ---


def _rank_main(rank: int, world_size: int, task: RankTask) -> RankResult:
    # the engine imports this module
    from harness.evaluation.engine import measure_case, still_correct_after_timing

    device = torch.device("cuda", rank) if task.device_type == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        use_triton_interpreter()
    manifest = ScopeManifest.model_validate_json(task.manifest_json)
    case = Case(**{**task.case, "config": MappingProxyType(task.case["config"])})
    group, cp_rank = _join_cp_group(rank, world_size, case.cp)
    snapshot = Snapshot.take()  # before the submitted code is imported on this rank
    path = load_path(manifest)
    _check_untampered(snapshot, rank, "importing the path")
    seed = derive_seed(task.secret_seed, "replica", rank // case.cp)
    sharing = _sharing_path(path, case, cp_rank, group)
    agreed: list[bool] = []  # per trial: whether every rank passed it

    def all_passed(passed: bool) -> bool:
        agreed.append(_all_ranks(passed, device))
        return agreed[-1]

    checked = correctness_mod.check_case(
        sharing,
        case,
        seed,
        task.trials,
        manifest.tolerance,
        device,
        all_passed,
        all_settled=lambda settled: _all_ranks(settled, device),
    )
    _check_untampered(snapshot, rank, "checking correctness")
    if isinstance(checked.outcome, Crashed):
        raise RankFailed(checked.outcome.error)  # the parent stops every rank at once
    if not isinstance(checked.outcome, Passed) or not all(agreed):
        # this rank, or a peer, failed a trial: no rank times the case (a rank that went on
        # alone would wait forever in a collective its failed peers never join)
        return RankResult(checked)
    shared = _pre_shared_path(path, case, cp_rank, group)
    sync = RankSync(
        lambda layers: _most_of_all_ranks(layers, device),
        lambda: _align(device),
        lambda draw: _sum_of_all_ranks(draw, device),
    )
    performance, stale, timing = measure_case(
        shared, case, seed, task.stop, task.max_layers, device, manifest, sync
    )
    try:
        stale += still_correct_after_timing(sharing, case, seed, manifest, device)
    except correctness_mod.CandidateCrash as crash:
        raise RankFailed(crash.error) from None
    _check_untampered(snapshot, rank, "timing")
    return RankResult(checked, performance, timing, stale)


def _check_untampered(snapshot: Snapshot, rank: int, when: str) -> None:
    """On a rank as in the engine's own process: a replaced harness function or threshold ends
    the case (the parent stops every rank), with what was replaced as its reason."""
    replaced = snapshot.replaced()
    if replaced:
        raise RankFailed(f"tampering: {', '.join(replaced)} replaced on rank {rank} while {when}")


class RankFailed(RuntimeError):
    """The candidate failed on this rank; the message is the failure, for the parent."""


def _join_cp_group(rank: int, world_size: int, cp: int) -> tuple[dist.ProcessGroup | None, int]:
    """Every rank creates every CP group (new_group is collective over the world), in order."""
    if world_size % cp:
        raise ValueError(f"{world_size} ranks do not split into CP groups of {cp}")
    mine = None
    for first in range(0, world_size, cp):
        group = dist.new_group(list(range(first, first + cp)))
        if first <= rank < first + cp:
            mine = group
    return (mine if cp > 1 else None), rank % cp


def _align(device: torch.device) -> None:
    """Return on every rank at about the same moment: a collective, then this rank's GPU idle."""
    dist.all_reduce(torch.zeros(1, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _most_of_all_ranks(value: int, device: torch.device) -> int:
    most = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def _sum_of_all_ranks(value: int, device: torch.device) -> int:
    """Uniform modulo n on every rank when any one rank's value is (a rank's own draw)."""
    total = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(total)
    return int(total.item())


def _all_ranks(passed: bool, device: torch.device) -> bool:
    flag = torch.tensor([1 if passed else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _share(problem: Any, case: Case, inputs: Tensors, cp_rank: int) -> Tensors:
    if case.cp == 1:
        return dict(inputs)
    hook = getattr(problem, "shard_inputs", None)
    if hook is None:
        raise TypeError(f"{type(problem).__name__} has no shard_inputs hook: it cannot run cp > 1")
    return dict(hook(case, inputs, cp_rank))


def _sharing_path(
    path: LoadedPath, case: Case, cp_rank: int, group: dist.ProcessGroup | None
) -> LoadedPath:
    """Correctness: the paths get this rank's share of whole inputs; the reference gets them
    whole, on this process alone."""

    def on_share(fn: PathFn) -> PathFn:
        def call(weights: Tensors, inputs: Tensors, outputs: Tensors) -> None:
            share = _share(path.problem, case, inputs, cp_rank)
            given = {name: tensor.clone() for name, tensor in share.items()}
            with _in_cp_group(group):
                fn(weights, share, outputs)
            require_plain_tensors(share, outputs, when="after a call on an input share")
            changed = [name for name in share if not torch.equal(share[name], given[name])]
            if changed:  # the whole inputs never reached the path: report it here
                raise InputModified(f"modified its input share {changed}")

        return call

    return replace(
        path,
        baseline=on_share(path.baseline),
        candidate=on_share(path.candidate),
        reference=path.baseline,
    )


class InputModified(RuntimeError):
    """A path wrote into the share of the inputs it was given."""


class _SharedInputs:
    """The problem, whose inputs are already this rank's share (timing: nothing is cut inside
    the timed graphs); its other hooks run in the CP group."""

    def __init__(self, problem: Any, case: Case, cp_rank: int, group: Any) -> None:
        self._problem, self._case, self._cp_rank, self._group = problem, case, cp_rank, group

    def make_inputs(self, case: Case, seed: int, device: torch.device) -> Tensors:
        whole = self._problem.make_inputs(case, seed, device)
        share = _share(self._problem, case, whole, self._cp_rank)
        return {name: tensor.contiguous() for name, tensor in share.items()}

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._problem, name)
        if name != "ambiguous_rows" or not callable(attribute):
            return attribute

        def in_group(*args: Any) -> Any:
            with _in_cp_group(self._group):
                return attribute(*args)

        return in_group


def _pre_shared_path(
    path: LoadedPath, case: Case, cp_rank: int, group: dist.ProcessGroup | None
) -> LoadedPath:
    def in_group(fn: PathFn) -> PathFn:
        def call(weights: Tensors, inputs: Tensors, outputs: Tensors) -> None:
            with _in_cp_group(group):
                fn(weights, inputs, outputs)

        return call

    return replace(
        path,
        problem=_SharedInputs(path.problem, case, cp_rank, group),
        baseline=in_group(path.baseline),
        candidate=in_group(path.candidate),
    )


def _case_fields(case: Case) -> dict[str, Any]:
    """Case as plain data (its config is a read-only mapping, which does not pickle)."""
    values = {f.name: getattr(case, f.name) for f in fields(case)}
    return {**values, "config": dict(case.config)}
