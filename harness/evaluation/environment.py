"""What ran the evaluation: the host's GPUs and the versions of everything that shaped a number."""

from __future__ import annotations

import hashlib
import json
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from harness import __version__
from harness.evaluation.plan import Host

GPU_KIND_PATTERNS = (
    ("GB300", "GB300"),
    ("GB200", "GB200"),
    ("B200", "B200"),
    ("H200", "H200"),
    ("H100", "H100"),
    ("MI300X", "MI300X"),
)
REPO_ROOT = Path(__file__).resolve().parents[2]


class DeviceUnavailable(Exception):
    pass


def detect_host(device: str) -> Host:
    """device: "auto" (CUDA when present), "cpu" or "cuda"."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return Host("cpu", 1)
    if not torch.cuda.is_available():
        raise DeviceUnavailable("--device cuda was asked for, but torch sees no CUDA device")
    return Host(gpu_kind(torch.cuda.get_device_name(0)), torch.cuda.device_count())


def gpu_kind(device_name: str) -> str:
    for pattern, kind in GPU_KIND_PATTERNS:
        if pattern in device_name.upper():
            return kind
    return device_name  # an unknown kind matches no manifest, so nothing runs as if it were known


def fingerprint(host: Host, harness_sha: str | None) -> dict[str, object]:
    """The host, its versions and (on CUDA) its clocks now; harness_sha: git_sha of the tree as
    the run began, read beside the code digest (a tree edited mid-run must not be credited to
    the run, nor the run to it)."""
    env: dict[str, object] = {
        "host_gpu": host.gpu,
        "host_gpu_count": host.count,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "cutlass_dsl": _version("nvidia-cutlass-dsl"),
        "vllm": _version("vllm"),
        "numpy": _version("numpy"),
        "harness_version": __version__,
        "harness_sha": harness_sha,
    }
    if host.device == "cuda":
        env.update(_cuda_details())
    env["fingerprint_hash"] = hashlib.sha256(
        json.dumps(env, sort_keys=True, default=str).encode()
    ).hexdigest()[:16]
    return env


def _cuda_details() -> dict[str, object]:
    props = torch.cuda.get_device_properties(0)
    details: dict[str, object] = {
        "gpu_name": props.name,
        "sm_count": props.multi_processor_count,
        "gpu_memory_bytes": props.total_memory,
        "l2_cache_bytes": props.L2_cache_size,
        "compute_capability": f"{props.major}.{props.minor}",
    }
    details.update(_nvidia_smi())
    return details


def _nvidia_smi() -> dict[str, object]:
    fields = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {"driver": None}
    values = [v.strip() for v in out.splitlines()[0].split(",")]
    keys = ["driver", "sm_clock", "sm_clock_max", "mem_clock", "power_limit"]
    return dict(zip(keys, values, strict=False))


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def git_sha(directory: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        dirty = subprocess.run(
            ["git", "-C", str(directory), "status", "--porcelain"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.strip()
    return f"{sha}-dirty" if dirty else sha if re.fullmatch(r"[0-9a-f]{40}", sha) else None
