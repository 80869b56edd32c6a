"""Queues: one per hardware class. A manifest's targets map to queues; a worker's hardware to the
queues it can serve."""

from __future__ import annotations

from scopes.manifest import ScopeManifest

CPU_QUEUE = "cpu"


def queue_name(gpu: str, count: int) -> str:
    """ "cpu", or "gpu.<kind>.x<count>" (e.g. gpu.h200.x1, gpu.gb300.x8)."""
    return CPU_QUEUE if gpu == "cpu" else f"gpu.{gpu.lower()}.x{count}"


def queues_for_manifest(manifest: ScopeManifest) -> list[str]:
    """One job per hardware target: each GPU kind at each GPU count of the scope (the cases
    with 4 GPUs need a host with 4; gpu.h200.x4 runs only those). CPU is one job: a CPU host
    runs every count as that many processes."""
    queues = []
    for gpu in manifest.hardware.gpu:
        counts = [1] if gpu == "cpu" else sorted(manifest.hardware.gpus)
        queues += [queue_name(gpu, n) for n in counts]
    return queues


def gpus_of_queue(queue: str) -> int | None:
    """The GPU count a job of this queue runs (gpu.h200.x4 -> 4); None for the CPU queue, whose
    job runs every count."""
    if queue == CPU_QUEUE:
        return None
    return int(queue.rsplit(".x", 1)[1])


def queues_for_host(gpu: str, count: int) -> list[str]:
    """A GPU host serves its own kind at every count up to what it has, and CPU jobs too."""
    if gpu == "cpu":
        return [CPU_QUEUE]
    return [CPU_QUEUE, *(queue_name(gpu, n) for n in range(1, count + 1))]
