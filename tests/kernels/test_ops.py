"""kernels.ops dispatch: references for CPU tensors, Triton for CUDA or under TRITON_INTERPRET=1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels import ops, reference

from .test_decode_attention import make_batch as make_decode_batch
from .test_extend_attention import make_batch as make_extend_batch

_USER_SET_INTERPRET = "TRITON_INTERPRET" in os.environ


def _inputs(device: torch.device) -> dict[str, tuple]:
    g = torch.Generator().manual_seed(5)
    ext = make_extend_batch([(3, 5), (0, 4)], 4, 2, 64, torch.float32, device)
    dec = make_decode_batch([4, 9], 4, 2, 64, torch.float32, device)
    x = torch.randn(3, 32, generator=g).to(device)
    w = torch.randn(32, generator=g).to(device)
    q, k = torch.randn(3, 4, 64, generator=g).to(device), torch.randn(3, 2, 64, generator=g).to(device)
    cache = torch.randn(8, 64, generator=g).to(device)
    positions = torch.tensor([0, 7, 2]).to(device)
    return {"extend": ext, "decode": dec, "norm": (x, w, 1e-5), "rope": (q, k, positions, cache)}


def _run_all(mod, inputs: dict[str, tuple]) -> list[torch.Tensor]:
    """Every public op through ``mod`` (kernels.ops or kernels.reference); store_kv on a fresh pool."""
    kv = inputs["rope"][1]  # [3, 2, 64]
    k_cache, v_cache = torch.zeros(6, 2, 64, device=kv.device), torch.zeros(6, 2, 64, device=kv.device)
    mod.store_kv(k_cache, v_cache, torch.tensor([5, 1, 3], device=kv.device), kv, kv * 2)
    return [
        mod.extend_attention(*inputs["extend"]),
        mod.decode_attention(*inputs["decode"]),
        mod.rms_norm(*inputs["norm"]),
        *mod.apply_rope(*inputs["rope"]),
        k_cache,
        v_cache,
    ]


def test_interpreter_setting_does_not_leak_to_child_processes():
    """Workers that other tests start must run the torch reference path, not the interpreter."""
    if _USER_SET_INTERPRET:
        pytest.skip("TRITON_INTERPRET was set by the caller")
    code = "import os; print(os.environ.get('TRITON_INTERPRET'))"
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert child.stdout.strip() == "None"


def test_cpu_tensors_take_the_reference_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def no_triton(*args, **kwargs):
        raise AssertionError("Triton path taken for CPU tensors")

    monkeypatch.setattr(ops, "kernel_module", no_triton)
    inputs = _inputs(torch.device("cpu"))
    for got, want in zip(_run_all(ops, inputs), _run_all(reference, inputs), strict=True):
        assert torch.equal(got, want)


def test_triton_path_under_interpreter_or_cuda(backend, monkeypatch, assert_close_rel):
    if backend.interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    inputs = _inputs(backend.device)
    expected = _run_all(reference, {k: tuple(a.cpu() if torch.is_tensor(a) else a for a in v)
                                    for k, v in inputs.items()})  # fmt: skip

    def no_reference(*args, **kwargs):
        raise AssertionError("reference path taken")

    for name in ("extend_attention", "decode_attention", "rms_norm", "apply_rope", "store_kv"):
        monkeypatch.setattr(reference, name, no_reference)
    for got, want in zip(_run_all(ops, inputs), expected, strict=True):
        assert_close_rel(got.cpu(), want)


def test_kernel_module_refuses_the_other_mode(backend):
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        ops.kernel_module("fused", interpret=not backend.interpret)
    with pytest.raises(ValueError):
        ops.kernel_module("reference", interpret=backend.interpret)
