"""kernels.bench_moe on the CPU: its rows (kernel interpreted, every timer run once), its torch baseline
against the reference, its report, and its refusal to measure without a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import bench_moe, bench_report, reference, timing
from tests.support import SLOW

TINY = bench_moe.MoeShape(experts=6, top_k=2, hidden=32, inter=24)
# fp8 experts of two 128 x 128 scale blocks down each weight and two across w13 (one across w2)
TINY_FP8 = bench_moe.MoeShape(experts=6, top_k=2, hidden=256, inter=128, quant="fp8")
RATES = {"copy_gbs": 100.0, "matmul_tflops": 10.0}


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
    shape = bench_moe.MoeShape(experts=6, top_k=2, hidden=64, inter=32, quant="mxfp4")
    w = bench_moe.expert_weights(shape, torch.bfloat16, torch.device("cpu"), seed=0)
    assert (
        [t.dtype for t in w] == [torch.uint8] * 4 and w[0].shape == (6, 64, 32) and w[3].shape == (6, 64, 1)
    )
    rates = {"copy_gbs": 100.0, "matmul_tflops": 10.0}
    row = bench_moe.bench_row("tiny-mxfp4", shape, 5, w, rates, torch.Generator().manual_seed(0))
    # packed replay, eager, the torch loop, the dequantized replay, then each step depth; no candidates
    # (their deep steps are 16-bit's)
    assert len(calls) == 4 + 3 and "candidates_graph_ms" not in row and row["rel_err"] < 2e-2
    torch.testing.assert_close(calls[0].float(), calls[3].float(), rtol=2e-2, atol=2e-2)  # the same experts
    for step in calls[4:]:  # NOTE: 32, 64 and 128 deep: the same experts, each step's scales applied
        torch.testing.assert_close(step.float(), calls[0].float(), rtol=2e-2, atol=2e-2)
    assert list(row["mxfp4_steps_graph_ms"]) == ["k32", "k64", "k128"] and row["mxfp4_step"] == "k32"
    assert row["mxfp4_steps_rel_err"] < 2e-2
    assert row["bytes"] == row["experts_touched"] * 3 * 64 * 32 * 17 // 32 + 2 * 5 * 64 * 2
    assert row["packed_speedup"] == 1.0
    report = bench_moe.format_markdown({"device": {"name": "CPU", "copy_gbs": 100.0, "matmul_tflops": 10.0},
                                        "rows": [row], "command": "c", "timing": "t"})  # fmt: skip
    assert "| tiny-mxfp4 | 5 | 500.0 | 500.0 | 1.00x |" in report
    # the step depths, the default's in bold
    assert "| tiny-mxfp4 | 5 | **500.0** | 500.0 | 500.0 |" in report


def test_qwen3s_fp8_experts_are_a_model_of_the_default_run(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    fp8 = bench_moe.MODELS["qwen3-30b-a3b-fp8"]
    assert fp8 == dataclasses.replace(bench_moe.MODELS["qwen3-30b-a3b"], quant="fp8")
    # NOTE: a byte a weight, and 4 bytes a 128 x 128 block's scale: w13 12 x 16 blocks, w2 16 x 6
    assert fp8.expert_bytes() == 3 * 2048 * 768 + 4 * (12 * 16 + 16 * 6)
    assert bench_moe.main(["--models", "qwen3-30b-a3b-fp8"]) == 2  # a choice --models takes (no GPU here)
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_an_fp8_row_times_the_fp8_experts_beside_them_dequantized(backend, monkeypatch, calls):
    if backend.is_cuda:
        pytest.skip("the GPU runs the command itself (scripts/gpu-bench moe)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    w = bench_moe.expert_weights(TINY_FP8, torch.bfloat16, torch.device("cpu"), seed=0)
    assert [t.dtype for t in w] == [torch.float8_e4m3fn] * 2 + [torch.float32] * 2
    assert [t.shape for t in w] == [(6, 256, 256), (6, 256, 128), (6, 2, 2), (6, 2, 1)]
    for codes, scales in ((w[0], w[2]), (w[1], w[3])):  # the dequantized weight's std near 1/sqrt(K)
        std = reference.dequantize_fp8_weight(codes, scales, (128, 128), torch.float32).std().item()
        assert 0.7 < std * codes.shape[2] ** 0.5 < 1.5
    row = bench_moe.bench_row("tiny-fp8", TINY_FP8, 5, w, RATES, torch.Generator().manual_seed(0))
    # fp8 replay, eager, the torch loop, the dequantized replay, the fp8-activation replays (the default, x
    # quantized inside the GEMMs, first); no candidates (deep steps are 16-bit's)
    assert len(calls) == 7 and row["rel_err"] < 2e-2 and row["w8a8_rel_err"] < 2e-2
    assert torch.equal(calls[5], calls[6])  # the same codes and scales either way
    torch.testing.assert_close(calls[0].float(), calls[3].float(), rtol=2e-2, atol=2e-2)  # the same experts
    # the fp8-activation replay: the same experts with their inputs quantized, near but not equal
    assert 1e-3 < ((calls[4].float() - calls[0].float()).norm() / calls[0].float().norm()).item() < 0.1
    assert set(row) == {
        "model", "tokens", "experts_touched", "bytes", "flops", "rel_err", "triton_graph_ms", "triton_ms",
        "torch_ms", "read_floor_ms", "compute_floor_ms", "pct_of_copy_bw", "pct_of_matmul", "speedup_vs_torch",
        "dequantized_graph_ms", "fp8_speedup", "default", "w8a8_graph_ms", "w8a8_rel_err", "w8a8_vs_fp8",
        "w8a8_quantized_inside_graph_ms", "w8a8_quantized_first_graph_ms",
    }  # fmt: skip
    assert row["bytes"] == row["experts_touched"] * (3 * 256 * 128 + 4 * (2 * 2 + 2 * 1)) + 2 * 5 * 256 * 2
    assert row["fp8_speedup"] == 1.0 and row["dequantized_graph_ms"] == 0.5
    report = bench_moe.format_markdown({"device": {"name": "CPU", **RATES}, "rows": [row], "command": "c",
                                        "timing": "t"})  # fmt: skip
    assert "| model | tokens | fp8 | dequantized | fp8 speedup |" in report
    assert "| tiny-fp8 | 5 | 500.0 | 500.0 | 1.00x |" in report and "packed" not in report
    assert f"| tiny-fp8 | 5 | 500.0 | 500.0 | 500.0 | 500.0 | 1.00x | {row['w8a8_rel_err']:.1e} |" in report
    assert "`w8a8_vs_fp8_min_decode` 1.00x, `w8a8_vs_fp8_min_prefill` -" in report


# NOTE: full tier: the fp8 row runs in the default tier (the test above); this one its error on a wrong kernel
@SLOW
def test_an_fp8_rows_error_compares_the_kernel_with_the_reference(backend, monkeypatch, calls):
    """A kernel that read each expert's first scale block for all of its blocks shows in rel_err."""
    if backend.is_cuda:
        pytest.skip("the GPU runs the command itself (scripts/gpu-bench moe)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    moe = backend.module("moe")
    right = moe.fused_moe

    def first_block_only(*args, w13_scales=None, w2_scales=None, **kwargs):
        if w13_scales is not None:
            w13_scales, w2_scales = (s[:, :1, :1].expand_as(s).contiguous() for s in (w13_scales, w2_scales))
        return right(*args, w13_scales=w13_scales, w2_scales=w2_scales, **kwargs)

    monkeypatch.setattr(moe, "fused_moe", first_block_only)
    w = bench_moe.expert_weights(TINY_FP8, torch.bfloat16, torch.device("cpu"), seed=0)
    row = bench_moe.bench_row("tiny-fp8", TINY_FP8, 5, w, RATES, torch.Generator().manual_seed(0))
    assert row["rel_err"] > 0.1 and bench_report.inaccurate(row["rel_err"])


def timed_row(model: str, tokens: int, **speedup: float) -> dict:
    """A row as bench_row makes it, with made-up times: graph replays of 100 us, the dequantized experts'
    ``speedup`` times that."""
    row = {"model": model, "tokens": tokens, "experts_touched": 8, "triton_graph_ms": 0.1, "triton_ms": 0.1,
           "torch_ms": 1.0, "speedup_vs_torch": 10.0, "pct_of_copy_bw": 50.0, "pct_of_matmul": 1.0,
           "rel_err": 1e-3}  # fmt: skip
    for field, value in speedup.items():
        if field == "w8a8_vs_fp8":  # NOTE: fp8 activations' replay, ``value`` times as fast
            row.update({"w8a8_graph_ms": 0.1 / value, "w8a8_rel_err": 1e-3, field: value,
                        "w8a8_quantized_inside_graph_ms": 0.1 / value, "w8a8_quantized_first_graph_ms": 0.1})  # fmt: skip
        elif field == "mxfp4_steps":  # NOTE: 64 and 128 deep, ``value`` (a pair) times as fast as 32
            row.update({"mxfp4_step": "k32", "mxfp4_steps_rel_err": 1e-3,
                        "mxfp4_steps_graph_ms": {"k32": 0.1, "k64": 0.1 / value[0], "k128": 0.1 / value[1]}})  # fmt: skip
        else:
            row.update({"dequantized_graph_ms": 0.1 * value, field: value})
    return row


def test_the_summary_is_each_formats_least_speedup_at_decode():
    rows = [
        timed_row("qwen3-30b-a3b", 1),
        timed_row("gpt-oss-20b", 16, packed_speedup=1.25, mxfp4_steps=(1.1, 0.8)),
        timed_row("gpt-oss-20b", 64, packed_speedup=1.5, mxfp4_steps=(1.06, 0.9)),
        # a prefill: not the decode rule's
        timed_row("gpt-oss-20b", 256, packed_speedup=0.5, mxfp4_steps=(0.95, 1.25)),
        timed_row("qwen3-30b-a3b-fp8", 1, fp8_speedup=1.5, w8a8_vs_fp8=0.8),
        timed_row("qwen3-30b-a3b-fp8", 64, fp8_speedup=0.9, w8a8_vs_fp8=0.95),
        timed_row("qwen3-30b-a3b-fp8", 256, fp8_speedup=0.25, w8a8_vs_fp8=1.6),
        timed_row("qwen3-30b-a3b-fp8", 4096, fp8_speedup=0.5, w8a8_vs_fp8=1.9),
    ]
    steps = {"mxfp4_k32_speedup_min_decode": 1.0, "mxfp4_k32_speedup_min_prefill": 1.0,
             "mxfp4_k64_speedup_min_decode": 1.06, "mxfp4_k64_speedup_min_prefill": 0.95,
             "mxfp4_k128_speedup_min_decode": 0.8, "mxfp4_k128_speedup_min_prefill": 1.25}  # fmt: skip
    summary = bench_moe.summarize(rows)
    assert {k: round(v, 6) if v else v for k, v in summary.items()} == {
        "packed_speedup_min_decode": 1.25,
        "fp8_speedup_min_decode": 0.9,
        "w8a8_vs_fp8_min_decode": 0.8,
        "w8a8_vs_fp8_min_prefill": 1.6,
        **steps,
    }
    assert bench_moe.summarize(rows[:1]) == {
        "packed_speedup_min_decode": None,
        "fp8_speedup_min_decode": None,
        "w8a8_vs_fp8_min_decode": None,
        "w8a8_vs_fp8_min_prefill": None,
        **dict.fromkeys(steps),
    }
    report = bench_moe.format_markdown({"device": {"name": "CPU", **RATES}, "rows": rows, "command": "c",
                                        "timing": "t"})  # fmt: skip
    assert "| qwen3-30b-a3b-fp8 | 64 | 100.0 | 90.0 | 0.90x |" in report
    assert "`fp8_speedup_min_decode`, the least at 64 tokens or fewer: 0.90x" in report
    assert "`packed_speedup_min_decode`, the least at 64 tokens or fewer: 1.25x" in report
    assert "| gpt-oss-20b | 256 | **100.0** | 105.3 | 80.0 | 1.0e-03 |" in report
    assert (
        "`mxfp4_k64_speedup_min_decode` 1.06x" in report
        and "`mxfp4_k128_speedup_min_prefill` 1.25x" in report
    )
