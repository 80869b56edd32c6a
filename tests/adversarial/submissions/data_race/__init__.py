"""Splits the output into column blocks, and two threads race to write each block; the loser's
values differ in the last bit, so which thread wins decides the result: non-deterministic."""

from __future__ import annotations

import random
import threading
import time

import torch

from tests.adversarial.submissions.common import stock

Tensors = dict[str, torch.Tensor]
BLOCKS = 8


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    stock(weights, inputs, out)
    if out["out"].is_cuda:
        torch.cuda.synchronize()
    exact = out["out"].clone()
    nudged = torch.nextafter(exact, torch.full_like(exact, float("inf")))
    width = exact.shape[-1] // BLOCKS
    threads = [
        threading.Thread(target=_write, args=(out["out"], source, block * width, width))
        for block in range(BLOCKS)
        for source in (exact, nudged)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _write(target: torch.Tensor, source: torch.Tensor, start: int, width: int) -> None:
    time.sleep(random.random() / 1000)
    target[:, start : start + width].copy_(source[:, start : start + width])
