"""The fused layer's Triton kernels compile for the H200 (sm_90), on any machine.

The other CPU tests run these kernels under Triton's interpreter, which never compiles them:
`benchmarks/sm90_compile.py` records the H200 plan's launches on meta tensors and compiles each
one for sm_90, in a process without TRITON_INTERPRET (this one has it, conftest.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import pytest

from benchmarks.sm90_compile import BLOCK_SHARED_MAX, programs_per_sm

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "benchmarks" / "sm90_compile.py"
# fused.py's 12 kernels, in order (its docstring's table); the down is the plan's walker
LAYER = [
    "cute_kernels.add_rmsnorm (CuTe DSL)",
    "_splitk_gemv_kernel",
    "_latent_prep_kernel",
    "_splitk_gemv_kernel",
    "_q_absorb_kernel",
    "_mla_split_kernel",
    "_mla_combine_kernel",
    "_w_uv_kernel",
    "_gemv_pair_kernel",
    "_add_rmsnorm_route_kernel",
    "_gate_up_kernel",
    "_down_kernel",
]
# above batch 4 the plan's MoE is one kernel (MoeBlocks.stream_programs): 11 kernels; runs 19
# and 20 had the gate_up and the down as work items (MoeBlocks.down_programs)
LAYER_STREAM = [*LAYER[:-2], "_moe_stream_kernel"]
LAYER_ITEMS = [*LAYER[:-1], "_down_items_kernel"]
# above batch 4 the query is absorbed too (LayerPlan.absorb_q): q_b's GEMV over the absorbed
# weight, always the Triton kernel (32-column tiles), and no q_absorb: 10 kernels
Q_LAT_AT = 3
LAYER_ABSORBED = [*LAYER_STREAM[:Q_LAT_AT], "_splitk_gemv_kernel", *LAYER_STREAM[Q_LAT_AT + 2 :]]
# o_proj's GEMV (the pair with the router's part) and the norm that routes
PAIR_AT = LAYER.index("_gemv_pair_kernel")
BATCHES, CONTEXTS = (1, 8, 64), (1024, 32768)
CUTE_GEMV = "cute_gemv.splitk_gemv (CuTe DSL)"
# The plan's GEMVs at batch <= 8 are CuTe DSL (LayerPlan.gemv_cute): compiled where
# nvidia-cutlass-dsl is installed (Linux x86-64), else the Triton ones stand in.
HAS_CUTE = importlib.util.find_spec("cutlass") is not None


def _plan_kernels(batch: int) -> list[str]:
    kernels = LAYER if batch <= 4 else LAYER_ABSORBED
    if HAS_CUTE and batch <= 8:
        triton_gemvs = {Q_LAT_AT} if batch > 4 else set()
        return [
            CUTE_GEMV if kernel == "_splitk_gemv_kernel" and i not in triton_gemvs else kernel
            for i, kernel in enumerate(kernels)
        ]
    return kernels


def _without_interpreter() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}


def _run_tool(out: Path, *args: str) -> dict:
    result = subprocess.run(
        [sys.executable, str(TOOL), *args, "--out", str(out)],
        env=_without_interpreter(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(out.read_text())


def _by_case(report: dict) -> dict[tuple[int, int], list[dict]]:
    cases: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for launch in report["launches"]:
        cases[(launch["batch"], launch["context"])].append(launch)
    return cases


@pytest.fixture(scope="module")
def plan_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("sm90") / "plan.json"
    batches, contexts = (str(b) for b in BATCHES), (str(c) for c in CONTEXTS)
    gemv = [] if HAS_CUTE else ["--gemv", "triton"]
    return _run_tool(out, "--batches", *batches, "--contexts", *contexts, *gemv)


def test_every_kernel_of_the_h200_plan_compiles_for_sm90(plan_report: dict) -> None:
    cases = _by_case(plan_report)
    assert set(cases) == {(b, c) for b in BATCHES for c in CONTEXTS}
    for case, launches in cases.items():
        assert [launch["kernel"] for launch in launches] == _plan_kernels(case[0]), case
        for launch in launches[1:]:  # kernel 1 is CuTe DSL, not compiled by Triton
            where = f"{launch['kernel']} at batch x context {case}"
            assert launch["error"] == "", where
            assert launch["registers"] > 0, where
            assert launch["shared_bytes"] <= BLOCK_SHARED_MAX, where
            assert launch["programs_per_sm"] >= 1, where
            # a kernel that starts spilling registers is a regression to look at, not a crash
            assert launch["spill_bytes"] == 0, f"{where} spills {launch['spill_bytes']} B"


def test_the_compiled_launches_are_the_plans(plan_report: dict) -> None:
    """The tool compiled what the H200 plan launches, not the interpreter's variant: bf16 MMA
    operands, one token row per program of the row-wise kernels, the plan's grids."""
    launches = _by_case(plan_report)[(64, 32768)]
    for launch in launches[1:]:
        if "DOT_F32" in launch["constexprs"]:
            assert launch["constexprs"]["DOT_F32"] is False, launch["kernel"]
        if "ROWS" in launch["constexprs"]:
            assert launch["constexprs"]["ROWS"] == 1, launch["kernel"]
    moe = next(launch for launch in launches if launch["kernel"] == "_moe_stream_kernel")
    assert moe["grid"] == [2 * 132]  # the one-kernel MoE: 2 programs per SM claim the items
    assert moe["programs_per_sm"] >= 2  # all of them resident (not needed, but measured so)
    assert (moe["constexprs"]["TOKENS"], moe["constexprs"]["BLOCK_N"]) == (16, 64)
    split = next(launch for launch in launches if launch["kernel"] == "_mla_split_kernel")
    assert split["grid"] == [64, 16]  # 16 splits of the context per token above batch 8
    assert split["constexprs"]["FINISH_Q"] is True  # it finishes the absorbed query
    q_lat = launches[Q_LAT_AT]
    assert q_lat["grid"] == [144, 1]  # 4608 columns in 32-wide tiles, the whole K in one split
    pair = launches[PAIR_AT - 1]  # o_proj's 224 programs and the router's 96 (K = 8192)
    assert pair["kernel"] == "_gemv_pair_kernel" and pair["grid"] == [320]
    assert 2 * pair["programs_per_sm"] * 132 >= 320  # at most two waves


