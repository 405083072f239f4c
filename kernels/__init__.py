"""Attention, norm and RoPE kernels: Triton on CUDA, torch references elsewhere (see kernels.ops).

Importing this package must stay cheap: no torch or triton import here.

Every kernel launch passes ``enable_fp_fusion=True`` (a * b + c compiled to one FMA): the kernels'
accuracy bounds, tiles and timings are those of fused code, Triton's default through 3.9, which 3.10
turns off. ``TRITON_FORCE_DISABLE_FP_FUSION=1`` still turns it off, for debugging.
"""

from __future__ import annotations

import os

_TRUTHY = {"1", "true", "on", "yes"}


def interpret_requested() -> bool:
    """True when TRITON_INTERPRET asks for Triton's CPU interpreter (same spelling Triton accepts)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUTHY
