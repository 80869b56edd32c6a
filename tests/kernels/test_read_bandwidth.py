"""benchmarks/read_bandwidth.py's tile kernel under Triton's interpreter, at small sizes: it
reads every tile exactly once, so the bandwidth it times is over the bytes claimed (the stream
kernel it shares with the engine: tests/evaluation/test_bandwidth.py). The timing itself needs
a GPU (`read_bandwidth.py` refuses without one)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.read_bandwidth import (
    _tiles_kernel,
    check_tiles,
    pack_tiles,
)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("programs", [1, 3])
def test_the_tiles_multiply_every_tile_once(programs: int, packed: bool) -> None:
    hidden, tile_rows, token_rows = 64, 16, 16
    weights = torch.randn(5 * tile_rows, hidden, dtype=torch.bfloat16)
    tokens = torch.randn(token_rows, hidden, dtype=torch.bfloat16)
    out = torch.empty(programs, token_rows, tile_rows)
    source = pack_tiles(weights, tile_rows, 32) if packed else weights
    layout = "packed" if packed else "rows"
    _tiles_kernel[(programs,)](
        source, tokens, out, 5, hidden, token_rows, tile_rows, 32, True, LAYOUT=layout
    )
    check_tiles(out, tokens, weights)
    with pytest.raises(AssertionError):  # the check sees a tile left out
        check_tiles(out, tokens, weights[tile_rows:])
