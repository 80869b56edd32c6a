"""Kernels per layer from torch.profiler (CUPTI on CUDA) over one step, and their summed time.

The summed kernel time per layer cross-checks the event timing: a large gap means work the events
did not see (a side stream) or idle time inside the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class KernelProfile:
    kernels_per_layer: float
    kernel_us_per_layer: float
    source: str  # "cupti" (GPU kernels) or "cpu-ops" (top-level torch ops; not GPU evidence)
    kernel_names: tuple[str, ...]  # distinct names, in first-launch order


def profile_step(step: Callable[[], None], layers: int, device: torch.device) -> KernelProfile:
    if device.type == "cuda":
        return _profile_cuda(step, layers)
    return _profile_cpu(step, layers)


def _profile_cuda(step: Callable[[], None], layers: int) -> KernelProfile:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    total_us = sum(e.time_range.elapsed_us() for e in kernels)
    names = tuple(dict.fromkeys(e.name for e in kernels))
    return KernelProfile(len(kernels) / layers, total_us / layers, "cupti", names)


def _profile_cpu(step: Callable[[], None], layers: int) -> KernelProfile:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    top_level = [e for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    total_us = sum(e.time_range.elapsed_us() for e in top_level)
    names = tuple(dict.fromkeys(e.name for e in top_level))
    return KernelProfile(len(top_level) / layers, total_us / layers, "cpu-ops", names)
