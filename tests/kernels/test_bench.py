"""The CPU-checkable parts of kernels.bench: shape grids, FLOP/byte accounting, baselines' semantics."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest
import torch

from kernels import bench, bench_report, reference, timing
from tests.support import SLOW

MODEL = bench.Model(num_q_heads=8, num_kv_heads=2, head_dim=64, dtype="fp32")


def test_extend_grid_covers_every_pair_with_similar_work_per_call():
    grid = bench.extend_grid((0, 100), (64, 512), tokens_per_call=4096)
    assert {(s.prefix, s.new) for s in grid} == {(0, 64), (0, 512), (100, 64), (100, 512)}
    assert all(s.batch * s.new == 4096 for s in grid)
    assert bench.extend_grid((0,), (8192,), tokens_per_call=4096)[0].batch == 1


def test_decode_grid_respects_the_token_cap_and_reaches_long_contexts():
    grid = bench.decode_grid()
    assert all(s.batch * s.context <= bench.DECODE_MAX_TOKENS for s in grid)
    assert any(s.context >= bench_report.LONG_CONTEXT for s in grid)  # where the bandwidth target is judged
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


def test_the_decode_layer_stack_copies_each_layers_kv_within_its_byte_budget():
    assert bench.stack_layers(1 << 20) == bench.STACK_LAYERS  # small K/V: the full stack
    assert bench.stack_layers(3 << 30, layers=8, max_bytes=8 << 30) == 3  # two copies fit, a third would not
    assert bench.stack_layers(16 << 30, layers=8, max_bytes=8 << 30) == 2  # never fewer than two layers
    gen = torch.Generator().manual_seed(0)
    args, _ = bench.decode_case(bench.DecodeShape(2, 32), MODEL, torch.device("cpu"), gen)
    stack = bench.layer_stack(args, 3)
    assert len(stack) == 3 and stack[0] is args
    for layer in stack[1:]:
        assert layer[0] is args[0] and layer[3] is args[3] and layer[4] is args[4]  # q and the indices shared
        for copy, original in zip(layer[1:3], args[1:3], strict=True):
            assert copy.data_ptr() != original.data_ptr() and torch.equal(copy, original)
    assert stack[1][1].data_ptr() != stack[2][1].data_ptr()


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


def synthetic_result() -> dict:
    """A kernels.bench result as main() builds it, with made-up numbers (no GPU involved)."""
    return {
        "device": {"name": "NVIDIA H100 80GB HBM3", "copy_gbs": 1000.0, "matmul_tflops": 500.0},
        "software": {"torch": "2.11.0+cu130", "triton": "3.6.0", "python": "3.12.3"},
        "command": "python -m kernels.bench --quick",
        "model": {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bf16"},
        "timing": "do_bench median",
        "extend": [
            {
                "batch": 1,
                "prefix": 0,
                "new": 8,
                "triton_tflops": 90.0,
                "sdpa_tflops": 100.0,
                "ratio_vs_sdpa": 0.9,
                "rel_err_vs_sdpa": 0.00123,
                "config": {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2},
            },
            {"batch": 1, "prefix": 8, "new": 8, "triton_tflops": 70.0, "sdpa_error": "refused"},
        ],
        "decode": [
            {"batch": 1, "context": 1024, "triton_gbs": 100.0},  # short: launch-bound, not judged
            {"batch": 1, "context": bench_report.LONG_CONTEXT, "triton_gbs": 750.0, "sdpa_gbs": 800.0},
        ],
    }


def test_summary_judges_targets_on_long_contexts_only():
    result = synthetic_result()
    result["summary"] = s = bench_report.summarize(result)
    assert s["decode_min_fraction_of_copy_bw_at_long_context"] == pytest.approx(0.75)
    assert s["decode_target_met"] is True
    assert s["extend_geomean_ratio_vs_sdpa_flash"] == pytest.approx(0.9)
    assert s["extend_target_met"] is True
    table = bench_report.format_table(result)
    assert table.splitlines()[0].startswith("kind") and len(table.splitlines()) == 1 + 2 + 2 + 1


def table_rows(markdown: str, heading: str) -> list[list[str]]:
    """The body rows of the first table after ``heading``, as lists of stripped cells."""
    lines = markdown.splitlines()
    start = lines.index(heading)
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|") and not line.startswith("|-"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows[1:]  # without the header row


def test_markdown_report_names_the_setup_and_judges_both_targets():
    result = synthetic_result()
    result["summary"] = bench_report.summarize(result)
    md = bench_report.format_markdown(result)
    assert md.startswith("# Attention kernels on NVIDIA H100 80GB HBM3\n")
    assert "torch 2.11.0+cu130, triton 3.6.0, Python 3.12.3" in md
    assert "`python -m kernels.bench --quick`" in md
    assert "copy **1,000 GB/s**" in md and "matmul **500 TF/s** (bf16)" in md
    targets = table_rows(md, md.splitlines()[0])
    assert targets[0][1:] == ["75%", ">= 70%", "met"]  # 750 of 1000 GB/s at the long context only
    assert targets[1][1:] == ["0.90", ">= 0.80", "met"]
    assert "(min 0.90)" in targets[1][0]
    extend = table_rows(md, "## Extend (prefill over a cached prefix)")
    assert extend == [
        ["1", "0", "8", "90.0", "100.0", "0.90", "18%", "1.2e-03", "64x32/4w/2s", "-", "-", "-", "-", "-"],
        ["1", "8", "8", "70.0", "-", "-", "14%", "-", "-", "-", "-", "-", "-", "-"],
    ]
    decode = table_rows(md, "## Decode (one query token per request)")
    assert decode == [
        ["1", "1024", "100", "-", "-", "10%", *["-"] * 15, "100", "-", "-"],
        [
            "1",
            str(bench_report.LONG_CONTEXT),
            "750",
            "800",
            "0.94",
            "75%",
            *["-"] * 15,
            "750",
            "800",
            "-",
        ],
    ]
    assert md.rstrip().endswith("- extend b=1 prefix=8 new=8: refused")  # why the row has no baseline


def test_markdown_report_says_when_a_target_is_missed_or_unmeasured():
    result = synthetic_result()
    result["decode"][1]["triton_gbs"] = 650.0  # 65% of copy bandwidth
    result["extend"] = [{"batch": 1, "prefix": 0, "new": 8, "triton_tflops": 1.0, "sdpa_error": "refused"}]
    result["decode"][1]["sdpa_kv_expanded"] = True
    result["summary"] = bench_report.summarize(result)
    md = bench_report.format_markdown(result)
    targets = table_rows(md, md.splitlines()[0])
    assert targets[0][1:] == ["65%", ">= 70%", "**missed**"]
    assert targets[1][1:] == ["-", ">= 0.80", "not measured"]
    assert "| 800 (K/V expanded) |" in md


def test_decode_is_judged_on_graph_replays_when_measured():
    result = synthetic_result()
    long_row = result["decode"][1]  # eager: 750 GB/s against SDPA's 800 (launch cost included)
    long_row.update(
        triton_graph_gbs=900.0,
        triton_graph_dirty_gbs=700.0,  # recorded beside, never judged
        triton_fused_graph_gbs=950.0,  # the fused-merge variant: recorded beside, never judged
        triton_stack_graph_gbs=980.0,  # per layer of a replayed stack: recorded beside, never judged
        stack_layers=8,
        triton_pdl_graph_gbs=920.0,  # the PDL candidate, single and stacked: recorded beside, never judged
        triton_pdl_stack_graph_gbs=990.0,
        triton_prefetch_graph_gbs=940.0,  # the prefetch candidate, alone and with PDL, single and stacked:
        triton_prefetch_stack_graph_gbs=960.0,  # recorded beside, never judged
        triton_prefetch_pdl_graph_gbs=945.0,
        triton_prefetch_pdl_stack_graph_gbs=995.0,
        triton_slots_graph_gbs=930.0,  # the slots-ahead candidate, alone and with PDL, single and stacked:
        triton_slots_stack_graph_gbs=985.0,  # recorded beside, never judged
        triton_slots_pdl_graph_gbs=935.0,
        triton_slots_pdl_stack_graph_gbs=1001.0,
        triton_pipelined_graph_gbs=910.0,
        triton_pipelined_stack_graph_gbs=975.0,
        sdpa_graph_gbs=600.0,
        rel_err_vs_sdpa=1e-3,
        rel_err_graph_vs_sdpa=4e-3,
        rel_err_stack_vs_sdpa=2e-3,
        rel_err_fused_vs_sdpa=5e-3,
        rel_err_pdl_vs_sdpa=3e-3,
        rel_err_pdl_stack_vs_sdpa=6e-3,
        rel_err_prefetch_vs_sdpa=2e-3,
        rel_err_prefetch_stack_vs_sdpa=2e-3,
        rel_err_prefetch_pdl_vs_sdpa=7e-3,  # NOTE: the error column shows the worst of the sixteen outputs
        rel_err_prefetch_pdl_stack_vs_sdpa=2e-3,
        **{
            f"rel_err_{name}{stacked}_vs_sdpa": 3e-3
            for name in ("slots", "slots_pdl", "pipelined")
            for stacked in ("", "_stack")
        },
    )
    result["summary"] = s = bench_report.summarize(result)
    assert s["decode_min_fraction_of_copy_bw_at_long_context"] == pytest.approx(0.9)
    assert s["decode_min_fraction_in_layer_stack_at_long_context"] == pytest.approx(0.98)
    assert s["decode_min_fraction_with_pdl_at_long_context"] == pytest.approx(0.92)
    assert s["decode_min_fraction_in_layer_stack_with_pdl_at_long_context"] == pytest.approx(0.99)
    assert s["decode_min_fraction_with_prefetch_at_long_context"] == pytest.approx(0.94)
    assert s["decode_min_fraction_in_layer_stack_with_prefetch_at_long_context"] == pytest.approx(0.96)
    assert s["decode_min_fraction_with_prefetch_pdl_at_long_context"] == pytest.approx(0.945)
    assert s["decode_min_fraction_in_layer_stack_with_prefetch_pdl_at_long_context"] == pytest.approx(0.995)
    assert s["decode_min_fraction_with_slots_at_long_context"] == pytest.approx(0.93)
    assert s["decode_min_fraction_in_layer_stack_with_slots_at_long_context"] == pytest.approx(0.985)
    assert s["decode_min_fraction_with_slots_pdl_at_long_context"] == pytest.approx(0.935)
    assert s["decode_min_fraction_in_layer_stack_with_slots_pdl_at_long_context"] == pytest.approx(1.001)
    assert s["decode_min_fraction_with_pipelined_at_long_context"] == pytest.approx(0.91)
    assert s["decode_min_fraction_in_layer_stack_with_pipelined_at_long_context"] == pytest.approx(0.975)
    md = bench_report.format_markdown(result)
    decode = table_rows(md, "## Decode (one query token per request)")
    assert decode[1] == [
        "1",
        str(bench_report.LONG_CONTEXT),
        "900",
        "600",
        "1.50",
        "90%",
        "980 (8)",
        "920",
        "990",
        "950",
        "940",
        "960",
        "945",
        "995",
        "930",
        "985",
        "935",
        "1,001",
        "910",
        "975",
        "700",
        "750",
        "800",
        "7.0e-03",
    ]
    table = bench_report.format_table(result).splitlines()
    assert "900 GB/s" in table[-2] and "600 GB/s" in table[-2] and "eager 750 GB/s" in table[-2]
    assert table[-2].endswith("stacked 980 GB/s")
    assert "the worst row at context >= 16384 reaches 98% of copy bandwidth" in md
    assert "it reaches 92% in single replays and 99% per layer of a stack" in md
    assert "(DecodeConfig.prefetch, off by default) it reaches 94% in single replays and 96% per layer" in md
    assert "with the prefetch and PDL together 94% and 100%." in md
    assert "(DecodeConfig.prefetch_slots, off by default) 93% and 98%; with PDL too 94% and 100%;" in md
    assert "(decode_attention.PIPELINED_TILES), 91% and 98%." in md
    assert "7.0e-03" in table[-2]
    del long_row["sdpa_graph_gbs"]  # SDPA could not be replayed: no comparison against its eager time
    result["summary"] = bench_report.summarize(result)
    assert table_rows(bench_report.format_markdown(result), "## Decode (one query token per request)")[1][
        3:5
    ] == [
        "-",
        "-",
    ]


def test_extend_rows_show_the_tiles_without_the_prefix_hint_and_judge_their_output_too():
    result = synthetic_result()
    result["extend"].append({
        "batch": 4, "prefix": 16384, "new": 256, "triton_tflops": 200.0, "sdpa_tflops": 180.0,
        "ratio_vs_sdpa": 200 / 180, "rel_err_vs_sdpa": 3e-3, "triton_blind_tflops": 150.0,
        "config": {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
        "config_blind": {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2},
        "rel_err_blind_vs_sdpa": 4e-3, "split_cap": 3, "triton_split_tflops": 400.0, "rel_err_split_vs_sdpa": 2e-3,
    })  # fmt: skip
    result["extend"].append({
        "batch": 1, "prefix": 4096, "new": 256, "triton_tflops": 100.0, "sdpa_tflops": 100.0,
        "ratio_vs_sdpa": 1.0, "rel_err_vs_sdpa": 3e-3, "split_cap": 5, "triton_split_tflops": 50.0,
        "config": {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}, "rel_err_split_vs_sdpa": 2e-3,
    })  # fmt: skip
    result["summary"] = s = bench_report.summarize(result)
    assert s["extend_target_met"] is True
    assert s["extend_split_speedup_geomean"] == pytest.approx(1.0) and s["extend_split_speedup_min"] == 0.5
    md = bench_report.format_markdown(result)
    rows = table_rows(md, "## Extend (prefill over a cached prefix)")
    assert rows[-2] == ["4", "16384", "256", "200.0", "180.0", "1.11", "40%", "4.0e-03", "128x64/8w/3s",
                        "64x32/4w/2s", "150.0", "3", "400.0", "-"]  # fmt: skip
    assert rows[0][-3:] == ["-", "-", "-"]  # a row without the split
    assert "runs at 1.00x the unsplit kernel's TF/s (geomean; min 0.50)" in md
    for name in ("blind", "split"):  # the timed alternative wrote nothing
        result["extend"][-2][f"rel_err_{name}_vs_sdpa"] = float("nan")
        result["summary"] = s = bench_report.summarize(result)
        assert s["extend_target_met"] is False and s["inaccurate"] == ["extend b=4 prefix=16384 new=256"]
        result["extend"][-2][f"rel_err_{name}_vs_sdpa"] = 1e-3
    # a row whose default splits (an eager call over a deep prefix): the unsplit tiles are the alternative,
    # and the speed-up is the split's (the default's) over theirs
    result["extend"][-2].update(
        triton_split_tflops=200.0, triton_unsplit_tflops=160.0, rel_err_unsplit_vs_sdpa=0.5
    )
    result["summary"] = s = bench_report.summarize(result)
    assert s["extend_split_speedup_min"] == 0.5 and s["extend_split_speedup_geomean"] == pytest.approx(
        (1.25 * 0.5) ** 0.5
    )
    assert s["inaccurate"] == ["extend b=4 prefix=16384 new=256"]  # the unsplit alternative is judged too
    rows = table_rows(bench_report.format_markdown(result), "## Extend (prefill over a cached prefix)")
    assert rows[-2][-3:] == ["3", "200.0", "160.0"]


def test_an_unwritten_or_wrong_output_misses_the_target_however_fast():
    result = synthetic_result()
    long_row = result["decode"][1]
    # the replay left its (poisoned) output unwritten: NaN, which must not hide behind the eager error
    long_row.update(triton_graph_gbs=900.0, rel_err_vs_sdpa=1e-3, rel_err_graph_vs_sdpa=float("nan"))
    assert math.isnan(bench_report.decode_error(long_row))
    result["summary"] = s = bench_report.summarize(result)
    assert s["decode_target_met"] is False and s["inaccurate"] == [
        f"decode b=1 ctx={bench_report.LONG_CONTEXT}"
    ]
    assert s["extend_target_met"] is True  # the other kind keeps its verdict
    md = bench_report.format_markdown(result)
    assert "**Inaccurate** (rel err past 2e-02 or NaN): decode b=1" in md
    assert (
        bench_report.format_table(result)
        .splitlines()[-1]
        .endswith(f"INACCURATE: decode b=1 ctx={bench_report.LONG_CONTEXT}")
    )
    long_row["rel_err_graph_vs_sdpa"] = 0.05  # wrong but a number
    result["extend"][0]["rel_err_vs_sdpa"] = 0.03
    result["summary"] = s = bench_report.summarize(result)
    assert s["decode_target_met"] is False and s["extend_target_met"] is False and len(s["inaccurate"]) == 2


def test_a_baseline_that_could_not_be_replayed_says_why():
    result = synthetic_result()
    result["decode"][1].update(
        triton_graph_gbs=900.0, sdpa_graph_error="operation not permitted when stream is capturing"
    )
    result["summary"] = bench_report.summarize(result)
    md = bench_report.format_markdown(result)
    assert f"- decode b=1 ctx={bench_report.LONG_CONTEXT}, replayed: operation not permitted" in md


def test_gpu_slug():
    assert bench.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_bench_without_cuda_exits_nonzero_with_a_message(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert bench.main(["--out", str(out)]) != 0
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not out.exists()


def test_markdown_report_lists_the_compiled_kernels_when_recorded():
    result = synthetic_result()
    result["summary"] = bench_report.summarize(result)
    assert "## Compiled kernels" not in bench_report.format_markdown(result)
    result["compiled"] = [
        {"kernel": "_extend_kernel", "constants": {"GROUP": 4, "BLOCK_M": 128, "BLOCK_N": 64},
         "num_warps": 8, "num_stages": 2, "shared_bytes": 98304, "regs": 232, "spills": 0},
        {"kernel": "_decode_merge_kernel", "constants": {"HEAD_DIM": 128, "BLOCK_S": 64},
         "num_warps": 4, "num_stages": 2, "shared_bytes": 38912, "regs": None, "spills": None},
    ]  # fmt: skip
    md = bench_report.format_markdown(result)
    assert table_rows(md, "## Compiled kernels (as loaded on this GPU)") == [
        ["_extend_kernel", "BLOCK_M=128 BLOCK_N=64", "8", "2", "96.0", "232", "0"],
        ["_decode_merge_kernel", "BLOCK_S=64", "4", "2", "38.0", "-", "-"],
    ]


def test_lora_bytes_count_each_adapters_weights_once():
    weights = bench.LORA_RANK * bench.LORA_IN + bench.LORA_OUT * bench.LORA_RANK
    one = (weights + bench.LORA_IN + 2 * bench.LORA_OUT) * 2
    assert bench.lora_bytes(1, 1, 2) == one
    assert bench.lora_bytes(64, 4, 2) == (4 * weights + 64 * bench.LORA_IN + 2 * 64 * bench.LORA_OUT) * 2


def test_lora_per_adapter_baseline_computes_the_reference_deltas():
    g = torch.Generator().manual_seed(3)
    x, out = torch.randn(7, 24, generator=g), torch.randn(7, 40, generator=g)
    a, b = torch.randn(3, 8, 24, generator=g), torch.randn(3, 40, 8, generator=g)
    slots = torch.tensor([2, 0, 0, 1, 2, 2, 0], dtype=torch.int32)
    rows = [torch.nonzero(slots == s).flatten() for s in range(3)]
    want = reference.lora_add(x, out.clone(), a, b, torch.arange(8, dtype=torch.int32), slots)
    torch.testing.assert_close(bench.lora_per_adapter(x, out.clone(), a, b, rows), want, rtol=1e-4, atol=1e-4)


def test_markdown_report_has_the_lora_table_when_measured():
    result = synthetic_result()
    result["lora"] = [{"batch": 64, "adapters": 4, "triton_graph_ms": 0.02, "triton_graph_gbs": 500.0,
                       "torch_graph_ms": 0.08, "triton_ms": 0.1, "torch_ms": 0.3, "rel_err_vs_torch": 0.004,
                       "segments": 64, "triton_per_request_graph_ms": 0.021, "triton_no_pdl_graph_ms": 0.018,
                       "rel_err_no_pdl_vs_torch": 0.005, "triton_batched_graph_ms": 0.0165,
                       "rel_err_batched_vs_torch": 0.006, "triton_narrow_graph_ms": 0.017,
                       "rel_err_narrow_vs_torch": 0.004, "triton_former_graph_ms": 0.0155,
                       "rel_err_former_vs_torch": 0.007},
                      {"batch": 64, "adapters": 1, "triton_graph_ms": 0.01, "triton_graph_gbs": 900.0,
                       "torch_graph_ms": 0.02, "triton_ms": 0.1, "torch_ms": 0.2, "rel_err_vs_torch": 0.003}]  # fmt: skip
    result["summary"] = bench_report.summarize(result)
    md = bench_report.format_markdown(result)
    rows = table_rows(md, "## LoRA deltas (kernels/lora.py), one decode step's gate/up projection")
    assert rows == [["64", "4", "64", "20.0", "500", "50%", "21.0", "18.0", "17.0", "15.5", "16.5", "80.0",
                     "4.00", "100.0", "300.0", "7.0e-03"],
                    ["64", "1", "-", "10.0", "900", "90%", "-", "-", "-", "-", "-", "20.0", "2.00", "100.0",
                     "200.0", "3.0e-03"]]  # fmt: skip
    assert "## LoRA" not in bench_report.format_markdown(synthetic_result() | {"summary": result["summary"]})
    assert bench_report.lora_candidates_summary(result["lora"]) in md.splitlines()


def test_the_lora_summary_counts_the_rows_each_candidate_wins():
    """Rule for a new LoRA default: a candidate that wins on every row. The summary gives the count of rows
    each candidate won and its geomean speedup, in LORA_CANDIDATES' order."""
    rows = [
        {"triton_graph_ms": 0.02, "triton_narrow_graph_ms": 0.016, "triton_former_graph_ms": 0.015,
         "triton_no_pdl_graph_ms": 0.021},
        {"triton_graph_ms": 0.01, "triton_narrow_graph_ms": 0.009, "triton_former_graph_ms": 0.0105},
        {"triton_graph_ms": 0.03},
    ]  # fmt: skip
    assert bench_report.lora_candidates_summary(rows) == (
        "Against the default's replay: without PDL faster on 0 of 1 rows, 0.95x; 128-column faster on 2 of 2"
        " rows, 1.18x; 128-column without PDL faster on 1 of 2 rows, 1.13x."
    )
    assert (
        bench_report.lora_candidates_summary(rows[2:]) == "Against the default's replay: no candidate timed."
    )


