"""A plain streaming read, the yardstick for a short call's fixed cost (kernels.bench, batch-1 decode).

Not a model kernel: one launch in which every program reads one contiguous block of an int32 vector and
writes the block's maximum, so it moves the vector's bytes once and writes next to nothing. Replayed as
a CUDA graph over the bytes a decode call reads, it shows what any single kernel reaches at that size
in the same harness (launch, ramp and tail included), beside the measured copy bandwidth (which a
1 GiB copy measures, with no fixed cost to speak of).
Shapes: x [N] int32, contiguous; out [cdiv(N, block)] int32: out[i] = max(x[i * block : (i + 1) * block]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import interpret_requested

# NOTE: read at import; Triton decides interpreted vs compiled when @triton.jit runs (see kernels.ops).
INTERPRETED = interpret_requested()
BLOCK = 64 if INTERPRETED else 8192  # int32 values per program: 32 KB compiled, 32 per thread at 8 warps
_INT32_MIN = -(2**31)


@triton.jit
def _block_max_kernel(X, Out, n, BLOCK: tl.constexpr, LOWEST: tl.constexpr):
    block = tl.program_id(0)
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=LOWEST)
    tl.store(Out + block, tl.max(x, 0))


def blocks(n: int, block: int = BLOCK) -> int:
    """Programs (and outputs) for a vector of ``n`` values."""
    return triton.cdiv(n, block)


def block_max(x: torch.Tensor, out: torch.Tensor | None = None, block: int = BLOCK) -> torch.Tensor:
    """Each ``block``-value block's maximum of the int32 vector ``x`` (ValueError for anything else)."""
    if x.dtype != torch.int32 or x.dim() != 1 or not x.is_contiguous() or x.numel() == 0:
        raise ValueError(f"x must be a non-empty contiguous 1-D int32 tensor, got {x.dtype} {tuple(x.shape)}")
    n = x.numel()
    if out is None:
        out = torch.empty(blocks(n, block), dtype=torch.int32, device=x.device)
    elif out.dtype != torch.int32 or out.shape != (blocks(n, block),) or out.device != x.device:
        raise ValueError(
            f"out must be int32 [{blocks(n, block)}] on {x.device}, got {out.dtype} {tuple(out.shape)}"
        )
    warps = 1 if INTERPRETED else 8
    _block_max_kernel[(blocks(n, block),)](
        x, out, n, BLOCK=block, LOWEST=_INT32_MIN, enable_fp_fusion=True, num_warps=warps
    )
    return out
