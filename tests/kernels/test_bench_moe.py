"""kernels.bench_moe on the CPU: its rows (kernel interpreted, every timer run once), its torch baseline
against the reference, its report, and its refusal to measure without a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels import bench_moe, reference, timing

TINY = bench_moe.MoeShape(experts=6, top_k=2, hidden=32, inter=24)


def test_the_torch_baseline_is_the_reference():
    w13, w2 = bench_moe.expert_weights(TINY, torch.float32, torch.device("cpu"), seed=1)
    x, weights, ids = bench_moe.inputs(
        TINY, 9, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(2)
    )
    torch.testing.assert_close(
        bench_moe.torch_per_expert(x, w13, w2, weights, ids), reference.fused_moe(x, w13, w2, weights, ids)
    )


@pytest.fixture
def calls(monkeypatch) -> list:
    """Every timer runs its function once and reports 0.5 ms; the results, in order."""
    results = []

    def once(fn, *args, **kwargs):
        results.append(fn())
        return 0.5

    monkeypatch.setattr(timing, "time_ms", once)
    monkeypatch.setattr(timing, "time_replay_ms", once)
    return results


def test_a_row_reports_the_floors_and_the_kernels_error(backend, monkeypatch, calls):
    if backend.is_cuda:
        pytest.skip("the GPU runs the command itself (scripts/gpu-bench moe)")
    moe = backend.module("moe")  # the interpreted kernels
    # NOTE: a GPU's default (the interpreter's own tiles are smaller), so that it is one of the candidates
    monkeypatch.setattr(
        moe, "default_config", lambda pairs, experts, mxfp4=False: moe.CANDIDATES["m16 n64 k128"]
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    w = bench_moe.expert_weights(TINY, torch.bfloat16, torch.device("cpu"), seed=0)
    rates = {"copy_gbs": 100.0, "matmul_tflops": 10.0}
    row = bench_moe.bench_row("tiny", TINY, 5, w, rates, torch.Generator().manual_seed(0))
    assert len(calls) == 3 + len(moe.CANDIDATES) and all(c.shape == (5, 32) for c in calls)
    assert row["default"] == "m16 n64 k128" and set(row["candidates_graph_ms"]) == set(moe.CANDIDATES)
    assert 1 <= row["experts_touched"] <= 6 and row["rel_err"] < 2e-2
    assert row["bytes"] == row["experts_touched"] * 3 * 32 * 24 * 2 + 2 * 5 * 32 * 2
    assert row["flops"] == 2 * 5 * 2 * 3 * 32 * 24
    assert row["pct_of_copy_bw"] == pytest.approx(100 * row["bytes"] / 100e6 / 0.5)
    assert row["speedup_vs_torch"] == 1.0
    report = bench_moe.format_markdown({"device": {"name": "CPU", "copy_gbs": 100.0, "matmul_tflops": 10.0},
                                        "rows": [row], "command": "c", "timing": "t"})  # fmt: skip
    assert "| tiny | 5 |" in report and "500.0" in report
    assert f"| {' | '.join(moe.CANDIDATES)} |" in report and "**500.0" in report  # the default in bold


def test_it_measures_nothing_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert bench_moe.main(["--models", "mixtral-8x7b"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_an_mxfp4_row_times_the_packed_experts_beside_them_dequantized(backend, monkeypatch, calls):
    if backend.is_cuda:
        pytest.skip("the GPU runs the command itself (scripts/gpu-bench moe)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    shape = bench_moe.MoeShape(experts=6, top_k=2, hidden=64, inter=32, mxfp4=True)
    w = bench_moe.expert_weights(shape, torch.bfloat16, torch.device("cpu"), seed=0)
    assert (
        [t.dtype for t in w] == [torch.uint8] * 4 and w[0].shape == (6, 64, 32) and w[3].shape == (6, 64, 1)
    )
    rates = {"copy_gbs": 100.0, "matmul_tflops": 10.0}
    row = bench_moe.bench_row("tiny-mxfp4", shape, 5, w, rates, torch.Generator().manual_seed(0))
    # packed replay, eager, the torch loop, the dequantized replay; no candidates (deep steps are 16-bit's)
    assert len(calls) == 4 and "candidates_graph_ms" not in row and row["rel_err"] < 2e-2
    torch.testing.assert_close(calls[0].float(), calls[3].float(), rtol=2e-2, atol=2e-2)  # the same experts
    assert row["bytes"] == row["experts_touched"] * 3 * 64 * 32 * 17 // 32 + 2 * 5 * 64 * 2
    assert row["packed_speedup"] == 1.0
    report = bench_moe.format_markdown({"device": {"name": "CPU", "copy_gbs": 100.0, "matmul_tflops": 10.0},
                                        "rows": [row], "command": "c", "timing": "t"})  # fmt: skip
    assert "| tiny-mxfp4 | 5 | 500.0 | 500.0 | 1.00x |" in report
