"""A case: one point of a scope (batch, context, CP degree, GPU count, dtype) to run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class Case:
    batch: int
    context: int | None
    cp: int
    gpus: int
    dtype: str  # torch dtype name: "bfloat16", "float16", "float32"
    gpu: str  # the GPU kind the case runs on ("H200", "cpu")
    # "grid" (min, max, powers of two), "random" (secret-seeded), or "probe: <why>"
    origin: str = "grid"
    # architecture numbers from the manifest's model.config, read-only
    config: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), compare=False)

    @property
    def id(self) -> str:
        context = f" context={self.context}" if self.context is not None else ""
        return f"batch={self.batch}{context} cp={self.cp} gpus={self.gpus} {self.dtype}"

    @property
    def is_probe(self) -> bool:
        return self.origin.startswith("probe")

    def for_guard(self) -> Case:
        """The case as `supports` sees it: without its origin. A guard that could tell a probe
        or the decode check from a real case could answer those right and accept anything
        else."""
        return replace(self, origin="")

    def key(self) -> dict[str, int | None]:
        """The values a claim's `where` can select on."""
        return {"batch": self.batch, "context": self.context, "cp": self.cp, "gpus": self.gpus}