def test_verify_bytes_count_each_requests_kv_once():
    model = bench.Model(32, 8, 128, "bf16")
    shape = bench.ExtendShape(batch=2, prefix=100, new=5)
    kv = 2 * 105 * 8 * 128 * 2  # K and V of every position, prefix and new
    assert bench.verify_bytes(shape, model) == (kv + 2 * 2 * 5 * 32 * 128) * 2


def test_markdown_report_has_the_verify_table_and_flags_a_wrong_row():
    result = synthetic_result()
    result["verify"] = [
        {"batch": 1, "prefix": 4096, "new": 5, "block_rows": 32, "short_graph_ms": 0.02, "short_graph_gbs": 600.0,
         "extend_graph_ms": 0.1, "rel_err_vs_extend": 0.002, "short_pdl_graph_ms": 0.018,
         "rel_err_pdl_vs_extend": 0.003, "short_narrow_graph_ms": 0.03, "rel_err_narrow_vs_extend": 0.001,
         "short_slots_graph_ms": 0.019, "rel_err_slots_vs_extend": 0.002},
        {"batch": 4, "prefix": 8192, "new": 16, "block_rows": 32, "short_graph_ms": 0.05, "short_graph_gbs": 900.0,
         "extend_graph_ms": 0.3, "rel_err_vs_extend": 0.002, "short_narrow_graph_ms": 0.1,
         "rel_err_narrow_vs_extend": 0.001, "short_wide_graph_ms": 0.04, "rel_err_wide_vs_extend": 0.001},
        {"batch": 16, "prefix": 4096, "new": 5, "short_graph_ms": 0.2, "short_graph_gbs": 900.0,
         "extend_graph_ms": 0.5, "rel_err_vs_extend": float("nan")},
        {"batch": 4, "prefix": 4096, "new": 5, "short_graph_ms": 0.1, "short_graph_gbs": 900.0,
         "extend_graph_ms": 0.3, "rel_err_vs_extend": 0.002, "short_pdl_graph_ms": 0.09,
         "rel_err_pdl_vs_extend": float("nan")},  # the candidate left its output unwritten
        {"batch": 8, "prefix": 4096, "new": 5, "block_rows": 32, "short_graph_ms": 0.1, "short_graph_gbs": 900.0,
         "extend_graph_ms": 0.3, "rel_err_vs_extend": 0.002, "short_narrow_graph_ms": 0.09,
         "rel_err_narrow_vs_extend": float("nan")},  # and the 16-row candidate
    ]  # fmt: skip
    result["summary"] = bench_report.summarize(result)
    md = bench_report.format_markdown(result)
    rows = table_rows(md, "## Verify steps: few new tokens per request over a long prefix")
    assert rows[0] == ["1", "4096", "5", "32", "20.0", "600", "60%", "100.0", "5.00", "18.0", "19.0", "30.0",
                       "-", "3.0e-03"]  # fmt: skip
    assert rows[1][-4:] == ["-", "100.0", "40.0", "2.0e-03"]
    assert rows[2][3] == "-" and rows[2][-5:] == ["-", "-", "-", "-", "nan"]
    assert result["summary"]["inaccurate"] == [
        "verify b=16 prefix=4096 new=5",
        "verify b=4 prefix=4096 new=5",
        "verify b=8 prefix=4096 new=5",
    ]
    # each candidate's time over the default's: 16 rows 0.03 / 0.02, 0.1 / 0.05 and 0.09 / 0.1; 64 rows 0.04 / 0.05
    s = result["summary"]
    assert s["verify_default_over_narrow_min"] == pytest.approx(0.9)
    assert s["verify_default_over_narrow_max"] == pytest.approx(2.0)
    assert s["verify_default_over_wide_min"] == s["verify_default_over_wide_max"] == pytest.approx(0.8)
    assert s["verify_default_over_slots_min"] == s["verify_default_over_slots_max"] == pytest.approx(0.95)


