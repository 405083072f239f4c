"""Attention, norm and RoPE kernels: Triton on CUDA, torch references elsewhere (see kernels.ops).

Importing this package must stay cheap: no torch or triton import here.
"""

from __future__ import annotations

import os

_TRUTHY = {"1", "true", "on", "yes"}


def interpret_requested() -> bool:
    """True when TRITON_INTERPRET asks for Triton's CPU interpreter (same spelling Triton accepts)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUTHY
