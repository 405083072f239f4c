"""kernels.stream's plain read (kernels.bench's yardstick) reads every value of every block exactly."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("n", [1, 64, 1000])  # one value; exactly one block; a ragged last block
def test_block_max_reads_every_value_of_every_block(backend, n):
    stream = backend.module("stream")
    block = 64
    g = torch.Generator().manual_seed(n)
    # NOTE: all negative, so a masked tail read as 0 (not the lowest int32) would win the last block; the
    # last value is the largest, so the last block's maximum needs it read
    x = -torch.randint(2, 2**31 - 1, (n,), generator=g, dtype=torch.int32)
    x[-1] = -1
    out = torch.full((stream.blocks(n, block),), 7, dtype=torch.int32, device=backend.device)  # poisoned
    stream.block_max(x.to(backend.device), out, block)  # NOTE: 7 is above every value: unwritten shows
    padded = torch.cat([x, torch.full((-n % block,), -(2**31), dtype=torch.int32)])
    assert torch.equal(out.cpu(), padded.view(-1, block).amax(1))


def test_block_max_refuses_what_it_cannot_read(backend):
    stream = backend.module("stream")
    x = torch.arange(100, dtype=torch.int32, device=backend.device)
    for bad in (x.float(), x.view(10, 10), x[::2], x[:0]):
        with pytest.raises(ValueError, match="contiguous 1-D int32"):
            stream.block_max(bad, block=64)
    with pytest.raises(ValueError, match=r"out must be int32 \[2\]"):
        stream.block_max(x, torch.empty(3, dtype=torch.int32, device=backend.device), block=64)