# NOTE: full tier: the command's test below runs a row of every kind, extend and LoRA among them; this one the
# extend rows' tile choices, the prefix split and the fp8 pool, and every LoRA candidate's output
@SLOW
def test_the_gpu_rows_run_end_to_end_on_the_interpreter(backend, monkeypatch):
    """bench_extend and bench_lora (GPU-only in the command) on the interpreter: the CUDA graphs re-run
    their calls and the host clock times them. The numbers mean nothing; every output is checked
    against its baseline, and the rows have their fields, the long-prefix tiles' too. (The decode and
    verify rows: the command's test below.)"""
    if not backend.interpret:
        pytest.skip("on CUDA, python -m kernels.bench runs these rows for real")
    from kernels import extend_attention as ext
    from kernels import timing

    def once(fn, **_):  # NOTE: one run on the host clock (kernels.timing's own CPU path: test_timing)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    monkeypatch.setattr(
        timing, "capture", lambda fn: (fn(), type("Rerun", (), {"replay": staticmethod(fn)}))[1]
    )
    monkeypatch.setattr(timing, "time_ms", once)
    monkeypatch.setattr(timing, "time_replay_ms", once)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "TIMELINE_REPS", 1)
    cpu, gen = torch.device("cpu"), torch.Generator().manual_seed(0)

    # the compiled sm_90 tile choice, with LONG_PREFIX lowered to this shape's prefix
    choose = ext.default_config
    monkeypatch.setattr(ext, "device_arch", lambda device: 90)
    monkeypatch.setattr(ext, "LONG_PREFIX", 32)

    def compiled_choice(*args):
        monkeypatch.setattr(ext, "INTERPRETED", False)
        try:
            return choose(*args)
        finally:
            monkeypatch.setattr(ext, "INTERPRETED", True)

    monkeypatch.setattr(ext, "default_config", compiled_choice)
    # 4 programs for 4 "SMs" x 2 waves, a prefix of two 256-token parts: the prefix split is timed too
    row = bench.bench_extend(bench.ExtendShape(1, 300, 20), bench.Model(4, 2, 128, "fp16"), cpu, gen)
    unsplit = {"split_prefix": False, "min_split_len": 256, "packed_blocks": False}
    assert row["config"] == {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3} | unsplit
    assert row["config_blind"] == {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2} | unsplit
    assert row["triton_blind_tflops"] > 0 and row["split_cap"] == 2 and row["triton_split_tflops"] > 0
    assert row["triton_unsplit_tflops"] == row["triton_tflops"]  # the default
    assert max(row[f"rel_err_{name}vs_sdpa"] for name in ("", "blind_", "split_")) < 2e-3
    # with the eager split's threshold at this prefix the default splits: the unsplit tiles are timed instead
    monkeypatch.setattr(ext, "EAGER_SPLIT_MIN_PREFIX", 300)
    split = bench.bench_extend(bench.ExtendShape(1, 300, 20), bench.Model(4, 2, 128, "fp16"), cpu, gen)
    assert split["config"] == row["config"] | {"split_prefix": True}
    assert split["triton_split_tflops"] == split["triton_tflops"] and split["triton_unsplit_tflops"] > 0
    assert split["rel_err_unsplit_vs_sdpa"] < 2e-3 and "rel_err_split_vs_sdpa" not in split
    monkeypatch.setattr(ext, "EAGER_SPLIT_MIN_PREFIX", ext.DEEP_PREFIX)
    # the same prefix in an fp8 pool (sm_90: e4m3), against SDPA over the widened values
    assert row["fp8_pool"] == "float8_e4m3fn" and row["triton_fp8_tflops"] > 0 and row["fp8_speedup"] > 0
    assert row["rel_err_fp8_vs_sdpa"] < 2e-3

    monkeypatch.setattr(bench, "LORA_IN", 64)
    monkeypatch.setattr(bench, "LORA_OUT", 48)
    monkeypatch.setattr(bench, "LORA_RANK", 8)
    joined, mixed = bench.bench_lora(20, 1, MODEL, cpu, gen), bench.bench_lora(20, 4, MODEL, cpu, gen)
    assert (joined["segments"], mixed["segments"]) == (2, 4)  # one adapter: 16 + 4 rows; four: 5 rows each
    for row in joined, mixed:
        assert row["rel_err_vs_torch"] < 1e-5 and row["triton_per_request_graph_ms"] > 0
        assert row["triton_former_graph_ms"] > 0 and bench_report.lora_error(row) < 1e-5
    # every row profiled; off CUDA the profiler sees no kernels
    assert (
        joined["timeline"] == mixed["timeline"] == dict.fromkeys(["default", *bench_report.LORA_CANDIDATES])
    )
    for row in joined, mixed:  # every candidate timed and right: launched plainly, 128 columns, both, batched
        for name in bench_report.LORA_CANDIDATES:
            assert row[f"triton_{name}_graph_ms"] > 0 and row[f"rel_err_{name}_vs_torch"] < 1e-5, name


