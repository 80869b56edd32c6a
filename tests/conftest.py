"""Test setup: without CUDA, Triton kernels run under Triton's interpreter and `gpu` tests skip;
`multigpu` tests skip unless at least two GPUs are visible."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before any Triton kernel module is imported.
    os.environ["TRITON_INTERPRET"] = "1"


GPU_COUNT = torch.cuda.device_count() if HAS_CUDA else 0

# The tests' git sources are repositories on this machine (file:// URLs); a service's default
# accepts https only. Set before any settings are read, and inherited by the workers tests start.
os.environ.setdefault("PATHGATE_GIT_PROTOCOLS", '["https", "file"]')


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to torch here")
    skip_multi = pytest.mark.skip(
        reason=f"needs at least 2 CUDA GPUs; {GPU_COUNT} visible to torch here"
    )
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        elif "multigpu" in item.keywords and GPU_COUNT < 2:
            item.add_marker(skip_multi)


pytest_plugins = ["tests.service_fixtures"]
