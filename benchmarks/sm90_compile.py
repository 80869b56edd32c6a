"""Compile the fused layer's Triton kernels for the H200 (sm_90) on any machine, GPU or not.

The CPU suite runs these kernels under Triton's interpreter, which never compiles them: a
kernel the interpreter runs can still fail Triton's GPU compiler (the seventeenth session's
loop-carried `_` did), or ask for more shared memory than an SM has. This script runs the
fused layer's host code on meta tensors (the real shard's shapes, no data, nothing runs; meta
tensors get the GPU's decisions, `triton_common.on_gpu`) with the H200 plan (132 SMs), records
every kernel launch instead of running it, compiles each one for sm_90 with the launch's own
arguments, constexprs, warps and stages, and reads the cubin's resources: registers, spills
(local memory), shared memory, and from those the programs per SM that fit.

Run it without TRITON_INTERPRET (the interpreter replaces the kernels the compiler needs):

    python3 benchmarks/sm90_compile.py [--batches 1 8 64] [--contexts 1024 32768]
        [--moe plan|run18|run19] [--gemv plan|triton|cute] [--fold-latent-prep]
        [--absorb-q plan|on|off] [--router-in-o-proj plan|on|off]
        [--input-norm-in-qkv-a] [--w-uv-in-combine]
        [--out pathgate-out/benchmarks/sm90_compile.json] [--ptx DIR]

It prints one row per launch and writes the rows as JSON. The compiler is this machine's
Triton (CI: 3.9), not necessarily the device's (3.6): a clean compile here is evidence, not
proof, that the device compiles it; the shared memory and registers are this compiler's.
Kernel 1 is CuTe DSL: it is listed, not compiled (tests/kernels/test_cute_compile.py compiles
it). The four GEMVs are what the plan launches (`--gemv plan`): the CuTe DSL kernel of cute_gemv
at batch <= 8 (LayerPlan.gemv_cute), the Triton one above; `--gemv triton|cute` takes one at
every batch. A CuTe DSL GEMV is compiled by CuTe DSL for sm_90a (CUTE_DSL_ARCH, set here),
assembled by ptxas for its registers and spills; its shared memory is the pipeline's tiles
(dynamic, so not in the cubin).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

# Triton 3.9 warns until it is told; fused multiply-adds on, as Triton 3.6 on the device has them
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # read when CuTe DSL is imported (a CuTe DSL GEMV)

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.mla_moe_decode import cute_gemv, fused
from kernels.mla_moe_decode.config import LayerConfig
from kernels.mla_moe_decode.problem import _weight_dtype, weight_shapes

Tensors = dict[str, torch.Tensor]
H200_SMS = 132
SM90 = GPUTarget("cuda", 90, 32)
# sm_90's per-SM limits (CUDA occupancy rules): shared memory (1 KB of it reserved per block),
# the most one block may ask for, registers, warps and resident blocks.
SM_SHARED = 233472
BLOCK_SHARED_MAX = 232448
BLOCK_SHARED_RESERVED = 1024
SM_REGISTERS = 65536
REGISTER_UNIT = 256  # registers are given to a warp in units of 256
SM_WARPS = 64
SM_BLOCKS = 32


@dataclass
class Launch:
    """One kernel launch of the layer, as its host code made it."""

    kernel: str
    grid: tuple[int, ...]
    fn: JITFunction | None = None  # None: not a Triton kernel (CuTe DSL)
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    cute_gemv: tuple[int, ...] = ()  # a CuTe DSL GEMV: cute_gemv.compile_kernel's arguments


@dataclass
class Compiled:
    """What sm_90's compiler made of one launch."""

    kernel: str
    batch: int
    context: int
    grid: list[int]
    num_warps: int = 0
    num_stages: int = 0
    constexprs: dict[str, Any] = field(default_factory=dict)
    shared_bytes: int = 0
    registers: int = 0
    spill_bytes: int = 0  # local memory per thread: registers spilled
    programs_per_sm: int = 0
    compile_s: float = 0.0
    error: str = ""  # the compiler's message, when it failed
    note: str = ""


def meta_layer(config: LayerConfig, batch: int, context: int) -> tuple[Tensors, Tensors, Tensors]:
    """The real shard's weights, inputs and outputs as meta tensors (the config stays the host
    tensor the layer reads its numbers from)."""
    weights = {"config": config.to_tensor()}
    for name, shape in weight_shapes(config).items():
        weights[name] = _meta(*shape, dtype=_weight_dtype(name, torch.bfloat16))
    inputs = {
        "x": _meta(batch, config.hidden),
        "residual": _meta(batch, config.hidden),
        "kv_cache": _meta(batch, context, config.latent_dim),
        "positions": _meta(batch, dtype=torch.int64),
    }
    out = {
        "out": _meta(batch, config.hidden),
        "residual_out": _meta(batch, config.hidden),
        "kv_new": _meta(batch, config.latent_dim),
    }
    return weights, inputs, out


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=dtype)