def test_two_runs_compare_shape_by_shape_with_times_inverted(tmp_path, capsys):
    before = synthetic_result()
    after = synthetic_result()
    after["device"]["copy_gbs"] = 1500.0
    after["extend"][0]["triton_tflops"] = 180.0  # twice the TF/s: 2.00
    after["decode"][1]["triton_graph_gbs"] = 900.0
    before["decode"][1]["triton_graph_gbs"] = 600.0  # 1.50
    # NOTE: decode's first row has no replayed rate in either run: left out
    before["lora"] = [{"batch": 64, "adapters": 1, "triton_graph_ms": 0.04}]
    after["lora"] = [{"batch": 64, "adapters": 1, "triton_graph_ms": 0.01}, {"batch": 1, "adapters": 1,
                                                                           "triton_graph_ms": 0.01}]  # fmt: skip
    md = bench_report.compare_markdown(before, after)
    assert "Copy bandwidth 1,000 against 1,500 GB/s." in md
    assert table_rows(md, "## extend: triton_tflops") == [
        ["1", "0", "8", "90", "180", "2.00"],
        ["1", "8", "8", "70", "70", "1.00"],
    ]
    assert table_rows(md, "## decode: triton_graph_gbs") == [["1", "16384", "600", "900", "1.50"]]
    assert "triton_pdl_graph_gbs" not in md  # measured by neither run
    assert table_rows(md, "## lora: triton_graph_ms") == [
        ["64", "1", "0.04", "0.01", "4.00"]
    ]  # a time: 4x faster
    assert "## verify" not in md  # measured by neither run
    paths = [tmp_path / "before.json", tmp_path / "after.json"]
    for path, doc in zip(paths, (before, after), strict=True):
        path.write_text(json.dumps(doc))
    assert bench_report.main(["--compare", *map(str, paths)]) == 0
    assert capsys.readouterr().out == md
    before["decode"][1]["triton_pdl_graph_gbs"], after["decode"][1]["triton_pdl_graph_gbs"] = 700.0, 1400.0
    pdl = table_rows(bench_report.compare_markdown(before, after), "## decode: triton_pdl_graph_gbs")
    assert pdl == [["1", "16384", "700", "1400", "2.00"]]


