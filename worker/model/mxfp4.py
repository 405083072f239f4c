"""MXFP4 weights (OCP Microscaling FP4, as gpt-oss ships its experts), dequantized at load.

A row of K values is stored as K/32 blocks: 16 bytes of 4-bit E2M1 values each (two a byte, the low
nibble first) and one shared scale byte, an E8M0 power of two with bias 127. The worker serves the
dequantized weights (bf16 on a GPU): exact, since every E2M1 value times a power of two is a bf16 value
for the scales real checkpoints hold.
"""

from __future__ import annotations

import torch

# the 16 E2M1 codes: sign bit, 2 exponent bits, 1 mantissa bit
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values sharing one scale


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> [..., G * 32] in ``dtype``. Raises ValueError
    when the two do not describe the same rows."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks [..., G, 16] and scales [..., G] expected, got {list(blocks.shape)} and "
            f"{list(scales.shape)}"
        )
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = table[codes].flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32).unsqueeze(-1) - 127
    return torch.ldexp(values, exponents).flatten(-2).to(dtype)
