"""Kernels per layer from torch.profiler (CUPTI on CUDA) over one step, and their summed time.

The summed kernel time per layer cross-checks the event timing: a large gap means work the events
did not see (a side stream) or idle time inside the step.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class KernelProfile:
    kernels_per_layer: float
    kernel_us_per_layer: float  # summed kernel durations: busy time
    span_us_per_layer: float  # first kernel start to last kernel end: busy time plus gaps
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
    return _summary(kernels, layers, "cupti")


def _profile_cpu(step: Callable[[], None], layers: int) -> KernelProfile:
    # torch 2.13's kineto prints two "USDT:" lines per profile at its default log level, into
    # the progress output; on the CPU the profile only counts ops, so its log is noise. Kineto
    # reads the level when the process first profiles; a level set by the user stays.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    top_level = [e for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    return _summary(top_level, layers, "cpu-ops")


def _summary(events: list[Any], layers: int, source: str) -> KernelProfile:
    busy_us = sum(e.time_range.elapsed_us() for e in events)
    span_us = (
        max(e.time_range.end for e in events) - min(e.time_range.start for e in events)
        if events
        else 0.0
    )
    names = tuple(dict.fromkeys(e.name for e in events))
    return KernelProfile(len(events) / layers, busy_us / layers, span_us / layers, source, names)
