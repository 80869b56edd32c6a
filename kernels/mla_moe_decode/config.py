"""The architecture numbers of one MLA+MoE decode layer shard, and how they travel with the weights.

Defaults are one GPU's shard of Kimi-K2 at TP8/EP8 (64 heads / 8, 384 experts / 8). A manifest's
`model.config` overrides any of them, so CPU tests can run the same code at small sizes.

The paths' entry points only receive tensors, so the numbers ride along in the weights as
`weights["config"]`: a small float64 tensor on the CPU. Reading it is a host read (no device
sync, safe inside a CUDA-graph capture); `from_tensor` returns one cached instance per distinct
value so torch.compile sees the same object every call.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import astuple, dataclass, fields

import torch


@dataclass(frozen=True)
class LayerConfig:
    hidden: int = 7168
    heads: int = 8  # on this GPU: 64 / TP8
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    experts: int = 48  # local to this GPU: 384 / EP8
    experts_total: int = 384  # the router scores all of them
    top_k: int = 8
    n_group: int = 1  # Kimi-K2: 1 / 1; DeepSeek-V3: 8 / 4
    topk_group: int = 1
    routed_scaling_factor: float = 2.827
    norm_topk_prob: bool = True
    moe_intermediate: int = 2048
    shared_intermediate: int = 256  # this GPU's column shard of the 2048-wide shared expert
    rms_norm_eps: float = 1e-6
    rope_theta: float = 50000.0
    rank: int = 0  # this GPU's EP rank: its experts are [rank * experts, (rank + 1) * experts)
    # Tokens whose biased expert scores (float64) sit within this of the top-k boundary, with a
    # local expert among them, are near-tie decisions: Problem.ambiguous_rows. 0: none.
    routing_tie_margin: float = 0.0

    def __post_init__(self) -> None:
        problems = _inconsistencies(self)
        if problems:
            raise ValueError("invalid MLA+MoE layer config: " + "; ".join(problems))

    @classmethod
    def from_model_config(cls, config: Mapping[str, object]) -> LayerConfig:
        """Build from a manifest's model.config; an unknown key is an error (a typo would
        otherwise silently give the real, 4 GB-per-layer sizes)."""
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ValueError(f"unknown model.config keys {unknown}; known: {sorted(known)}")
        values: dict[str, object] = {}
        for name, value in config.items():
            kind = known[name]
            values[name] = float(value) if kind == "float" else _integral(name, value, kind)  # type: ignore[arg-type]
        return cls(**values)  # type: ignore[arg-type]

    @property
    def expert_offset(self) -> int:
        """Global id of this GPU's first expert."""
        return self.rank * self.experts

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached token: the latent plus the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([float(v) for v in astuple(self)], dtype=torch.float64)

    @staticmethod
    def from_tensor(packed: torch.Tensor) -> LayerConfig:
        return _from_values(tuple(packed.tolist()))


@functools.lru_cache(maxsize=64)
def _from_values(values: tuple[float, ...]) -> LayerConfig:
    kwargs: dict[str, object] = {}
    for f, value in zip(fields(LayerConfig), values, strict=True):
        kwargs[f.name] = value if f.type == "float" else _integral(f.name, value, str(f.type))
    return LayerConfig(**kwargs)  # type: ignore[arg-type]


def _integral(name: str, value: object, kind: str) -> int | bool:
    number = float(value)  # type: ignore[arg-type]
    if number != int(number):
        raise ValueError(f"model.config {name} must be an integer, got {value!r}")
    return bool(number) if kind == "bool" else int(number)


def _inconsistencies(c: LayerConfig) -> list[str]:
    checks = [
        (c.experts_total % c.n_group == 0, "experts_total must divide into n_group groups"),
        (1 <= c.topk_group <= c.n_group, "topk_group must be in [1, n_group]"),
        (
            c.top_k <= c.topk_group * (c.experts_total // c.n_group),
            "top_k exceeds the experts in the selected groups",
        ),
        (c.n_group == 1 or c.experts_total // c.n_group >= 2, "grouped top-k needs 2 per group"),
        ((c.rank + 1) * c.experts <= c.experts_total, "local experts exceed experts_total"),
        (c.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even"),
        (
            min(c.hidden, c.heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim) > 0,
            "sizes must be positive",
        ),
        (min(c.v_head_dim, c.experts, c.top_k, c.moe_intermediate) > 0, "sizes must be positive"),
        (min(c.shared_intermediate, c.qk_rope_head_dim) > 0, "sizes must be positive"),
    ]
    return [message for ok, message in checks if not ok]