def test_an_interrupted_run_keeps_the_rows_measured_so_far(monkeypatch):
    """scripts/gpu-bench's deadline interrupts kernels.bench with SIGINT: the rows measured before it stay,
    the kinds not reached are empty, and the report says where the run stopped."""
    order = []

    def measured(kind, row, interrupt=False):
        def measure(rows, *args):
            order.append(kind)
            rows.extend([row] if row else [])
            if interrupt:
                raise KeyboardInterrupt

        return measure

    decode_row = {"batch": 1, "context": bench_report.LONG_CONTEXT, "triton_gbs": 800.0}
    extend_row = {"batch": 1, "prefix": 0, "new": 8, "triton_tflops": 90.0}
    monkeypatch.setattr(bench, "MEASURE", {
        "decode": measured("decode", decode_row), "extend": measured("extend", extend_row, interrupt=True),
        "lora": measured("lora", {}), "verify": measured("verify", {}),
    })  # fmt: skip
    result = {k: v for k, v in synthetic_result().items() if k not in bench.KINDS}
    bench.measure_kinds(result, ["verify", "extend", "decode", "lora"], None)
    assert order == ["decode", "extend"]  # decode first; nothing after the interruption
    assert result["decode"] == [decode_row] and result["extend"] == [extend_row]
    assert result["lora"] == result["verify"] == [] and result["interrupted"] == "during extend"
    result["summary"] = bench_report.summarize(result)
    md = bench_report.format_markdown(result)
    assert "**Interrupted** during extend (a deadline)" in md and "Measured only" not in md
    assert table_rows(md, "## Decode (one query token per request)")[0][:3] == ["1", "16384", "800"]

    order.clear()
    result = {k: v for k, v in synthetic_result().items() if k not in bench.KINDS}
    bench.measure_kinds(result, ["lora", "decode"], None)
    assert order == ["decode", "lora"] and "interrupted" not in result and result["extend"] == []
    result["summary"] = bench_report.summarize(result)
    md = bench_report.format_markdown(result)
    assert "Measured only: decode, lora (--only)" in md and "Interrupted" not in md
    assert bench.parse_args(["--only", "decode", "verify"]).only == ["decode", "verify"]
    assert bench.parse_args([]).only == list(bench.KINDS)


def test_split_merge_times_pair_each_split_with_the_merge_after_it():
    spans = [
        ("flush_kernel", 0.0, 50.0),
        ("_decode_merge_kernel", 51.0, 52.0),  # no split before it: left out
        ("_decode_split_kernel", 60.0, 90.0),
        ("_decode_merge_kernel", 92.0, 95.0),  # 2 us after the split
        ("_decode_merge_kernel", 96.0, 97.0),  # a second merge after one split: left out
        ("flush_kernel", 100.0, 150.0),
        ("_decode_split_kernel", 200.0, 232.0),
        ("_decode_merge_kernel", 230.0, 236.0),  # started 2 us before the split ended (PDL)
        ("_decode_split_kernel", 300.0, 330.0),  # no merge after it: left out
    ]
    got = bench.split_merge_times(spans, "_decode_split_kernel", "_decode_merge_kernel")
    assert got == {"pairs": 2, "split_us": 31.0, "merge_us": 4.5, "gap_us": 0.0, "span_us": 35.5}
    assert bench.split_merge_times(spans[:2], "_decode_split_kernel", "_decode_merge_kernel") is None
    # the merge fused into the split kernel: every split kernel alone
    got = bench.split_merge_times(spans, "_decode_split_kernel", None)
    assert got == {"pairs": 3, "split_us": 30.0, "merge_us": None, "gap_us": None, "span_us": 30.0}
    assert bench.split_merge_times(spans[:2], "_decode_split_kernel", None) is None


def test_the_profiler_sees_every_replayed_split_and_merge(backend):
    """On CUDA: the profiler records the kernels a replayed graph runs, under their Triton names."""
    if not backend.is_cuda:
        pytest.skip("the CUDA profiler needs CUDA")
    dec = backend.module("decode_attention")
    args, _ = bench.decode_case(
        bench.DecodeShape(1, 4096), MODEL, backend.device, torch.Generator().manual_seed(0)
    )
    out = torch.empty_like(args[0])
    graph = timing.capture(lambda: dec.decode_attention(*args, max_kv_len=4096, out=out))
    spans = timing.profile_kernels(graph.replay, backend.device, reps=5)
    got = bench.split_merge_times(spans, "_decode_split_kernel", "_decode_merge_kernel")
    assert got is not None and got["pairs"] == 5, spans
    assert got["split_us"] > 0 and got["merge_us"] > 0 and got["span_us"] >= got["split_us"]
    fused = dataclasses.replace(dec.default_config(128, args[0].dtype), fused_merge=True)
    graph = timing.capture(lambda: dec.decode_attention(*args, max_kv_len=4096, out=out, config=fused))
    spans = timing.profile_kernels(graph.replay, backend.device, reps=5)
    assert not any("_decode_merge_kernel" in name for name, _, _ in spans), spans
    got = bench.split_merge_times(spans, "_decode_split_kernel", None)
    assert got is not None and got["pairs"] == 5 and got["span_us"] == got["split_us"] > 0, spans


