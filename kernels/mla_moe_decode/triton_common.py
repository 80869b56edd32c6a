"""Device helpers shared by the fused path's Triton kernels.

- ROUNDING: the kernels keep every intermediate in fp32 and round to bf16 only where a value
  leaves as bf16: stored to memory, or fed to a bf16 MMA. That is what the compiled stock path
  (the baseline) does inside each Inductor kernel, where eager PyTorch rounds after every bf16
  op; a fused path that copied eager's extra roundings sat 1.2-1.4x further from float64 than
  the compiled stock (docs/mla_moe_notes.md, `benchmarks/mla_moe_precision_probe.py`).
- `round_bf16`: float32 -> bfloat16 round-to-nearest-even done on the bits. The GPU's
  conversion already rounds to nearest; Triton's CPU interpreter truncates, which would double
  the rounding error there. Rounding explicitly gives the same bits on both.
- `mma`: `tl.dot` with a float32 accumulator. The interpreter (Triton 3.9) returns garbage for
  bf16 operands, so there (`DOT_F32`) the operands are widened first: bf16 x bf16 products are
  exact in fp32, so the result is the same class of number (fp32 accumulation of exact products).
- `sum_splits`: the deterministic reduction of split-K partial sums, in split order.
- `rms_normalize`, `rotate_pairs`: the stock path's RMSNorm and GPT-J RoPE.
- `derived_weight` (host side): a weight computed from the layer's weights (the absorbed query,
  the router folded through the post-attention norm), computed once per weights.
- `on_gpu`, `rows_per_program` (host side): whether a tensor gets the GPU's decisions; how
  many token rows the row-wise kernels give a program.
- `dependent_launch`, `pdl_options` (host side), `wait_for_previous_kernel`, `prefetch_l2`:
  programmatic dependent launch (PDL, sm_90+), off by default. A kernel launched with the PDL
  attribute may start before its predecessor has finished; it waits (`griddepcontrol.wait`)
  before its first dependent read or any write, so the order of effects is the unchained one.
  "exit": the successor is released as each program exits, which overlaps its launch with the
  predecessor's tail. "early": released at the start, so the successor's programs sit resident
  (and spin) for the whole kernel. "prefetch": "early", and the GEMVs ask L2 for their weight
  slice (memory nothing in the layer writes) before they wait. Measured on the H200
  (docs/mla_moe_notes.md): "early" and "prefetch" were 2-11% slower than "off", same bits.
  The CuTe DSL kernels take the same mode (cute_kernels.wait_for_previous_kernel); a non-PDL
  launch (any torch op) waits for everything before it as usual.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

# See the module docstring. Benchmarks switch it to compare (mla_moe_device_check.py
# --sweep-pdl); the CPU interpreter always runs "off". The value each mode gives the kernels'
# PDL constexpr: 0 plain, 1 wait at the start, 2 release the successor, then wait.
DEPENDENT_LAUNCH_MODES = {"off": 0, "exit": 1, "early": 2, "prefetch": 2}
dependent_launch = "off"


@triton.jit
def round_bf16(x):
    """fp32 -> bf16, round to nearest even (the conversion of an exact bf16 value is exact)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def mma(a, b, acc, DOT_F32: tl.constexpr):
    """acc + a @ b in fp32; a (M, K), b (K, N) in bf16."""
    if DOT_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc)


@triton.jit
def sum_splits(ptr, offsets, mask, N_SPLITS: tl.constexpr, split_stride):
    """sum over s < N_SPLITS of ptr[s * split_stride + offsets] in fp32, in split order (the
    split-K GEMVs write partials instead of using atomics, so results do not vary run to run).
    The loads are independent so that several are in flight at once: in a plain loop each load
    waited for the previous add, one memory round trip per split. Up to 8 splits are unrolled;
    more go in masked groups of 4 (unrolling the router's 28 cost registers and time on the
    H200: routing 6.0 -> 8.7 µs at batch 1)."""
    total = tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if N_SPLITS <= 8:
        for split in tl.static_range(1, N_SPLITS):
            total += tl.load(ptr + split * split_stride + offsets, mask=mask, other=0.0)
    else:
        for first in range(1, N_SPLITS, 4):
            for step in tl.static_range(4):
                split = first + step
                more = tl.where(split < N_SPLITS, mask, False)
                total += tl.load(ptr + split * split_stride + offsets, mask=more, other=0.0)
    return total


@triton.jit
def rms_normalize(x, n, eps, weight):
    """x (..., BLOCK) fp32 with masked lanes 0, weight (BLOCK,) fp32 -> bf16 rmsnorm(x) * weight
    over the last axis, rounded once (see ROUNDING in the module docstring)."""
    return round_bf16(x * inverse_rms(x, n, eps) * weight)