@contextlib.contextmanager
def recording(plan: fused.LayerPlan | None) -> Iterator[list[Launch]]:
    """Within: Triton launches are recorded, not run; the plan is the H200's (or `plan`);
    kernel 1 is recorded as the CuTe DSL call it is on the GPU."""
    launches: list[Launch] = []

    def record(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append(Launch(self.fn.__name__, tuple(grid), self, args, kwargs))

    def record_cute(x: torch.Tensor, *_: Any) -> None:
        launches.append(Launch("cute_kernels.add_rmsnorm (CuTe DSL)", (x.shape[0],)))

    def record_cute_gemv(
        x: torch.Tensor, weight: torch.Tensor, blocks: Any, summed: bool = False
    ) -> torch.Tensor:
        n, k = weight.shape
        key = (blocks.block_m, blocks.block_k, blocks.num_stages, n, k, blocks.k_per_split)
        grid = (n // blocks.block_n, blocks.splits)
        name = "cute_gemv.summed_gemv" if summed else "cute_gemv.splitk_gemv"
        launches.append(Launch(f"{name} (CuTe DSL)", grid, cute_gemv=(*key, summed)))
        return _meta(blocks.splits, x.shape[0], n, dtype=torch.float32)

    def record_cute_summed(
        x: torch.Tensor, _: torch.Tensor, weight: torch.Tensor, blocks: Any, __: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        parts = record_cute_gemv(x, weight, blocks, summed=True)
        return parts, _meta(blocks.splits, x.shape[0], dtype=torch.float32)

    def h200_plan(c: LayerConfig, x: torch.Tensor, context: int) -> fused.LayerPlan:
        return plan or fused.layer_plan(c, x.shape[0], context, True, H200_SMS)

    saved = (
        JITFunction.run, fused.input_add_rmsnorm, fused._plan, cute_gemv.splitk_gemv,
        cute_gemv.summed_gemv,
    )  # fmt: skip
    JITFunction.run = record  # type: ignore[method-assign]
    fused.input_add_rmsnorm = record_cute  # type: ignore[assignment]
    fused._plan = h200_plan  # type: ignore[assignment]
    cute_gemv.splitk_gemv = record_cute_gemv  # type: ignore[assignment]
    cute_gemv.summed_gemv = record_cute_summed  # type: ignore[assignment]
    try:
        yield launches
    finally:
        (
            JITFunction.run, fused.input_add_rmsnorm, fused._plan, cute_gemv.splitk_gemv,
            cute_gemv.summed_gemv,
        ) = saved  # type: ignore[method-assign,assignment]  # fmt: skip


def layer_launches(batch: int, context: int, plan: fused.LayerPlan | None = None) -> list[Launch]:
    """Every launch of one fused layer at (batch, context) on the H200, in order."""
    config = LayerConfig()
    weights, inputs, out = meta_layer(config, batch, context)
    with recording(plan) as launches:
        fused._fused_layer(config, weights, inputs, out)
    return launches


def compile_launch(
    launch: Launch, batch: int, context: int, ptx_path: Path | None = None
) -> Compiled:
    """Compile one launch for sm_90; with ptx_path, also write its PTX there (to compare the
    code two launches got, e.g. at a context that is a multiple of 16 and one that is not)."""
    result = Compiled(launch.kernel, batch, context, list(launch.grid))
    if launch.cute_gemv:
        return compile_cute_gemv(launch.cute_gemv, result, ptx_path)
    if launch.fn is None:
        result.note = "CuTe DSL: compiled by tests/kernels/test_cute_compile.py, not here"
        return result
    start = time.perf_counter()
    try:
        source, options = _source(launch.fn, launch.args, launch.kwargs)
        result.num_warps, result.num_stages = options.num_warps, options.num_stages
        names = launch.fn.arg_names
        result.constexprs = {names[path[0]]: value for path, value in source.constants.items()}
        kernel = triton.compile(source, target=SM90, options=options.__dict__)
    except Exception as error:  # every compiler failure is a finding to report
        result.error = f"{type(error).__name__}: {error}".strip()[:2000]
        return result
    result.compile_s = round(time.perf_counter() - start, 2)
    shared = int(kernel.metadata.shared)
    return _resources(result, kernel.asm["ptx"], kernel.asm["cubin"], shared, ptx_path)


def _resources(
    result: Compiled, ptx: str, cubin: bytes, shared_bytes: int, ptx_path: Path | None
) -> Compiled:
    """Fill in what the cubin says (registers, spills) and what fits an SM; keep the PTX."""
    if ptx_path is not None:
        ptx_path.parent.mkdir(parents=True, exist_ok=True)
        ptx_path.write_text(ptx)
    result.shared_bytes = shared_bytes
    result.registers, result.spill_bytes = cubin_resources(cubin)
    result.programs_per_sm = programs_per_sm(
        result.shared_bytes, result.registers, result.num_warps
    )
    return result


def compile_cute_gemv(
    key: tuple[int, ...], result: Compiled, ptx_path: Path | None = None
) -> Compiled:
    """Compile a CuTe DSL GEMV launch for sm_90a, assemble its PTX with ptxas (Triton's) for
    the registers and spills; its shared memory is its stages of (block_m + block_n) x block_k
    bf16 tiles, and the residual's block_m x block_k when summed. CuTe DSL keeps the PTX it
    writes in a temporary folder (CUTE_DSL_DUMP_DIR)."""
    block_m, block_k, stages, *_, summed = key
    result.num_warps, result.num_stages = cute_gemv.WARPS, stages
    names = ("block_m", "block_k", "stages", "n", "k", "k_per_split", "summed")
    result.constexprs = dict(zip(names, key, strict=True))
    start = time.perf_counter()
    os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(prefix="sm90-compile-cute-"))
    try:
        ptx = cute_gemv.compile_kernel(*key[:-1], keep_ptx=True, summed=bool(summed)).__ptx__
        cubin = _ptxas(ptx)
    except Exception as error:  # every compiler failure is a finding to report
        result.error = f"{type(error).__name__}: {error}".strip()[:2000]
        return result
    result.compile_s = round(time.perf_counter() - start, 2)
    shared = ((2 if summed else 1) * block_m + cute_gemv.WARPS * 16) * block_k * 2 * stages
    return _resources(result, ptx, cubin, shared, ptx_path)


def _ptxas(ptx: str) -> bytes:
    tool = Path(triton.backends.nvidia.__file__).parent / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as folder:
        source, cubin = Path(folder) / "kernel.ptx", Path(folder) / "kernel.cubin"
        source.write_text(ptx)
        subprocess.run(
            [str(tool), "-arch=sm_90a", str(source), "-o", str(cubin)],
            capture_output=True,
            text=True,
            check=True,
        )
        return cubin.read_bytes()


def _source(
    fn: JITFunction, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[ASTSource, Any]:
    """What `fn[grid](*args, **kwargs)` hands the compiler on an sm_90 device, by Triton's own
    binder: the same signature, constexprs and specializations (an integer or a pointer that
    is a multiple of 16 is compiled as one; a meta tensor's pointer is its offset into an
    allocation that starts aligned, as CUDA's do)."""
    backend = make_backend(SM90)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, kwargs, bound, specialization, options
    )
    return ASTSource(fn, signature, constexprs, attrs), options


def cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, local memory bytes per thread) from cuobjdump's resource usage."""
    tool = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run(
            [str(tool), "--dump-resource-usage", file.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    registers = re.search(r"REG:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    if registers is None or local is None:
        raise RuntimeError(f"cuobjdump gave no resource usage: {usage!r}")
    return int(registers.group(1)), int(local.group(1))


def programs_per_sm(shared_bytes: int, registers: int, warps: int) -> int:
    """How many programs of this kernel one sm_90 SM holds at once: the least of what its
    shared memory, its registers, its warp slots and its block slots allow."""
    if shared_bytes > BLOCK_SHARED_MAX:
        return 0
    by_shared = SM_SHARED // (shared_bytes + BLOCK_SHARED_RESERVED)
    per_warp = -(-max(registers, 1) * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = (SM_REGISTERS // per_warp) // warps
    return min(by_shared, by_registers, SM_WARPS // warps, SM_BLOCKS)


def compile_layer(
    batch: int,
    context: int,
    moe: str = "plan",
    ptx_dir: Path | None = None,
    gemv: str = "plan",
    fold_latent_prep: bool = False,
    absorb_q: str = "plan",
    router_in_o_proj: str = "plan",
    input_norm_in_qkv_a: bool = False,
    w_uv_in_combine: bool = False,
) -> list[Compiled]:
    plan = fused.layer_plan(LayerConfig(), batch, context, True, H200_SMS)
    if moe in ("run18", "run19"):
        from benchmarks.mla_moe_device_check import run18_moe_plan, run19_moe_plan

        plan = (run18_moe_plan if moe == "run18" else run19_moe_plan)(plan, batch)
    gemv_cute = plan.gemv_cute if gemv == "plan" else gemv == "cute"
    absorbed = plan.absorb_q if absorb_q == "plan" else absorb_q == "on"
    folded = plan.router_in_o_proj if router_in_o_proj == "plan" else router_in_o_proj == "on"
    plan = replace(
        plan, gemv_cute=gemv_cute, fold_latent_prep=fold_latent_prep, absorb_q=absorbed,
        router_in_o_proj=folded, input_norm_in_qkv_a=input_norm_in_qkv_a,
        w_uv_in_combine=w_uv_in_combine,
    )  # fmt: skip
    launches = layer_launches(batch, context, plan)
    case_dir = ptx_dir and ptx_dir / f"{batch}x{context}"
    return [
        compile_launch(
            launch, batch, context, case_dir and case_dir / f"{launch.kernel}-{i:02d}.ptx"
        )
        for i, launch in enumerate(launches, 1)
    ]


def print_table(rows: list[Compiled]) -> None:
    columns = "batch context kernel grid warps stages shared_KB regs spill_B per_SM compile_s"
    print("| " + " | ".join(columns.split()) + " |")
    print("|---" * len(columns.split()) + "|")
    for r in rows:
        first = f"| {r.batch} | {r.context} | {r.kernel} | {r.grid} |"
        if r.error or r.note:
            print(f"{first} {f'ERROR {r.error[:200]}' if r.error else r.note} |")
            continue
        print(
            f"{first} {r.num_warps} | {r.num_stages} | {r.shared_bytes / 1024:.1f}"
            f" | {r.registers} | {r.spill_bytes} | {r.programs_per_sm} | {r.compile_s} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    parser.add_argument("--moe", choices=("plan", "run18", "run19"), default="plan")
    parser.add_argument(
        "--gemv",
        choices=("plan", "triton", "cute"),
        default="plan",
        help="the four GEMVs: the plan's (cute_gemv's CuTe DSL kernel at batch <= 8), or the "
        "Triton kernel or cute_gemv's at every batch (cute needs nvidia-cutlass-dsl)",
    )
    parser.add_argument(
        "--fold-latent-prep",
        action="store_true",
        help="kernels 3 and 4 as one launch (LayerPlan.fold_latent_prep): 13 kernels",
    )
    parser.add_argument(
        "--absorb-q",
        choices=("plan", "on", "off"),
        default="plan",
        help="kernels 4 and 5 as one GEMV over the absorbed query weight (LayerPlan.absorb_q): "
        "as the plan has it (above batch 4), or on or off at every batch",
    )
    parser.add_argument(
        "--router-in-o-proj",
        choices=("plan", "on", "off"),
        default="plan",
        help="the router folded through the post-attention norm (LayerPlan.router_in_o_proj: "
        "its GEMV in o_proj's launch, the routing in the norm kernel; the plan's, on at every "
        "batch), or off: the router GEMV and the routing kernel, two kernels more",
    )
    parser.add_argument(
        "--input-norm-in-qkv-a",
        action="store_true",
        help="the input RMSNorm folded into qkv_a's GEMV (LayerPlan.input_norm_in_qkv_a): "
        "kernel 1 gone",
    )
    parser.add_argument(
        "--w-uv-in-combine",
        action="store_true",
        help="the combine and w_uv as one kernel (LayerPlan.w_uv_in_combine)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("pathgate-out/benchmarks/sm90_compile.json")
    )
    parser.add_argument(
        "--ptx",
        type=Path,
        help="also write each kernel's PTX, as DIR/BATCHxCONTEXT/KERNEL-NN.ptx (NN: its place)",
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print(
            "sm90_compile: unset TRITON_INTERPRET (the interpreter has no compiler)",
            file=sys.stderr,
        )
        return 2
    rows = [
        row
        for batch in args.batches
        for context in args.contexts
        for row in compile_layer(
            batch,
            context,
            args.moe,
            args.ptx,
            args.gemv,
            args.fold_latent_prep,
            args.absorb_q,
            args.router_in_o_proj,
            args.input_norm_in_qkv_a,
            args.w_uv_in_combine,
        )
    ]
    print_table(rows)
    report = {
        "target": "sm_90 (H200 plan, 132 SMs)",
        "moe": args.moe,
        "gemv": args.gemv,
        "fold_latent_prep": args.fold_latent_prep,
        "absorb_q": args.absorb_q,
        "router_in_o_proj": args.router_in_o_proj,
        "input_norm_in_qkv_a": args.input_norm_in_qkv_a,
        "w_uv_in_combine": args.w_uv_in_combine,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "launches": [asdict(row) for row in rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    failed = [row for row in rows if row.error]
    print(f"{len(rows)} launches, {len(failed)} failed to compile; JSON in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