def test_run_18s_and_19s_moe_plans_compile_for_sm90(tmp_path: Path) -> None:
    """--moe run18 / run19: the validated plans before the down became items and before the
    MoE became one kernel, for comparisons (run 18's GEMVs were Triton's)."""
    for moe, kernels in (("run18", LAYER), ("run19", LAYER_ITEMS)):
        args = ["--batches", "8", "64", "--contexts", "1024", "--moe", moe, "--gemv", "triton"]
        args += ["--absorb-q", "off"]  # as those runs had it
        report = _run_tool(tmp_path / f"{moe}.json", *args)
        for case, launches in _by_case(report).items():
            assert [launch["kernel"] for launch in launches] == kernels, case
            gate_up, down = launches[-2:]
            assert (gate_up["error"], down["error"]) == ("", ""), case
            cap = moe == "run18" or case[0] <= 8
            assert gate_up["grid"] == [2 * 132] if cap else gate_up["grid"][0] > 2 * 132
            assert down["programs_per_sm"] >= 1
            if moe == "run19":
                assert down["grid"] == [4 * 132]  # the down's items: 4 programs per SM


def test_the_cute_gemvs_compile_for_sm90a_in_place_of_the_triton_ones(tmp_path: Path) -> None:
    """--gemv cute: the four dense GEMVs (qkv_a, q_b, o_proj and the router, with the router's
    fold off) are cute_gemv's CuTe DSL kernel (LayerPlan.gemv_cute), compiled by CuTe DSL and
    assembled by ptxas: the plan's grids, no spills, and as many programs per SM as the grids
    need (at most 2 per SM below batch 16, 3 above)."""
    pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed")
    args = ["--batches", "8", "64", "--contexts", "1024", "--gemv", "cute", "--absorb-q", "off"]
    report = _run_tool(tmp_path / "cute.json", *args, "--router-in-o-proj", "off")
    for case, launches in _by_case(report).items():
        kernels = [launch["kernel"] for launch in launches]
        gemv_places = [i for i, kernel in enumerate(kernels) if kernel == CUTE_GEMV]
        assert len(gemv_places) == 4 and "_splitk_gemv_kernel" not in kernels, case
        for launch in (launches[i] for i in gemv_places):
            assert launch["error"] == "" and launch["spill_bytes"] == 0, (case, launch)
            assert launch["registers"] > 0
            assert launch["programs_per_sm"] * 132 >= launch["grid"][0] * launch["grid"][1]


