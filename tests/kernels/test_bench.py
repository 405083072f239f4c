"""The CPU-checkable parts of kernels.bench: shape grids, FLOP/byte accounting, baselines' semantics."""

from __future__ import annotations

import pytest
import torch

from kernels import bench, reference

MODEL = bench.Model(num_q_heads=8, num_kv_heads=2, head_dim=64, dtype="fp32")


def test_extend_grid_covers_every_pair_with_similar_work_per_call():
    grid = bench.extend_grid((0, 100), (64, 512), tokens_per_call=4096)
    assert {(s.prefix, s.new) for s in grid} == {(0, 64), (0, 512), (100, 64), (100, 512)}
    assert all(s.batch * s.new == 4096 for s in grid)
    assert bench.extend_grid((0,), (8192,), tokens_per_call=4096)[0].batch == 1


def test_decode_grid_respects_the_token_cap_and_reaches_long_contexts():
    grid = bench.decode_grid()
    assert all(s.batch * s.context <= bench.DECODE_MAX_TOKENS for s in grid)
    assert any(s.context >= bench.LONG_CONTEXT for s in grid)  # where the bandwidth target is judged
    assert bench.decode_grid((4, 64), (100, 1000), max_tokens=4000) == [
        bench.DecodeShape(4, 100),
        bench.DecodeShape(4, 1000),
    ]


@pytest.mark.parametrize(("prefix", "new"), [(0, 1), (0, 7), (5, 3), (16, 16)])
def test_extend_flops_counts_exactly_the_visible_keys(prefix, new):
    visible = torch.ones(new, prefix + new).tril(diagonal=prefix).sum().item()  # lower-right causal
    shape = bench.ExtendShape(batch=3, prefix=prefix, new=new)
    assert bench.extend_flops(shape, MODEL) == 3 * visible * 4 * MODEL.num_q_heads * MODEL.head_dim


def test_decode_bytes_equals_the_tensors_a_decode_call_touches():
    shape = bench.DecodeShape(batch=3, context=40)
    model = bench.Model(8, 2, 64, "fp16")
    (q, k_cache, v_cache, _, kv_indices), _ = bench.decode_case(
        shape, model, torch.device("cpu"), torch.Generator().manual_seed(0)
    )
    touched = k_cache.nbytes + v_cache.nbytes + 2 * q.nbytes + kv_indices.nbytes  # q in, out back
    assert bench.decode_bytes(shape, model, kv_indices.element_size()) == touched


def test_shuffled_slots_is_a_page_shuffled_permutation():
    for tokens in (96, 100):  # whole pages, and a partial last page
        slots = bench.shuffled_slots(tokens, torch.Generator().manual_seed(0))
        assert slots.dtype == torch.int32
        assert sorted(slots.tolist()) == list(range(tokens))
    pages = bench.shuffled_slots(96, torch.Generator().manual_seed(0)).view(-1, bench.PAGE_TOKENS).long()
    assert (pages.diff(dim=1) == 1).all()  # contiguous inside a page
    assert pages[:, 0].tolist() != sorted(pages[:, 0].tolist())  # pages out of order


@pytest.mark.parametrize(("prefix", "new"), [(0, 9), (13, 6)])
def test_extend_sdpa_baseline_computes_the_same_attention_as_the_reference(prefix, new):
    shape = bench.ExtendShape(batch=2, prefix=prefix, new=new)
    kernel_args, sdpa_args = bench.extend_case(
        shape, MODEL, torch.device("cpu"), torch.Generator().manual_seed(1)
    )
    ref = reference.extend_attention(*kernel_args)
    torch.testing.assert_close(bench.sdpa_extend(*sdpa_args), ref, rtol=1e-5, atol=1e-5)


def test_decode_sdpa_baseline_computes_the_same_attention_as_the_reference():
    shape = bench.DecodeShape(batch=3, context=21)
    kernel_args, sdpa_args = bench.decode_case(
        shape, MODEL, torch.device("cpu"), torch.Generator().manual_seed(2)
    )
    ref = reference.decode_attention(*kernel_args)
    torch.testing.assert_close(bench.sdpa_decode(*sdpa_args), ref, rtol=1e-5, atol=1e-5)
    q, k, v = sdpa_args
    expanded = (q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1))  # the no-GQA fallback
    torch.testing.assert_close(bench.sdpa_decode(*expanded), ref, rtol=1e-5, atol=1e-5)


def test_summary_judges_targets_on_long_contexts_only():
    result = {
        "device": {"name": "X", "copy_gbs": 1000.0, "matmul_tflops": 500.0},
        "extend": [
            {
                "batch": 1,
                "prefix": 0,
                "new": 8,
                "triton_tflops": 90.0,
                "sdpa_tflops": 100.0,
                "ratio_vs_sdpa": 0.9,
            },
            {"batch": 1, "prefix": 8, "new": 8, "triton_tflops": 70.0, "sdpa_error": "refused"},
        ],
        "decode": [
            {"batch": 1, "context": 1024, "triton_gbs": 100.0},  # short: launch-bound, not judged
            {"batch": 1, "context": bench.LONG_CONTEXT, "triton_gbs": 750.0, "sdpa_gbs": 800.0},
        ],
    }
    result["summary"] = s = bench.summarize(result)
    assert s["decode_min_fraction_of_copy_bw_at_long_context"] == pytest.approx(0.75)
    assert s["decode_target_met"] is True
    assert s["extend_geomean_ratio_vs_sdpa_flash"] == pytest.approx(0.9)
    assert s["extend_target_met"] is True
    table = bench.format_table(result)
    assert table.splitlines()[0].startswith("kind") and len(table.splitlines()) == 1 + 2 + 2 + 1


def test_gpu_slug():
    assert bench.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_bench_without_cuda_exits_nonzero_with_a_message(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert bench.main(["--out", str(out)]) != 0
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not out.exists()
