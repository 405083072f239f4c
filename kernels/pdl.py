"""Programmatic dependent launch (PDL; compute capability 9.0 and later) for the kernels' launch pairs.

A kernel launched as a programmatic dependent may start while the kernel before it in the stream
drains. Every kernel here that is launched so waits for the grid before it (``tl.extra.cuda.gdc_wait``)
before it reads anything that grid could have written, and a kernel lets its dependents launch
(``gdc_launch_dependents``) only after its own wait. So whatever ran before the kernel before has
finished when a dependent starts, and a dependent may read, before its own wait, what was written
before that (host uploads, weights): kernels/decode_attention.py's merge reads ``kv_indptr`` so.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels import interpret_requested

# NOTE: read at import; Triton decides interpreted vs compiled when @triton.jit runs (see kernels.ops).
INTERPRETED = interpret_requested()
try:  # NOTE: grid dependency control came with Triton 3.x (3.6, the H100 image's, has it)
    from triton.language.extra.cuda import gdc_wait  # noqa: F401

    TRITON_HAS_PDL = True
except ImportError:
    TRITON_HAS_PDL = False


def pdl_active(requested: bool, arch: int) -> bool:
    """Whether a launch on compute capability ``arch`` (x10) uses PDL: ``requested``, compiled (the
    interpreter has no grid dependencies), on 9.0 or later, and with a Triton that has it."""
    return requested and not INTERPRETED and arch >= 90 and TRITON_HAS_PDL


def pdl_launch(pdl: bool) -> dict:
    """The launch keyword for a programmatic dependent launch; none otherwise, so that a Triton without
    the option launches the default kernels as before."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait_then_release():
    """The start of a PDL-launched kernel whose own dependent reads what it writes: wait for the grid
    before (its writes are visible past this), then let the dependent launch, never before the wait."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