def test_the_folded_latent_prep_compiles_for_sm90_as_13_kernels(tmp_path: Path) -> None:
    """--fold-latent-prep: kernels 3 and 4 as q_b_folded's one launch (its kv programs after
    the column blocks), in one wave of the H200: its qkv_a partials per K step must not take
    the shared memory of a second program per SM."""
    args = ["--batches", "8", "64", "--contexts", "1024", "--fold-latent-prep", "--gemv", "triton"]
    args += ["--absorb-q", "off"]  # the absorbed query replaces q_b's GEMV, which folds here
    report = _run_tool(tmp_path / "fold.json", *args)
    folded = [*LAYER_STREAM[:2], "_q_b_folded_kernel", *LAYER_STREAM[4:]]
    for case, launches in _by_case(report).items():
        assert [launch["kernel"] for launch in launches] == folded, case
        for launch in launches[1:]:
            assert launch["error"] == "" and launch["spill_bytes"] == 0, (case, launch)
        fold = launches[2]
        assert fold["programs_per_sm"] * 132 >= fold["grid"][0] * fold["grid"][1], fold


def test_the_router_gemv_and_routing_kernel_compile_for_sm90_two_kernels_more(
    tmp_path: Path,
) -> None:
    """--router-in-o-proj off: o_proj's GEMV, the post-attention norm, the router's GEMV and the
    routing kernel, as through the fortieth session, each without spills."""
    args = ["--batches", "1", "8", "64", "--contexts", "1024", "--router-in-o-proj", "off"]
    report = _run_tool(tmp_path / "router.json", *args, "--gemv", "triton")
    for (batch, _), launches in _by_case(report).items():
        folded = LAYER if batch <= 4 else LAYER_ABSORBED
        at = PAIR_AT if batch <= 4 else PAIR_AT - 1
        four = [
            "_splitk_gemv_kernel",
            "_add_rmsnorm_kernel",
            "_splitk_gemv_kernel",
            "_route_kernel",
        ]
        assert [launch["kernel"] for launch in launches] == [*folded[:at], *four, *folded[at + 2 :]]
        for launch in launches[at : at + 4]:
            assert launch["error"] == "" and launch["spill_bytes"] == 0, (batch, launch)


def test_the_input_norm_and_w_uv_folds_compile_for_sm90_two_kernels_fewer(
    tmp_path: Path,
) -> None:
    """--input-norm-in-qkv-a --w-uv-in-combine: kernel 1 gone into qkv_a's GEMV (the summed
    GEMV, CuTe DSL where the plan takes it), and the combine and w_uv as one kernel, each
    without spills (10 kernels at batch <= 4, 8 above)."""
    args = ["--batches", "1", "8", "64", "--contexts", "1024", "--input-norm-in-qkv-a"]
    gemv = [] if HAS_CUTE else ["--gemv", "triton"]
    report = _run_tool(tmp_path / "folds.json", *args, "--w-uv-in-combine", *gemv)
    for (batch, _), launches in _by_case(report).items():
        planned = _plan_kernels(batch)
        summed = "cute_gemv.summed_gemv (CuTe DSL)" if planned[1] == CUTE_GEMV else None
        combine = planned.index("_mla_combine_kernel")
        expected = [
            summed or "_summed_gemv_kernel",
            *planned[2:combine],
            "_combine_w_uv_kernel",
            *planned[combine + 2 :],
        ]
        assert [launch["kernel"] for launch in launches] == expected, batch
        for launch in launches:
            assert launch["error"] == "" and launch["spill_bytes"] == 0, (batch, launch)