def test_candidates_are_set_against_the_default_on_their_own_rows():
    """Single replays against the default's single replay, stacked ones against its stack; the target's
    row apart, the least of the others with the row it is on; rows without a candidate's time skipped."""
    long = bench_report.LONG_CONTEXT
    rows = [
        {"batch": 1, "context": long, "triton_graph_ms": 0.0338, "triton_stack_graph_ms": 0.0309,
         "triton_prefetch_graph_ms": 0.0312, "triton_prefetch_stack_graph_ms": 0.0300},
        {"batch": 8, "context": 1024, "triton_graph_ms": 0.010, "triton_stack_graph_ms": 0.008,
         "triton_prefetch_graph_ms": 0.0125, "triton_prefetch_stack_graph_ms": 0.0080},
        {"batch": 32, "context": long, "triton_graph_ms": 0.200, "triton_stack_graph_ms": 0.190,
         "triton_prefetch_graph_ms": 0.190, "triton_prefetch_stack_graph_ms": 0.200},
        {"batch": 1, "context": 1024, "triton_graph_ms": 0.006},  # no candidate timed here
    ]  # fmt: skip
    got = bench_report.candidate_speedups(rows)
    assert set(got) == {"prefetch", "prefetch_stack"}
    assert got["prefetch"]["at_batch_1_long_context"] == pytest.approx(0.0338 / 0.0312)
    assert got["prefetch"]["min_elsewhere"] == pytest.approx(0.8)
    assert got["prefetch"]["min_elsewhere_shape"] == "b=8 ctx=1024"
    assert got["prefetch_stack"]["at_batch_1_long_context"] == pytest.approx(0.0309 / 0.0300)
    assert got["prefetch_stack"]["min_elsewhere"] == pytest.approx(0.95)
    assert got["prefetch_stack"]["min_elsewhere_shape"] == f"b=32 ctx={long}"
    # apart by the default's tile regime: below MANY_REQUESTS (the target's row apart) and from it
    from kernels import decode_attention as dec

    assert bench_report.MANY_REQUESTS == dec.MANY_REQUESTS
    assert got["prefetch"]["min_elsewhere_below_many_requests"] == pytest.approx(0.8)
    assert got["prefetch"]["min_from_many_requests"] == got["prefetch"]["max_from_many_requests"]
    assert got["prefetch"]["max_from_many_requests"] == pytest.approx(0.200 / 0.190)
    assert got["prefetch_stack"]["min_elsewhere_below_many_requests"] == pytest.approx(1.0)
    assert got["prefetch_stack"]["min_from_many_requests"] == pytest.approx(0.95)
    only_long = bench_report.candidate_speedups(rows[:1])["prefetch"]
    assert only_long["min_elsewhere"] is None and only_long["min_elsewhere_shape"] is None
    assert (
        only_long["min_elsewhere_below_many_requests"] is None and only_long["max_from_many_requests"] is None
    )
    result = synthetic_result()
    result["decode"] = rows
    for r in rows:
        r |= {"triton_gbs": 100.0, "triton_graph_gbs": 1.0 / r["triton_graph_ms"]}
    result["summary"] = bench_report.summarize(result)
    md = bench_report.format_markdown(result)
    assert table_rows(md, "### Decode candidates against the default") == [
        ["prefetch", "1.083", "0.800", "b=8 ctx=1024", "0.800", "1.053", "1.053"],
        ["prefetch_stack", "1.030", "0.950", f"b=32 ctx={long}", "1.000", "0.950", "0.950"],
    ]
    result["decode"] = synthetic_result()["decode"]  # no candidate timed: no such table
    result["summary"] = bench_report.summarize(result)
    assert "Decode candidates against the default" not in bench_report.format_markdown(result)


def test_markdown_report_has_the_batch_1_timeline_when_profiled():
    result = synthetic_result()
    long_row = result["decode"][1]
    long_row.update(triton_graph_ms=0.0338, triton_pdl_graph_ms=0.031, timeline={
        "default": {"pairs": 20, "split_us": 25.0, "merge_us": 2.5, "gap_us": 1.5, "span_us": 29.0},
        "pdl": {"pairs": 20, "split_us": 25.0, "merge_us": 3.0, "gap_us": -1.0, "span_us": 27.0},
        "fused": {"pairs": 20, "split_us": 34.0, "merge_us": None, "gap_us": None, "span_us": 34.0},
    })  # fmt: skip
    long_row["triton_fused_graph_ms"] = 0.039
    result["decode"][0]["timeline_error"] = "RuntimeError: CUPTI unavailable"
    result["summary"] = bench_report.summarize(result)
    md = bench_report.format_markdown(result)
    assert table_rows(md, "### Batch-1 calls, kernel by kernel") == [
        ["16384", "default", "33.8", "25.0", "1.5", "2.5", "29.0", "4.8"],
        ["16384", "pdl", "31.0", "25.0", "-1.0", "3.0", "27.0", "4.0"],
        ["16384", "fused", "39.0", "34.0", "-", "-", "34.0", "5.0"],
    ]
    assert "- context=1024: RuntimeError: CUPTI unavailable" in md and "one element replays in" not in md
    result["device"]["graph_floor_us"] = 4.25
    assert "a graph of one kernel on one element replays in 4.2 us here" in bench_report.format_markdown(
        result
    )
    assert "kernel by kernel" not in bench_report.format_markdown(
        synthetic_result() | {"summary": result["summary"]}
    )
    assert "plain read" not in md
    nbytes = 67_190_784  # batch 1 x 16k on the 8B shape; copy bandwidth 1000 GB/s here
    long_row.update(bytes=nbytes, triton_graph_gbs=nbytes / 33.8e-6 / 1e9, read_graph_ms=0.0275,
                    read_graph_gbs=nbytes / 27.5e-6 / 1e9)  # fmt: skip
    result["decode"][0]["read_error"] = "OutOfMemoryError: CUDA out of memory"
    md = bench_report.format_markdown(result)
    assert table_rows(md, "### Batch-1 calls beside one plain read of the same bytes") == [
        ["16384", "67.2", "33.8", "199%", "27.5", "244%", "1.23"],
    ]
    assert "The plain read failed on these rows:\n\n- context=1024: OutOfMemoryError" in md
    # LoRA rows: each one's shrink and expand, in the LoRA section
    lora_row = {"batch": 1, "adapters": 1, "triton_graph_ms": 0.0127, "triton_graph_gbs": 170.0,
                "torch_graph_ms": 0.02, "triton_ms": 0.1, "torch_ms": 0.2, "rel_err_vs_torch": 0.004,
                "timeline": {"default": {"pairs": 20, "split_us": 4.0, "merge_us": 3.5, "gap_us": 1.0,
                                         "span_us": 8.5}, "pdl": None}}  # fmt: skip
    many = lora_row | {"batch": 64, "adapters": 4, "triton_graph_ms": 0.0403, "timeline": {
        "default": {"pairs": 20, "split_us": 6.0, "merge_us": 28.0, "gap_us": 0.5, "span_us": 34.5}}}  # fmt: skip
    result["lora"] = [lora_row, many]
    md = bench_report.format_markdown(result)
    assert table_rows(md, "### LoRA deltas, kernel by kernel") == [
        ["1 x 1", "default", "12.7", "4.0", "1.0", "3.5", "8.5", "4.2"],
        ["64 x 4", "default", "40.3", "6.0", "0.5", "28.0", "34.5", "5.8"],
    ]
    assert "| requests x adapters | variant | replay us | shrink us | gap us | expand us |" in md


