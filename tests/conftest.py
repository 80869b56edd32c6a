"""Test setup: without CUDA, Triton kernels run under Triton's interpreter and `gpu` tests skip."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before any Triton kernel module is imported.
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to torch here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


pytest_plugins = ["tests.service_fixtures"]
