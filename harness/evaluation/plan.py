"""The plan: a scope expanded into cases to run, probes for the guard, and what cannot run here.

Cases are the batch (and context) minimum, maximum and the powers of two between, plus values
drawn from a secret per-run seed, so a path tuned only to the probed sizes fails; crossed with
every GPU count this host can serve (or the one count a queue's job asks for) and every CP
degree that splits that count into CP groups. A case of N GPUs runs on N ranks
(harness.evaluation.ranks). Probes sit just outside the scope: there the guard must refuse and
the dispatching entry must give exactly the stock result.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, replace
from types import MappingProxyType

from harness.evaluation.cases import Case
from scopes.manifest import IntRange, ScopeManifest

# A CPU host runs a case of N "GPUs" as N gloo processes (the multi-rank machinery's CPU form).
CPU_MAX_RANKS = 8
OTHER_DTYPE = {"bfloat16": "float16", "float16": "bfloat16", "float32": "bfloat16"}
# Seeds are 63-bit (derive_seed, the engine's own draw): a run's seed must go back through
# --seed and through JSON readers that hold 64-bit signed integers only.
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Host:
    """What this machine offers: a GPU kind (or "cpu") and how many."""

    gpu: str
    count: int

    @property
    def device(self) -> str:
        return "cpu" if self.gpu == "cpu" else "cuda"


@dataclass(frozen=True)
class Plan:
    cases: tuple[Case, ...]
    probes: tuple[Case, ...]
    not_run: tuple[str, ...]  # e.g. "gpus=8: needs 8x GB300, this host has 1x H200"
    # the GPU counts of the scope this host could not run (a part of not_run): a run that left
    # part of its scope out is no PASS (a `--gpus N` job leaves the other counts out on purpose)
    left_out: tuple[str, ...] = ()

    @property
    def runnable(self) -> bool:
        return bool(self.cases)


def derive_seed(secret_seed: int, *parts: object) -> int:
    """A 63-bit seed for one purpose (a trial, a layer) from the secret run seed."""
    text = ":".join(str(p) for p in (secret_seed, *parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 1


def grid_values(bounds: IntRange, rng: random.Random, n_random: int) -> list[tuple[int, str]]:
    """min, max, the powers of two between, and n_random other in-range values."""
    grid = {bounds.min, bounds.max}
    power = 1
    while power < bounds.max:
        if power > bounds.min:
            grid.add(power)
        power *= 2
    values = [(v, "grid") for v in sorted(grid)]
    off_grid = (
        sorted(set(range(bounds.min, bounds.max + 1)) - grid)
        if bounds.max - bounds.min < 4096
        else []
    )
    if off_grid:
        picks = rng.sample(off_grid, min(n_random, len(off_grid)))
    else:
        picks = [
            v
            for v in (rng.randint(bounds.min, bounds.max) for _ in range(n_random))
            if v not in grid
        ]
    values += [(v, "random") for v in sorted(set(picks))]
    return values


def make_plan(
    manifest: ScopeManifest,
    host: Host,
    secret_seed: int,
    quick: bool = False,
    gpus: int | None = None,
) -> Plan:
    """`gpus`: run only the cases of that GPU count (a job of the gpu.<kind>.x<gpus> queue);
    None: every count this host can serve."""
    runnable_gpus, not_run = _gpu_counts_here(manifest, host, gpus)
    left_out = tuple(not_run)
    if not runnable_gpus:
        return Plan((), (), tuple(not_run), left_out)
    rng = random.Random(derive_seed(secret_seed, "plan"))
    workload = manifest.workload
    batches = _with_claimed(
        _thin(grid_values(workload.batch, rng, 2), quick), _claimed(manifest, "batch")
    )
    contexts: list[tuple[int | None, str]] = [(None, "grid")]
    if workload.context is not None:
        contexts = list(
            _with_claimed(
                _thin(grid_values(workload.context, rng, 2), quick), _claimed(manifest, "context")
            )
        )
    base = Case(
        batch=workload.batch.min,
        context=workload.context.min if workload.context else None,
        cp=1,
        gpus=runnable_gpus[0],
        dtype=manifest.model.dtype,
        gpu=host.gpu,
        config=MappingProxyType(dict(manifest.model.config)),
    )
    cases = []
    for gpus in runnable_gpus:
        for cp in workload.context_parallel:
            if cp > gpus:
                not_run.append(f"cp={cp} with gpus={gpus}: a CP degree needs that many GPUs")
                continue
            if gpus % cp:
                not_run.append(f"cp={cp} with gpus={gpus}: the ranks must split into CP groups")
                continue
            for batch, b_origin in batches:
                for context, c_origin in contexts:
                    origin = "random" if "random" in (b_origin, c_origin) else "grid"
                    cases.append(
                        replace(base, batch=batch, context=context, cp=cp, gpus=gpus, origin=origin)
                    )
    return Plan(tuple(cases), tuple(_probes(manifest, base)), tuple(not_run), left_out)


def _claimed(manifest: ScopeManifest, key: str) -> set[int]:
    """The values of `key` that some claim's `where` names: every one must be measured, or the
    claim would be judged on the others alone."""
    values: set[int] = set()
    for claim in manifest.claims:
        wanted = claim.where.get(key)
        values.update(wanted if isinstance(wanted, list) else [] if wanted is None else [wanted])
    return values


def _with_claimed(values: list[tuple[int, str]], claimed: set[int]) -> list[tuple[int, str]]:
    """`values` plus the claimed ones it lacks (as grid points); out-of-range ones stay out, and
    the claim then finds no case for them."""
    have = {value for value, _ in values}
    low, high = min(have), max(have)
    extra = [(v, "grid") for v in claimed if v not in have and low <= v <= high]
    return sorted(values + extra)


def _thin(values: list[tuple[int, str]], quick: bool) -> list[tuple[int, str]]:
    """Quick mode keeps min, max, one middle power of two and one random value."""
    if not quick:
        return values
    grid = [v for v in values if v[1] == "grid"]
    randoms = [v for v in values if v[1] == "random"]
    keep = {grid[0], grid[-1], grid[len(grid) // 2]} | set(randoms[:1])
    return sorted(keep)


def _gpu_counts_here(
    manifest: ScopeManifest, host: Host, only: int | None
) -> tuple[list[int], list[str]]:
    kinds = manifest.hardware.gpu
    if host.gpu not in kinds:
        needed = min(manifest.hardware.gpus)
        gpu_names = " or ".join(k for k in kinds)
        return [], [
            f"not runnable here: needs {needed}x {gpu_names}; this host has "
            f"{host.count}x {host.gpu}"
        ]
    wanted = [n for n in manifest.hardware.gpus if only is None or n == only]
    limit = host.count if host.device == "cuda" else CPU_MAX_RANKS
    runnable = [n for n in wanted if n <= limit]
    not_run = [
        f"gpus={n}: needs {n}x {host.gpu}, this host has {host.count}"
        for n in wanted
        if n not in runnable
    ]
    return runnable, not_run


def _probes(manifest: ScopeManifest, base: Case) -> list[Case]:
    workload = manifest.workload
    probes = [replace(base, batch=workload.batch.max + 1, origin="probe: batch above max")]
    if workload.batch.min > 1:
        probes.append(replace(base, batch=workload.batch.min - 1, origin="probe: batch below min"))
    if workload.context is not None:
        probes.append(
            replace(base, context=workload.context.max + 1, origin="probe: context above max")
        )
    listed = workload.context_parallel
    unlisted_cp = next((d for d in (2, 4, 8, 16, 32, 3) if d not in listed), max(listed) + 1)
    probes.append(replace(base, cp=unlisted_cp, origin="probe: unlisted CP degree"))
    probes.append(replace(base, dtype=OTHER_DTYPE[base.dtype], origin="probe: other dtype"))
    return probes


def probe_runs_on_one_process(probe: Case) -> bool:
    """A CP probe is checked through the guard only: one process cannot run another CP degree."""
    return probe.origin != "probe: unlisted CP degree"