def test_the_command_runs_every_kind_and_writes_its_reports(
    backend, monkeypatch, tmp_path, gpu_command_on_cpu
):
    """main() end to end on the interpreter, CUDA's parts stood in for (the device, its properties,
    the rates it measures, the timers) and each kind cut to one or two shapes: every kind has its
    rows, the summary and both reports are written, so a GPU call cannot fail on the command itself."""
    if not backend.interpret:
        pytest.skip("on CUDA, python -m kernels.bench runs for real")

    monkeypatch.setattr(bench, "decode_grid", lambda *args: [bench.DecodeShape(1, 40)])
    monkeypatch.setattr(bench, "extend_grid", lambda *args: [bench.ExtendShape(1, 24, 8)])
    monkeypatch.setattr(bench, "EXTEND_CACHE_HITS", ((1, 40, 4),))
    monkeypatch.setattr(bench, "LORA_BATCHES", (2,))
    monkeypatch.setattr(bench, "LORA_ADAPTERS", (1,))
    monkeypatch.setattr(bench, "LORA_IN", 64)
    monkeypatch.setattr(bench, "LORA_OUT", 48)
    monkeypatch.setattr(bench, "LORA_RANK", 8)
    # GQA 2 x 17 tokens: two blocks of 32 rows, so the 16-row and 64-row candidates are timed too
    monkeypatch.setattr(bench, "VERIFY_SHAPES", ((2, 40, 17),))
    monkeypatch.setattr(bench, "TIMELINE_REPS", 1)
    monkeypatch.setattr(bench, "stack_layers", lambda kv_bytes: 2)  # NOTE: interpreter time (8 on a GPU)
    out = tmp_path / "kernels.json"
    argv = ["--q-heads", "4", "--kv-heads", "2", "--head-dim", "64", "--dtype", "fp16", "--out", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["device"]["name"] == "CPU stand-in" and result["device"]["copy_gbs"] == 100.0
    assert [len(result[kind]) for kind in bench_report.KINDS] == [1, 2, 1, 1]  # extend: the grid and a hit
    assert result["summary"]["inaccurate"] == []
    row = result["decode"][0]
    assert row["stack_layers"] == 2 and row["triton_stack_graph_gbs"] > 0
    # batch 1: profiled too; off CUDA the profiler records no kernels, so neither variant has a timeline
    assert row["timeline"] == {
        "default": None,
        "pdl": None,
        "prefetch": None,
        "prefetch_pdl": None,
        "slots": None,
        "slots_pdl": None,
        "pipelined": None,
        "fused": None,
    }
    assert row["read_graph_gbs"] > 0 and "read_error" not in row  # and beside one plain read of its bytes
    assert bench_report.DECODE_CANDIDATES == ("fused", "pdl", "prefetch", "prefetch_pdl", "slots", "slots_pdl",
                                              "pipelined", "pdl_stack", "prefetch_stack", "prefetch_pdl_stack",
                                              "slots_stack", "slots_pdl_stack", "pipelined_stack")  # fmt: skip
    for name in bench_report.DECODE_CANDIDATES:  # NOTE: PDL falls back to plain launches here
        assert row[f"triton_{name}_graph_gbs"] > 0 and row[f"rel_err_{name}_vs_sdpa"] < 3e-3, name
    assert bench_report.decode_error(row) < 3e-3  # fp16
    row = result["verify"][0]
    assert row["block_rows"] == 32 and row["short_pdl_graph_ms"] > 0
    assert all(row[f"short_{name}_graph_ms"] > 0 for name in bench_report.VERIFY_CANDIDATES)
    assert {f"rel_err_{name}_vs_extend" for name in bench_report.VERIFY_CANDIDATES} <= row.keys()
    assert bench_report.verify_error(row) < 3e-3
    assert "# Attention kernels on CPU stand-in" in out.with_suffix(".md").read_text()


# NOTE: full tier: a decode row's candidates run in the command's test; this is one tile choice's rule
@SLOW
def test_a_decode_row_whose_default_tiles_are_the_pipelined_ones_times_slots_once(
    backend, monkeypatch, gpu_command_on_cpu
):
    """Where the default already has PIPELINED_TILES' tiles (sm_90 from MANY_REQUESTS requests), "pipelined"
    would be "slots" again: the row times "slots", single and stacked, and no "pipelined" at all."""
    from kernels import decode_attention as dec

    if not backend.interpret:
        pytest.skip("on CUDA, python -m kernels.bench runs for real")
    tiles = dec.DecodeConfig(block_n=64, min_split_len=16, num_warps=1, num_stages=3)
    monkeypatch.setattr(dec, "default_config", lambda *args, **kwargs: tiles)
    monkeypatch.setattr(bench, "stack_layers", lambda kv_bytes: 2)
    row = bench.bench_decode(
        bench.DecodeShape(2, 40), MODEL, torch.device("cpu"), torch.Generator().manual_seed(5)
    )
    assert row["triton_slots_graph_gbs"] > 0 and row["triton_slots_stack_graph_gbs"] > 0
    assert row["rel_err_slots_vs_sdpa"] < 3e-3 and row["rel_err_slots_stack_vs_sdpa"] < 3e-3
    assert not [key for key in row if "pipelined" in key], row


def test_the_fp8_pool_row_runs_on_the_interpreter_and_reports_against_the_16_bit_pool(backend, monkeypatch):
    """measure_fp8_pool (GPU-only in the command) on the interpreter, timed by the host clock: the fp8
    pool's bytes count one a K/V value, its output matches SDPA over the widened values, and the report
    and summary carry it; an fp8 row that failed is shown as failed."""
    if not backend.interpret:
        pytest.skip("on CUDA, python -m kernels.bench runs this row for real")
    monkeypatch.setattr(
        timing, "capture", lambda fn: (fn(), type("Rerun", (), {"replay": staticmethod(fn)}))[1]
    )
    monkeypatch.setattr(timing, "time_ms", lambda fn, **_: (fn(), 2.0)[1])
    shape, model = bench.DecodeShape(2, 40), dataclasses.replace(MODEL, dtype="fp16")
    kernel_args, _ = bench.decode_case(shape, model, torch.device("cpu"), torch.Generator().manual_seed(4))
    row = {"batch": 2, "context": bench_report.LONG_CONTEXT, "triton_graph_ms": 3.0, "triton_gbs": 500.0}
    bench.measure_fp8_pool(row, shape, model, kernel_args, torch.device("cpu"))
    assert row["fp8_pool"] == "float8_e4m3fn"  # device_arch: 90 off CUDA
    assert (
        row["fp8_bytes"] == bench.decode_bytes(shape, model, 4, kv_bytes=1) < bench.decode_bytes(shape, model)
    )
    assert row["triton_fp8_graph_gbs"] == pytest.approx(row["fp8_bytes"] / 2e-3 / 1e9)
    assert row["fp8_speedup"] == pytest.approx(1.5)
    assert row["triton_fp8_stack_graph_ms"] > 0 and row["rel_err_fp8_vs_sdpa"] < 3e-3
    result = synthetic_result()
    result["decode"] = [row, {"batch": 8, "context": 1024, "triton_gbs": 90.0, "triton_fp8_error": "boom"}]
    result["summary"] = s = bench_report.summarize(result)
    assert s["decode_fp8_speedup_min_at_long_context"] == pytest.approx(1.5)
    assert s["decode_fp8_min_fraction_of_copy_bw_at_long_context"] == pytest.approx(
        row["triton_fp8_graph_gbs"] / 1000.0
    )
    assert s["inaccurate"] == []
    rows = table_rows(bench_report.format_markdown(result), "### fp8 KV pool (float8_e4m3fn)")
    assert rows[0][:3] == ["2", str(bench_report.LONG_CONTEXT), f"{row['triton_fp8_graph_gbs']:,.0f}"]
    assert rows[0][6] == "1.50x" and rows[1][2] == "boom"
    row["rel_err_fp8_vs_sdpa"] = 0.5  # a wrong fp8 row is named, however fast
    assert bench_report.summarize(result)["inaccurate"] == [f"decode fp8 b=2 ctx={bench_report.LONG_CONTEXT}"]
    # extend rows over an fp8 prefix: their own table and the summary's speed-ups
    result["extend"][1].update(fp8_pool="float8_e4m3fn", triton_fp8_ms=1.0, triton_fp8_tflops=80.0, fp8_speedup=0.8,
                               rel_err_fp8_vs_sdpa=1e-3)  # fmt: skip
    s = bench_report.summarize(result)
    assert s["extend_fp8_speedup_min"] == s["extend_fp8_speedup_geomean"] == pytest.approx(0.8)
    extend_rows = table_rows(
        bench_report.format_markdown(result), "### Extend over an fp8 KV pool (float8_e4m3fn)"
    )
    assert extend_rows == [["1", "8", "8", "80.0", "0.80x", "1.0e-03"]]


# NOTE: full tier: the fp8 pool row runs in the default tier (the test above); this one its candidates
@SLOW
def test_the_fp8_pool_row_times_the_candidates_beside_the_default_under_a_bf16_query(backend, monkeypatch):
    """Under a bf16 q, measure_fp8_pool also replays fp8_candidates: the default with its widening to fp16
    flipped, FP8_SHORT_TILES where default_config takes the fp8 pools' tiles, and the default with PDL
    flipped (device_arch: 90 off CUDA; the interpreter launches it plainly), and the default with its slots
    loaded a tile ahead; each output against
    SDPA, the default's speed-up over each, the table's columns and the summary's least; a candidate
    that fails is recorded and shown, and the row keeps the default's numbers."""
    from kernels import decode_attention as dec

    if not backend.interpret:
        pytest.skip("on CUDA, python -m kernels.bench runs this row for real")
    monkeypatch.setattr(
        timing, "capture", lambda fn: (fn(), type("Rerun", (), {"replay": staticmethod(fn)}))[1]
    )
    times = iter([2.0, 4.0, 1.6, 2.5, 2.2, 1.9])  # NOTE: the default alone, its stack, then each candidate
    monkeypatch.setattr(timing, "time_ms", lambda fn, **_: (fn(), next(times))[1])
    monkeypatch.setattr(dec, "takes_fp8_tiles", lambda *a: True)  # the interpreter's default is its tiny tile
    configs = []
    decode = dec.decode_attention
    monkeypatch.setattr(
        dec, "decode_attention", lambda *a, **k: (configs.append(k.get("config")), decode(*a, **k))[1]
    )
    shape, model = bench.DecodeShape(2, 40), dataclasses.replace(MODEL, dtype="bf16")
    kernel_args, _ = bench.decode_case(shape, model, torch.device("cpu"), torch.Generator().manual_seed(4))
    row = {"batch": 2, "context": bench_report.LONG_CONTEXT, "triton_graph_ms": 3.0, "triton_gbs": 500.0}
    bench.measure_fp8_pool(row, shape, model, kernel_args, torch.device("cpu"))
    default = dec.default_config(128, torch.bfloat16)
    assert not default.fp8_f16 and not any(c is not None for c in configs[:1])
    assert dataclasses.replace(default, fp8_f16=True) in configs and dec.FP8_SHORT_TILES in configs
    assert dataclasses.replace(default, pdl=True) in configs
    assert dataclasses.replace(default, prefetch_slots=True) in configs
    assert row["fp8_default_over_flip_f16"] == pytest.approx(1.6 / 2.0)
    assert row["fp8_default_over_short_tiles"] == pytest.approx(2.5 / 2.0)
    assert row["fp8_default_over_pdl"] == pytest.approx(2.2 / 2.0)
    assert row["fp8_default_over_slots"] == pytest.approx(1.9 / 2.0)
    assert row["triton_fp8_flip_f16_graph_gbs"] == pytest.approx(row["fp8_bytes"] / 1.6e-3 / 1e9)
    assert (
        max(row[f"rel_err_fp8{n}_vs_sdpa"] for n in ("", "_flip_f16", "_short_tiles", "_pdl", "_slots"))
        < 2e-2
    )
    result = synthetic_result()
    result["decode"] = [row]
    result["summary"] = s = bench_report.summarize(result)
    assert s["decode_fp8_default_over_flip_f16_min"] == pytest.approx(0.8)
    assert s["decode_fp8_default_over_short_tiles_min"] == pytest.approx(1.25) and s["inaccurate"] == []
    rows = table_rows(bench_report.format_markdown(result), "### fp8 KV pool (float8_e4m3fn)")
    assert rows[0][8:] == [
        f"{row['triton_fp8_flip_f16_graph_gbs']:,.0f}",
        "0.80x",
        f"{row['triton_fp8_short_tiles_graph_gbs']:,.0f}",
        "1.25x",
        f"{row['triton_fp8_pdl_graph_gbs']:,.0f}",
        "1.10x",
        f"{row['triton_fp8_slots_graph_gbs']:,.0f}",
        "0.95x",
    ]
    row["rel_err_fp8_short_tiles_vs_sdpa"] = 0.5  # a wrong candidate is named, however slow
    assert bench_report.summarize(result)["inaccurate"] == [
        f"decode fp8 short_tiles b=2 ctx={bench_report.LONG_CONTEXT}"
    ]
    # candidates that fail to launch: recorded, shown in their columns, the default's numbers kept
    times = iter([2.0, 4.0])
    monkeypatch.setattr(timing, "time_ms", lambda fn, **_: (fn(), next(times))[1])

    def refuse(*args, **kwargs):
        if kwargs.get("config") is not None:
            raise RuntimeError("no such tiles")
        return decode(*args, **kwargs)

    monkeypatch.setattr(dec, "decode_attention", refuse)
    again = {"batch": 2, "context": bench_report.LONG_CONTEXT, "triton_graph_ms": 3.0, "triton_gbs": 500.0}
    bench.measure_fp8_pool(again, shape, model, kernel_args, torch.device("cpu"))
    for name in bench_report.FP8_CANDIDATES:
        assert again[f"triton_fp8_{name}_error"] == "RuntimeError: no such tiles"
        assert f"fp8_default_over_{name}" not in again
    assert again["fp8_speedup"] == pytest.approx(1.5)
    result["decode"] = [again]
    result["summary"] = bench_report.summarize(result)
    assert result["summary"]["decode_fp8_default_over_flip_f16_min"] is None
    rows = table_rows(bench_report.format_markdown(result), "### fp8 KV pool (float8_e4m3fn)")
    assert rows[0][8:] == ["RuntimeError: no such tiles", "-"] * 4


def test_fp8_candidates_follow_the_default():
    """fp8_candidates: the widening flipped under a bf16 q only, FP8_SHORT_TILES only where default_config
    takes the fp8 pools' tiles (sm_90, head dims 65-128, 16-bit q) and they are not the default, PDL
    flipped from sm_90, the slots loaded a tile ahead flipped everywhere."""
    from kernels import decode_attention as dec

    e4m3, bf16 = torch.float8_e4m3fn, torch.bfloat16
    assert bench.fp8_candidates(dec.FP8_TILES, 128, bf16, 90, e4m3) == {
        "flip_f16": dataclasses.replace(dec.FP8_TILES, fp8_f16=False),
        "short_tiles": dec.FP8_SHORT_TILES,
        "pdl": dataclasses.replace(dec.FP8_TILES, pdl=True),
        "slots": dataclasses.replace(dec.FP8_TILES, prefetch_slots=True),
    }
    assert set(bench.fp8_candidates(dec.FP8_MANY_TILES, 128, torch.float16, 90, e4m3)) == {
        "short_tiles",
        "pdl",
        "slots",
    }
    assert set(bench.fp8_candidates(dec.FP8_SHORT_TILES, 128, bf16, 89, e4m3)) == {"flip_f16", "slots"}
    assert bench.fp8_candidates(dec.FP8_SHORT_TILES, 64, torch.float16, 89, e4m3) == {
        "slots": dataclasses.replace(dec.FP8_SHORT_TILES, prefetch_slots=True)
    }
    assert set(bench.fp8_candidates(dec.FP8_TILES, 128, bf16, 90, e4m3)) <= set(bench_report.FP8_CANDIDATES)
