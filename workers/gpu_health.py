"""Is the GPU fit for the next job after a job's child was killed or crashed?

A kernel killed mid-flight can leave the device wedged (an Xid error, a stuck context) or its
memory held by a process that did not die. The next job must not measure on such a device, so
after any kill or crash of a GPU job the worker runs a small check in a fresh process: a matmul
checked against the CPU, and enough free memory. A device that fails it ends the worker (it
stops taking jobs; its queue then shows as unserved) rather than serve wrong numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass

CHECK_TIMEOUT_S = 120.0
ATTEMPTS = 3  # a killed process's memory takes a moment to come back
RETRY_AFTER_S = 5.0
MIN_FREE_FRACTION = 0.8  # a worker owns its GPU: most of it must be free between jobs
MAX_RELATIVE_ERROR = 1e-4

# Runs in its own interpreter: a wedged context must not hang the worker, only this process.
CHECK_SCRIPT = """
import json, torch
torch.backends.cuda.matmul.allow_tf32 = False
a = torch.randn(1024, 1024, dtype=torch.float64)
b = torch.randn(1024, 1024, dtype=torch.float64)
want = (a.float() @ b.float()).double()
got = (a.float().cuda() @ b.float().cuda()).double().cpu()
torch.cuda.synchronize()
error = float((got - want).norm() / want.norm())
free, total = torch.cuda.mem_get_info()
print(json.dumps({"relative_error": error, "free_bytes": free, "total_bytes": total,
                  "device": torch.cuda.get_device_name()}))
"""


@dataclass(frozen=True)
class GpuHealth:
    healthy: bool
    detail: str


def check_gpu(
    command: list[str] | None = None,
    timeout_s: float = CHECK_TIMEOUT_S,
    attempts: int = ATTEMPTS,
    retry_after_s: float = RETRY_AFTER_S,
) -> GpuHealth:
    """Healthy as soon as one attempt passes; else the last attempt's reason."""
    command = command or [sys.executable, "-c", CHECK_SCRIPT]
    health = GpuHealth(False, "not checked")
    for attempt in range(attempts):
        if attempt:
            time.sleep(retry_after_s)
        health = _check_once(command, timeout_s)
        if health.healthy:
            return health
    return health


def _check_once(command: list[str], timeout_s: float) -> GpuHealth:
    try:
        done = subprocess.run(command, capture_output=True, timeout=timeout_s, text=True)
    except subprocess.TimeoutExpired:
        return GpuHealth(False, f"the GPU check did not finish in {timeout_s:.0f} s")
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        return GpuHealth(False, f"the GPU check failed (exit {done.returncode}): {tail[0]}")
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
        error, free, total = found["relative_error"], found["free_bytes"], found["total_bytes"]
    except (ValueError, IndexError, KeyError, TypeError):
        return GpuHealth(False, f"the GPU check printed no result: {done.stdout[-200:]!r}")
    if not error <= MAX_RELATIVE_ERROR:
        return GpuHealth(False, f"a matmul on the GPU is wrong (relative error {error:.2e})")
    if free < MIN_FREE_FRACTION * total:
        return GpuHealth(
            False,
            f"only {free / 2**30:.1f} of {total / 2**30:.1f} GiB free: memory still held "
            "after the job ended",
        )
    return GpuHealth(True, f"matmul right ({error:.1e}), {free / 2**30:.1f} GiB free")
