"""benchmarks/launch_floor.py's persistent-kernel chain: its phases and grid barrier, run by
one program under Triton's interpreter (more would spin: the interpreter runs programs one
after another). The timing itself needs a GPU (`launch_floor.py` refuses without one)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.launch_floor import _phases_kernel


@pytest.mark.parametrize("phases", [1, 2, 5])
def test_each_phase_adds_one_to_what_the_last_phase_wrote(phases: int) -> None:
    buffers = torch.zeros(2, 1)
    counter = torch.zeros(1, dtype=torch.int32)
    _phases_kernel[(1,)](buffers, counter, PHASES=phases)
    assert buffers[phases % 2].item() == phases  # the live half: every phase built on the last
    assert buffers[(phases + 1) % 2].item() == phases - 1
    assert counter.item() == phases  # one arrival per phase, never reset inside a launch


@pytest.mark.gpu
@pytest.mark.parametrize("phases", [1, 32])
def test_the_grid_barrier_holds_across_every_sm(phases: int) -> None:
    """One program per SM, each reading its neighbour's value from the last phase: any
    program that passed the barrier early would add one to a stale value."""
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    buffers = torch.zeros(2, programs, device="cuda")
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)
    for _ in range(3):
        buffers.zero_()
        counter.zero_()
        _phases_kernel[(programs,)](buffers, counter, PHASES=phases)
        torch.cuda.synchronize()
        assert torch.equal(buffers[phases % 2], torch.full_like(buffers[0], float(phases)))
        assert counter.item() == phases * programs