BAD_KERNEL = """
import json, sys
from dataclasses import asdict
sys.path.insert(0, {root!r})
import torch
import triton
import triton.language as tl
from benchmarks.sm90_compile import Launch, compile_launch


@triton.jit
def changes_type_in_loop(x_ptr, N: tl.constexpr):
    value = 0  # an int before the loop, a bf16 inside it: the interpreter runs it, the compiler not
    for i in range(tl.program_id(0), N):
        value = tl.load(x_ptr + i)
    tl.store(x_ptr, value)


x = torch.empty(16, device="meta", dtype=torch.bfloat16)
launch = Launch("bad", (1,), changes_type_in_loop, (x,), {{"N": 16}})
print(json.dumps(asdict(compile_launch(launch, 1, 1))))
"""


def test_a_kernel_the_interpreter_runs_but_the_compiler_refuses_is_reported(
    tmp_path: Path,
) -> None:
    script = tmp_path / "bad_kernel.py"
    script.write_text(BAD_KERNEL.format(root=str(ROOT)))
    result = subprocess.run(
        [sys.executable, str(script)],
        env=_without_interpreter(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = json.loads(result.stdout.strip().splitlines()[-1])
    assert compiled["error"], compiled
    assert "loop-carried variable" in compiled["error"].lower()
    assert compiled["registers"] == 0 and compiled["programs_per_sm"] == 0


def test_programs_per_sm_takes_the_scarcest_resource() -> None:
    # the gate_up at batch 8 (60 KB, 144 registers, 4 warps): shared memory and registers
    # both allow 3
    assert programs_per_sm(60 * 1024, 144, 4) == 3
    # 136 registers round up to 4352 per warp: 15 warps' worth, 3 programs of 4 warps, though
    # shared memory would hold 6
    assert programs_per_sm(36 * 1024, 136, 4) == 3
    assert programs_per_sm(36 * 1024, 128, 4) == 4
    assert programs_per_sm(0, 32, 4) == 16  # warp slots: 64 per SM
    assert programs_per_sm(0, 16, 1) == 32  # block slots
    assert programs_per_sm(164 * 1024, 178, 4) == 1
    assert programs_per_sm(BLOCK_SHARED_MAX + 1, 32, 4) == 0


def test_the_split_kernels_loads_need_no_per_token_predicate_off_the_grid(tmp_path: Path) -> None:
    """At a context that is not a multiple of 16 Triton cannot prove a tile's token mask
    constant over 16 tokens. The split kernel's loads take no token mask (tokens past a split
    read its last one again), so its PTX has about the comparisons of a context that is (the
    kernel that masked its loads had 129 against 43 at batch 8 with Triton 3.9; now 21 and 19)."""
    ptx = tmp_path / "ptx"
    _run_tool(
        tmp_path / "r.json", "--batches", "8", "--contexts", "22759", "22768", "--ptx", str(ptx)
    )
    compares = {
        context: _only((ptx / f"8x{context}").glob("_mla_split_kernel-*.ptx"))
        .read_text()
        .count("setp.lt")
        for context in (22759, 22768)
    }
    assert 0 < compares[22768] <= compares[22759] <= compares[22768] + 8, compares


def _only(paths: Iterable[Path]) -> Path:
    found = list(paths)
    assert len(found) == 1, found
    return found[0]
