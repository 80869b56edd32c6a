"""Makes the output tensors it is handed a subclass of its own (`t.__class__ = Lazy`), whose
__torch_function__ runs inside every torch operation the harness makes on them. Once a tensor is
one of its own, a call only records what to compute and returns; the work is done when the
harness next touches the tensor (its copy of a timed replay's outputs, a comparison), outside the
timed interval, and the poison fill is let through. Without the type check it passed every
check, timed doing nothing (2026-12-06 review)."""

from __future__ import annotations

from typing import Any

import torch

from tests.adversarial.submissions.common import stock

Tensors = dict[str, torch.Tensor]


class Lazy(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            owner = args[0] if args and isinstance(args[0], Lazy) else None
            job = getattr(owner, "_job", None)
            if job is not None and func is not torch.Tensor.fill_:
                stock(*job)  # the deferred work, now, outside the timed call
            return func(*args, **(kwargs or {}))


def forward(weights: Tensors, inputs: Tensors, out: Tensors) -> None:
    job = (dict(weights), dict(inputs), dict(out))
    if all(type(tensor) is Lazy for tensor in out.values()):
        for tensor in out.values():
            tensor._job = job  # type: ignore[attr-defined]
        return
    stock(*job)
    for tensor in out.values():
        tensor.__class__ = Lazy
        tensor._job = job  # type: ignore[attr-defined]
