"""Queues: one per hardware class. A manifest's targets map to queues; a worker's hardware to the
queues it can serve."""

from __future__ import annotations

from scopes.manifest import ScopeManifest

CPU_QUEUE = "cpu"


def queue_name(gpu: str, count: int) -> str:
    """ "cpu", or "gpu.<kind>.x<count>" (e.g. gpu.h200.x1, gpu.gb300.x8)."""
    return CPU_QUEUE if gpu == "cpu" else f"gpu.{gpu.lower()}.x{count}"


def queues_for_manifest(manifest: ScopeManifest) -> list[str]:
    """One job per hardware target: each GPU kind at the smallest GPU count of the scope (a
    worker runs every count it can host within that job)."""
    smallest = min(manifest.hardware.gpus)
    return [queue_name(gpu, 1 if gpu == "cpu" else smallest) for gpu in manifest.hardware.gpu]


def queues_for_host(gpu: str, count: int) -> list[str]:
    """A GPU host serves its own kind at every count up to what it has, and CPU jobs too."""
    if gpu == "cpu":
        return [CPU_QUEUE]
    return [CPU_QUEUE, *(queue_name(gpu, n) for n in range(1, count + 1))]