@triton.jit
def inverse_rms(x, n, eps):
    """x (..., BLOCK) fp32 with masked lanes 0 -> 1 / sqrt(mean(x^2) + eps), (..., 1)."""
    mean_square = tl.sum(x * x, axis=-1, keep_dims=True) / n
    return tl.rsqrt(mean_square + eps)


@triton.jit
def rotate_pairs(even, odd, turns):
    """Rotate pairs (even, odd) by 2*pi*turns; turns fp64 = position * frequency / (2*pi).

    Only the fraction of a turn matters, and it is taken in fp64: at positions near 3e4 an fp32
    angle is off by ~2e-3 rad (the stock path's fp32 angles are), fp64 keeps it at ~1e-7.
    Positions are >= 0, so truncation is the floor.
    """
    fraction = turns - turns.to(tl.int64).to(tl.float64)
    angle = fraction.to(tl.float32) * 6.283185307179586
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    return even * cos - odd * sin, odd * cos + even * sin


def k_splits(k: int, wanted: int, block_k: int) -> tuple[int, int]:
    """Split a K range of `k` about `wanted` ways: (K per split, a multiple of block_k; the
    number of splits that gives)."""
    k_per_split = triton.cdiv(triton.cdiv(k, wanted), block_k) * block_k
    return k_per_split, triton.cdiv(k, k_per_split)


_derived: dict[tuple[object, ...], tuple[list[Any], tuple[int, ...], torch.Tensor]] = {}


def derived_weight(
    compute: Callable[..., torch.Tensor], weights: tuple[torch.Tensor, ...], *params: object
) -> torch.Tensor:
    """compute(*weights, *params), computed once per tuple of weight tensors (again if any of
    them is written in place) and kept while they all live. The first call for a layer's weights
    must come before a CUDA-graph capture (the warm-up), as for the MoE's counters."""
    key = (compute, params, *map(id, weights))
    versions = tuple(w._version for w in weights)
    cached = _derived.get(key)
    if cached is not None:
        refs, cached_versions, value = cached
        alive = all(ref() is w for ref, w in zip(refs, weights, strict=True))
        if alive and cached_versions == versions:
            return value
    if weights[0].is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{compute.__name__}: run the layer once before capturing a graph")
    value = compute(*weights, *params)

    def forget(_: object) -> None:  # a weight freed: its id may name another tensor
        _derived.pop(key, None)

    _derived[key] = ([weakref.ref(w, forget) for w in weights], versions, value)
    return value


def on_gpu(t: torch.Tensor) -> bool:
    """Whether the host code takes the GPU's decisions (tiles, rows per program, bf16 MMA
    operands) for `t`: a CUDA tensor, or a meta tensor, which stands for one where
    benchmarks/sm90_compile.py records the H200 plan's launches without a GPU (shapes, no
    data; nothing runs). Every other tensor takes the interpreter's."""
    return t.is_cuda or t.is_meta


def rows_per_program(batch: int, on_gpu: bool) -> int:
    """Token rows per program of the row-wise kernels: one on the GPU (B programs, each a full
    row in registers); on the CPU up to 16, because the interpreter pays per program."""
    return 1 if on_gpu else min(16, triton.next_power_of_2(batch))


def pdl_options(device: torch.device) -> dict[str, int | bool]:
    """The launch keywords of a layer kernel: its PDL constexpr and Triton's launch_pdl
    attribute. Off on the CPU and before sm_90 (no griddepcontrol there)."""
    if dependent_launch not in DEPENDENT_LAUNCH_MODES:
        modes = ", ".join(DEPENDENT_LAUNCH_MODES)
        raise ValueError(f"dependent_launch {dependent_launch!r}: one of {modes}")
    level = DEPENDENT_LAUNCH_MODES[dependent_launch]
    if level == 0 or device.type != "cuda" or not _sm90_or_later(device.index):
        return {"PDL": 0}  # no launch_pdl keyword: the interpreter has no such option
    return {"PDL": level, "launch_pdl": True}


def prefetch_weights(device: torch.device) -> bool:
    """Whether the GEMVs prefetch their weight slice while they wait (mode "prefetch")."""
    return dependent_launch == "prefetch" and pdl_options(device)["PDL"] > 0


def _sm90_or_later(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """PDL 2: let the next kernel launch now; PDL >= 1: wait for the previous one to finish
    and flush. Called before a kernel's first dependent read or any write."""
    if PDL >= 2:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL >= 1:
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(pointers):
    """Ask L2 for the 128-byte lines of `pointers` (one pointer per line is enough). No result,
    no effect on values; only for memory that no kernel of the layer writes."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // $0 unused",
        "=r,l",
        [pointers],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
