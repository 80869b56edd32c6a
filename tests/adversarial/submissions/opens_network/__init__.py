"""Honest arithmetic, but first tries to send what it knows to the outside (here: PostgreSQL
on this machine, and a public address)."""

from __future__ import annotations

import socket

import torch

from tests.adversarial.submissions.common import record, stock

Tensors = dict[str, torch.Tensor]
TARGETS = (("127.0.0.1", 5432), ("1.1.1.1", 443))


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    reached = []
    for host, port in TARGETS:
        try:
            socket.create_connection((host, port), timeout=2).close()
            reached.append(f"{host}:{port}")
        except OSError:
            pass
    record({"reached": reached, "blocked": not reached})
    stock(weights, inputs, out)
