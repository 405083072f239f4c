"""Kernel test backends: Triton's CPU interpreter (no GPU) or compiled Triton on CUDA (GPU present).

Triton fixes interpreted-vs-compiled per process at import, so this file imports triton and the kernel
modules once under TRITON_INTERPRET=1 when there is no GPU, then restores the environment: other
test files and any child process they start never see the variable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

from kernels import compile_replay, interpret_requested, ops

_KERNEL_MODULES = (
    "kernels.extend_attention",
    "kernels.extend_short",
    "kernels.decode_attention",
    "kernels.pointwise",
    "kernels.fused",
    "kernels.fp8_linear",
    "kernels.lora",
    "kernels.moe",
    "kernels.sampling",
    "kernels.stream",
)


def _skip_repeated_language_patches() -> None:
    """Make the interpreter's device-function calls cheap. Triton 3.9's interpreter re-patches
    triton.language (inspect.getmembers over each module) on every call of a @triton.jit helper from
    inside a kernel: ~0.4 ms a call, a third of tests/kernels' time. Here the patching is skipped when
    the language modules the helper sees are patched already (by the launch, or by an earlier helper
    call: Triton never undoes those), so every helper still runs on the patched language, as before.
    Installed only where the call is the one described (its source re-patches, then runs the rewrite)."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    fn_class = getattr(interpreter, "InterpretedFunction", None)
    try:
        source = inspect.getsource(fn_class.__call__)
    except (TypeError, OSError):
        return
    if "_patch_lang(self.fn)" not in source or "self.rewrite()" not in source:
        return
    original = fn_class.__call__
    langs_by_globals: dict[int, list[ModuleType]] = {}

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        langs = langs_by_globals.get(id(self.fn.__globals__))
        if langs is None:  # NOTE: the modules _patch_lang would patch for this helper
            langs = [v for v in self.fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
            langs_by_globals[id(self.fn.__globals__)] = langs
        if not langs or any(tl.core.is_builtin(lang.load) for lang in langs):
            return original(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # as the original call reports a helper's error
            raise interpreter.InterpreterError(repr(exc)) from exc

    fn_class.__call__ = call


def _prepare_interpreter() -> str | None:
    """Import triton and the kernels interpreted when possible; return why not otherwise."""
    if interpret_requested():  # the caller asked for the interpreter for the whole run
        _skip_repeated_language_patches()
        return None
    if torch.cuda.is_available():
        return "CUDA present: this run tests compiled kernels (TRITON_INTERPRET=1 tests the interpreter)"
    already = [m for m in ("triton", *_KERNEL_MODULES) if m in sys.modules]
    if already:
        return f"{already} imported compiled before tests/kernels; run tests/kernels in its own process"
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton

        _skip_repeated_language_patches()
        # imported lazily on first launch otherwise, and it checks the interpreter setting it sees then
        with contextlib.suppress(ImportError):
            import triton.experimental.gluon  # noqa: F401
        for name in _KERNEL_MODULES:
            __import__(name)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return None


INTERPRETER_UNAVAILABLE = _prepare_interpreter()
if os.environ.get(compile_replay.ENV) and not INTERPRETER_UNAVAILABLE and not torch.cuda.is_available():
    compile_replay.record_launches(os.environ[compile_replay.ENV])  # python -m kernels.compile_replay
CUDA_UNAVAILABLE = (
    "no CUDA device"
    if not torch.cuda.is_available()
    else ("TRITON_INTERPRET=1: kernels are interpreted in this run" if interpret_requested() else None)
)


@dataclasses.dataclass(frozen=True)
class Backend:
    """Where a kernel test runs: device for the tensors, and the matching kernel modules."""

    name: str
    device: torch.device
    interpret: bool

    def module(self, name: str) -> ModuleType:
        return ops.kernel_module(name, self.interpret)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


@pytest.fixture(params=["interpret", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "interpret":
        if INTERPRETER_UNAVAILABLE:
            pytest.skip(INTERPRETER_UNAVAILABLE)
        return Backend("interpret", torch.device("cpu"), interpret=True)
    if CUDA_UNAVAILABLE:
        pytest.skip(CUDA_UNAVAILABLE)
    return Backend("cuda", torch.device("cuda"), interpret=False)


# ||out - ref|| / ||ref|| bounds: a missing key, a wrong mask or a wrong head is > 5e-2.
REL_TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.fixture
def assert_close_rel() -> Callable[[torch.Tensor, torch.Tensor], None]:
    def check(out: torch.Tensor, ref: torch.Tensor) -> None:
        assert out.shape == ref.shape and out.dtype == ref.dtype
        out_f, ref_f = out.detach().float().cpu(), ref.detach().float().cpu()
        assert torch.isfinite(out_f).all(), "unwritten (NaN-poisoned) or non-finite output elements"
        err = ((out_f - ref_f).norm() / ref_f.norm().clamp_min(1e-30)).item()
        assert err <= REL_TOL[ref.dtype], f"relative error {err:.2e} > {REL_TOL[ref.dtype]:.0e} ({ref.dtype})"

    return check


# (dtype, head dim, query heads, KV heads) of served models beyond head dims 64 / 128 and GQA 1 / 2 / 4 / 8,
# scaled down: Phi-3's head dim 96 (BLOCK_D 128, masked), Gemma 2 and 3's 256, and query groups of 7 and 5
# (Qwen2.5: 28 / 4 and 40 / 8 heads), whose padded rows (BLOCK_H 16) hold 2 and 3 tokens' groups in the
# short extend. The attention tests add them to their own cases.
SERVED_SHAPES = [
    (torch.bfloat16, 96, 4, 4),
    (torch.float16, 256, 4, 2),
    (torch.bfloat16, 128, 14, 2),
    (torch.float16, 64, 10, 2),
]


def strided(x: torch.Tensor) -> torch.Tensor:
    """The same values as a stride-2 view (a column of an [N, 2] tensor); the other column holds 0."""
    return torch.stack([x, torch.zeros_like(x)], dim=1)[:, 0]


@pytest.fixture
def gpu_command_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU commands (kernels.bench, kernels.tune, kernels.sweep) run on the CPU: start_gpu_run gives
    the CPU ("CPU stand-in", 2 SMs), every timer runs its call once and says 1 ms, a CUDA-graph capture
    re-runs its function, and the rates kernels.bench measures are fixed (copy 100 GB/s, matmul
    10 TF/s, graph floor 5 us)."""
    from kernels import bench, timing

    def cpu_run(prog: str, args: object) -> bench.GpuRun:
        model = bench.Model(args.q_heads, args.kv_heads, args.head_dim, args.dtype)
        return bench.GpuRun(
            torch.device("cpu"), "CPU stand-in", model, torch.Generator().manual_seed(args.seed)
        )

    def once(fn: Callable[[], object], **_: object) -> float:
        fn()
        return 1.0

    monkeypatch.setattr(bench, "start_gpu_run", cpu_run)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: type("P", (), {"multi_processor_count": 2})
    )
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    for name, value in (
        ("measure_copy_gbs", 100.0),
        ("measure_matmul_tflops", 10.0),
        ("measure_graph_floor_us", 5.0),
    ):
        monkeypatch.setattr(bench, name, lambda *args, value=value: value)
    monkeypatch.setattr(
        timing, "capture", lambda fn: (fn(), type("Rerun", (), {"replay": staticmethod(fn)}))[1]
    )
    monkeypatch.setattr(timing, "time_ms", once)
    monkeypatch.setattr(timing, "time_replay_ms", once)
