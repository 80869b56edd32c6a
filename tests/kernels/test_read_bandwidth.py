"""benchmarks/read_bandwidth.py's kernels under Triton's interpreter, at small sizes: each
reads every block or tile exactly once, so the bandwidth they time is over the bytes claimed.
The timing itself needs a GPU (`read_bandwidth.py` refuses without one)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.read_bandwidth import (
    _stream_sum_kernel,
    _tiles_kernel,
    check_stream,
    check_tiles,
    pack_tiles,
)


@pytest.mark.parametrize("programs", [1, 3, 8])
def test_the_stream_sums_every_block_once(programs: int) -> None:
    data = torch.randn(16 * 64, dtype=torch.bfloat16)
    sums = torch.empty(programs)
    _stream_sum_kernel[(programs,)](data, sums, 16, BLOCK=64)
    check_stream(sums, data)
    with pytest.raises(AssertionError):  # the check sees a block missing
        check_stream(sums, torch.cat([data, torch.full((64,), 1.0, dtype=torch.bfloat16)]))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("programs", [1, 3])
def test_the_tiles_multiply_every_tile_once(programs: int, packed: bool) -> None:
    hidden, tile_rows, token_rows = 64, 16, 16
    weights = torch.randn(5 * tile_rows, hidden, dtype=torch.bfloat16)
    tokens = torch.randn(token_rows, hidden, dtype=torch.bfloat16)
    out = torch.empty(programs, token_rows, tile_rows)
    source = pack_tiles(weights, tile_rows, 32) if packed else weights
    _tiles_kernel[(programs,)](
        source, tokens, out, 5, hidden, token_rows, tile_rows, 32, True, PACKED=packed
    )
    check_tiles(out, tokens, weights)
    with pytest.raises(AssertionError):  # the check sees a tile left out
        check_tiles(out, tokens, weights[tile_rows:])
